"""HiDivDrop, training-free: late vision injection, concave pyramid pruning, early vision exit
("HiDivDrop: Vision Token Reduction in MLLMs via Late Injection and Differentiable Top-K", under
review at the time of writing, no arXiv id; sections 2-3).

* **Late injection**: layers below ``L_inj`` run on the text tokens only (the vision encoder runs
  meanwhile, beside them: the engine's parallel decoupling). The vision tokens join at ``L_inj``
  with their original embeddings and their persistent positions; layers below hold no vision KV.
* **Concave pyramid pruning**: at each filtering layer f in ``F`` the last prompt token's attention
  to the vision tokens (mean over heads; one probe query) ranks them, and from layer f + 1 on only
  the top ``keep[i]`` share of the original vision tokens stays — steep at the first filtering
  layer, gentle after.
* **Early exit**: from ``L_exit`` on no vision token is active; deeper layers and their KV hold text.

The paper's setting on LLaVA-1.5-7B (32 layers): ``L_inj`` 9, ``L_exit`` 25, ``F`` {10, 14, 16, 18},
576 -> 87 -> 10 -> 5 -> 1 tokens — reached by *training* with a differentiable top-k. Glimpse runs
it training-free, so its schedule is softer (docs/pruning.md says how it was chosen and measured):
at speed 1 it keeps 40%, 25%, 18% and 12% after the four filtering layers, with the paper's
injection and exit layers; lower speeds exit later and keep more, and below speed 0.5 the vision
tokens are not injected late at all (skipping just the first few layers hurt most, measured). ``F`` comes from
an ILVAS calibration profile of the model when one exists (``glimpse calibrate hidivdrop``),
otherwise from the paper's layers scaled to the depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glimpse.common import Modality, UserError
from glimpse.pruning.base import ScoreThenCut, check_layer, check_speed, drop_lowest_visual, visual_in

PAPER_DEPTH = 32
PAPER_INJECT, PAPER_EXIT = 9, 25
PAPER_FILTERS = (10, 14, 16, 18)
KEEP_AT_FULL_SPEED = (0.40, 0.25, 0.18, 0.12)  # training-free: softer than the trained 15%, 1.7%, 0.9%, 0.2%
# Injection is all or nothing: skipping only the first one to three layers changed answers far more
# than skipping the paper's nine (docs/pruning.md), so below this speed the vision tokens start at
# layer 0 and from it on they join at the paper's layer.
INJECT_FROM_SPEED = 0.5


@dataclass
class HiDivDrop(ScoreThenCut):
    inject_layer: int | None = None  # L_inj; None: round(inject_fraction * L)
    exit_layer: int | None = None  # L_exit; None: L - round(exit_fraction * L)
    inject_fraction: float = 0.0  # share of the depth the vision tokens skip at the bottom
    exit_fraction: float = 0.0  # share of the depth the vision tokens skip at the top
    filter_layers: tuple[int, ...] | None = None  # F; None: the paper's, scaled to the depth
    keep: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # share of the vision tokens kept after each f in F
    name = "hidivdrop"

    @classmethod
    def from_speed(cls, speed: float) -> "HiDivDrop":
        speed = check_speed(speed)
        return cls(inject_fraction=round(PAPER_INJECT / PAPER_DEPTH, 6) if speed >= INJECT_FROM_SPEED else 0.0,
                   exit_fraction=round(speed * (PAPER_DEPTH - PAPER_EXIT) / PAPER_DEPTH, 6),
                   keep=tuple(round(1.0 - speed * (1.0 - k), 6) for k in KEEP_AT_FULL_SPEED))

    def window(self, num_layers: int) -> tuple[int, int]:
        """(L_inj, L_exit) on a model of ``num_layers`` layers."""
        inject = self.inject_layer if self.inject_layer is not None else round(self.inject_fraction * num_layers)
        exit_ = self.exit_layer if self.exit_layer is not None else num_layers - round(self.exit_fraction * num_layers)
        return inject, exit_

    def check(self, num_layers: int | None = None) -> None:
        if not (0.0 <= self.inject_fraction < 1.0 and 0.0 <= self.exit_fraction < 1.0
                and self.inject_fraction + self.exit_fraction < 1.0):
            raise UserError("HiDivDrop inject_fraction and exit_fraction must be in [0, 1) and leave some depth "
                            f"between them, got {self.inject_fraction} and {self.exit_fraction}")
        grows = any(b > a for a, b in zip(self.keep, self.keep[1:]))
        if not self.keep or grows or not all(0.0 <= k <= 1.0 for k in self.keep):
            raise UserError(f"HiDivDrop keep shares (one or more) must be in [0, 1] and never grow, got {self.keep}")
        check_layer("HiDivDrop inject_layer", self.inject_layer, num_layers, low=0)
        if self.exit_layer is not None and self.exit_layer < 1:
            raise UserError(f"HiDivDrop exit_layer must be at least 1, got {self.exit_layer}")
        if self.filter_layers is not None and len(self.filter_layers) == 0:  # it was the paper's, unsaid
            raise UserError("HiDivDrop filter_layers is empty: leave it out for the paper's layers (scaled)")
        for f in self.filter_layers or ():
            check_layer("HiDivDrop filter_layers", f, num_layers, low=0)
        if num_layers is not None:
            inject, exit_ = self.window(num_layers)
            if not 0 <= inject < exit_ <= num_layers:
                raise UserError(f"HiDivDrop needs 0 <= L_inj < L_exit <= L, got {inject}, {exit_} on {num_layers} "
                                "layers")

    def plan(self, ctx) -> None:
        L = ctx.num_layers
        inject, exit_ = self.window(L)
        filters = self.filter_layers or tuple(max(1, round(f * L / PAPER_DEPTH)) for f in PAPER_FILTERS)
        keep = resample(self.keep, len(filters))  # a calibration profile may find more or fewer layers
        visual = (ctx.modality != Modality.TEXT).nonzero().squeeze(1)
        V = visual.shape[0]
        # A filtering layer counts only inside the vision window, and prunes from the layer after it.
        self.cuts: dict[int, int] = {}  # layer from which the count applies -> vision tokens kept
        self.shares: dict[int, float] = {}
        for f, share in zip(sorted(filters), keep):
            if inject <= f and f + 1 < exit_ and f + 1 not in self.cuts:
                self.cuts[f + 1], self.shares[f + 1] = round(share * V), share
        self.visual, self.inject, self.exit, self.num_layers = visual, inject, exit_, L
        self.resolved = {"inject_layer": inject, "exit_layer": exit_, "filter_layers": sorted(f - 1 for f in self.cuts),
                         "keep_counts": [self.cuts[c] for c in sorted(self.cuts)], "visual_tokens": V}
        self.resolved["paper"] = {"L_inj": inject, "L_exit": exit_, "F": self.resolved["filter_layers"],
                                  "keep": [V, *self.resolved["keep_counts"]]}
        # A filtering layer f ranks the vision tokens by its own last-token attention; layer f + 1 cuts.
        self.cut_at, self.scores = frozenset(self.cuts), None

    def select(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        if layer_idx < self.inject or layer_idx >= self.exit:
            if layer_idx not in (0, self.exit):
                # Text only already (no policy adds vision tokens but this one, at injection): the same set,
                # so the engine has nothing to check or copy for this layer.
                return active
            return active[ctx.modality[active] == Modality.TEXT]  # text only: before injection, after the exit
        if layer_idx == self.inject:  # the vision tokens join, with their original embeddings
            return torch.cat([active, self.visual]).unique(sorted=True) if self.inject > 0 else active
        return super().select(layer_idx, active, ctx)

    def cut(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        excess = visual_in(active, ctx) - self.cuts[layer_idx]
        return drop_lowest_visual(active, ctx, self.scores, excess) if excess > 0 else active

    def summary(self) -> str:
        r = self.resolved
        shares = [self.shares[c] for c in sorted(self.cuts)]
        if r["inject_layer"] == 0 and r["exit_layer"] == self.num_layers and all(k >= 1.0 for k in shares):
            return "HiDivDrop off"
        text = f"HiDivDrop vision in layers {r['inject_layer']}-{r['exit_layer'] - 1}"
        if shares:
            keep = ", ".join(f"{k:.0%}" for k in shares)
            text += f", keeps {keep} after layers {', '.join(map(str, r['filter_layers']))}"
        return text


def resample(shares: tuple[float, ...], n: int) -> tuple[float, ...]:
    """The keep curve at ``n`` evenly spaced points (linear in between): same start, same end."""
    if n == len(shares) or n == 0:
        return tuple(shares[:n])
    if len(shares) == 1 or n == 1:
        return (shares[0],) * n
    out = []
    for i in range(n):
        x = i * (len(shares) - 1) / (n - 1)
        j = min(int(x), len(shares) - 2)
        out.append(round(shares[j] + (x - j) * (shares[j + 1] - shares[j]), 6))
    return tuple(out)
