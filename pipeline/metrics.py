"""Request metrics: the record every answer carries (``Metrics``), the FLOPs proxy, the keep map,
memory, clocks."""

from __future__ import annotations

import resource
import sys
from typing import TypedDict

import torch

from glimpse.common import Modality


class Metrics(TypedDict):
    """What every answer reports, as ``result.metrics`` (a dict: the stable interface) with its keys and
    types declared here once. The CLI (``ask --json``), the API's ``glimpse`` field, the chat's panel and
    the benchmarks all read these keys; being a plain dict, it serialises as it is."""

    ttft_s: float  # request received -> first token chosen (waiting for the engine, prompt building, vision, prefill)
    queue_s: float  # of which waiting for the engine (the server's scheduler; 0 otherwise)
    prompt_s: float  # of which building the prompt: reading and decoding its media, the chat template, tokens
    prefill_s: float  # prefill alone (the wait for the vision encoder included)
    vision_encoder_s: float  # the vision encoder + projector's own time
    vision_wait_s: float  # how long the layer loop waited for it
    decode_tokens_per_s: float | None  # over the answer after the first token; None for one token
    new_tokens: int
    prompt_tokens: dict[str, int]  # per modality: {"text": n, "image": n, "video": n}
    active_tokens_per_layer: list[int]  # prefill: tokens each layer computed
    attention_tokens_per_layer: list[int]  # ... of which took part in attention (ZipVL)
    prefill_flops: int  # the FLOPs proxy (docs/pruning.md)
    prefill_flops_baseline: int  # ... of the same prompt unpruned, every token computed
    prefill_flops_unpruned: int  # ... unpruned, of the tokens computed here (equal to the baseline unless a prefix
    # came from the prefix cache): baseline / unpruned is the cache's saving, unpruned / prefill_flops pruning's
    kv_bytes: int  # the KV cache at the end of the answer
    kv_bytes_per_step: list[int]  # what each decode step attended to
    visual_kv_per_step: list[int]  # visual KV entries per decode step (ST3's annealing shrinks them)
    decode_step_s: list[float]
    decode_tokens_per_s_per_step: list[float | None]  # tokens the batch made in the step / step time
    batch_size: int
    revived_tokens: int  # prompt-token computations added by revival in decode (LazyLLM)
    prefix_reused_tokens: int  # leading prompt tokens taken from the prefix cache, not computed (0: none)
    aux_cache_bytes: int
    peak_memory_bytes: int  # the process's peak while this request ran (``MemoryMeter``)
    keep_map: dict  # how deep every visual token went (``keep_map``), for the chat's heatmap
    policy_telemetry: dict  # what the policy observed (DASH's num_halted, ZipVL's important_per_layer, ...)


def decoder_prefill_s(metrics: dict) -> float:
    """The decoder's own prefill time: ``prefill_s`` less the layer loop's wait for the vision encoder. Run beside the
    encoder (a GPU's parallel vision, HiDivDrop's early layers), less the encoder's whole time would take the
    overlapped decoder work too (an outside reading); run after it, as on a CPU, the two are the same."""
    vision = metrics.get("vision_encoder_s")
    waited = metrics.get("vision_wait_s", vision)
    return float(metrics["prefill_s"]) - float(waited or 0.0)


