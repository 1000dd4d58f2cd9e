"""Per-layer KV cache whose entries remember which prompt token they are.

Each layer keeps exactly the tokens that were active in it, so lengths differ between layers.
Next to the key/value tensors every layer stores, per entry, the token's original index in the
sequence (prompt tokens 0..T-1, generated tokens T, T+1, ...) and its modality (0 text, 1 image,
2 video): decode-time policies find visual entries through them.

Entries can be packed to a few bits per value (ZipVL's mixed-precision KV, ``LayerKV.pack``) and
evicted (``LayerKV.keep``; ST3's annealing through ``rank_visual`` and ``keep_top_visual``); readers get
float keys and values from ``LayerKV.keys_values``, dequantized on the fly, so the cache only ever holds the
packed bytes.
"""

from __future__ import annotations

import bisect
import math

import torch

from glimpse.common import Modality
from glimpse.pipeline.quant import QuantizedTensor, cat_tokens, dequantize, quantize

# ST3's ranks (``LayerKV.rank_visual``): an entry no ranking covers (text, generated tokens) is ranked UNRANKED and
# always kept; a layer that has hidden nothing keeps every rank below NO_LIMIT.
UNRANKED, NO_LIMIT = -1, 2**31 - 1


# Index lists made on the host (which entries a step reads, keeps or packs) go to the device with
# ``non_blocking=True``: from pageable memory the copy is staged before the call returns, so the temporary may go,
# while a blocking copy also waits for everything queued on the device (on a GPU's decode step: once per layer per
# request).


