"""ZipVL's prefill: layer-wise adaptive ratio of important tokens, sparse attention (seeds/ZipVL.txt).

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
on every token. tau = 1 keeps every token (exact). The KV-cache quantisation of decode is separate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pruning.base import Policy, check_speed, probe_attention

TAU_DROP_AT_FULL_SPEED = {"image": 0.08, "video": 0.05}  # tau = 1 - drop * speed: paper values at 0.5


@dataclass
class ZipVL(Policy):
    tau_image: float = 1.0  # share of the probe attention mass the important tokens must reach
    tau_video: float = 1.0  # used when the prompt holds a video (the paper uses 0.975 for video)
    recent_probes: int = 64
    random_probes: int = 64
    seed: int = 0  # the random probes are drawn from a generator seeded per layer: reproducible
    name = "zipvl"

    @classmethod
    def from_speed(cls, speed: float) -> "ZipVL":
        speed = check_speed(speed)
        return cls(tau_image=round(1.0 - TAU_DROP_AT_FULL_SPEED["image"] * speed, 6),
                   tau_video=round(1.0 - TAU_DROP_AT_FULL_SPEED["video"] * speed, 6))

    def plan(self, ctx) -> None:
        has_video = bool((ctx.modality == 2).any())
        tau = self.tau_video if has_video else self.tau_image
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"ZipVL tau must be in (0, 1], got {tau}")
        self.resolved = {"tau": tau, "important_per_layer": []}
        self.resolved["paper"] = {"tau": tau, "p": self.resolved["important_per_layer"]}  # p filled per layer

    def probe_rows(self, layer_idx: int, n: int, device) -> torch.Tensor:
        recent = torch.arange(max(0, n - self.recent_probes), n)
        pool = n - recent.shape[0]  # tokens before the recent window
        generator = torch.Generator().manual_seed(self.seed * 100003 + layer_idx)
        random = torch.randperm(pool, generator=generator)[: self.random_probes]
        return torch.cat([random.sort().values, recent]).to(device)

    def attention_rows(self, layer_idx: int, ctx) -> torch.Tensor | None:
        n = ctx.active.shape[0]
        tau = self.resolved["tau"]
        if tau >= 1.0:
            self.resolved["important_per_layer"].append(n)
            return None
        rows = self.probe_rows(layer_idx, n, ctx.queries.device)
        probs = probe_attention(ctx.queries, ctx.keys, rows, ctx.scaling).mean(dim=0)  # (r, n)
        p = important_count(probs, tau)
        self.resolved["important_per_layer"].append(p)
        if p >= n:
            return None
        visible = (torch.arange(n, device=rows.device)[None, :] <= rows[:, None]).sum(dim=0)  # nnz per column
        importance = probs.sum(dim=0) / visible.clamp(min=1)
        importance[n - 1] = float("inf")  # the last prompt token is always important
        return importance.topk(p).indices.sort().values

    def summary(self) -> str:
        if self.resolved["tau"] >= 1.0:
            return "ZipVL off"
        return f"ZipVL tau={self.resolved['tau']:.3f}"


def important_count(probs: torch.Tensor, tau: float) -> int:
    """Eq. 6: the fewest tokens whose column sums (largest first) reach ``tau`` x the number of rows."""
    rows, n = probs.shape
    if tau >= 1.0:
        return n
    mass = probs.sum(dim=0).sort(descending=True).values.cumsum(dim=0)
    p = int(torch.searchsorted(mass, torch.tensor([tau * rows], dtype=mass.dtype, device=mass.device))) + 1
    return min(max(p, 1), n)
