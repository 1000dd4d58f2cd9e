"""ST^3 ("ST3: Accelerating Multimodal Large Language Model by Spatial-Temporal Visual Token Trimming",
Zhuang et al., AAAI 2025, arXiv:2412.20105): Progressive Visual Token Pruning in prefill, Visual Token
Annealing in decode.

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
QK heredity (optional in the paper) is not implemented.

Visual Token Annealing (decode): at generated length g every layer keeps the ``ceil(beta(g) V_l)``
most important of its ``V_l`` prefill visual KV entries, ``beta(g) = cos(g pi / (2 tau))`` for
g < tau, else 0 (Eq. 5-6; the paper's linear ``1 - g/tau`` and exponential ``exp(-g/sigma)``
schedules too, sigma = tau / 3). Importance is what prefill knew: the last prompt token's attention
to each visual token in that layer (mean over heads); the paper's Algorithm 3 reuses the order of PVTP's cuts,
which exist at a few layers only (docs/pruning.md says why every layer ranks its own). Evicted entries
are really freed (``KVCache.keep_top_visual``; in a decode batch's KV slots they are masked out at once and freed
when the batch forms again, at the latest once it holds twice what its requests need); text entries and generated
tokens are never touched. We round up (ceil) so a layer keeps at least one visual entry until g reaches tau, where
beta is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glimpse.common import Modality, UserError
from glimpse.pruning.base import (ScoreThenCut, check_layer, check_speed, drop_lowest_visual, last_token_attention, scores_by_token,
                                  share_of, visual_in)

PAPER_START, PAPER_STRIDE, PAPER_DEPTH = 3, 7, 32
PAPER_TAU = 50
SCHEDULES = ("cosine", "linear", "exponential")


def anneal_share(schedule: str, generated: int, tau: float) -> float:
    """beta(g): the share of a layer's prefill visual KV kept at generated length g."""
    if schedule == "exponential":
        return math.exp(-generated / (tau / 3))
    if generated >= tau:
        return 0.0
    if schedule == "linear":
        return 1.0 - generated / tau
    return math.cos(generated * math.pi / (2 * tau))


