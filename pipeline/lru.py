"""A map bounded in bytes, least recently used out first: what the media and encoder caches share."""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

Value = TypeVar("Value")


class BytesLRU(Generic[Value]):
    """Values under string keys, at most ``max_bytes`` of them as ``size_of`` counts (0: nothing is kept). Safe
    to use from several threads; counts its hits and misses for /metrics. A value larger than the whole bound is
    not kept; adding one drops the least recently used until the rest fit."""

    def __init__(self, max_bytes: int = 0):
        self.max_bytes = max_bytes
        self.entries: collections.OrderedDict[str, tuple[Value, int]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.lock = threading.Lock()

    def size_of(self, value: Value) -> int:
        raise NotImplementedError

    def get(self, key: str) -> Value | None:
        with self.lock:
            found = self.entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return found[0]

    def put(self, key: str, value: Value) -> None:
        size = self.size_of(value)
        with self.lock:
            if size > self.max_bytes or key in self.entries:
                return
            self.entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.bytes -= dropped
