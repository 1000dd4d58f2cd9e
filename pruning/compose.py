"""Composition: several policies acting as one, in order (kvpress's wrapper idea).

Every callback goes to every member in order; ``skip_encoding`` joins the members' skipped tokens;
``select`` chains, so each member only ever shrinks what the previous ones left (tokens a member lets join at a
layer, HiDivDrop's late injection, pass the later members' cuts at that layer: see ``select``); ``attention_rows`` and
``decode_attend`` intersect the members' choices; ``decode_rows`` chains. This is how the design card's
default pipeline (HiDivDrop late injection, then DASH or ZipVL, then ST3's decode-time annealing) is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from glimpse.pruning.base import Policy


@dataclass
class Pipeline(Policy):
    policies: tuple[Policy, ...] = ()
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or "+".join(p.name for p in self.policies) or "none"

    @property
    def reads_visual_inputs(self) -> bool:
        return any(p.reads_visual_inputs for p in self.policies)

    def params(self) -> dict:
        return {p.name: p.params() for p in self.policies}

    def observed(self) -> dict:
        return {p.name: p.observed() for p in self.policies if p.observed()}

    def check(self, num_layers: int | None = None) -> None:
        for p in self.policies:
            p.check(num_layers)

    def plan(self, ctx) -> None:
        for p in self.policies:
            p.plan(ctx)

    def skip_encoding(self, ctx) -> torch.Tensor | None:
        skipped = [s for s in (p.skip_encoding(ctx) for p in self.policies) if s is not None]
        return torch.unique(torch.cat(skipped)) if skipped else None

    def fresh(self) -> "Pipeline":
        return replace(self, policies=tuple(p.fresh() for p in self.policies))

    def select(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        # Tokens a member lets join at this layer (HiDivDrop's late injection) pass the cuts of the members after it
        # at this layer: a cut ranks by the layer before's attention, which those tokens were not in. Ranked as
        # -inf, they were cut first (LazyLLM cutting at HiDivDrop's inject layer pruned 11 of the 12 visual tokens
        # that had just joined and no text; FastV dropped the first visual tokens by position: an outside pass).
        # DASH already leaves the tokens it did not score. The next layer's cuts rank them like any other.
        joined = None
        for p in self.policies:
            given = active
            active = p.select(layer_idx, active, ctx)
            if active.shape[0] > given.shape[0]:  # a member adds tokens or removes them at a layer, never both
                added = joined_tokens(given, active)
                joined = added if joined is None else torch.cat([joined, added])
                active = given
        return active if joined is None else torch.cat([active, joined]).sort().values

    def attention_rows(self, layer_idx: int, ctx) -> torch.Tensor | None:
        rows = None
        for p in self.policies:
            chosen = p.attention_rows(layer_idx, ctx)
            if chosen is not None:
                rows = chosen if rows is None else rows[torch.isin(rows, chosen)]
        return rows

    def score(self, layer_idx: int, attn_output: torch.Tensor, ctx) -> None:
        for p in self.policies:
            p.score(layer_idx, attn_output, ctx)

    def decode_step(self, step: int, ctx) -> None:
        for p in self.policies:
            p.decode_step(step, ctx)

    def decode_rows(self, layer_idx: int, rows, ctx):
        for p in self.policies:
            rows = p.decode_rows(layer_idx, rows, ctx)
        return rows

    def decode_attend(self, layer_idx: int, ctx) -> torch.Tensor | None:
        attend = None
        for p in self.policies:
            chosen = p.decode_attend(layer_idx, ctx)
            if chosen is not None:
                attend = chosen if attend is None else attend[torch.isin(attend, chosen)]
        return attend

    def decode_score(self, layer_idx: int, ctx) -> None:
        for p in self.policies:
            p.decode_score(layer_idx, ctx)

    def implements(self, callback: str) -> bool:
        return any(p.implements(callback) for p in self.policies)

    def scores_in_decode(self) -> bool:
        return any(p.scores_in_decode() for p in self.policies)

    def summary(self) -> str:
        return ", ".join(p.summary() for p in self.policies) or "no pruning"


def joined_tokens(given: torch.Tensor, grown: torch.Tensor) -> torch.Tensor:
    """The entries of ``grown`` (sorted original indices, ``given``'s and more) that ``given`` lacks. How many is
    known on the host (the difference of the sizes), so nothing waits for the device to count them."""
    new = torch.isin(grown, given, invert=True).to(torch.int8)
    return grown[torch.sort(new, descending=True, stable=True).indices[: grown.shape[0] - given.shape[0]]]
