"""How a request's next token is picked: greedy, or temperature and nucleus (top-p) sampling, with its checks.

Its own module, apart from the engine, so that a command checks ``--temperature``, ``--top-p`` and ``--seed``
before it imports the engine and the model code behind it (glimpse ask refuses them in seconds, not after the
model's imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glimpse.common import UserError
from glimpse.common.jsonable import plain_number


@dataclass
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        # Checked when asked, not at the first sampled token: NaN or an infinite temperature made NaN
        # probabilities, and a top_p outside (0, 1] or a seed torch cannot take failed deep in decode.
        self.temperature, self.top_p, self.seed = map(plain_number, (self.temperature, self.top_p, self.seed))
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise UserError(f"seed must be a whole number, got {self.seed!r}")
        if not self.do_sample:
            return
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"temperature must be a finite number > 0 when sampling (got {self.temperature})")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise UserError(f"seed must be in [-2^63, 2^64) (got {self.seed})")

    def next(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        return sample_next(logits, self.do_sample, self.temperature, self.top_p, generator)


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: float,
                generator: torch.Generator | None) -> int:
    """Greedy argmax, or a draw from ``next_token_distribution``."""
    if not do_sample:
        return int(logits.argmax())
    probs = next_token_distribution(logits, temperature, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def next_token_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """What sampling draws the next token from: the logits divided by ``temperature``, then cut to the nucleus of
    ``top_p`` (the fewest most likely tokens whose probabilities reach it; the most likely always), in transformers'
    warper order (``TemperatureLogitsWarper``, then ``TopPLogitsWarper``), as probabilities."""
    if temperature <= 0:
        raise UserError("temperature must be > 0 when sampling")
    scores = logits / temperature
    if not bool(torch.isfinite(scores).all()):
        # A temperature so small that the division overflows (1e-40 in float32) or is by 0 (1e-46 is 0 in float32):
        # inf - inf and 0 / 0 made NaNs. Such a temperature's distribution is the limit one, all its mass on the
        # largest logit(s) (a gap that 1e-38 times a float32 logit would not swamp cannot be told from a tie), in
        # the logits' own dtype and device (float64, tried first, is not on every device: MPS has none).
        scores = torch.zeros_like(logits).masked_fill(logits < logits.max(), float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - top_p)
        remove[-1:].fill_(False)  # always keep the most likely token (a scalar fill: no host copy)
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return scores.softmax(-1)
