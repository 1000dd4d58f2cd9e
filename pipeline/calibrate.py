"""ILVAS calibration of HiDivDrop's filtering layers (the HiDivDrop paper, "Vision Token Reduction in MLLMs via
Late Injection and Differentiable Top-K", section 3.2).

Inter-Layer Visual Attention Similarity between layer l and l + n, over the K vision tokens the
last text token attends to most at layer l:

    ILVAS(l, l+n, K) = 1/|V_K^l| * sum_{i in V_K^l} cos(A~_i^l, A~_i^{l+n})

with ``A~_i^l`` the head-wise attention vector of vision token i (the last prompt token's attention
to it in every head). A high value means layer l has formed an importance ranking that holds: a
good place to filter. Following the paper, the curve is computed on a model run with late injection
and early exit (the paper's layers scaled to the depth, no pruning in between), averaged over the
calibration images, and its local maxima become the filtering layers F (at most ``max_filters``, the
highest, in layer order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from glimpse.common import Modality, UserError
from glimpse.pipeline.prompt import user_message
from glimpse.pruning import HiDivDrop, Pipeline, Policy
from glimpse.pruning.base import probe_attention
from glimpse.vision import MediaError


@dataclass
class VisionAttentionRecorder(Policy):
    """Records, per layer, the last prompt token's attention to each vision token, per head."""

    records: dict = field(default_factory=dict)
    name = "ilvas-recorder"

    def score(self, layer_idx: int, attn_output: torch.Tensor, ctx) -> None:
        visual = (ctx.layer.modality != Modality.TEXT).nonzero().squeeze(1)
        if visual.numel() == 0:
            return
        last = torch.tensor([ctx.layer.active.shape[0] - 1], device=ctx.layer.active.device)
        per_head = probe_attention(ctx.layer.queries, ctx.layer.keys, last, ctx.layer.scaling)[:, 0]  # (heads, n)
        self.records[layer_idx] = (ctx.layer.active[visual].cpu(), per_head[:, visual].cpu())


def ilvas(first: torch.Tensor, later: torch.Tensor, top_k: int) -> float:
    """ILVAS between two layers' head-wise attention (heads, V) over the same vision tokens."""
    k = min(top_k, first.shape[1])
    top = first.mean(dim=0).topk(k).indices
    return float(torch.nn.functional.cosine_similarity(first[:, top], later[:, top], dim=0).mean())


def local_maxima(curve: dict[int, float], max_count: int) -> list[int]:
    """Layers whose value is above both neighbours (one neighbour at the ends); the ``max_count``
    highest, in layer order."""
    layers = sorted(curve)
    peaks = []
    for i, layer in enumerate(layers):
        left = curve[layers[i - 1]] if i > 0 else float("-inf")
        right = curve[layers[i + 1]] if i + 1 < len(layers) else float("-inf")
        if curve[layer] > left and curve[layer] > right:
            peaks.append(layer)
    return sorted(sorted(peaks, key=lambda l: curve[l], reverse=True)[:max_count])


def calibrate_hidivdrop(engine, images: list, question: str = "Describe the image in detail.", window: int = 4,
                        top_k: int = 20, max_filters: int = 4,
                        progress: Callable[[str], None] | None = None) -> dict:
    """The ILVAS curve of ``engine``'s model on ``images`` and the filtering layers it picks."""
    progress = progress or (lambda line: None)
    if not images:
        raise UserError("calibration needs at least one image")
    window_policy = HiDivDrop.from_speed(1.0)
    window_policy.keep = (1.0,) * len(window_policy.keep)  # injection and exit only, no pruning
    L = len(engine.adapter.layers)
    totals: dict[int, list[float]] = {}
    used = 0
    for number, image in enumerate(images, start=1):
        progress(f"[{number}/{len(images)}] {image}")
        recorder = VisionAttentionRecorder()
        messages = user_message(question, [("image", image)])
        try:
            prompt = engine.prepare(messages)
        except MediaError as error:  # one unreadable file does not spoil a calibration
            progress(f"skipped: {error}")
            continue
        with torch.inference_mode():
            engine.prefill(prompt, Pipeline(policies=(window_policy, recorder)))
        used += 1
        for layer in sorted(recorder.records):
            if layer + window in recorder.records:
                index, first = recorder.records[layer]
                later_index, later = recorder.records[layer + window]
                assert torch.equal(index, later_index)  # no pruning inside the window
                totals.setdefault(layer, []).append(ilvas(first, later, top_k))
    curve = {layer: sum(values) / len(values) for layer, values in sorted(totals.items())}
    if not used:
        raise UserError("none of the calibration images could be read")
    if not curve:
        raise UserError(f"the vision window of this {L}-layer model is shorter than the ILVAS window {window}")
    peaks = local_maxima(curve, max_filters)
    if not peaks:  # (a curve of ties): saved, HiDivDrop would read the empty list as "the paper's layers"
        raise UserError(f"the ILVAS curve has no peak to filter at ({', '.join(f'{v:.3f}' for v in curve.values())}): "
                        "nothing saved; try other images, --window or --top-k")
    resolved = window_policy.resolved
    return {"policy": "hidivdrop", "model": engine.model_id, "num_layers": L, "window": window, "top_k": top_k,
            "images": used, "inject_layer": resolved["inject_layer"], "exit_layer": resolved["exit_layer"],
            "ilvas": {str(layer): value for layer, value in curve.items()},
            "filter_layers": peaks}