def keep_map(prompt, active_per_layer: list[torch.Tensor],
             attention_per_layer: list[torch.Tensor | None] | None = None, reused: int = 0) -> dict:
    """How deep every visual token went: ``depth`` counts the layers it was active in — a window
    of consecutive layers starting at ``entered`` (0, or the injection layer under late injection).

    ``attended`` counts, per visual token, the layers in which it took part in attention (equal to
    ``depth`` unless a policy such as ZipVL made attention sparse while the FFN stayed dense).
    ``media`` lists each image/video with its token span and (t, h, w) grid so the UI can draw a
    heatmap of ``depth`` over the picture or the frame strip. The first ``reused`` tokens (a prefix whose
    keys and values came from the prefix cache) count as in every layer: their entries are.
    """
    visual = (prompt.modality != Modality.TEXT).nonzero().squeeze(1)
    depth = torch.zeros(prompt.modality.shape[0], dtype=torch.long)
    attended = torch.zeros_like(depth)
    entered = torch.full_like(depth, -1)
    attention_per_layer = attention_per_layer or [None] * len(active_per_layer)
    for layer_idx, (active, rows) in enumerate(zip(active_per_layer, attention_per_layer)):
        present = torch.zeros_like(depth, dtype=torch.bool)
        present[active.cpu()] = True
        present[:reused] = True
        entered[present & (entered < 0)] = layer_idx
        depth += present  # a token that left never comes back, so its layers are consecutive
        attended += present if rows is None else torch.zeros_like(present).index_fill_(0, rows.cpu(), True)
    spans, offset = [], 0
    for item in prompt.media:
        spans.append({"kind": "image" if item.kind == Modality.IMAGE else "video", "start": offset,
                      "count": item.num_tokens, "grid": list(item.grid) if item.grid else None,
                      "grid_start": item.grid_start, "tiles": list(item.tiles) if item.tiles else None})
        offset += item.num_tokens
    return {"num_layers": len(active_per_layer), "depth": depth[visual].tolist(),
            "entered": entered[visual].clamp(min=0).tolist(), "attended": attended[visual].tolist(), "media": spans}


def layer_flops(n: int, d: int, m: int, past: int = 0, attending: int | None = None) -> int:
    """FLOPs proxy of one decoder layer computing ``n`` tokens (hidden ``d``, FFN ``m``).

    ``4nd^2`` (q, k, v, o projections) + ``2n(n + past)d`` (scores and weighted sum over the ``n``
    tokens' keys and the ``past`` keys of a prefix reused from the cache) + ``3ndm`` (SwiGLU: gate, up,
    down). FastV/DASH write ``2ndm`` for a two-matrix FFN; every model Glimpse supports uses SwiGLU, so we
    count three matrices.

    ``attending``: when only ``p`` of the ``n`` tokens take part in attention, and only with each
    other and the reused prefix (ZipVL's sparse prefill), the attention term is ``2p(p + past)d``;
    projections and FFN stay dense.
    """
    p = n if attending is None else attending
    return 4 * n * d * d + 2 * p * (p + past) * d + 3 * n * d * m


def prefill_flops(active_per_layer: list[int], d: int, m: int, attending_per_layer: list[int] | None = None,
                  past: int = 0) -> int:
    """``past``: keys of a reused prefix before the computed tokens, which each of them attends to (the engine
    passes ``attending`` for every layer; the attention term counted the prefix only where it did not)."""
    attending = attending_per_layer or [None] * len(active_per_layer)
    return sum(layer_flops(n, d, m, past=past, attending=p) for n, p in zip(active_per_layer, attending))


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a clock read measures what really ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryMeter:
    """The process's peak memory since the meter was made: CUDA peak allocated on GPU, peak resident set
    on CPU. Making a meter resets the peak (on Linux through ``/proc/self/clear_refs``), so a request's
    reading is its own, not the process's lifetime peak; elsewhere the CPU reading is that lifetime peak.

    The peak is process-wide: a request answered beside others (a batch, the server's scheduler) reads
    the peak of the steps it shared with them.
    """

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            _reset_peak_rss()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return _peak_rss()


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak resident set size to the current one (Linux >= 4.0)
    except OSError:
        pass  # not Linux, or not allowed: peak() reads the lifetime peak


def proc_bytes(path: str, field: str) -> int | None:
    """A ``kB`` field of a Linux /proc file in bytes (``VmHWM`` of /proc/self/status, ``MemAvailable`` of
    /proc/meminfo), or None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss() -> int:
    peak = proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
