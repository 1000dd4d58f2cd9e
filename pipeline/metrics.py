"""Request metrics: the FLOPs proxy, memory, clocks."""

from __future__ import annotations

import resource
import sys

import torch


def layer_flops(n: int, d: int, m: int, cache: int | None = None, attending: int | None = None) -> int:
    """FLOPs proxy of one decoder layer computing ``n`` tokens (hidden ``d``, FFN ``m``).

    ``4nd^2`` (q, k, v, o projections) + ``2ncd`` (scores and weighted sum over ``c`` keys; ``c = n``
    in prefill) + ``3ndm`` (SwiGLU: gate, up, down). FastV/DASH write ``2ndm`` for a two-matrix FFN;
    every model Glimpse supports uses SwiGLU, so we count three matrices.

    ``attending``: when only ``p`` of the ``n`` tokens take part in attention, and only with each
    other (ZipVL's sparse prefill), the attention term is ``2p^2d``; projections and FFN stay dense.
    """
    if attending is not None:
        return 4 * n * d * d + 2 * attending * attending * d + 3 * n * d * m
    c = n if cache is None else cache
    return 4 * n * d * d + 2 * n * c * d + 3 * n * d * m


def prefill_flops(active_per_layer: list[int], d: int, m: int, attending_per_layer: list[int] | None = None) -> int:
    attending = attending_per_layer or [None] * len(active_per_layer)
    return sum(layer_flops(n, d, m, attending=p) for n, p in zip(active_per_layer, attending))


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a clock read measures what really ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryMeter:
    """Peak memory of a request: CUDA peak allocated on GPU, process peak RSS on CPU.

    On CPU the kernel only reports the process's lifetime peak, so that is what we give.
    """

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
