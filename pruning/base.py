"""The policy interface: a small object with typed parameters and a few callbacks.

The engine calls, in this order:
  plan(ctx)                          before prefill, once the prompt, its modalities and the depth
                                     are known: resolve layer numbers, reset per-request state
  skip_encoding(ctx)                 before the vision encoder starts: the visual tokens it need not
                                     compute (RLT's repeats); they enter no decoder layer either
  select(layer_idx, active, ctx)     before each decoder layer: return the token indices it computes;
                                     a policy that merges (``merge_into_kept``) may also replace
                                     ``ctx.hidden``, which the engine reads back before the layer.
                                     At layer 0 the visual rows of ``ctx.hidden`` are placeholders
                                     unless the policy sets ``reads_visual_inputs`` (the engine then
                                     waits for the vision encoder first, as DivPrune needs)
  attention_rows(layer_idx, ctx)     once the layer's queries and keys exist: which of the active
                                     tokens take part in attention (None: all of them)
  score(layer_idx, attn_output, ctx) after that layer's attention output (after o_proj, before the
                                     residual add) is known, for importance signals such as DASH's
  decode_step(step, ctx)             before each decode step: evict or pack KV entries
  decode_rows(layer_idx, rows, ctx)  before each layer of a decode step: the rows it computes — the
                                     new token, plus prompt tokens revived into it (LazyLLM)
  decode_attend(layer_idx, ctx)      which entries of the layer's cache the rows attend to (None: all)
  decode_score(layer_idx, ctx)       after the layer's decode attention: ``ctx.layer.queries`` is the new
                                     token's query, ``ctx.layer.keys`` / ``ctx.layer.key_index`` what it attended to

``active`` is always a sorted 1-D LongTensor of original prompt indices. A policy may only shrink
it (never re-add a token whose hidden state went stale) and must keep the last prompt token; the
engine checks both. From ``attention_rows`` to ``score`` (and in ``decode_score``), ``ctx.layer`` is a
``pipeline.engine.LayerView`` of the layer acting: its index, active tokens and their modalities, its
queries and keys after RoPE (in decode, the new token's query and the keys it attended to, with their
original indices); it is gone once the layer is done, so no callback can read another layer's by mistake.

A policy object carries its parameters (dataclass fields) and, between ``plan`` and the end of the
request, its per-request state; ``make_policy`` builds a fresh one per request. Policies know
nothing of files, Gradio or HTTP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch

from glimpse.common import Modality, UserError
from glimpse.common.jsonable import plain_number

def check_speed(speed: float) -> float:
    speed = plain_number(speed)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise UserError(f"speed must be a number in [0, 1], got {speed!r}")
    if not 0.0 <= speed <= 1.0:
        raise UserError(f"speed must be in [0, 1], got {speed}")
    return float(speed)


def check_layer(what: str, layer: int | None, num_layers: int | None, low: int = 1) -> None:
    """A layer number a user set: None (the policy's default) or in ``[low, num_layers - 1]`` (without the
    model's depth, at least ``low``)."""
    if layer is None:
        return
    if num_layers is None and layer < low:
        raise UserError(f"{what} must be a layer number of at least {low}, got {layer}")
    if num_layers is not None and not low <= layer < num_layers:
        raise UserError(f"{what} must be in [{low}, {num_layers - 1}] on this {num_layers}-layer model, got {layer}")


def scaled_layer(paper_layer: float, paper_depth: int, num_layers: int) -> int:
    """A layer number from a paper's model, scaled to this model's depth (rounded, at least 1)."""
    return max(1, round(paper_layer * num_layers / paper_depth))


@dataclass
class Policy:
    name = "none"
    # Whether the policy can prune a text-only prompt (the pass-key task); visual-only policies cannot.
    prunes_text = False
    # Whether ``select`` at layer 0 reads the visual tokens' input embeddings (``ctx.hidden``): the engine
    # then waits for the vision encoder before layer 0's select instead of after it (DivPrune).
    reads_visual_inputs = False
    # Layer numbers and other values only known once the model's depth and the prompt are (set by plan).
    resolved: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # What the policy observed on this request (tokens halted, important tokens per layer, ...): reported as
    # ``metrics["policy_telemetry"]``, kept apart from the parameters it ran with (``params()``).
    telemetry: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_speed(cls, speed: float) -> "Policy":
        """Parameters for a speed in [0, 1]; speed 0 must be exact (no pruning)."""
        check_speed(speed)
        return cls()

    def fresh(self) -> "Policy":
        """A new object of the same settings and none of a request's state (``plan`` sets that)."""
        return replace(self)

    def params(self) -> dict:
        """The parameters this request ran with: the fields, then the resolved values."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        out.update(self.resolved)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def observed(self) -> dict:
        """This request's telemetry (``telemetry``), as the metrics report it."""
        return dict(self.telemetry)

    def check(self, num_layers: int | None = None) -> None:
        """Refuse a parameter out of its range (``UserError`` naming it and the range) before anything runs:
        ``make_policy`` calls it before a model is loaded (``num_layers`` None: the ranges that need no model),
        the engine with the model's depth before ``plan`` (layer numbers too)."""

    def plan(self, ctx) -> None:
        pass

    def skip_encoding(self, ctx) -> torch.Tensor | None:
        """Original indices (sorted) of visual tokens the vision encoder does not compute; the engine keeps
        them out of every decoder layer too. None: the encoder computes every one."""
        return None

    def select(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        return active

    def attention_rows(self, layer_idx: int, ctx) -> torch.Tensor | None:
        """Positions (into this layer's active set, sorted) of the tokens that take part in this
        layer's attention, or None for all of them. The others get no attention update."""
        return None

    def score(self, layer_idx: int, attn_output: torch.Tensor, ctx) -> None:
        pass

    def decode_step(self, step: int, ctx) -> None:
        pass

    def decode_rows(self, layer_idx: int, rows, ctx):
        return rows

    def decode_attend(self, layer_idx: int, ctx) -> torch.Tensor | None:
        """Sorted positions in ``ctx.cache.tokens(layer_idx)`` the decode rows attend to (None: all)."""
        return None

    def decode_score(self, layer_idx: int, ctx) -> None:
        pass

    def implements(self, callback: str) -> bool:
        """Whether this policy does something in ``callback`` (e.g. "decode_rows"): the engine skips the
        per-layer work of a callback that does nothing (a decode step on a GPU is bound by host work)."""
        return getattr(type(self), callback) is not getattr(Policy, callback)

    def scores_in_decode(self) -> bool:
        """Whether this policy's ``decode_score`` does something at the next step (a policy whose scoring ends, or
        that needs none with its parameters, says so). A decode step in which no request's policy scores (and none
        picks rows or keys) runs as one fixed-shape step, captured as a CUDA graph on a GPU
        (pipeline/decode_graph.py); work between steps (``decode_step``) does not stop it."""
        return self.implements("decode_score")

    def summary(self) -> str:
        """One line for the UI, after plan: what this request runs with."""
        return "no pruning"


@dataclass
class ScoreThenCut(Policy):
    """The pattern FastV, ST3, LazyLLM, HiDivDrop and DASH share: a score read in layer l - 1 decides which
    tokens layer l (and every deeper one) drops. A subclass's ``plan`` sets ``cut_at`` (the layers that
    cut); ``cut`` says what a cut keeps, given ``scores``. The score is the last prompt token's
    attention (one probe query) unless ``token_scores`` says otherwise.
    """

    # Per-request state, reset by ``plan``: the layers that cut, and the scores (by original token
    # index; -inf for tokens the layer did not compute) read in the layer before the next cut.
    cut_at: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    scores: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def token_scores(self, attn_output: torch.Tensor, ctx) -> torch.Tensor:
        """Importance of the layer's active tokens, one per token (higher: keep)."""
        return last_token_attention(ctx)

    def cut(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        """The tokens layer ``layer_idx`` computes, of ``active``, given ``self.scores``."""
        raise NotImplementedError

    def score(self, layer_idx: int, attn_output: torch.Tensor, ctx) -> None:
        if layer_idx + 1 in self.cut_at:
            self.scores = scores_by_token(ctx, self.token_scores(attn_output, ctx))

    def select(self, layer_idx: int, active: torch.Tensor, ctx) -> torch.Tensor:
        if layer_idx not in self.cut_at or self.scores is None:
            return active
        return self.cut(layer_idx, active, ctx)


@dataclass
class NoPruning(Policy):
    """Every token through every layer: the engine reproduces transformers exactly."""

    name = "none"


# ---------------------------------------------------------------------------- shared signals
def probe_attention(queries: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities of a few query rows over all of a layer's keys, causal.

    ``queries`` (1, heads, n, head_dim) and ``keys`` (1, kv_heads, n, head_dim) are the layer's,
    after RoPE; ``rows`` are positions in the layer's active set (which is in original order, so
    causal order is position order). Returns (heads, len(rows), n) in float32; a key after its
    query's position gets probability 0. Costs O(rows * n * d): no T x T matrix is formed.
    """
    heads, kv_heads = queries.shape[1], keys.shape[1]
    groups = heads // kv_heads
    q = queries[0, :, rows].float()  # (heads, r, hd)
    k = keys[0].float()  # (kv_heads, n, hd)
    r, n = q.shape[1], k.shape[1]
    # Grouped-query attention: query head h reads kv head h // groups (transformers' repeat_kv).
    q = q.reshape(kv_heads, groups * r, q.shape[-1])
    # The causal mask enters as the product's bias and the scaling as its factor: one (heads, r, n) float32 tensor
    # is written and softmaxed, not three (the product, the scaled one, the masked one). At 16K tokens that tensor
    # is 238 MB per layer for ZipVL's 128 probes on Qwen2-VL-7B, so each pass counts (docs/pruning.md, ZipVL).
    future = torch.arange(n, device=k.device)[None, :] > rows.to(k.device)[:, None]  # (r, n)
    bias = torch.zeros(future.shape, device=k.device).masked_fill_(future, float("-inf"))
    scores = torch.baddbmm(bias.repeat(groups, 1), q, k.transpose(1, 2), alpha=scaling)  # (kv_heads, groups * r, n)
    return scores.reshape(heads, r, n).softmax(dim=-1)


def last_token_attention(ctx) -> torch.Tensor:
    """The last prompt token's attention over the layer's active tokens, mean over heads: (n,).

    The signal of FastV, ST3 and LazyLLM (Eq. 1 of LazyLLM), from one probe query.
    """
    last = torch.full((1,), ctx.layer.queries.shape[2] - 1, device=ctx.layer.queries.device)  # made there, not copied
    return probe_attention(ctx.layer.queries, ctx.layer.keys, last, ctx.layer.scaling).mean(dim=0)[0]


def new_token_attention(ctx) -> torch.Tensor:
    """In decode: the new token's attention over the keys it attended to (original indices in
    ``ctx.layer.key_index``), mean over heads, float32: (n,)."""
    kv_heads, n, head_dim = ctx.layer.keys.shape[1:]
    q = ctx.layer.queries[0, :, -1].float().reshape(kv_heads, -1, head_dim)  # query head h reads kv head h // groups
    scores = (q @ ctx.layer.keys[0].float().transpose(1, 2)) * ctx.layer.scaling  # (kv_heads, groups, n)
    return scores.softmax(dim=-1).reshape(-1, n).mean(dim=0)


def scores_by_token(ctx, attention: torch.Tensor) -> torch.Tensor:
    """A layer's per-token scores laid over the whole prompt (-inf for tokens not in the layer),
    so a later layer can look them up by original index."""
    scores = torch.full_like(ctx.modality, float("-inf"), dtype=torch.float32)
    scores[ctx.layer.active] = attention
    return scores


def drop_lowest_visual(active: torch.Tensor, ctx, scores: torch.Tensor, count: int) -> torch.Tensor:
    """``active`` without its ``count`` visual tokens of lowest ``scores`` (indexed by original
    index); text tokens are never touched."""
    return without(active, lowest_visual(active, ctx, scores, count))


def visual_in(active: torch.Tensor, ctx) -> int:
    """How many of ``active``'s tokens are visual: from the engine's host copy of its modalities when ``active``
    is the set the engine holds (``ctx.host_active``), else counted on the device (a read the host waits for)."""
    held = getattr(ctx, "host_active", None)
    if held is not None and held[0] is active:
        return int((held[2] != Modality.TEXT).sum())
    return int((ctx.modality[active] != Modality.TEXT).sum())


def lowest_visual(active: torch.Tensor, ctx, scores: torch.Tensor, count: int) -> torch.Tensor:
    """Positions in ``active`` (sorted) of its ``count`` visual tokens of lowest ``scores`` (indexed
    by original index; ties: the earlier token); ``count`` at most the visual tokens in ``active``.
    Two stable sorts instead of selecting the visual positions first, whose number the host would
    have to read from the device before it could go on."""
    if count <= 0:
        return torch.empty(0, dtype=torch.long, device=active.device)
    by_score = torch.sort(scores[active], stable=True).indices  # positions in active
    text_last = torch.sort((ctx.modality[active][by_score] == Modality.TEXT).to(torch.int8), stable=True).indices
    return by_score[text_last[:count]].sort().values


def merge_into_kept(ctx, active: torch.Tensor, pruned: torch.Tensor, sizes: torch.Tensor) -> None:
    """Fold the visual tokens at ``pruned`` (positions into ``active``) into the visual tokens of
    ``active`` that stay, instead of losing what they carry (token merging, as ToMe does in a ViT).

    Each pruned visual token joins the kept visual token whose hidden state is most similar (cosine)
    and that token becomes the size-weighted mean of everything it holds; ``sizes`` (indexed by
    original index, 1 for a token that holds only itself) is updated, so a later stage averages
    correctly again. Pruned text tokens are not merged. Replaces ``ctx.hidden``.
    """
    gone = active[pruned]
    gone = gone[ctx.modality[gone] != Modality.TEXT]
    stays = without(active, pruned)
    stays = stays[ctx.modality[stays] != Modality.TEXT]
    if gone.numel() == 0 or stays.numel() == 0:
        return
    hidden = ctx.hidden[0]
    source, target = hidden[gone].float(), hidden[stays].float()
    similarity = torch.nn.functional.normalize(source, dim=-1) @ torch.nn.functional.normalize(target, dim=-1).T
    into = similarity.argmax(dim=1)  # for each pruned token, the kept token it joins
    weight = sizes.to(hidden.device, torch.float32)
    total = target * weight[stays, None]
    total.index_add_(0, into, source * weight[gone, None])
    size = weight[stays].index_add(0, into, weight[gone])
    sizes[stays.to(sizes.device)] = size.to(sizes.device, sizes.dtype)
    ctx.hidden = ctx.hidden.index_copy(1, stays, (total / size[:, None]).to(hidden.dtype)[None])


def share_of(share: float, count: int) -> int:
    """floor(``share`` x ``count``), as the papers write it and decimal arithmetic gives it: in binary floating point
    0.35 x 180 is 62.99999999999999, and LazyLLM pruned 62 of 180 tokens where its rule says 63 (an outside pass)."""
    return math.floor(share * count + 1e-9)


def lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the ``count`` smallest scores (ties broken towards earlier positions)."""
    if count <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, stable=True).indices
    return order[:count]


def lowest_except(scores: torch.Tensor, count: int, keep: int = -1) -> torch.Tensor:
    """``lowest`` that never picks position ``keep``: the token that predicts the next one."""
    scores = scores.clone()
    # A scalar fill: ``scores[keep] = inf`` copies a host value into the tensor, a wait on a GPU.
    scores.narrow(0, keep % scores.shape[0], 1).fill_(float("inf"))
    return lowest(scores, count)


def without(active: torch.Tensor, dropped_positions: torch.Tensor) -> torch.Tensor:
    """``active`` minus the entries at ``dropped_positions`` (distinct positions into ``active``). The kept
    positions come from a stable sort, not a boolean mask: their number is known on the host, so the host
    does not wait for the device to learn it."""
    if dropped_positions.numel() == 0:
        return active
    dropped = torch.zeros(active.shape[0], dtype=torch.int8, device=active.device)
    dropped.index_fill_(0, dropped_positions.to(dropped.device), 1)
    kept = torch.sort(dropped, stable=True).indices[: active.shape[0] - dropped_positions.numel()]
    return active[kept]
