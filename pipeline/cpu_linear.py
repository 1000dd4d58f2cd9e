"""Linear layers for decoding on a CPU: the product written with the weight on the left.

A decode step multiplies every weight matrix of the language model by a handful of rows, one per request
in the batch. ``nn.Linear`` computes ``x @ W.T``. On the CPU machine (MKL 2024.2 in torch's CPU wheel,
AVX-512, two cores) that product is slow for few rows: one row becomes a matrix-vector product that runs on
one thread, and 2-16 rows take MKL's path for a transposed weight, which for a weight too large for the
cache is no faster than 8 rows. The same product written ``(W @ x.T).T``, with ``x`` contiguous and one
row doubled into two, streams each weight once over all threads. Measured on the embedded model
(docs/benchmarks.md, "Decode on a CPU"): 24 decoded tokens 1.6x faster for one request, 2.2x for two,
1.1x for eight.

Above ``MAX_ROWS`` rows (prefill) nothing changes: ``nn.Linear``'s own product runs, so prompts are
processed exactly as transformers processes them. Below, the numbers differ from ``nn.Linear``'s in the
last bits (another summation order), as they already differ between batch sizes in ``nn.Linear`` itself.

Only float32 weights on the CPU are switched: that is what was measured (bfloat16 and GPUs take other
kernels). The switch changes the class of each ``nn.Linear`` in place (as ``torch.nn.utils.parametrize``
does), keeping its parameters and hooks; ``forward`` is the only thing it replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16


class WeightLeftLinear(nn.Linear):
    """``nn.Linear`` computing ``(W @ x.T).T`` for up to ``MAX_ROWS`` rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        if count > MAX_ROWS or count == 0:
            return F.linear(x, self.weight, self.bias)
        # One row twice: a two-column product runs on every thread, a matrix-vector product on one.
        rows = rows.expand(2, -1) if count == 1 else rows
        out = (self.weight @ rows.contiguous().T).T[:count].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_weight_left_linears(model: nn.Module) -> int:
    """Switch the model's float32 ``nn.Linear`` layers on the CPU to ``WeightLeftLinear``; the number
    switched. Subclasses of ``nn.Linear`` (quantized or adapted layers) are left as they are."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = WeightLeftLinear
            switched += 1
    return switched
