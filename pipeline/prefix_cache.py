"""Keys and values of recent unpruned prompts, for a later prompt that starts the same way.

A chat sends the whole conversation every turn, and API clients send the same system prompt and the same
picture with question after question: most of such a prompt was prefilled before. Without pruning, a
prompt token's keys and values in every layer depend only on the tokens before it (causal attention), so
the entries of a prompt that began with the same tokens — the same media among them — are exactly what
computing them again would give, up to the order of floating-point sums. ``PrefixCache`` keeps the
per-layer keys and values of recent unpruned prompts; a new unpruned prompt takes the entries of the
longest prefix it shares with one of them and prefills only the rest (vLLM's automatic prefix caching and
SGLang's RadixAttention do the same, block by block).

Only requests that prune nothing reuse or store entries: a pruning policy's choices in a layer depend on
the whole prompt (the last token's attention, the question), so its entries are not a prefix's. The cache
is bounded in bytes, least recently used out first, and off (``max_bytes=0``) unless asked for:
``glimpse serve`` turns it on (``--prefix-cache-mb``); benchmarks, calibration and evaluation leave it
off, so that every measured prefill computes its whole prompt.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch

from glimpse.pipeline.cache import KVCache
from glimpse.pipeline.encoder_cache import item_key
from glimpse.pipeline.prompt import Prompt


@dataclass(frozen=True)
class MediaSpan:
    start: int  # the first placeholder token of the item in the prompt
    end: int  # one past its last
    key: str  # what the encoder reads for it (``encoder_cache.item_key``)


def media_spans(prompt: Prompt) -> list[MediaSpan]:
    """Each media item's placeholder span, in prompt order."""
    return [MediaSpan(int(rows[0]), int(rows[-1]) + 1, item_key(item)) for item, rows in prompt.media_rows()]


@dataclass
class PrefixEntry:
    input_ids: torch.Tensor  # (T,) on CPU
    positions: torch.Tensor  # (P, T) on CPU: the RoPE positions its keys were rotated with
    spans: list[MediaSpan]
    keys: list[torch.Tensor]  # per layer, (1, kv_heads, T, head_dim), after RoPE
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def shared_with(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[MediaSpan]) -> int:
        """How many leading tokens of a prompt (``input_ids``, ``positions``, ``spans``) are this entry's: the
        same ids at the same positions (M-RoPE's depend on the media's grids and frame times), and the same
        media wherever a media item starts before that point. At most ``len - 1``: the prompt's last token is
        always computed, its output is the first token's logits."""
        n = min(len(self.input_ids), len(input_ids) - 1)
        same = (self.input_ids[:n] == input_ids[:n]) & (self.positions[:, :n] == positions[:, :n]).all(dim=0)
        differs = (~same).nonzero()
        shared = int(differs[0]) if differs.numel() else n
        for mine, theirs in zip(self.spans, spans):
            if min(mine.start, theirs.start) >= shared:
                break
            if mine != theirs:  # another picture behind the same placeholder ids
                return min(shared, mine.start, theirs.start)
        return shared

    def is_prefix_of(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[MediaSpan]) -> bool:
        """Whether a prompt begins with this entry's whole prompt (so it serves everything this one does)."""
        return _begins_with(input_ids, positions, spans, self.input_ids, self.positions, self.spans)

    def holds(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[MediaSpan]) -> bool:
        """Whether this entry's prompt begins with the whole of a prompt (so it serves everything that one would)."""
        return _begins_with(self.input_ids, self.positions, self.spans, input_ids, positions, spans)


def _begins_with(input_ids, positions, spans, prefix_ids, prefix_positions, prefix_spans) -> bool:
    """Whether the prompt (``input_ids``, ``positions``, ``spans``) begins with the whole prefix prompt."""
    n = len(prefix_ids)
    return (n <= len(input_ids) and torch.equal(prefix_ids, input_ids[:n])
            and torch.equal(prefix_positions, positions[:, :n]) and prefix_spans == [s for s in spans if s.start < n])


class PrefixCache:
    def __init__(self, max_bytes: int = 0):
        self.max_bytes = max_bytes
        self.entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.reused_tokens = 0  # over all hits: the prompt tokens not computed again
        self._next_id = 0
        self.lock = threading.Lock()

    def lookup(self, input_ids: torch.Tensor, positions: torch.Tensor,
               spans: list[MediaSpan]) -> tuple[PrefixEntry, int] | None:
        """The entry sharing the longest prefix with the prompt, and that length (it becomes the most recently
        used); None if none shares any."""
        input_ids, positions = input_ids.cpu(), positions.cpu()
        with self.lock:
            best, best_id, shared = None, None, 0
            for entry_id, entry in self.entries.items():
                n = entry.shared_with(input_ids, positions, spans)
                if n > shared:
                    best, best_id, shared = entry, entry_id, n
            if best is None:
                self.misses += 1
                return None
            self.entries.move_to_end(best_id)
            self.hits += 1
            self.reused_tokens += shared
            return best, shared

    def put(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[MediaSpan], cache: KVCache) -> None:
        """Keep the prompt's entries (a private copy: the request goes on writing to its own cache). Entries
        this one contains (an earlier turn of the same chat) are dropped: this one serves their prompts too."""
        if not self.max_bytes:
            return
        input_ids, positions = input_ids.cpu(), positions.cpu()
        T = len(input_ids)
        layers = cache.layers
        if any(layer.packed or layer.key is None or layer.key.shape[-2] != T for layer in layers):
            return  # not a whole unpruned prompt
        with self.lock:
            # Asked again (API clients repeat prompts): the entry that holds it is used, not copied once more.
            for entry_id, entry in self.entries.items():
                if entry.holds(input_ids, positions, spans):
                    self.entries.move_to_end(entry_id)
                    return
        entry = PrefixEntry(input_ids, positions, spans, [layer.key.clone() for layer in layers],
                            [layer.value.clone() for layer in layers])
        size = entry.nbytes
        with self.lock:
            if size > self.max_bytes:
                return
            for entry_id, other in list(self.entries.items()):
                if other.is_prefix_of(input_ids, positions, spans):
                    del self.entries[entry_id]
                    self.bytes -= other.nbytes
            self.entries[self._next_id] = entry
            self._next_id += 1
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, dropped = self.entries.popitem(last=False)
                self.bytes -= dropped.nbytes

    def stats(self) -> dict:
        with self.lock:
            return {"entries": len(self.entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens}