@dataclass
class ST3(ScoreThenCut):
    first_drop: float = 0.0  # P: share of the visual tokens dropped at the start layer
    end_keep: float = 1.0  # C: share of the visual tokens the last layer keeps (sets R)
    drop_step: float | None = None  # R: share dropped every S layers; None: from end_keep
    stride: int | None = None  # S; None: round(7 L / 32), not dividing L - 3
    start_layer: int | None = None  # None: the paper's layer 3 (the last layer on shallower models)
    anneal_tau: float | None = None  # VTA's tau in generated tokens; None: no annealing
    anneal: str = "cosine"  # or "linear", "exponential"
    name = "st3"

    @classmethod
    def from_speed(cls, speed: float) -> "ST3":
        speed = check_speed(speed)
        # Speed 1 is the paper's setting (P 50%, C 1%, tau 50); speed 0 prunes and anneals nothing.
        return cls(first_drop=round(0.5 * speed, 6), end_keep=round(1.0 - 0.99 * speed, 6),
                   anneal_tau=annealing_tau(speed))

    @classmethod
    def annealing_only(cls, speed: float) -> "ST3":
        """The decode half alone: the default pipeline ends with it."""
        return cls(anneal_tau=annealing_tau(check_speed(speed)))

    def check(self, num_layers: int | None = None) -> None:
        if not (0.0 <= self.first_drop <= 1.0 and 0.0 <= self.end_keep <= 1.0):
            raise UserError(f"ST3 first_drop and end_keep must be in [0, 1], got {self.first_drop} and {self.end_keep}")
        if self.drop_step is not None and self.drop_step < 0:
            raise UserError(f"ST3 drop_step must be >= 0, got {self.drop_step}")
        if self.stride is not None and self.stride < 1:
            raise UserError(f"ST3 stride must be >= 1, got {self.stride}")
        # At least 1: the drop at a layer ranks by the layer before's attention. 0 was taken, reported as "P at layer 0"
        # and never applied (P folded into the first stride drop; on 2 layers nothing pruned: an outside pass).
        check_layer("ST3 start_layer", self.start_layer, num_layers, low=1)
        if self.drop_step is None and self.first_drop + self.end_keep > 1.0 + 1e-9:  # needs no depth: said at once
            raise UserError(f"ST3 first_drop P={self.first_drop} and end_keep C={self.end_keep}: P is dropped at the "
                            "start layer and C kept at the last, so P + C must be at most 1")
        if self.anneal not in SCHEDULES:
            raise UserError(f"ST3 anneal must be one of {', '.join(SCHEDULES)}, got {self.anneal!r}")
        if self.anneal_tau is not None and self.anneal_tau < 1:  # in answer tokens (the paper's is 50): 5e-324 was
            # taken, and the exponential schedule's tau / 3 was 0, a ZeroDivisionError in decode (an outside pass)
            raise UserError(f"ST3 anneal_tau (answer tokens) must be >= 1, got {self.anneal_tau}")
        if num_layers is not None:  # (before the media are decoded, as every other parameter is)
            self._layers(num_layers)

    def _layers(self, L: int) -> tuple[int, int, list[int], float]:
        """On an L-layer model: the start layer, the stride S, the layers that drop R each, and R; refused when P and
        R, or P and C, prune more than all of the visual tokens."""
        start = self.start_layer if self.start_layer is not None else min(PAPER_START, L - 1)
        stride = self.stride or default_stride(L, start)
        drops = list(range(start + stride, L, stride))
        if self.drop_step is None and self.first_drop + self.end_keep > 1.0 + 1e-9:
            raise UserError(f"ST3 first_drop P={self.first_drop} and end_keep C={self.end_keep}: P is dropped at the "
                            "start layer and C kept at the last, so P + C must be at most 1")
        step = self.drop_step if self.drop_step is not None else (
            (1.0 - self.first_drop - self.end_keep) / len(drops) if drops else 0.0)
        if self.first_drop + step * len(drops) > 1.0 + 1e-9:
            raise UserError(f"ST3 first_drop P={self.first_drop} and drop_step R={step} over the {len(drops)} drops of "
                            f"this {L}-layer model prune more than all of the visual tokens")
        return start, stride, drops, step

    def plan(self, ctx) -> None:
        start, stride, drops, step = self._layers(ctx.num_layers)
        # Cumulative share of the original visual tokens pruned before each pruning layer.
        self.schedule = {start: self.first_drop} if start >= 1 else {}
        for j, layer in enumerate(drops, start=1):
            self.schedule[layer] = self.first_drop + j * step
        self.visual_total = int((ctx.modality != Modality.TEXT).sum())
        self.resolved = {"start_layer": start, "stride": stride, "drop_step": step,
                         "prune_layers": sorted(self.schedule),
                         "last_layer_keep": 1.0 - (max(self.schedule.values()) if self.schedule else 0.0)}
        self.resolved["paper"] = {"P": self.first_drop, "R": step, "S": stride, "C": self.resolved["last_layer_keep"]}
        if self.anneal_tau is not None:
            self.resolved["paper"]["tau"] = self.anneal_tau
        self.cut_at, self.scores = frozenset(self.schedule), None
        self.ranking: dict[int, torch.Tensor] = {}  # layer -> its visual tokens, most important first (host)
        self.kept: dict[int, int] = {}  # layer -> visual KV entries it holds now
        # Each layer's prefill ranking on the device, until the first decode step copies them all at once:
        # (the layer's active tokens, most attended first, and whether each is visual; text sorts last).
        self.ranked_on_device: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def score(self, layer_idx: int, attn_output: torch.Tensor, ctx) -> None:
        # One probe of this layer's last-token attention serves both halves: PVTP's next cut and VTA.
        cuts_next = layer_idx + 1 in self.cut_at
        if not cuts_next and self.anneal_tau is None:
            return
        attention = last_token_attention(ctx)
        if cuts_next:
            self.scores = scores_by_token(ctx, attention)
        if self.anneal_tau is not None:  # VTA ranks each layer's visual KV by this layer's attention
            # Nothing read back here: a read per layer would make the host wait for the GPU at every layer.
            visual = ctx.layer.modality != Modality.TEXT
            order = attention.masked_fill(~visual, -math.inf).argsort(descending=True, stable=True)
            self.ranked_on_device[layer_idx] = (ctx.layer.active[order], visual[order])

    def _rankings_to_host(self) -> None:
        """Every layer's ranking of its visual tokens on the host, in one copy after the prefill."""
        layers = list(self.ranked_on_device)
        tokens = torch.cat([self.ranked_on_device[i][0] for i in layers]).cpu()
        visual = torch.cat([self.ranked_on_device[i][1] for i in layers]).cpu()
        sizes = [self.ranked_on_device[i][0].shape[0] for i in layers]
        for layer_idx, layer_tokens, layer_visual in zip(layers, tokens.split(sizes), visual.split(sizes)):
            self.ranking[layer_idx] = layer_tokens[layer_visual]
            self.kept[layer_idx] = self.ranking[layer_idx].shape[0]
        self.ranked_on_device = {}

    def decode_step(self, step: int, ctx) -> None:
        if self.anneal_tau is None:
            return
        if self.ranked_on_device:
            self._rankings_to_host()
            for layer_idx, ranking in self.ranking.items():
                ctx.cache.rank_visual(layer_idx, ranking)
        share = anneal_share(self.anneal, step, self.anneal_tau)
        for layer_idx, ranking in self.ranking.items():
            keep = math.ceil(share * ranking.shape[0] - 1e-9)
            if keep < self.kept[layer_idx]:  # a few integers per layer: the cache hides or frees the rest
                ctx.cache.keep_top_visual(layer_idx, keep)
                self.kept[layer_idx] = keep

    def cut(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        target = self.visual_total - share_of(self.schedule[layer_idx], self.visual_total)
        excess = visual_in(active, ctx) - target
        return drop_lowest_visual(active, ctx, self.scores, excess) if excess > 0 else active

    def summary(self) -> str:
        parts = []
        if self.schedule and max(self.schedule.values()) > 0.0:
            r = self.resolved
            parts.append(f"P={self.first_drop:.1%} at layer {r['start_layer']}, R={r['drop_step']:.2%} every "
                         f"{r['stride']} layers, last layer keeps {r['last_layer_keep']:.1%}")
        if self.anneal_tau is not None:
            parts.append(f"visual KV annealed ({self.anneal}) to 0 by token {self.anneal_tau:g}")
        return "ST3 " + ("; ".join(parts) if parts else "off")


def default_stride(num_layers: int, start: int) -> int:
    stride = max(1, round(PAPER_STRIDE * num_layers / PAPER_DEPTH))
    while (num_layers - start) % stride == 0 and stride <= num_layers - start:
        stride += 1
    return stride


def annealing_tau(speed: float) -> float | None:
    """tau = 50 / speed generated tokens: the paper's 50 at speed 1, slower annealing below, none at 0 (nor at a speed
    so small that tau is past any float: 50 / 1e-320 was infinite, and ``glimpse ask --json`` printed "Infinity",
    which is not JSON)."""
    tau = PAPER_TAU / speed if speed > 0 else math.inf
    return round(tau, 3) if math.isfinite(tau) else None
