"""The KV of the requests a decode step computes together: one slot per request in one tensor per layer,
so that the step attends for all of them with one kernel call per layer.

Why: on a GPU a decode step of a 7B model is bound by host work (kernel launches and Python), not by the
GPU. Attending request by request costs, per request and layer, a kernel call, two cache writes and the
bookkeeping around them: at batch 16 the engine decoded at 0.22x of ``generate`` (docs/benchmarks.md, the
GPU suite). With the slots, a step writes every member's new entries with one indexed write per layer and
attends with one masked call over the slots; each request still reads its own entries as a view of its
slot, so policies, eviction (ST3, compacted in place) and metrics see their own cache as before.

A request's float entries *move* into its slot once, when it joins (one copy of its own entries, never
per step), and a slot has room for the rest of the request's answer, up to ``ANSWER_ROOM`` tokens, so no step
reallocates until then (then the batch forms again). Members are
the requests whose policy does nothing per decode layer (no revival, no choice of keys: not LazyLLM with the
paper's re-selection); the others decode request by request beside them. ZipVL's packed entries have packed slots
(``BatchKV.parts``: per layer and bit width, a packed tensor with a row per slot, zeros where a member holds
fewer), dequantized at once for the batch at every step.
Requests come and go between steps (the server's continuous batching): one that leaves frees its slot, one
that arrives takes a free slot it fits in. The batch forms again (one copy of its members' entries) only
when no free slot fits a newcomer, when a member's cache left its slot, when evictions left the members' slots
more than twice what they need (so that ST3 gives its memory back), and when a slot has stayed free for
``FREE_STEPS_PER_SLOT`` steps per slot (so that a server whose load dropped gives the memory back, while one
whose clients come and go refills its free slots instead of forming a batch at every departure). Requests whose
sizes differ too much are not put in one batch: the slots of a batch are as long as its longest member
needs, and a batch takes no member that would make it hold more than ``WASTE`` times what its members need. Those
left out form batches of their own, *slot groups* (``form_groups``): a step attends with one call per group and
layer, and the groups are served, and formed again, together (``serve_step``).
"""

from __future__ import annotations

import torch

from glimpse.common import Modality
from glimpse.pipeline import packed_attention
from glimpse.pipeline.cache import NO_LIMIT, UNRANKED
from glimpse.pipeline.quant import dequantize

WASTE = 1.5  # a batch's slots hold at most this many times the entries (and answer room) its members need
SLACK = 1.125  # a slot's room beyond its largest member's need, so that a request like it can take a freed slot
# A free slot is given back (the batch formed again) once it has been free this many steps per slot. Rent or
# buy: keeping it costs reading one slot's room per step (the step attends over every slot), forming again
# costs copying every member's entries once (a read and a write per slot), so after about two steps per slot
# the free slot has cost as much as forming again would have. Given back at once, a server whose clients come
# and go formed a batch every 2-3 requests (44 formations in 128 requests of `glimpse bench serve`).
FREE_STEPS_PER_SLOT = 2
# A slot has room for at most this many more answer tokens: past them the batch forms again (``BatchKV.keeps``),
# its slots with room for the rest of the answers. Room for the whole budget allocated a whole context per
# request up front: 8 two-token answers asked with max_new_tokens 10**9 took 3.2 GB instead of 34 MB.
ANSWER_ROOM = 1024


def decodes_plainly(request) -> bool:
    """Whether ``request`` can take a slot: its next step computes its new token alone and attends to every
    entry it holds (float, or packed: ZipVL's KV takes packed slots)."""
    policy = request.policy
    return (request.pending is None and not policy.implements("decode_rows")
            and not policy.implements("decode_attend")
            and all(layer.holds_entries() for layer in request.ctx.cache.layers))


