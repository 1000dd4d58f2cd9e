"""Recently seen images and videos, decoded and preprocessed.

A chat client sends the whole conversation every turn, its pictures and videos included, so each follow-up
question would decode and preprocess the same media again before the encoder cache (pipeline/encoder_cache.py)
can even be asked: about 2.5 ms for a small PNG, 0.6 s for a 10-second 720p clip on two CPU cores
(docs/serving.md). ``MediaCache`` keeps the preprocessed ``MediaInput`` of each recent source, keyed by a
digest of its bytes, whether they came as bytes (an image's data URL) or as a file (an upload, a path, the
API's temporary copy of a video's bytes): the same content is the same key wherever it lies, and a file written
again with other content is read again. Hashing reads the file once more (about 1 ms a megabyte), against
decoding it. Preprocessing is deterministic for a given adapter, so a hit is exactly what preparing again would
give. A PIL image handed in by Python code is not cached.

Bounded in bytes (the encoder's input tensors and the frames kept for display), least recently used out first;
off (``max_bytes=0``) unless asked for: ``glimpse serve`` turns it on (``--media-cache-mb``); benchmarks,
calibration and evaluation leave it off, so that every measured request pays for its decoding.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from glimpse.pipeline.adapters import MediaInput
from glimpse.pipeline.lru import BytesLRU

HASH_CHUNK = 1 << 20
# A larger local file (only ``--allowed-root`` can name one: uploads stop at 200 MB, media URLs at 50 MB) is
# not cached: hashing reads all of it, where sampling a video's frames may seek past most of it.
MAX_HASHED_BYTES = 256 * 2**20


def source_key(kind: str, source) -> str | None:
    """A digest of the content of ``source`` (bytes, or the path of a regular file) as a ``kind``
    ("image"/"video") input; None for a PIL image, a file over ``MAX_HASHED_BYTES``, and what is not a regular
    file that can be read (preparing it reports why: a folder, a FIFO that would block, a missing file)."""
    digest = hashlib.blake2b(kind.encode(), digest_size=20)
    if isinstance(source, (bytes, bytearray, memoryview)):
        digest.update(source)
        return digest.hexdigest()
    if not isinstance(source, (str, os.PathLike)):
        return None
    try:
        path = Path(source)
        if not path.is_file() or path.stat().st_size > MAX_HASHED_BYTES:
            return None
        with open(path, "rb") as file:
            while chunk := file.read(HASH_CHUNK):
                digest.update(chunk)
    except (OSError, ValueError):
        return None
    return digest.hexdigest()


def item_bytes(item: MediaInput) -> int:
    """Memory an item holds: its tensors and, at 3 bytes a pixel, the frames it keeps for display."""
    tensors = sum(t.numel() * t.element_size() for t in item.tensors.values())
    return tensors + sum(3 * frame.width * frame.height for frame in item.frames)


class MediaCache(BytesLRU[MediaInput]):
    """Preprocessed media by ``source_key``; prompts are built in the submitting threads."""

    def size_of(self, item: MediaInput) -> int:
        return item_bytes(item)

    def prepared(self, kind: str, source, prepare) -> MediaInput:
        """``prepare(source)``, or what it gave for the same source before. Failures are not kept: a bad file
        is reported again each time it is sent.

        A file is read twice, hashed and then prepared: one replaced or written in between (an --allowed-root
        snapshot such as a camera's latest.jpg, renamed over every second) had the other content's pixels kept
        under the first content's key, and every later request with the first content was answered about the other
        picture (an outside pass: 30 of 300 prompts built while a thread swapped two pictures). What was prepared is
        kept only when the file is the same one, unchanged, after preparing as before hashing."""
        if self.max_bytes <= 0:
            return prepare(source)
        before = file_identity(source)
        key = source_key(kind, source)
        item = self.get(key) if key is not None else None
        if item is None:
            item = prepare(source)
            if key is not None and file_identity(source) == before:
                self.put(key, item)
        return item


def file_identity(source) -> tuple | None:
    """Which file ``source`` is and its state (device, inode, size, modification and change times in ns), or None for
    bytes. Replacing the file (a rename) changes the inode; writing it changes the times, the change time at least,
    which no program can set. (Times are kept at the kernel's tick, a few ms on most systems: a file written twice
    within one tick, hashed between the two writes, would pass.)"""
    if not isinstance(source, (str, os.PathLike)):
        return None
    try:
        state = os.stat(source)
    except (OSError, ValueError):
        return None
    return state.st_dev, state.st_ino, state.st_size, state.st_mtime_ns, state.st_ctime_ns
