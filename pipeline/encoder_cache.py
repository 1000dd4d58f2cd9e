"""The vision encoder's outputs for recently seen media.

A chat sends the whole conversation every turn, so a follow-up question about the same picture would run
the vision encoder on it again. ``EncoderCache`` keeps what the encoder + projector gave for each recent set
of media, keyed by a digest of the encoder's *inputs* (the preprocessed tensors): the same kernels on the same
inputs give the same features, so a hit is exactly what encoding again would give. It is bounded in bytes,
least recently used out first, and off (``max_bytes=0``) unless asked for: ``glimpse serve`` turns it on
(``--encoder-cache-mb``); benchmarks, calibration and evaluation leave it off, so that every measured
prefill pays for its encoder.
"""

from __future__ import annotations

import hashlib

import torch

from glimpse.pipeline.adapters import MediaInput
from glimpse.pipeline.lru import BytesLRU

Features = tuple[torch.Tensor, list[torch.Tensor]]  # encode_with_layers' output: features, DeepStack layers


def item_key(item: MediaInput) -> str:
    """A digest of what the encoder reads for one item: its kind, token count, and each tensor's name, dtype,
    shape and bytes. Kept on the item, so that the caches that key it hash its pixels once."""
    if item.key is None:
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"{int(item.kind)}:{item.num_tokens}".encode())
        for name in sorted(item.tensors):
            tensor = item.tensors[name].detach().cpu().contiguous()
            digest.update(f"|{name}:{tensor.dtype}:{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # its bytes as they are, not a copy
        item.key = digest.hexdigest()
    return item.key


def media_key(items: list[MediaInput], keep: torch.Tensor | None = None) -> str:
    """A digest of what the encoder reads for ``items``, in order, and of which of their tokens it computes
    (``keep``, one bool per placeholder; None: all of them)."""
    digest = hashlib.blake2b("+".join(item_key(item) for item in items).encode(), digest_size=20)
    if keep is not None:
        digest.update(b"|keep:" + keep.to(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class EncoderCache(BytesLRU[Features]):
    """Features by ``media_key``; the vision encoder may look them up from its own thread (engine.VisionJob)."""

    def size_of(self, value: Features) -> int:
        features, layers = value
        return sum(t.numel() * t.element_size() for t in [features, *layers])
