"""LazyLLM's progressive token pruning ("LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM
Inference", Fu et al., arXiv:2407.14057).

A token's importance in layer l is the last prompt token's attention to it, mean over heads
(Eq. 1). At each pruning layer, the tokens whose importance in the previous layer falls below the
``k``-th percentile of the active tokens are pruned and skip every later layer (Algorithm 1): the
active sets are nested, and later layers keep fewer tokens. LazyLLM is a language-model method, so
every modality can be pruned; the last prompt token never is.

Exactly ``floor(k n)`` of the ``n`` active tokens are pruned at a pruning layer (the lowest scores),
so ``ceil((1 - k) n)`` stay. The hidden states of the pruned tokens, as they entered the pruning
layer, go to the Aux Cache (``ctx.aux_cache``): decode-time revival recomputes their keys and
values there instead of re-running the earlier layers.

Decode (Reviving Tokens, Aux Cache, Algorithm 1): every decode step prunes again, at the same
layers and percentiles, by the new token's attention in the previous layer over the tokens it saw
there (prompt and generated tokens alike), so each step may pick a different subset. At and after a
pruning layer the new token attends only to the selected tokens. A selected token with no key/value
in that layer is revived: its hidden state comes out of that layer's Aux Cache, it joins the step's
computed rows at its original position (after the cached tokens, as the paper appends revived
tokens) and runs on through the following layers, which store its keys/values. A computed row
pruned at a later pruning layer goes into that layer's Aux Cache. So every token is computed at
most once per layer, and in each layer it has either a key/value or an Aux Cache entry, never both.

Decode re-selection is the paper's behaviour and stays available (``decode_reselect=True``, the
field's default), but the slider's settings (``from_speed``) switch it off: each step gathers the
selected entries of every layer past the first pruning layer and computes the revived tokens, which
made decode 0.69x the unpruned speed at batch 1 (docs/benchmarks.md), so a faster first token came
with a slower long answer. Without it, decode attends to what prefill left in each layer's KV cache
(a shorter cache, so each step is cheaper than the unpruned one) and is plain decoding: batched with
other requests in KV slots, captured as a CUDA graph on a GPU, and no Aux Cache is kept (nothing
would read it); docs/pruning.md has the measured difference in answers.

``merge=True`` (not in the paper; a Glimpse option, measured in docs/pruning.md) folds each pruned
visual token into its most similar kept visual token (``pruning.base.merge_into_kept``) instead of
only setting it aside; the Aux Cache still gets its own state.

The paper sweeps where and how much to prune and fixes no default. Ours: prune at 1/4, 1/2 and 3/4
of the depth, with percentiles ``(0.4, 0.5, 0.6) x speed``: at speed 1 the three stages keep 60%,
30% and 12% of the prompt (pruning later layers harder, as the paper's Section 5.5 finds safer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glimpse.common import UserError
from glimpse.pruning.base import (ScoreThenCut, check_layer, check_speed, lowest_except, lowest_visual, merge_into_kept,
                          new_token_attention, share_of, visual_in, without)

DEPTH_FRACTIONS = (0.25, 0.5, 0.75)
PERCENTILES_AT_FULL_SPEED = (0.4, 0.5, 0.6)


@dataclass
class LazyLLM(ScoreThenCut):
    percentiles: tuple[float, ...] = (0.0, 0.0, 0.0)  # k at each pruning layer, in [0, 1)
    depth_fractions: tuple[float, ...] = DEPTH_FRACTIONS  # where the pruning layers sit
    prune_layers: tuple[int, ...] | None = None  # explicit layers instead of depth_fractions
    decode_reselect: bool = True  # the paper's per-step re-selection and revival in decode
    # The paper prunes every token; False prunes the visual tokens only (k of the active visual
    # tokens; text never), in prefill only: a calibration candidate for VLMs.
    prune_text: bool = True
    merge: bool = False  # fold pruned visual tokens into their most similar kept ones
    name = "lazyllm"
    prunes_text = True

    @classmethod
    def from_speed(cls, speed: float) -> "LazyLLM":
        speed = check_speed(speed)
        # The slider's LazyLLM prunes in prefill only: never slower end to end (see the module docstring).
        return cls(percentiles=tuple(round(k * speed, 6) for k in PERCENTILES_AT_FULL_SPEED), decode_reselect=False)

    def check(self, num_layers: int | None = None) -> None:
        layers = self.prune_layers or self.depth_fractions
        if len(layers) != len(self.percentiles):
            raise UserError(f"LazyLLM: {len(layers)} pruning layers but {len(self.percentiles)} percentiles")
        if any(not 0.0 <= k < 1.0 for k in self.percentiles):
            raise UserError(f"LazyLLM percentiles must be in [0, 1), got {self.percentiles}")
        if any(not 0.0 < f < 1.0 for f in self.depth_fractions):
            raise UserError(f"LazyLLM depth_fractions must be in (0, 1), got {self.depth_fractions}")
        for layer in self.prune_layers or ():
            check_layer("LazyLLM prune_layers", layer, num_layers)
        # Set by hand, a layer given twice or a fraction past the last layer was dropped without a word (the request
        # ran unpruned, "LazyLLM off": an outside pass). The defaults may meet on a shallow model (``plan``).
        if self.prune_layers and len(set(self.prune_layers)) != len(self.prune_layers):
            raise UserError(f"LazyLLM prune_layers names a layer twice: {list(self.prune_layers)}")
        if num_layers is not None and not self.prune_layers and self.depth_fractions != DEPTH_FRACTIONS:
            past = [f for f in self.depth_fractions if round(f * num_layers) >= num_layers]
            if past:
                raise UserError(f"LazyLLM depth_fractions {past} put a pruning layer past the last layer "
                                f"({num_layers - 1}) of this {num_layers}-layer model")
        if not self.prune_text and self.decode_reselect:
            raise UserError("LazyLLM prune_text=False prunes in prefill only: set decode_reselect=False")

    def plan(self, ctx) -> None:
        L = ctx.num_layers
        layers = self.prune_layers or tuple(max(1, round(f * L)) for f in self.depth_fractions)
        # On shallow models two fractions can round to one layer: the first keeps it.
        self.schedule: dict[int, float] = {}
        for layer, k in zip(layers, self.percentiles):
            if 1 <= layer < L and layer not in self.schedule:
                self.schedule[layer] = k
        self.resolved = {"prune_layers": sorted(self.schedule),
                         "layer_percentiles": [self.schedule[l] for l in sorted(self.schedule)]}
        self.resolved["paper"] = {"pruning_layers": self.resolved["prune_layers"],
                                  "k": self.resolved["layer_percentiles"]}
        self.cut_at, self.scores = frozenset(layer for layer, k in self.schedule.items() if k > 0.0), None
        self.decode_scores: tuple[torch.Tensor, torch.Tensor] | None = None  # (key_index, attention)
        self.selected: torch.Tensor | None = None  # this decode step's A_l (original indices), sorted
        self.sizes = torch.ones(ctx.modality.shape[0])  # how many tokens each one holds (merge)

    def cut(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        k = self.schedule[layer_idx]  # the scores are the previous layer's importance, by original index
        if self.prune_text:
            pruned = lowest_except(self.scores[active], share_of(k, active.shape[0]))
        else:
            visual = visual_in(active, ctx)
            pruned = lowest_visual(active, ctx, self.scores, share_of(k, visual))
        if self.decode_reselect:  # only decode's revival reads the Aux Cache
            ctx.aux_cache.add(layer_idx, active[pruned], ctx.hidden[0, active[pruned]].clone())
        if self.merge:
            merge_into_kept(ctx, active, pruned, self.sizes)
        return without(active, pruned)

    def implements(self, callback: str) -> bool:
        # Without re-selection the decode callbacks do nothing: saying so lets decode run plainly, as the
        # unpruned model's does over a shorter cache (in a batch's KV slots, as one CUDA graph on a GPU).
        if not self.decode_reselect and callback in ("decode_rows", "decode_attend", "decode_score"):
            return False
        return super().implements(callback)

    def decode_rows(self, layer_idx: int, rows, ctx):
        if layer_idx == 0:
            self.selected = None  # a new step starts from every token
        k = self.schedule.get(layer_idx, 0.0)
        if k == 0.0 or self.decode_scores is None or not self.decode_reselect:
            return rows
        seen, attention = self.decode_scores  # A_{l-1} and the new token's attention over it
        new_token = int((seen == rows.index[-1]).nonzero())  # never pruned
        selected = without(seen, lowest_except(attention.cpu(), share_of(k, seen.shape[0]), new_token)).sort().values
        # Rows computed in this step that were not selected leave it; they have no key/value here,
        # so their hidden state goes to this layer's Aux Cache.
        keep = torch.isin(rows.index, selected)
        gone = (~keep).nonzero().squeeze(1)
        if gone.numel():
            ctx.aux_cache.add(layer_idx, rows.index[gone], rows.hidden[0, gone.to(rows.hidden.device, non_blocking=True)])
            rows = rows.keep(keep.nonzero().squeeze(1))
        # Selected tokens with no key/value here are revived from the Aux Cache (a token found in
        # neither, e.g. evicted by another policy, is simply not attended to).
        cached = ctx.cache.tokens(layer_idx)
        missing = selected[~torch.isin(selected, cached) & ~torch.isin(selected, rows.index)]
        index, hidden = ctx.aux_cache.take(layer_idx, missing)
        if index.numel():
            rows = rows.join(index, hidden, ctx)
        self.selected = selected
        return rows

    def decode_attend(self, layer_idx: int, ctx) -> torch.Tensor | None:
        if self.selected is None:
            return None
        return torch.isin(ctx.cache.tokens(layer_idx), self.selected).nonzero().squeeze(1)

    def decode_score(self, layer_idx: int, ctx) -> None:
        if layer_idx + 1 in self.schedule and self.decode_reselect:
            self.decode_scores = (ctx.layer.key_index.clone(), new_token_attention(ctx))

    def summary(self) -> str:
        if not any(self.schedule.values()):
            return "LazyLLM off"
        stages = ", ".join(f"{k:.0%} at layer {layer}" for layer, k in sorted(self.schedule.items()))
        stages += ", merged into the kept tokens" if self.merge else ""
        return f"LazyLLM prunes {stages}" + (", again at every decode step" if self.decode_reselect else " in prefill")
