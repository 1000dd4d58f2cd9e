"""Counting, on a CPU, the operators that would make the host wait for a GPU."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostWaits(TorchDispatchMode):
    """Counts the operators that make the host wait for a GPU:

    * a value read on the host (``item``, ``bool``) or a result whose size depends on the data (``nonzero``,
      indexing with a boolean mask);
    * a value made on the host written through a tensor index (``mask[rows] = False``, ``scores[-1] = inf``): on a
      GPU, PyTorch makes the Python value a host tensor and copies it from pageable memory, which synchronizes
      (an H200 profile of a 7B prefill found one such copy per decoder layer, docs/benchmarks.md).
      ``index_fill_``, ``masked_fill``, ``scatter_`` and ``fill_`` take the value as a scalar instead (so does a
      slice, ``mask[:n] = False``, which becomes a ``fill_``).

    Copies to the host (``.cpu()``) are not seen on a CPU, where they are no operator at all."""

    READS = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default}
    INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}
    WRITES = {torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default, torch.ops.aten.copy_.default}

    def __init__(self):
        super().__init__()
        self.count = 0
        self._made_on_host: dict[int, torch.Tensor] = {}  # 0-dim tensors made from Python values (``lift_fresh``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default and out.dim() == 0:  # a Python value (not torch.tensor([..]))
            self._made_on_host[id(out)] = out  # held, so that the id is not reused while counting
        elif func in self.READS:
            self.count += 1
        elif func in self.INDEXING and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.count += 1
        elif func in self.WRITES and self._made_on_host.get(id(args[-1])) is args[-1]:  # the value written
            self.count += 1
        return out
