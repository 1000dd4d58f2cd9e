"""DivPrune: keep the most diverse visual tokens before the first decoder layer (Alvar et al., CVPR 2025,
"DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models", arXiv:2503.02175).

Not one of the design card's five papers: a calibration candidate for the slider, added because the
embedded model's measurements asked for a selection that does not rank by attention (docs/pruning.md,
"DivPrune"). Attention-ranked pruning (FastV, LazyLLM, ST3) keeps the tokens the last prompt token
looks at, and on plain backgrounds those are often many cells of the same thing; DivPrune keeps a
subset that covers what the picture holds.

The paper's rule, as its released code runs it: the visual tokens are the language model's inputs
(after the projector); the distance between two is ``1 - cosine similarity``; the kept set ``S`` of
``round(keep * n)`` tokens is built greedily for the max-min diversity problem — first the token
whose nearest other token is farthest, then, again and again, the token whose distance to its nearest
member of ``S`` is largest (Eq. 3). The rest never enter the decoder: every layer, and the KV cache,
holds only ``S`` and the text.

Glimpse's decisions where the paper is silent (docs/pruning.md): each image is selected on its own
(the paper has one image per prompt), and each *frame* of a video on its own (``per_frame``; measured
on the embedded model's clips), so that a frame that repeats the one before keeps its share; ties go
to the earlier token; under RLT, only a frame's tokens that were encoded are selected among (its share is
of those). The greedy loop costs ``O(k n d)`` with ``n`` the tokens of one image or frame; the
frames of a video (and images of one size) are selected side by side in one batched loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glimpse.common import Modality, UserError
from glimpse.pruning.base import Policy, check_speed, without


@dataclass
class DivPrune(Policy):
    keep: float = 1.0  # share of each image's (or frame's) visual tokens that enter the decoder
    per_frame: bool = True  # a video's frames are selected one by one (False: the whole video at once)
    name = "divprune"
    reads_visual_inputs = True  # select() at layer 0 needs the visual tokens' embeddings, not placeholders

    @classmethod
    def from_speed(cls, speed: float) -> "DivPrune":
        return cls(keep=round(1.0 - 0.8 * check_speed(speed), 6))  # 20% kept at speed 1; the paper headlines 9.8% (56 of 576)

    def check(self, num_layers: int | None = None) -> None:
        if not 0.0 < self.keep <= 1.0:
            raise UserError(f"DivPrune keep must be in (0, 1], got {self.keep}")

    def plan(self, ctx) -> None:
        self.resolved = {"paper": {"ratio": self.keep}}
        self.telemetry = {"num_dropped": 0}

    def select(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        if layer_idx != 0 or self.keep >= 1.0:
            return active
        # Only the tokens that reach layer 0: under RLT (pruning/rlt.py) a video's repeated tokens were never
        # encoded, and DivPrune keeps its share of what is left.
        groups = [g.to(active.device) for g in visual_groups(ctx.prompt, self.per_frame)]
        groups = [reaching for g in groups if (reaching := g[torch.isin(g, active)]).numel()]
        kept = []
        # Groups of one size (a video's frames, images of one shape) are chosen together in one batched loop.
        for size in sorted({g.shape[0] for g in groups}):
            same = torch.stack([g for g in groups if g.shape[0] == size])  # (G, size)
            chosen = max_min_diverse(ctx.hidden[0, same], kept_count(self.keep, size))  # (G, count)
            kept.append(same.gather(1, chosen).flatten())
        if not kept:
            return active
        visual = torch.cat(groups)
        dropped = visual[~torch.isin(visual, torch.cat(kept))]
        self.telemetry["num_dropped"] = int(dropped.shape[0])
        return without(active, torch.isin(active, dropped).nonzero().squeeze(1))

    def summary(self) -> str:
        if self.keep >= 1.0:
            return "DivPrune off"
        unit = "image and video frame" if self.per_frame else "image and video"
        # A share under 1% is not "0%": at least one token of each is kept (kept_count).
        share = f"{self.keep:.0%}" if self.keep >= 0.01 else f"{self.keep * 100:.2g}% (at least one)"
        return f"DivPrune keeps the {share} most diverse visual tokens of each {unit} before layer 0"


def visual_groups(prompt, per_frame: bool) -> list[torch.Tensor]:
    """Original indices of each media item's visual tokens (each video frame's, with ``per_frame``), in prompt
    order. A video's tokens are split into frames only where its grid says how (``MediaInput.grid``)."""
    groups = []
    for item, tokens in prompt.media_rows():
        frames = item.grid[0] if (per_frame and item.kind == Modality.VIDEO and item.grid) else 1
        if frames > 1 and tokens.shape[0] % frames == 0:
            groups.extend(tokens.chunk(frames))
        else:
            groups.append(tokens)
    return [g for g in groups if g.numel()]


def kept_count(keep: float, n: int) -> int:
    """How many of a group's ``n`` visual tokens DivPrune keeps at share ``keep``: at least one."""
    return max(1, round(keep * n))


def max_min_diverse(features: torch.Tensor, count: int) -> torch.Tensor:
    """For each of the G sets of ``features`` (G, n, d), the positions of ``count`` of its n rows, chosen greedily
    for the max-min diversity problem under cosine distance: first the row whose nearest other row is farthest,
    then each time the row farthest from its nearest chosen row (DivPrune's Eq. 3); ties go to the earlier row.
    (G, count), sorted. The sets are chosen side by side, with no host synchronisation inside the loop."""
    G, n, _ = features.shape
    device = features.device
    if count >= n:
        return torch.arange(n, device=device).expand(G, n)
    unit = torch.nn.functional.normalize(features.float(), dim=-1)
    # The first pick needs each row's nearest other row: (n, n) products, in blocks of rows so that a long
    # video selected whole never holds the whole matrix.
    nearest = torch.empty(G, n, device=device)
    for start in range(0, n, 1024):
        rows = torch.arange(start, min(start + 1024, n), device=device)
        distance = 1.0 - unit[:, rows] @ unit.transpose(1, 2)  # (G, rows, n)
        distance.diagonal(offset=start, dim1=1, dim2=2).fill_(float("inf"))  # a row is not its own neighbour
        nearest[:, rows] = distance.min(dim=2).values
    sets = torch.arange(G, device=device)
    pick = nearest.argmax(dim=1)
    chosen = torch.zeros(G, n, dtype=torch.bool, device=device)
    chosen.scatter_(1, pick[:, None], True)
    to_chosen = 1.0 - (unit @ unit[sets, pick].unsqueeze(2)).squeeze(2)  # (G, n): distance to the nearest chosen
    for _ in range(count - 1):
        pick = to_chosen.masked_fill(chosen, float("-inf")).argmax(dim=1)
        chosen.scatter_(1, pick[:, None], True)
        to_chosen = torch.minimum(to_chosen, 1.0 - (unit @ unit[sets, pick].unsqueeze(2)).squeeze(2))
    return chosen.nonzero()[:, 1].reshape(G, count)
