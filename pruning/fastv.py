"""FastV, the baseline every paper here compares against (Chen et al., 2024, "An image is worth 1/2
tokens after layer 2", arXiv:2403.06764).

Layers ``0 .. K-1`` see every token. From layer K on, the share ``R`` of the image (visual) tokens
that received the least attention in layer K-1 is dropped for good. FastV's released code ranks
by the last token's attention row, averaged over heads, which is what we use: one probe query, no
T x T matrix. Paper defaults: K = 2, R = 50% on LLaVA-1.5 (32 layers); K scales with depth.

``merge=True`` folds each dropped visual token into its most similar kept one instead of losing it
(``pruning.base.merge_into_kept``; not in the paper, a Glimpse option measured in docs/pruning.md).

``text=True`` is the text adaptation DASH's appendix compares against: the share R of *all* tokens
but the last is dropped the same way (for text-only prompts such as the pass-key task).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glimpse.common import UserError
from glimpse.pruning.base import (ScoreThenCut, check_layer, check_speed, lowest_except, lowest_visual, merge_into_kept, scaled_layer,
                          share_of, visual_in, without)


@dataclass
class FastV(ScoreThenCut):
    ratio: float = 0.0  # R: share of the visual tokens dropped at layer K
    layer: int | None = None  # K; None: round(2 L / 32), at least 1
    text: bool = False  # also drop text tokens (every token but the last)
    merge: bool = False  # fold dropped visual tokens into their most similar kept ones
    name = "fastv"
    prunes_text = True

    @classmethod
    def from_speed(cls, speed: float) -> "FastV":
        return cls(ratio=check_speed(speed))  # the paper's R = 50% at speed 0.5

    def check(self, num_layers: int | None = None) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise UserError(f"FastV ratio must be in [0, 1], got {self.ratio}")
        check_layer("FastV layer", self.layer, num_layers)

    def plan(self, ctx) -> None:
        K = self.layer if self.layer is not None else scaled_layer(2, 32, ctx.num_layers)
        self.resolved = {"layer": K, "paper": {"K": K, "R": self.ratio}}
        self.telemetry = {"num_dropped": 0}
        self.cut_at, self.scores = (frozenset({K}) if self.ratio > 0 else frozenset()), None

    def cut(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        if self.text:
            count = share_of(self.ratio, active.shape[0] - 1)
            dropped = lowest_except(self.scores[active], count)
        else:
            count = share_of(self.ratio, visual_in(active, ctx))
            dropped = lowest_visual(active, ctx, self.scores, count)
        self.telemetry["num_dropped"] = count
        if self.merge:
            merge_into_kept(ctx, active, dropped, torch.ones(ctx.modality.shape[0]))
        return without(active, dropped)

    def summary(self) -> str:
        if self.ratio == 0.0:
            return "FastV off"
        scope = " of all tokens" if self.text else ""
        how = ", merged into the kept ones" if self.merge else ""
        return f"FastV R={self.ratio:.0%}{scope} at layer {self.resolved['layer']}{how}"
