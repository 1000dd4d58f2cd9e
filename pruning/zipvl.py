"""ZipVL's prefill: layer-wise adaptive ratio of important tokens, sparse attention ("ZipVL: Efficient
Large Vision-Language Models with Dynamic Token Sparsification", He et al., arXiv:2410.08584).

In every layer, a few probe queries — the 64 most recent tokens and 64 random others (Appendix A)
— attend to all keys: ``A' = softmax(Q_probe K^T / sqrt(d))`` (mean over heads, causal). With
``a_j`` the column sums of ``A'`` (they add up to the number of probe rows r):

* the number of important tokens is the fewest tokens whose largest column sums reach ``tau * r``
  (Eq. 6): ``p = min{p : sum_{j<=p} a_sorted(j) >= tau * r}``;
* importance is the normalised column sum ``a_j / nnz(A'_{:,j})`` (Eq. 7), nnz counting the probe
  rows that can see token j under the causal mask;
* the top-p tokens by importance (Eq. 8) are the important set. The last prompt token always is
  one of them (it predicts the next token); it takes the place of the p-th if it was not.

Attention is then computed only among the important tokens (FlashAttention on Q[T], K[T], V[T] in
Algorithm 1); the others get no attention update, but their keys/values are cached and the FFN runs
on every token. tau = 1 keeps every token (exact).

Decode (Section 4.2, Algorithm 1): the KV cache is stored with mixed precision — the prefill's
important tokens of each layer at ``important_bits`` (4), the others at ``other_bits`` (2), packed
group-wise (``pipeline.quant``) so the bytes really shrink, dequantized on the fly for attention.
New tokens stay in float until ``requantize_every`` (100) of them have accumulated in a layer; then
the new token's attention over them (mean over heads, renormalised to the window's mass) picks the
important ones by Eq. 6-8 with the same tau, and the window is packed the same way. A layer with no
restricted attention in prefill (p = n) has every token important. No bits (speed 0): float KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glimpse.common import Modality, UserError
from glimpse.pruning.base import Policy, check_speed, new_token_attention, probe_attention

TAU_DROP_AT_FULL_SPEED = {"image": 0.08, "video": 0.05}  # tau = 1 - drop * speed: paper values at 0.5
# KV bits (important, other) for speed 0, speed in (0, 0.5), speed >= 0.5 (the paper's 4 and 2 bits).
KV_BITS = ((None, None), (8, 4), (4, 2))


@dataclass
class ZipVL(Policy):
    tau_image: float = 1.0  # share of the probe attention mass the important tokens must reach
    tau_video: float = 1.0  # used when the prompt holds a video (the paper uses 0.975 for video)
    recent_probes: int = 64
    random_probes: int = 64
    seed: int = 0  # the random probes are drawn from a generator seeded per layer: reproducible
    important_bits: int | None = None  # KV bits of important tokens in decode; None: float KV
    other_bits: int | None = None  # KV bits of the other tokens
    requantize_every: int = 100  # new tokens stay float until this many have accumulated
    group: int = 32  # channels per quantization group (reduced to divide head_dim)
    name = "zipvl"
    prunes_text = True

    @classmethod
    def from_speed(cls, speed: float) -> "ZipVL":
        speed = check_speed(speed)
        bits = KV_BITS[0] if speed == 0 else KV_BITS[1] if speed < 0.5 else KV_BITS[2]
        return cls(tau_image=round(1.0 - TAU_DROP_AT_FULL_SPEED["image"] * speed, 6),
                   tau_video=round(1.0 - TAU_DROP_AT_FULL_SPEED["video"] * speed, 6),
                   important_bits=bits[0], other_bits=bits[1])

    def check(self, num_layers: int | None = None) -> None:
        for name, tau in (("tau_image", self.tau_image), ("tau_video", self.tau_video)):
            if not 0.0 < tau <= 1.0:
                raise UserError(f"ZipVL {name} must be in (0, 1], got {tau}")
        if self.recent_probes < 1 or self.random_probes < 0:
            raise UserError(f"ZipVL needs recent_probes >= 1 and random_probes >= 0, got {self.recent_probes} and "
                            f"{self.random_probes}")
        if (self.important_bits is None) != (self.other_bits is None):
            raise UserError("ZipVL: set both important_bits and other_bits, or neither")
        if self.important_bits is not None and (self.important_bits not in (2, 4, 8) or self.other_bits not in (2, 4, 8)):
            raise UserError(f"ZipVL important_bits and other_bits must be 2, 4 or 8, got {self.important_bits} "
                            f"and {self.other_bits}")
        if self.important_bits is not None and self.important_bits < self.other_bits:
            raise UserError(f"ZipVL important_bits ({self.important_bits}) must be at least other_bits "
                            f"({self.other_bits}): the important tokens keep the higher precision (Section 4.2)")
        if not 0 <= self.seed < 2**32:  # each layer's generator is seeded with seed * 100003 + layer: torch takes < 2**64
            raise UserError(f"ZipVL seed must be in [0, 2**32), got {self.seed}")
        if self.requantize_every < 1 or self.group < 1:
            raise UserError(f"ZipVL requantize_every and group must be >= 1, got {self.requantize_every} and "
                            f"{self.group}")

    def plan(self, ctx) -> None:
        has_video = bool((ctx.modality == Modality.VIDEO).any())
        tau = self.tau_video if has_video else self.tau_image
        self.resolved = {"tau": tau, "paper": {"tau": tau}}
        self.telemetry = {"important_per_layer": []}  # the paper's p, one per prefill layer
        self.fills_window = True  # until ``decode_step`` knows (``scores_in_decode``)
        if self.important_bits is not None:
            self.resolved["paper"].update(b_h=self.important_bits, b_l=self.other_bits)

    def probe_rows(self, layer_idx: int, n: int, device) -> torch.Tensor:
        recent = torch.arange(max(0, n - self.recent_probes), n)
        pool = n - recent.shape[0]  # tokens before the recent window
        generator = torch.Generator().manual_seed(self.seed * 100003 + layer_idx)
        random = torch.randperm(pool, generator=generator)[: self.random_probes]
        # Drawn on the host (the same probes on every device); a blocking copy would wait for every layer queued
        # before this one, non_blocking from pageable memory is copied before it returns.
        return torch.cat([random.sort().values, recent]).to(device, non_blocking=True)

    def attention_rows(self, layer_idx: int, ctx) -> torch.Tensor | None:
        n = ctx.layer.active.shape[0]
        tau = self.resolved["tau"]
        if tau >= 1.0:
            self.telemetry["important_per_layer"].append(n)
            return None
        rows = self.probe_rows(layer_idx, n, ctx.layer.queries.device)
        probs = probe_attention(ctx.layer.queries, ctx.layer.keys, rows, ctx.layer.scaling).mean(dim=0)  # (r, n)
        p = important_count(probs, tau)
        self.telemetry["important_per_layer"].append(p)
        if p >= n:
            return None
        visible = (torch.arange(n, device=rows.device)[None, :] <= rows[:, None]).sum(dim=0)  # nnz per column
        importance = probs.sum(dim=0) / visible.clamp(min=1)
        importance[n - 1:].fill_(float("inf"))  # the last prompt token is always important (a scalar fill, no copy)
        return importance.topk(p, sorted=False).indices.sort().values  # in position order, so no sorted topk

    def decode_step(self, step: int, ctx) -> None:
        if self.important_bits is None:
            return
        if step == 1:  # before the first decode step: pack each layer's prefill KV by the prefill split
            for layer_idx, important in enumerate(ctx.attention_per_layer):
                if important is None:  # every token of this layer took part in attention: all important
                    important = ctx.cache.unpacked_tokens(layer_idx)
                self._pack(ctx, layer_idx, important)
        # Whether a layer's float window fills in this step (its new entry is the window's last): only then does
        # ``decode_score`` work inside the step; the other steps can be the fixed-shape one (a CUDA graph).
        self.fills_window = any(ctx.cache.unpacked_entries(layer_idx) + 1 >= self.requantize_every
                                for layer_idx in range(len(ctx.cache.layers)))

    def decode_score(self, layer_idx: int, ctx) -> None:
        # The window is the layer's float tail; until it is full there is nothing to do (and nothing to read).
        if self.important_bits is None or ctx.cache.unpacked_entries(layer_idx) < self.requantize_every:
            return
        window_tokens = ctx.cache.unpacked_tokens(layer_idx)
        # The new token's attention to the window (the float tail), as a distribution over it.
        attention = new_token_attention(ctx)
        lookup = torch.full((int(ctx.layer.key_index.max()) + 1,), -1, dtype=torch.long)
        lookup[ctx.layer.key_index] = torch.arange(ctx.layer.key_index.shape[0])
        where = lookup[window_tokens]  # -1: not attended (another policy hid it)
        scores = torch.where(where >= 0, attention[where.clamp(min=0).to(attention.device)].cpu(), torch.tensor(0.0))
        probs = (scores / scores.sum().clamp(min=1e-12))[None]
        p = important_count(probs, self.resolved["tau"])
        self._pack(ctx, layer_idx, window_tokens[scores.topk(p).indices])

    def scores_in_decode(self) -> bool:
        # Without packed KV its work ends with the prefill; with it, only a step that fills a window scores.
        return self.important_bits is not None and self.fills_window

    def _pack(self, ctx, layer_idx: int, important: torch.Tensor) -> None:
        """Pack the layer's float entries: the ``important`` tokens' at high bits, the rest at low."""
        group = ctx.cache.pack(layer_idx, important, self.important_bits, self.other_bits, self.group)
        if group is not None:
            self.resolved["kv_group"] = group

    def summary(self) -> str:
        parts = ["ZipVL off" if self.resolved["tau"] >= 1.0 else f"ZipVL tau={self.resolved['tau']:.3f}"]
        if self.important_bits is not None:
            parts.append(f"KV {self.important_bits}/{self.other_bits}-bit")
        return ", ".join(parts)


def important_count(probs: torch.Tensor, tau: float) -> int:
    """Eq. 6: the fewest tokens whose column sums (largest first) reach ``tau`` x the number of rows."""
    rows, n = probs.shape
    if tau >= 1.0:
        return n
    mass = probs.sum(dim=0).sort(descending=True).values.cumsum(dim=0)
    # The one read of the device per layer: how many rows attend decides the shapes that follow.
    p = int(torch.searchsorted(mass, torch.full((1,), tau * rows, dtype=mass.dtype, device=mass.device))) + 1
    return min(max(p, 1), n)
