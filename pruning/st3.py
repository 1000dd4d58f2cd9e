"""ST3's Progressive Visual Token Pruning, the prefill half of ST^3 (seeds/ST3.txt).

No pruning in layers 0-2 (the paper keeps the first three layers whole, on 32- and 40-layer
models alike, so this layer is not scaled with depth). At layer 3 drop ``P`` of the visual tokens,
then every ``S`` layers drop ``R`` more (shares of the original visual count), each time keeping
the visual tokens the last prompt token attended to most in the previous layer (mean over heads).
Text tokens are never pruned. The share kept in the last layer is Eq. 9:
``C = 1 - floor((L - 3) / S) R - P``.

Eq. 9 counts a drop at every layer ``3 + jS <= L``; layer L does not exist, so when S divides
L - 3 the formula counts one drop too many. The default stride ``S = round(7 L / 32)`` (the
paper's 7 on 32 layers) is therefore nudged up by the fewest layers that make S not divide L - 3,
and the drops happen at layers ``3 + jS < L``: then Eq. 9 is exact. ``R`` defaults to the share
that ends at ``end_keep`` (the paper: P 50%, S 7, R 12.25% on LLaVA-1.5-7B, ending at C = 1%).
QK heredity (optional in the paper) is not implemented. Visual Token Annealing (decode) is separate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pruning.base import Policy, check_speed, last_token_attention, lowest, without

PAPER_START, PAPER_STRIDE, PAPER_DEPTH = 3, 7, 32


@dataclass
class ST3Pruning(Policy):
    first_drop: float = 0.0  # P: share of the visual tokens dropped at the start layer
    end_keep: float = 1.0  # C: share of the visual tokens the last layer keeps (sets R)
    drop_step: float | None = None  # R: share dropped every S layers; None: from end_keep
    stride: int | None = None  # S; None: round(7 L / 32), not dividing L - 3
    start_layer: int = PAPER_START
    name = "st3"

    @classmethod
    def from_speed(cls, speed: float) -> "ST3Pruning":
        speed = check_speed(speed)
        # Speed 1 is the paper's setting (P 50%, C 1%); speed 0 prunes nothing.
        return cls(first_drop=round(0.5 * speed, 6), end_keep=round(1.0 - 0.99 * speed, 6))

    def plan(self, ctx) -> None:
        L = ctx.num_layers
        start = min(self.start_layer, L - 1)
        stride = self.stride or default_stride(L, start)
        drops = list(range(start + stride, L, stride))
        if self.drop_step is not None:
            step = self.drop_step
        else:
            step = (1.0 - self.first_drop - self.end_keep) / len(drops) if drops else 0.0
        if self.first_drop + step * len(drops) > 1.0 + 1e-9 or min(self.first_drop, step) < 0:
            raise ValueError(f"ST3: P={self.first_drop} and R={step} over {len(drops)} drops prune more than all")
        # Cumulative share of the original visual tokens pruned before each pruning layer.
        self.schedule = {start: self.first_drop} if start >= 1 else {}
        for j, layer in enumerate(drops, start=1):
            self.schedule[layer] = self.first_drop + j * step
        self.visual_total = int((ctx.modality != 0).sum())
        self.resolved = {"start_layer": start, "stride": stride, "drop_step": step,
                         "prune_layers": sorted(self.schedule),
                         "last_layer_keep": 1.0 - (max(self.schedule.values()) if self.schedule else 0.0)}
        self.resolved["paper"] = {"P": self.first_drop, "R": step, "S": stride, "C": self.resolved["last_layer_keep"]}
        self.scores: torch.Tensor | None = None

    def score(self, layer_idx: int, attn_output: torch.Tensor, ctx) -> None:
        if layer_idx + 1 in self.schedule:  # ranked by the previous layer's last-token attention
            self.scores = torch.full_like(ctx.modality, float("-inf"), dtype=torch.float32)
            self.scores[ctx.active] = last_token_attention(ctx)

    def select(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        if layer_idx not in self.schedule or self.scores is None:
            return active
        target = self.visual_total - math.floor(self.schedule[layer_idx] * self.visual_total + 1e-9)
        visual = (ctx.modality[active] != 0).nonzero().squeeze(1)  # positions in active
        excess = visual.shape[0] - target
        if excess <= 0:
            return active
        return without(active, visual[lowest(self.scores[active[visual]], excess)])

    def summary(self) -> str:
        if not self.schedule or max(self.schedule.values()) == 0.0:
            return "ST3 off"
        r = self.resolved
        return (f"ST3 P={self.first_drop:.1%} at layer {r['start_layer']}, R={r['drop_step']:.2%} every "
                f"{r['stride']} layers, last layer keeps {r['last_layer_keep']:.1%}")


def default_stride(num_layers: int, start: int) -> int:
    stride = max(1, round(PAPER_STRIDE * num_layers / PAPER_DEPTH))
    while (num_layers - start) % stride == 0 and stride <= num_layers - start:
        stride += 1
    return stride
