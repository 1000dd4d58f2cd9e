"""The policy interface: a small object with typed parameters and a few callbacks.

The engine calls, in this order:
  plan(ctx)                          before prefill, once the prompt and its modalities are known
  select(layer_idx, active, ctx)     before each decoder layer: return the token indices it computes
  score(layer_idx, attn_output, ctx) after that layer's attention output (after o_proj, before the
                                     residual add) is known, for importance signals such as DASH's
  decode_step(step, ctx)             before each decode step (evict / quantize / revive KV entries)

``active`` is always a sorted 1-D LongTensor of original prompt indices. A policy may only shrink
it (never re-add a token whose hidden state went stale) and must keep the last prompt token; the
engine checks both. Policies know nothing of files, Gradio or HTTP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class Policy:
    name = "none"

    @classmethod
    def from_speed(cls, speed: float) -> "Policy":
        """Parameters for a speed in [0, 1]; speed 0 must be exact (no pruning)."""
        if not 0.0 <= speed <= 1.0:
            raise ValueError(f"speed must be in [0, 1], got {speed}")
        return cls()

    def params(self) -> dict:
        return asdict(self)

    def plan(self, ctx) -> None:
        pass

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


@dataclass
class NoPruning(Policy):
    """Every token through every layer: the engine reproduces transformers exactly."""

    name = "none"
