"""RLT: a video's tokens that repeat, left out before the vision encoder (Choudhury et al., NeurIPS 2024,
"Don't Look Twice: Faster Video Transformers with Run-Length Tokenization", arXiv:2411.05222).

Not one of the design card's five papers. Every one of those prunes inside the decoder, and on a long
video the vision encoder (and the host building its patches) is most of the time to first token: on an
H100, 0.53 s of a 16K-token video's 1.30 s is the encoder, so even a free decoder prefill would give 1.6x
(docs/benchmarks.md). RLT removes tokens *before* the encoder, so both get shorter.

The paper's rule: cut the video into its space-time patches (tubelets); where a tubelet differs from the
one at the same place one step earlier by a mean absolute pixel difference below ``tau`` (the paper compares
the tubelet's first frame with the earlier one's last), it repeats a run and is dropped; the run's first
tubelet stays (the paper adds a learnt encoding of the run's length, which needs training; its training-free
variant, the one used here, leaves it out). Each kept token keeps its own
space-time position (the decoder's M-RoPE or 1-D position), so the model sees where and when every kept
token is.

Glimpse's decisions where the paper is silent or Glimpse differs (docs/pruning.md, "RLT"):

- The unit is one *visual token* (Qwen2-VL: a 2x2 group of 14-pixel patches over its 2 frames; the
  LLaVA family: a pooled cell of 2x2 patches of a frame), not one encoder patch: a decoder token is kept or
  dropped whole. The paper's test is made on every encoder patch of the token, and the token repeats only
  when all of them do (a small object moving within one patch is not averaged away over four).
- A token is compared with the last *kept* token at its place, not with the one just before it, so that a
  slow change (a drift below ``tau`` per step) cannot go unseen for ever: once it adds up to ``tau``, the
  token is kept again. Every pixel of the token is compared (both frames of a Qwen2-VL tubelet, with the
  reference's), so a change within a tubelet counts too.
- The first temporal step is always kept whole; images are never touched.
- ``tau`` is in the units of the processed pixels the encoder reads (normalised by the processor's mean
  and standard deviation), so it means the same for every model of one family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glimpse.common import Modality, UserError
from glimpse.pruning.base import Policy, check_speed

# On a still-camera clip with sensor noise and H.264 (docs/pruning.md, "RLT"), tau 0.05 already leaves out the
# still background (75% of the tokens) and 0.1 little more (76%): the margin is for noisier footage.
TAU_AT_FULL_SPEED = 0.1


@dataclass
class RLT(Policy):
    tau: float = 0.0  # mean absolute difference (normalised pixels) below which a token repeats; 0: off
    name = "rlt"

    @classmethod
    def from_speed(cls, speed: float) -> "RLT":
        return cls(tau=TAU_AT_FULL_SPEED * check_speed(speed))

    def check(self, num_layers: int | None = None) -> None:
        if not self.tau >= 0.0:
            raise UserError(f"RLT tau must be at least 0, got {self.tau}")

    def plan(self, ctx) -> None:
        self.telemetry = {"video_tokens": 0, "not_encoded": 0}

    def skip_encoding(self, ctx) -> torch.Tensor | None:
        if self.tau <= 0.0:
            return None
        skipped = []
        for item, tokens in ctx.prompt.media_rows():
            if item.kind != Modality.VIDEO:
                continue
            self.telemetry["video_tokens"] += int(tokens.shape[0])
            pixels = ctx.adapter.token_pixels(item)
            if pixels is None or pixels.shape[0] * pixels.shape[1] != tokens.shape[0]:
                continue  # the architecture cannot say which pixels a token holds: nothing is skipped
            skipped.append(tokens[repeated_tokens(pixels, self.tau).flatten().to(tokens.device)])
        if not skipped:
            return None
        skipped = torch.cat(skipped)
        self.telemetry["not_encoded"] = int(skipped.shape[0])
        return skipped

    def summary(self) -> str:
        if self.tau <= 0.0:
            return "RLT off"
        return f"RLT leaves out video tokens that repeat (every patch's change < {self.tau:g}) before the encoder"


def repeated_tokens(pixels: torch.Tensor, tau: float) -> torch.Tensor:
    """(t, n) bool: which of a video's tokens repeat, from ``pixels`` (t, n, p, f): the processed pixels of each
    of its ``n`` tokens at each of its ``t`` steps, as ``p`` encoder patches of ``f`` values. A token repeats when
    every one of its patches differs from that patch in the last kept token at its place by a mean absolute
    difference below ``tau``; the first step is kept whole."""
    pixels = pixels.float()
    repeats = torch.zeros(pixels.shape[:2], dtype=torch.bool, device=pixels.device)
    reference = pixels[0].clone()
    for step in range(1, pixels.shape[0]):
        change = (pixels[step] - reference).abs_().mean(dim=-1).amax(dim=-1)  # the most changed patch
        repeats[step] = change < tau
        # Only the kept tokens become the new reference: copying those alone is what keeps a 16K-token video's
        # decision near 25 ms on a CPU (rebuilding the whole reference every step took 0.15-0.23 s).
        kept = (~repeats[step]).nonzero().squeeze(1)
        reference.index_copy_(0, kept, pixels[step].index_select(0, kept))
    return repeats