class Growing:
    """A tensor that grows along ``dim`` by writing into spare room after its last entry.

    Decode appends one entry per step. Re-concatenating at every step would copy the whole tensor per
    token; here a step writes in place, and only when the room is used up is the tensor copied into a
    buffer with room for ``GROW`` more entries. (A fixed chunk, not doubling: the prompt's entries
    dominate, and doubling would reserve as much memory again.)
    """

    GROW = 256

    def __init__(self, dim: int, tensor: torch.Tensor | None = None):
        self.dim = dim
        self.replace(tensor)

    def replace(self, tensor: torch.Tensor | None) -> None:
        """Hold ``tensor`` as it is (no copy), with no spare room."""
        self.buffer = tensor
        self.length = 0 if tensor is None else tensor.shape[self.dim]
        self.owner = None  # the token of the ``BatchKV`` whose slot ``buffer`` is, if any

    def adopt(self, buffer: torch.Tensor, owner) -> None:
        """Move the entries into ``buffer`` (room for at least as many along ``dim``; one copy) and grow
        there from now on: ``owner`` (a ``pipeline.batch_kv.BatchKV``'s token) reads them in place."""
        buffer.narrow(self.dim, 0, self.length).copy_(self.view())
        self.buffer, self.owner = buffer, owner

    def keep(self, rows: torch.Tensor) -> None:
        """Only the entries at ``rows`` (sorted). A slot of a ``BatchKV`` is compacted in place (it stays
        the owner's); otherwise the kept entries become a tensor of their own and the rest is freed."""
        kept = self.view().index_select(self.dim, rows.to(self.buffer.device))
        if self.owner is None:
            self.replace(kept)
            return
        self.buffer.narrow(self.dim, 0, kept.shape[self.dim]).copy_(kept)
        self.length = kept.shape[self.dim]

    def view(self) -> torch.Tensor | None:
        """The entries (a view of the buffer, no copy)."""
        return None if self.buffer is None else self.buffer.narrow(self.dim, 0, self.length)

    def nbytes(self, entries: int | None = None) -> int:
        """Bytes of the entries held (not of the room after them), or of ``entries`` of them."""
        if self.buffer is None or self.length == 0:
            return 0
        entries = self.length if entries is None else entries
        return entries * (self.buffer.numel() // self.buffer.shape[self.dim]) * self.buffer.element_size()

    def extend(self, tensor: torch.Tensor) -> None:
        if self.buffer is None:  # the first entries are kept as they come
            self.replace(tensor)
            return
        n, new = self.length, tensor.shape[self.dim]
        if n + new > self.buffer.shape[self.dim]:  # full: one copy into a buffer with room for GROW more
            shape = list(self.buffer.shape)
            shape[self.dim] = n + new + self.GROW
            grown = self.buffer.new_empty(shape)
            grown.narrow(self.dim, 0, n).copy_(self.view())
            self.buffer, self.owner = grown, None
        self.buffer.narrow(self.dim, n, new).copy_(tensor)
        self.length = n + new


class LayerKV:
    """One layer's KV entries in storage order: zero or more packed (quantized) segments, then a
    float tail where new entries are appended. ``index`` and ``modality`` follow the same order.

    Order along the token axis does not matter to attention once RoPE is applied (decode queries
    see every entry they are given; prefill ran before anything was packed), so packing a subset of
    the tail into a new segment just moves those entries ahead of the tail. The tail and the records
    grow in place (``Growing``): a decode step writes its entry, it does not copy the cache.

    ST3's annealing removes a layer's visual entries a few at a time at every decode step, least important
    first. It ranks them once (``rank_visual``) and then says how many to keep (``keep_top_visual``). Outside a
    decode batch's slots the rest go at once; in a slot they are *hidden*: left out of every count (``len``,
    ``nbytes``, ``visual_entries``) at once, masked out by the slots' attention (pipeline/batch_kv.py), and
    removed from storage the next time anything reads the entries (``_drop_hidden``) — at the latest when the
    batch forms again, smaller. So an annealing step costs no operator per layer and keeps the step's shapes
    (a CUDA graph replays it), where removing them at every step cost a dozen operators per layer and request.
    """

    def __init__(self):
        self._key, self._value = Growing(-2), Growing(-2)  # the float tail (B, kv_heads, n, head_dim), after RoPE
        self.packed: list[tuple[QuantizedTensor, QuantizedTensor]] = []  # (key, value) segments
        self._index = Growing(0, torch.empty(0, dtype=torch.long))  # (n,) original token index
        self._modality = Growing(0, torch.empty(0, dtype=torch.long))  # (n,)
        # Records of entries a batched decode step wrote (``written_in_place``), as plain ints: a step adds no
        # tensor operation per request for them; they join ``index``/``modality`` when someone reads those.
        self._unrecorded: list[tuple[int, int]] = []
        self._visual: int | None = 0  # image and video entries: counted as records come, recounted after a keep
        # ST3's ranking (``rank_visual``): each entry's rank in storage order (host; entries past its end are
        # unranked), the ranks kept, the ranks held and kept (sorted), and entries hidden (stored, past the ranks kept).
        self._rank: torch.Tensor | None = None
        self.rank_limit = NO_LIMIT
        self._ranks_held: list[int] = []
        self._hidden = 0
        self._rank_row: torch.Tensor | None = None  # the ranks of this layer's slot in its decode batch (``show_ranks``)
        self._packed_owner = None  # the decode batch whose packed slots ``packed`` are views of (``adopt_packed``)

    def __len__(self) -> int:
        return self.packed_entries() + self._key.length - self._hidden

    @property
    def key(self) -> torch.Tensor | None:
        self._drop_hidden()
        return self._key.view()

    @property
    def value(self) -> torch.Tensor | None:
        self._drop_hidden()
        return self._value.view()

    @property
    def index(self) -> torch.Tensor:
        self._drop_hidden()
        self._record_written()
        return self._index.view()

    @index.setter
    def index(self, index: torch.Tensor) -> None:
        self._record_written()
        self._visual = None
        self._index.replace(index)

    @property
    def modality(self) -> torch.Tensor:
        self._drop_hidden()
        self._record_written()
        return self._modality.view()

    @modality.setter
    def modality(self, modality: torch.Tensor) -> None:
        self._record_written()
        self._visual = None
        self._modality.replace(modality)

    def visual_entries(self) -> int:
        if self._visual is None:  # of the stored entries: reading them (``modality``) would remove the hidden ones
            self._record_written()
            self._visual = int((self._modality.view() != Modality.TEXT).sum())
        return self._visual - self._hidden  # hidden entries are visual (``rank_visual``)

    def _record_written(self) -> None:
        if self._unrecorded:
            index, modality = zip(*self._unrecorded)
            self._unrecorded = []
            self._index.extend(torch.tensor(index))  # not add_records: written_in_place counted them already
            self._modality.extend(torch.tensor(modality))

    def _set_tail(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._key.replace(key)
        self._value.replace(value)

    def tail_entries(self) -> int:
        self._drop_hidden()
        return self._key.length

    def slot_length(self) -> int:
        """Entries stored in the float tail, hidden ones included: where a decode batch's slot writes the next."""
        return self._key.length

    def packed_entries(self) -> int:
        return sum(k.tokens for k, _ in self.packed)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self._drop_hidden()
        self._key.extend(key)
        self._value.extend(value)

    # -- a slot of a decode batch's KV (pipeline/batch_kv.py) --------------------------------------------------
    def adopt(self, keys: torch.Tensor, values: torch.Tensor, owner) -> None:
        """Move the float entries into ``keys``/``values`` (1, kv_heads, room, head_dim), a slot known by ``owner``."""
        self._drop_hidden()
        self._rank_row = None
        self._key.adopt(keys, owner)
        self._value.adopt(values, owner)

    def holds_entries(self) -> bool:
        """Whether the layer has its entries (a float tail, maybe empty once everything is packed)."""
        return self._key.buffer is not None

    def slot_of(self, owner) -> bool:
        """Whether every entry is in place in a slot of ``owner``: the float tail not regrown, and the packed
        segments, if any, the views ``adopt_packed`` made (not packed or cut since)."""
        return (self._key.owner is owner and self._value.owner is owner
                and (not self.packed or self._packed_owner is owner))

    def packed_counts(self) -> dict[int, int]:
        """Packed entries per bit width."""
        counts: dict[int, int] = {}
        for key, _ in self.packed:
            counts[key.bits] = counts.get(key.bits, 0) + key.tokens
        return counts

    def adopt_packed(self, parts: dict, owner) -> None:
        """Move the packed entries into ``parts`` (bit width -> (keys, values), a slot's packed tensors of that width,
        (1, kv_heads, room, .), known by ``owner``): one segment per width, in the order of ``parts``. Entries
        change places in storage (attention does not mind; their records follow)."""
        self._drop_hidden()
        segments, start = {}, 0
        for key, value in self.packed:
            segments.setdefault(key.bits, []).append((key, value, start))
            start += key.tokens
        if set(segments) - set(parts):
            raise ValueError(f"no slot for packed entries of {sorted(set(segments) - set(parts))} bits")
        packed, order = [], []
        for bits, (slot_key, slot_value) in parts.items():
            mine = segments.get(bits, [])
            count = sum(key.tokens for key, _, _ in mine)
            if not count:
                continue
            cat_tokens([key for key, _, _ in mine]).copy_into(slot_key.narrow(-2, 0, count))
            cat_tokens([value for _, value, _ in mine]).copy_into(slot_value.narrow(-2, 0, count))
            packed.append((slot_key.narrow(-2, 0, count), slot_value.narrow(-2, 0, count)))
            order += [torch.arange(begin, begin + key.tokens) for key, _, begin in mine]
        order = torch.cat(order + [torch.arange(start, start + self._key.length)])
        if not torch.equal(order, torch.arange(order.numel())):
            self._reorder(order)
        self.packed, self._packed_owner = packed, owner

    def _reorder(self, order: torch.Tensor) -> None:
        """The records (and ranks) follow entries that changed places in storage: entry i was at ``order[i]``."""
        self.index, self.modality = self.index[order], self.modality[order]
        if self._rank is not None:
            self._rank = self._stored_ranks()[order]

    def written_in_place(self, index: int, modality: int) -> None:
        """The slot's owner wrote one entry, for token ``index`` of ``modality``, after the last one."""
        self._key.length += 1
        self._value.length += 1
        self._unrecorded.append((index, modality))
        if self._visual is not None and modality != Modality.TEXT:
            self._visual += 1

    def add_records(self, index: torch.Tensor, modality: torch.Tensor) -> None:
        """Which tokens the entries just appended belong to."""
        self._drop_hidden()
        self._record_written()
        modality = modality.cpu()
        self._index.extend(index.cpu())
        self._modality.extend(modality)
        if self._visual is not None:
            # Counted as they come: a decode step appends one entry or a few, and the count is read at every
            # step (the metrics' visual KV); recounting the whole layer cost three operators per layer per step.
            self._visual += (sum(m != Modality.TEXT for m in modality.tolist()) if modality.numel() <= 64
                             else int((modality != Modality.TEXT).sum()))

    def undo_append(self, index: torch.Tensor) -> None:
        """Remove the entries of tokens ``index`` (sorted) appended last, if they are there: a decode step that failed
        part-way appended them to the layers it reached (``KVCache.undo_append``). The records say what is stored;
        an entry the step wrote without its record (it failed between the two, or before a slot step recorded it)
        is beyond them and goes too. Only the lengths change: the storage holds the same entries as before the step."""
        self._record_written()
        records, count = self._index.view(), index.numel()
        if records.numel() >= count and torch.equal(records[records.numel() - count:], index):
            self._index.length -= count
            self._modality.length -= count
            self._visual = None  # recounted when read
        tail = self._index.length - self.packed_entries()
        self._key.length, self._value.length = min(self._key.length, tail), min(self._value.length, tail)

    def keys_values(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values in float — packed segments dequantized on the fly — for all entries, or
        for the entries at ``rows`` (positions in storage order), in the order of ``rows``."""
        self._drop_hidden()
        if not self.packed:
            if rows is None:
                return self.key, self.value
            rows = rows.to(self.key.device, non_blocking=True)  # non_blocking: the note at the top
            return self.key.index_select(-2, rows), self.value.index_select(-2, rows)
        if rows is None:
            return self._all_keys_values()
        # Each part (packed segment or float tail) is written straight into one output buffer, and only the
        # rows asked for are dequantized: no dequantize-everything-then-concatenate copies per step.
        parts, start = [], 0
        for key, value in self.packed:
            parts.append((key, value, start, key.tokens))
            start += key.tokens
        if self.key is not None:
            parts.append((self.key, self.value, start, self.tail_entries()))
        wanted = rows.cpu()
        sample_key, sample_value = self.packed[0]
        device = sample_key.packed.device
        shape = (*sample_key.packed.shape[:-2], wanted.numel(), sample_key.packed.shape[-1] * (8 // sample_key.bits))
        keys = torch.empty(shape, dtype=sample_key.dtype, device=device)
        values = torch.empty(shape, dtype=sample_value.dtype, device=device)
        for key, value, begin, count in parts:
            inside = (wanted >= begin) & (wanted < begin + count)
            if not inside.any():
                continue
            local = wanted[inside] - begin  # rows of this part, in the order they are wanted
            positions = inside.nonzero().squeeze(1)  # where they go in the output
            in_order = int(positions[-1] - positions[0]) + 1 == positions.numel() and bool((local.diff() > 0).all())
            target = slice(int(positions[0]), int(positions[-1]) + 1)
            if isinstance(key, torch.Tensor):  # the float tail
                if in_order and local.numel() == count:
                    picked_key, picked_value = key, value
                else:
                    local = local.to(device, non_blocking=True)
                    picked_key, picked_value = key.index_select(-2, local), value.index_select(-2, local)
            elif in_order:  # straight into the output buffer
                whole = local.numel() == count
                dequantize(key if whole else key.select(local), out=keys[..., target, :])
                dequantize(value if whole else value.select(local), out=values[..., target, :])
                continue
            else:
                picked_key, picked_value = dequantize(key.select(local)), dequantize(value.select(local))
            if in_order:
                keys[..., target, :], values[..., target, :] = picked_key, picked_value
            else:
                positions = positions.to(device, non_blocking=True)
                keys.index_copy_(-2, positions, picked_key)
                values.index_copy_(-2, positions, picked_value)
        return keys, values

    def _all_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry in storage order: each packed segment dequantized straight into its place in one buffer,
        then the float tail. A decode step of a packed cache reads this at every layer, so it does no index
        arithmetic: a few operations per segment (on a GPU the step is bound by the host's operator count)."""
        sample = self.packed[0][0]
        shape = (*sample.packed.shape[:-2], len(self), sample.packed.shape[-1] * (8 // sample.bits))
        keys = torch.empty(shape, dtype=sample.dtype, device=sample.packed.device)
        values = torch.empty(shape, dtype=self.packed[0][1].dtype, device=sample.packed.device)
        start = 0
        for key, value in self.packed:
            dequantize(key, out=keys.narrow(-2, start, key.tokens))
            dequantize(value, out=values.narrow(-2, start, key.tokens))
            start += key.tokens
        if self.tail_entries():
            keys.narrow(-2, start, self.tail_entries()).copy_(self.key)
            values.narrow(-2, start, self.tail_entries()).copy_(self.value)
        return keys, values

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only entries ``rows`` (sorted positions in storage order); the tensors — packed
        bytes included — really shrink."""
        self._drop_hidden()
        self._keep_stored(rows)

    def _keep_stored(self, rows: torch.Tensor) -> None:
        """``keep`` of stored entries, hidden ones counted (``_drop_hidden`` removes those this way)."""
        rows = rows.cpu()
        ranks = None if self._rank is None else self._stored_ranks()
        start, packed = 0, []
        for key, value in self.packed:
            local = rows[(rows >= start) & (rows < start + key.tokens)] - start
            if local.numel():
                packed.append((key.select(local), value.select(local)))
            start += key.tokens
        self.packed, self._packed_owner = packed, None  # selected: copies, out of any slot
        if self._key.buffer is not None:
            local = (rows[rows >= start] - start).to(self._key.buffer.device, non_blocking=True)  # one copy, for both
            self._key.keep(local)
            self._value.keep(local)
        self._record_written()
        self.index, self.modality = self._index.view()[rows], self._modality.view()[rows]
        if ranks is not None:
            self._rank = ranks[rows]
            self._ranks_held = sorted(r for r in self._rank.tolist() if UNRANKED < r < self.rank_limit)
        if self._rank_row is not None and self._key.owner is not None:  # compacted in its slot: the ranks moved too
            self._write_rank_row()

    # -- ST3's annealing -------------------------------------------------------------------------------------
    def rank_visual(self, tokens: torch.Tensor) -> None:
        """Rank this layer's entries of ``tokens`` (original indices of visual tokens, most important first) for
        ``keep_top_visual``; every other entry stays whatever is kept."""
        index = self.index
        size = max(int(t.max()) + 1 if t.numel() else 0 for t in (index, tokens))
        lookup = torch.full((size,), UNRANKED, dtype=torch.long)
        lookup[tokens.cpu()] = torch.arange(tokens.numel())
        self._rank, self.rank_limit = lookup[index], NO_LIMIT
        self._ranks_held = sorted(r for r in self._rank.tolist() if r != UNRANKED)
        if self._key.owner is not None:  # a slot's ranks are written when it is taken: take one again
            self._key.replace(self._key.view().clone())
            self._value.replace(self._value.view().clone())

    def keep_top_visual(self, count: int) -> None:
        """Keep only the ``count`` best ranked entries (``rank_visual``) of those ranked; never more than before."""
        if self._rank is None:
            raise RuntimeError("keep_top_visual before rank_visual")
        if count >= self.rank_limit:
            return
        cut = bisect.bisect_left(self._ranks_held, count)
        self._hidden += len(self._ranks_held) - cut
        del self._ranks_held[cut:]
        self.rank_limit = count
        if self.packed or self._key.owner is None:  # not in a slot: no step masks them, so they go now
            self._drop_hidden()

    def ranked(self) -> bool:
        return self._rank is not None

    def show_ranks(self, row: torch.Tensor) -> None:
        """Keep ``row`` (the ranks of this layer's slot in a decode batch, which masks hidden entries by them) equal to
        the stored entries' ranks, ``UNRANKED`` after them: now, and whenever its slot is compacted in place."""
        self._rank_row = row
        self._write_rank_row()

    def _write_rank_row(self) -> None:
        row = self._rank_row
        row.fill_(UNRANKED)
        if self._rank is not None:
            ranks = self._stored_ranks()[self.packed_entries():]
            row[:ranks.numel()] = ranks.to(row.device, row.dtype, non_blocking=True)

    def _stored_ranks(self) -> torch.Tensor:
        stored = self.packed_entries() + self._key.length
        rank = self._rank[:stored]
        return torch.cat([rank, torch.full((stored - rank.numel(),), UNRANKED, dtype=torch.long)])

    def _drop_hidden(self) -> None:
        """Remove the hidden entries from storage (before anything reads the entries)."""
        if not self._hidden:
            return
        self._hidden = 0
        self._keep_stored((self._stored_ranks() < self.rank_limit).nonzero().squeeze(1))

    def pack(self, tail_rows: torch.Tensor, bits: int, group: int) -> None:
        """Quantize the tail entries at ``tail_rows`` (positions in the tail) to ``bits`` into a new
        packed segment; the float copies are freed."""
        if tail_rows.numel() == 0:
            return
        self._drop_hidden()
        tail_rows = tail_rows.to(self.key.device, non_blocking=True)
        chosen = torch.zeros(self.key.shape[-2], dtype=torch.bool, device=self.key.device)
        chosen.index_fill_(0, tail_rows, True)
        rest = (~chosen).nonzero().squeeze(1)
        self.packed.append((quantize(self.key.index_select(-2, tail_rows), bits, group),
                            quantize(self.value.index_select(-2, tail_rows), bits, group)))
        self._packed_owner = None  # a new segment: the layer no longer fits its slot's packed tensors
        self._set_tail(self.key.index_select(-2, rest), self.value.index_select(-2, rest))
        start = self.packed_entries() - tail_rows.numel()  # where the tail began before packing
        self._reorder(torch.cat([torch.arange(start), start + tail_rows.cpu(), start + rest.cpu()]))

    def nbytes(self) -> int:
        packed = sum(k.nbytes() + v.nbytes() for k, v in self.packed)
        if self._key.buffer is None:
            return packed
        # The entries held, not the buffer's spare room (at most GROW entries per layer, or a decode batch's slot),
        # nor the hidden ones (all in the float tail: ``keep_top_visual`` removes them at once from a packed layer).
        held = self._key.length - self._hidden
        return packed + self._key.nbytes(held) + self._value.nbytes(held)


class KVCache:
    def __init__(self, num_layers: int):
        self.layers = [LayerKV() for _ in range(num_layers)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer.append(key, value)
        return layer.keys_values()

    def record(self, layer_idx: int, index: torch.Tensor, modality: torch.Tensor) -> None:
        """Remember which tokens the entries just added to ``layer_idx`` belong to."""
        layer = self.layers[layer_idx]
        layer.add_records(index, modality)
        assert len(layer.index) == len(layer), "KV entries and their token records out of step"

    def undo_append(self, index: torch.Tensor) -> None:
        """Undo a decode step that failed part-way, before which the cache was whole: remove the entries it appended
        for tokens ``index`` in the layers it reached. Only for a step that appended and did nothing else to the
        cache (no revived tokens, no packing: ``Engine._undoable``)."""
        index = index.cpu()
        for layer in self.layers:
            layer.undo_append(index)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.layers[layer_idx])

    # -- what policies ask of the cache (they never touch its storage) ----------------------------
    def tokens(self, layer_idx: int, modality: Modality | None = None) -> torch.Tensor:
        """The original token indices ``layer_idx`` holds entries for, in storage order (of one
        modality, if given): what ``decode_attend`` positions refer to."""
        layer = self.layers[layer_idx]
        return layer.index if modality is None else layer.index[layer.modality == modality]

    def rank_visual(self, layer_idx: int, tokens: torch.Tensor) -> None:
        """Rank ``layer_idx``'s entries of the visual ``tokens`` (original indices, most important first)."""
        self.layers[layer_idx].rank_visual(tokens)

    def keep_top_visual(self, layer_idx: int, count: int) -> None:
        """Evict all but the ``count`` best ranked visual entries of ``layer_idx`` (``rank_visual``); the memory is
        freed (in a decode batch's slot: when the batch forms again, ``LayerKV``)."""
        self.layers[layer_idx].keep_top_visual(count)

    def unpacked_entries(self, layer_idx: int) -> int:
        """How many of ``layer_idx``'s entries are still stored in float (appended since the last ``pack``)."""
        return self.layers[layer_idx].tail_entries()

    def unpacked_tokens(self, layer_idx: int) -> torch.Tensor:
        """The tokens of ``layer_idx`` still stored in float (appended since the last ``pack``)."""
        layer = self.layers[layer_idx]
        return layer.index[len(layer) - self.unpacked_entries(layer_idx):]

    def pack(self, layer_idx: int, important: torch.Tensor, important_bits: int, other_bits: int,
             group: int) -> int | None:
        """Quantize the float entries of ``layer_idx``: those of the ``important`` tokens (original
        indices) to ``important_bits``, the others to ``other_bits`` (ZipVL's mixed-precision KV).
        ``group`` (values per scale) is reduced to divide the head size; returns the group used, or
        None when there was nothing to pack."""
        layer = self.layers[layer_idx]
        if layer.tail_entries() == 0:
            return None
        group = math.gcd(group, layer.key.shape[-1])
        tail = self.unpacked_tokens(layer_idx)
        layer.pack(torch.isin(tail, important.cpu()).nonzero().squeeze(1), important_bits, group)
        layer.pack(torch.arange(layer.tail_entries()), other_bits, group)
        return group

    def visual_entries(self) -> int:
        """Image and video entries over all layers (what ST3's annealing shrinks)."""
        return sum(layer.visual_entries() for layer in self.layers)

    def lengths(self) -> list[int]:
        return [len(layer) for layer in self.layers]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class AuxCache:
    """LazyLLM's Aux Cache: the hidden states of tokens pruned at a layer.

    A token pruned at layer ``l`` has no key/value in layers ``l`` and deeper. Its hidden state as
    it entered layer ``l`` (the output of layer ``l - 1``) is kept here, so a decode step that needs
    the token again can compute its key/value at ``l`` from that state instead of running it through
    every earlier layer; a token lives in either the KV cache or the Aux Cache of a layer, not both.
    """

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (index (n,), hidden (n, d))

    def add(self, layer_idx: int, index: torch.Tensor, hidden: torch.Tensor) -> None:
        if index.numel() == 0:
            return
        if layer_idx in self.layers:
            old_index, old_hidden = self.layers[layer_idx]
            index, hidden = torch.cat([old_index, index.cpu()]), torch.cat([old_hidden, hidden])
        self.layers[layer_idx] = (index.cpu(), hidden)

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers.get(layer_idx)

    def take(self, layer_idx: int, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Remove and return (index, hidden) of the ``wanted`` tokens held for ``layer_idx``: a
        revived token's key/value is about to be computed there, so it leaves the Aux Cache."""
        entry = self.layers.get(layer_idx)
        if entry is None:
            return torch.empty(0, dtype=torch.long), None
        index, hidden = entry
        hit = torch.isin(index, wanted.cpu())
        if not bool(hit.any()):
            return torch.empty(0, dtype=torch.long), None
        on = hit.to(hidden.device)
        self.layers[layer_idx] = (index[~hit], hidden[~on])
        return index[hit], hidden[on]

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h in self.layers.values())