def _room(request, layer) -> int:
    """Float entries a slot needs for ``layer`` of ``request``: what it holds in float and one per step left, plus
    one, the steps counted up to ``ANSWER_ROOM``. (Packed entries have slots of their own, ``BatchKV.parts``.)"""
    return len(layer) - layer.packed_entries() + min(request.budget - len(request.tokens), ANSWER_ROOM) + 1


def _need(request) -> int:
    return sum(_room(request, layer) for layer in request.ctx.cache.layers)


class BatchKV:
    """The slots of a batch, one tensor pair per layer: slot i is ``requests[i]``'s, or free (None) once its
    request left. Requests come and go between steps (continuous batching): one that leaves frees its slot,
    one that arrives takes a free slot its entries fit in (a copy of its own entries only), so the batch
    forms again only when no free slot fits a newcomer."""

    def __init__(self, requests: list):
        self.requests: list = list(requests)
        # What a member's cache knows its slots by: not this object, so that no reference cycle (batch ->
        # request -> cache -> batch) keeps a finished batch's tensors alive until the garbage collector runs.
        self.token = object()
        num_layers = len(requests[0].ctx.cache.layers)
        self.keys, self.values = [], []
        # ST3's ranks of each slot's entries, per layer (``LayerKV.keep_top_visual``): a step masks out the entries
        # ranked past what their layer keeps. Only when a member has them: other batches' steps have no such mask.
        ranked = any(layer.ranked() for r in requests for layer in r.ctx.cache.layers)
        self.ranks: list[torch.Tensor] | None = [] if ranked else None
        # ZipVL's packed entries, per layer: for each bit width the members use, one packed key and value tensor
        # with a slot per request (quant.py packs token by token, so a slot is a row, as for float entries), and
        # per slot the entries each holds. A step dequantizes each whole tensor at once and attends over it with
        # the float entries, masked: a handful of operators per layer, whatever the batch size.
        self.parts: list[dict] = []
        self.part_lengths: list[torch.Tensor | None] = []
        for layer_idx in range(num_layers):
            members = [r.ctx.cache.layers[layer_idx] for r in requests]
            sample = members[0].key
            # Room for the largest member's answer, and SLACK more: a similar request can take a freed slot.
            room = int(max(_room(r, layer) for r, layer in zip(requests, members)) * SLACK) + 1
            shape = (len(requests), sample.shape[1], room, sample.shape[3])
            # Zeros, not empty: masked entries are multiplied by a zero weight, and 0 * NaN is NaN.
            keys, values = sample.new_zeros(shape), sample.new_zeros(shape)
            for slot, layer in enumerate(members):  # layer by layer, so the old tensors go as the slots fill
                layer.adopt(keys[slot:slot + 1], values[slot:slot + 1], owner=self.token)
            self.keys.append(keys)
            self.values.append(values)
            if ranked:
                self.ranks.append(torch.full(shape[::2], UNRANKED, dtype=torch.int32, device=keys.device))
                for slot, layer in enumerate(members):
                    layer.show_ranks(self.ranks[layer_idx][slot])
            self.parts.append(self._packed_slots(members))
            self.part_lengths.append(None)
            if self.parts[-1]:
                self.part_lengths[-1] = torch.zeros(len(requests), len(self.parts[-1]), dtype=torch.long,
                                                    device=keys.device)
                for slot, layer in enumerate(members):
                    layer.adopt_packed(self._slot_parts(layer_idx, slot), owner=self.token)
        self._members_changed()
        self.fixed_step = None  # its fixed-shape step (pipeline/decode_graph.py), made on first use
        self.free_steps = [0] * len(requests)  # per slot: the steps it has been free for
        # Formed again once the members' slots are more than twice as large as they need (or, if they started
        # larger, half as large again as at the start: never one formation after another).
        self.limit = max(2.0, 1.5 * self._room() / sum(_need(r) for r in requests))

    def _packed_slots(self, members: list) -> dict:
        """Bit width -> (keys, values): zeroed packed tensors with a slot per member and room for the most entries
        of that width a member holds, and SLACK more (highest width first: ZipVL's important entries)."""
        counts = [layer.packed_counts() for layer in members]
        parts = {}
        for bits in sorted({b for c in counts for b in c}, reverse=True):
            key, value = next((k, v) for layer in members for k, v in layer.packed if k.bits == bits)
            room = int(max(c.get(bits, 0) for c in counts) * SLACK) + 1
            parts[bits] = (key.slots(len(members), room), value.slots(len(members), room))
        return parts

    def _slot_parts(self, layer_idx: int, slot: int) -> dict:
        return {bits: (key.narrow(0, slot, 1), value.narrow(0, slot, 1))
                for bits, (key, value) in self.parts[layer_idx].items()}

    def packed_layout(self, layer_idx: int) -> tuple[torch.Tensor, list[int]] | None:
        """For ``slot_mask``: the entries each slot holds in each packed tensor (slots, parts), and their rooms."""
        parts = self.parts[layer_idx]
        return (self.part_lengths[layer_idx], [key.tokens for key, _ in parts.values()]) if parts else None

    def with_packed(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values with its packed slots in front, dequantized: (slots, kv_heads, rooms + n, d)
        (``keys``/``values``: the float slots' first n entries). Each packed tensor is dequantized straight into
        its place, at once for every slot."""
        parts = self.parts[layer_idx]
        total = sum(key.tokens for key, _ in parts.values()) + keys.shape[2]
        shape = (*keys.shape[:2], total, keys.shape[3])
        all_keys, all_values = keys.new_empty(shape), values.new_empty(shape)
        start = 0
        for key, value in parts.values():
            dequantize(key, out=all_keys.narrow(2, start, key.tokens))
            dequantize(value, out=all_values.narrow(2, start, key.tokens))
            start += key.tokens
        all_keys.narrow(2, start, keys.shape[2]).copy_(keys)
        all_values.narrow(2, start, keys.shape[2]).copy_(values)
        return all_keys, all_values

    def attend_with_packed(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           at: torch.Tensor, kernel, scaling: float, ranks: torch.Tensor | None = None,
                           limit: torch.Tensor | None = None) -> torch.Tensor:
        """Each slot's attention (``query``: (slots, heads, 1, head_dim)) over its packed entries and its float ones
        (``keys``/``values``: the float slots, slot i seeing those up to ``at[i]``, none ranked ``limit[i]`` or
        more): (slots, 1, heads, head_dim). On CUDA with Triton one kernel reads the packed bytes where they are
        (pipeline/packed_attention.py); otherwise the packed slots are dequantized in front of a copy of the float
        ones and ``kernel`` attends over the whole, masked."""
        if packed_attention.available(keys.device, keys.shape[-1]):
            try:
                return packed_attention.attend(query, list(self.parts[layer_idx].values()),
                                               self.part_lengths[layer_idx], keys, values, at + 1, scaling, ranks,
                                               limit)
            except Exception as error:  # noqa: BLE001 — a GPU or a Triton on which the kernel does not build
                packed_attention.disable(error)
        mask = slot_mask(at, keys.shape[2], query.dtype, ranks, limit, self.packed_layout(layer_idx))
        keys, values = self.with_packed(layer_idx, keys, values)
        return kernel(query, keys, values, mask)

    def _room(self) -> int:
        return sum(keys.shape[0] * keys.shape[2] for keys in self.keys)

    def _members_room(self) -> int:
        return len(self.members) * sum(keys.shape[2] for keys in self.keys)

    def _members_changed(self) -> None:
        self.members = [r for r in self.requests if r is not None]  # in slot order: the step's first rows
        taken = [slot for slot, r in enumerate(self.requests) if r is not None]
        self.slots = torch.tensor(taken, device=self.keys[0].device)
        self.all_slots = len(taken) == len(self.requests)  # no free slot: no gather, no scatter
        self.layers = [[r.ctx.cache.layers[i] for r in self.members] for i in range(len(self.keys))]
        for layer_idx, lengths in enumerate(self.part_lengths):
            if lengths is not None:  # in place: a captured step reads this tensor
                held = [[0] * lengths.shape[1] if r is None else
                         [r.ctx.cache.layers[layer_idx].packed_counts().get(bits, 0) for bits in self.parts[layer_idx]]
                         for r in self.requests]
                lengths.copy_(torch.tensor(held), non_blocking=True)
        self._where_memo = None  # lengths -> (where, at), for the layers of one step (``_where``)
        self._mask_memo = None  # (lengths, dtype) -> mask, likewise (``_mask``)

    @classmethod
    def form(cls, candidates: list) -> "BatchKV | None":
        """A batch of the most candidates that fit together (``WASTE``: the largest need at most that many times
        the mean), and of those the most entries; None if there are no candidates. For a given largest member the
        most members are the largest needs below it (each adds the most to the mean), so the batch is a run of the
        candidates sorted by need: of each run's end, the longest run that fits. (Taking the smallest first and
        stopping at the first that did not fit left six longer prompts to decode one by one beside two short
        questions, where all eight fit: tested.)"""
        needs = sorted((_need(r), i) for i, r in enumerate(candidates))
        best = None
        for end, (largest, _) in enumerate(needs):
            start, total = 0, sum(need for need, _ in needs[:end + 1])
            while (end + 1 - start) * largest > WASTE * total:
                total -= needs[start][0]
                start += 1
            if best is None or (end + 1 - start, total) > best[0]:
                best = (end + 1 - start, total), start, end
        if best is None:
            return None
        chosen = sorted(i for _, i in needs[best[1]:best[2] + 1])
        return cls([candidates[i] for i in chosen])  # slots in the order the requests came: the step's rows too

    def release(self, candidates: list) -> None:
        """Free the slots of members no longer among ``candidates`` or no longer in their slot."""
        wanted = {id(r) for r in candidates}
        changed = False
        for slot, request in enumerate(self.requests):
            if request is not None and (id(request) not in wanted or not all(
                    self.holds(layer) for layer in request.ctx.cache.layers)):
                self.requests[slot], changed = None, True
        if changed:
            self._members_changed()

    def admit(self, request) -> bool:
        """Give ``request`` a free slot its entries fit in (a copy of its own entries); False if there is none."""
        slot = next((i for i, r in enumerate(self.requests) if r is None and self._fits(request)), None)
        if slot is None:
            return False
        if self.ranks is None and any(layer.ranked() for layer in request.ctx.cache.layers):
            return False  # its step needs the ranks' mask, which this batch's step does not have
        for layer_idx, (layer, keys, values) in enumerate(zip(request.ctx.cache.layers, self.keys, self.values)):
            layer.adopt(keys[slot:slot + 1], values[slot:slot + 1], owner=self.token)
            if self.ranks is not None:
                layer.show_ranks(self.ranks[layer_idx][slot])
            if self.parts[layer_idx]:
                layer.adopt_packed(self._slot_parts(layer_idx, slot), owner=self.token)
        self.requests[slot] = request
        self._members_changed()
        return True

    def keeps(self, room_formed_again: int) -> bool:
        """Called once per step, after ``release`` and ``admit``: whether these slots are still worth their memory
        (members in them, no slot free for long, the members' slots at most ``limit`` times what they need).
        ``room_formed_again``: the entries that forming again would copy (every group's, ``_room``)."""
        if not self.members:
            return False
        # A member whose slot has no room for its next entry (its answer outgrew ANSWER_ROOM): form again, with room
        # for the rest of it. A step writes into the slots directly, so nothing else would move it: two answers of
        # 1,400 tokens asked together ended in an IndexError after about 1,180 steps (an outside pass).
        if any(layer.slot_length() >= keys.shape[2]
               for layers, keys in zip(self.layers, self.keys) for layer in layers):
            return False
        self.free_steps = [0 if r is not None else steps + 1 for r, steps in zip(self.requests, self.free_steps)]
        # Rent or buy (``FREE_STEPS_PER_SLOT``): a free slot costs its room at every step, forming again copies
        # ``room_formed_again`` once. For one group that is two steps per slot; a small group beside a large one
        # waits longer, since giving its free slot back forms the large one again too.
        if max(self.free_steps) * (self._room() // len(self.requests)) > FREE_STEPS_PER_SLOT * room_formed_again:
            return False  # nobody took a free slot for a while: give its memory back
        # What the members need stays the same step to step (one more entry, one step less) until a policy
        # evicts: then their slots are larger than needed, and past ``limit``, formed again.
        return self._members_room() <= self.limit * sum(_need(r) for r in self.members)

    def holds(self, layer) -> bool:
        """Whether ``layer`` (a member's ``LayerKV``) is all float and in place in one of these slots."""
        return layer.slot_of(self.token)

    def rank_limits(self, layer_idx: int) -> tuple[int, ...]:
        """Per slot, the rank from which ``layer_idx``'s entries are hidden (``NO_LIMIT`` for a free slot)."""
        layers = iter(self.layers[layer_idx])
        return tuple(next(layers).rank_limit if r is not None else NO_LIMIT for r in self.requests)

    def _fits(self, request) -> bool:
        for layer, keys, parts in zip(request.ctx.cache.layers, self.keys, self.parts):
            if _room(request, layer) > keys.shape[2]:
                return False
            if any(bits not in parts or count > parts[bits][0].tokens for bits, count in layer.packed_counts().items()):
                return False
        return True

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kernel, scaling: float) -> torch.Tensor:
        """The members' new tokens (``query``/``key``/``value``: (1, heads, members, head_dim), slot order)
        write their entries into their slots and attend to all their entries: (1, members, heads, head_dim)."""
        members, keys, values = self.layers[layer_idx], self.keys[layer_idx], self.values[layer_idx]
        lengths = tuple(layer.slot_length() for layer in members)
        new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (members, kv_heads, head_dim)
        query = query.transpose(0, 2)  # (members, heads, 1, head_dim)
        n = max(lengths) + 1
        limits = self.rank_limits(layer_idx) if self.ranks is not None else ()
        hiding = any(limit != NO_LIMIT for limit in limits)
        packed = self.packed_layout(layer_idx)
        if self.all_slots and min(lengths) == max(lengths) and not hiding and packed is None:  # the usual case: no mask
            keys[:, :, lengths[0]] = new_keys
            values[:, :, lengths[0]] = new_values
            mask = None
        else:
            where, at = self._where(lengths)
            keys[self.slots, :, where] = new_keys
            values[self.slots, :, where] = new_values
            ranks, limit = None, None
            if hiding:  # ST3's evicted entries, still stored
                ranks = self.ranks[layer_idx]
                limit = torch.tensor(limits, dtype=torch.int32).to(at.device, non_blocking=True)
            if packed is None:
                mask = slot_mask(at, n, query.dtype, ranks, limit) if hiding else self._mask(lengths, at, n, query.dtype)
            if not self.all_slots:  # free slots take part with a zero query; their rows are dropped after
                full = query.new_zeros(keys.shape[0], *query.shape[1:])
                query = full.index_copy(0, self.slots, query)
        self.record_written(layer_idx)
        keys, values = keys[:, :, :n], values[:, :, :n]
        if packed is not None:  # ZipVL's packed slots, with the float ones
            out = self.attend_with_packed(layer_idx, query, keys, values, at, kernel, scaling, ranks, limit)
        else:
            out = kernel(query, keys, values, mask)  # (slots, 1, heads, head_dim)
        if not self.all_slots:
            out = out.index_select(0, self.slots)
        return out.transpose(0, 1)

    def _where(self, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the members' new entries go (their tail lengths, on the device), and per slot the last entry it
        sees. Made once per step: every layer of a step usually has the same lengths (a policy that removes entries
        per layer makes them differ), and building them per layer cost 30 small tensors per step."""
        if self._where_memo is not None and self._where_memo[0] == lengths:
            return self._where_memo[1]
        device = self.keys[0].device
        where = torch.tensor(lengths).to(device, non_blocking=True)
        at = where
        if not self.all_slots:  # a free slot sees nothing but its entry 0 (its zero query's row is dropped)
            at = torch.zeros(len(self.requests), dtype=where.dtype, device=device).index_copy(0, self.slots, where)
        self._where_memo = lengths, (where, at)
        return where, at

    def _mask(self, lengths: tuple[int, ...], at: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's attention mask (the rest of a shorter slot masked out), made once for the layers of a step."""
        key = (lengths, dtype)
        if self._mask_memo is None or self._mask_memo[0] != key:
            self._mask_memo = key, slot_mask(at, n, dtype)
        return self._mask_memo[1]

    def record_written(self, layer_idx: int) -> None:
        """Each member wrote its new token's entry after its last one in layer ``layer_idx``."""
        for request, layer in zip(self.members, self.layers[layer_idx]):
            layer.written_in_place(len(request.ctx.prompt) + request.ctx.generated, Modality.TEXT)


def form_groups(candidates: list) -> list[BatchKV]:
    """Slot groups for every candidate: the batch of the most that fit together (``BatchKV.form``), then of the
    rest the same, until none is left. Each group is one attention call per layer: requests too different in size
    for one batch (a text question beside long video prompts) decode in two or three calls, not one per request."""
    groups, rest = [], list(candidates)
    while rest:
        groups.append(BatchKV.form(rest))
        taken = {id(r) for r in groups[-1].requests}
        rest = [r for r in rest if id(r) not in taken]
    return groups


def serve_step(groups: list[BatchKV], candidates: list) -> list[BatchKV] | None:
    """The last step's slot groups, made the slots of ``candidates``' next step: members that stayed keep their
    slots, newcomers take free slots they fit in, and a group none of whose members is left goes. None if they
    cannot serve the step (a newcomer fits no free slot, or a group is past what ``BatchKV.keeps`` allows): then
    every group forms again, together (forming only the newcomers' would leave a server whose clients come and
    go with a group per newcomer, each its own attention call)."""
    for group in groups:
        group.release(candidates)
    held = {id(r) for group in groups for r in group.members}
    for request in candidates:
        if id(request) not in held and not any(group.admit(request) for group in groups):
            return None
    groups = [group for group in groups if group.members]
    room = sum(group._room() for group in groups)
    return groups if all(group.keeps(room) for group in groups) else None


def slot_mask(at: torch.Tensor, length: int, dtype: torch.dtype, ranks: torch.Tensor | None = None,
              limit: torch.Tensor | None = None, packed: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
    """(slots, 1, 1, length) additive attention mask: slot i sees its entries up to ``at[i]``, its new one; with
    ``ranks`` ((slots, room): each entry's rank) none ranked ``limit[i]`` or more (ST3's evicted ones); with
    ``packed`` (``BatchKV.packed_layout``) the packed slots come first, slot i seeing the entries it holds there."""
    hidden = torch.arange(length, device=at.device)[None, :] > at[:, None]
    if ranks is not None:
        hidden |= ranks[:, :length] >= limit[:, None]
    if packed is not None:
        held, rooms = packed
        hidden = torch.cat([torch.arange(room, device=at.device)[None, :] >= held[:, part:part + 1]
                            for part, room in enumerate(rooms)] + [hidden], dim=1)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=at.device)
    return mask.masked_fill(hidden, torch.finfo(dtype).min)[:, None, None, :]
