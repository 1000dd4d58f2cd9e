"""DASH: Delta Attention Selective Halting ("Stability Implies Redundancy: Delta Attention Selective Halting
for Efficient Long-Context Prefilling", Chen et al.; no arXiv id known to us).

Tokens whose attention branch barely changes them have reached a "semantic fixing point". At the
start layer ``l_s`` DASH scores every token by ``||U_t||_2``, U the attention output after o_proj
and before the residual add, keeps the highest-scoring tokens and halts the rest: halted tokens
skip attention and FFN in every deeper layer and keep their hidden state. Single shot, every
modality, no attention matrix needed.

Layer numbering follows the paper's Algorithm 1 and Appendix A.1: layers ``0 .. l_s-1`` (0-based)
run on all T tokens; the score is the attention output of the last of them (the paper's 1-based
layer ``l_s``); layers ``l_s .. L-1`` run on the kept set, so
``C_ours = l_s A(T) + (L - l_s) A(T_hat)``. ``l_s = floor(0.4 L)`` (the paper's setting).

How many tokens are halted follows the paper's implementation (Appendix A.1, Table 5): the first
``keep_first`` and last ``keep_last`` tokens are always kept and ``round(rho * (T - n_fix))`` of the
remaining eligible tokens are halted, ``n_fix = keep_first + keep_last``; the kept length is
``T_hat = T - round(rho (T - n_fix))`` (8192 -> 2792 at rho=0.667, as in Table 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glimpse.common import UserError
from glimpse.pruning.base import ScoreThenCut, check_layer, check_speed, lowest

RHO_AT_FULL_SPEED = 0.8  # rho = 0.8 * speed: 0.4 at speed 0.5, the paper's 0.667 at speed ~0.83


@dataclass
class DASH(ScoreThenCut):
    """Scores in layer ``l_s - 1`` (the attention output's norm), cuts once at ``l_s``."""

    rho: float = 0.0  # pruning ratio: share of the eligible tokens halted at l_s
    start_layer: int | None = None  # l_s; None: floor(0.4 L), at least 1
    keep_first: int = 64
    keep_last: int = 32
    name = "dash"
    prunes_text = True

    @classmethod
    def from_speed(cls, speed: float) -> "DASH":
        return cls(rho=round(RHO_AT_FULL_SPEED * check_speed(speed), 6))

    def check(self, num_layers: int | None = None) -> None:
        if not 0.0 <= self.rho < 1.0:
            raise UserError(f"DASH rho must be in [0, 1), got {self.rho}")
        if self.keep_first < 0 or self.keep_last < 0:
            raise UserError(f"DASH keep_first and keep_last must be >= 0, got {self.keep_first} and {self.keep_last}")
        check_layer("DASH start_layer", self.start_layer, num_layers)

    def plan(self, ctx) -> None:
        l_s = self.start_layer if self.start_layer is not None else max(1, math.floor(0.4 * ctx.num_layers))
        self.resolved = {"start_layer": l_s,
                         "paper": {"rho": self.rho, "l_s": l_s, "n_first": self.keep_first, "n_last": self.keep_last}}
        self.telemetry = {"num_halted": 0}
        self.cut_at = frozenset({l_s}) if self.rho > 0.0 else frozenset()
        self.scores = None
        self.halted = torch.empty(0, dtype=torch.long)  # original indices halted at l_s (for tests and the UI)

    def token_scores(self, attn_output: torch.Tensor, ctx) -> torch.Tensor:
        return attn_output[0].float().norm(dim=-1)  # ||U_t||_2, one per active token

    def cut(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        # The tokens scored are layer l_s - 1's, in original order: the first keep_first and the last
        # keep_last of them never halt (the last prompt token always stays).
        scored = torch.isfinite(self.scores).nonzero().squeeze(1)
        n = scored.numel()
        first, last = min(self.keep_first, n), max(1, min(self.keep_last, n))
        eligible = scored[first:n - last] if n - first - last > 0 else scored[:0]
        halt_count = int(round(self.rho * eligible.numel()))
        self.halted = eligible[lowest(self.scores[eligible], halt_count)].sort().values
        self.telemetry["num_halted"] = halt_count
        self.scores = None  # single shot: from l_s on the kept set never changes
        return active[~torch.isin(active, self.halted)]

    def summary(self) -> str:
        if self.rho == 0.0:
            return "DASH off"
        return f"DASH rho={self.rho:.2f} at layer {self.resolved['start_layer']}"
