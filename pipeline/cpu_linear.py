"""Linear layers for inference on a CPU: oneDNN's product over a weight packed once, or for a few rows the
product written with the weight on the left.

Every step of the engine multiplies each weight matrix of the model by the rows at hand: a prompt's tokens
in prefill, one row per request in decode. ``nn.Linear`` computes ``x @ W.T`` with MKL's general product,
which on the CPU machine (torch's CPU wheel: MKL 2024.2, oneDNN 3.12; AVX-512, two cores) is slow both ways:
one row becomes a matrix-vector product that runs on one thread, and up to 8 rows take as long as reading a
large weight several times. Measured on the embedded model (docs/benchmarks.md, "Decode on a CPU"):

- **Packed** (``torch.ops.mkldnn``, the kernels torch's own compiler uses for frozen CPU models): the weight
  is reordered once into oneDNN's blocked layout and every product reads it in that layout. Decode
  1.7-2.4x the tokens/s of ``nn.Linear`` at batch 1 to 8, the first token 1.8x sooner. Each row's result is the same whatever
  the other rows, from 2 rows on (tested), which ``nn.Linear``'s is not; one row alone is summed in another order once
  the input is wider than 1,024 (a request decoding alone: logits about 1e-4 off its batched ones on the embedded
  model, an outside pass). Doubling a lone row would close that, for 5-7% of the embedded model's decode
  speed at batch 1 (``benchmarks/cpu_lone_row.py``): not done. It keeps a second copy of each weight, so it is used
  when that copy fits in half of the memory available (the original stays: the embedding it may be tied
  to, state dicts and gradients use it; loaded from safetensors it is file-backed, and pages the packed
  product never reads can go back to the system).
- **Weight on the left**, for up to ``MAX_ROWS`` rows when the weights are not packed: ``(W @ x.T).T`` with
  ``x`` contiguous and one row doubled into two streams each weight once over every thread. Decode 1.6x at
  batch 1, 1.1x at batch 8; no copy. Above ``MAX_ROWS`` rows ``nn.Linear``'s product runs.

Results differ from ``nn.Linear``'s in the last bits (another summation order), as ``nn.Linear``'s own
differ between batch sizes. Anything that needs gradients, another device or another dtype runs
``nn.Linear``'s own forward. Only float32 weights are switched: that is what was measured (bfloat16 and GPUs
take other kernels). The switch changes the class of each ``nn.Linear`` in place (as
``torch.nn.utils.parametrize`` does), keeping its parameters and hooks; ``forward`` is the only thing it
replaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glimpse.pipeline.metrics import proc_bytes

MAX_ROWS = 16


class CpuLinear(nn.Linear):
    """``nn.Linear`` for inference on a CPU (see the module's docstring)."""

    packed: torch.Tensor | None = None  # the weight in oneDNN's layout, when packed
    packed_from: tuple[int, int] | None = None  # (address, version) of the weight it was packed from

    def pack(self) -> None:
        weight = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.packed_from = (weight.data_ptr(), weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.device.type != "cpu" or weight.device.type != "cpu" or weight.dtype != torch.float32
                or x.dtype != torch.float32 or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
            return F.linear(x, weight, self.bias)
        if self.packed is not None:
            if self.packed_from != (weight.data_ptr(), weight._version):  # the weight changed since: pack again
                self.pack()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        if count > MAX_ROWS or count == 0:
            return F.linear(x, weight, self.bias)
        # One row twice: a two-column product runs on every thread, a matrix-vector product on one.
        rows = rows.expand(2, -1) if count == 1 else rows
        out = (weight @ rows.contiguous().T).T[:count].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def use_cpu_linears(model: nn.Module, pack: bool | None = None) -> tuple[int, int]:
    """Switch the model's float32 ``nn.Linear`` layers on the CPU to ``CpuLinear``, packed if ``pack`` (by
    default: if oneDNN is there and the packed copies fit in half of the available memory); returns
    (layers switched, layers packed). Subclasses of ``nn.Linear`` (quantized or adapted layers) are left
    as they are."""
    layers = [m for m in model.modules()
              if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if pack is None:
        copies = sum(m.weight.numel() * m.weight.element_size() for m in layers)
        available = available_memory_bytes()
        pack = torch.backends.mkldnn.is_available() and (available is None or copies < available / 2)
    for module in layers:
        module.__class__ = CpuLinear
        if pack:
            module.pack()
    return len(layers), len(layers) if pack else 0


def available_memory_bytes() -> int | None:
    """What the system reports as available for new allocations (Linux's MemAvailable), or None."""
    return proc_bytes("/proc/meminfo", "MemAvailable")
