"""A decode step of KV slots with fixed shapes, captured once as a CUDA graph and replayed.

Why: at batch 1 a decode step of a 7B model on a GPU is bound by the host, not by the GPU: launching
a few hundred small kernels through Python takes longer than running them (the GPU suite measured the
engine's slots at 0.87x of ``generate`` at batch 1). A CUDA graph records the step's kernels once; a
replay launches all of them with one call, and the host only fills three small input buffers (measured on
an H100: 2.2x ``generate``'s tokens/s at batch 1, the same tokens; on by default on CUDA since).

What it computes: the step of ``pipeline/batch_kv.py`` — every request in a slot writes its new key
and value after its entries and attends to all of them — written so that no shape and no tensor
address changes from step to step:

* every slot takes part, a free one with token 0 (its row is dropped, and what it writes into its own
  free slot is overwritten when a request takes the slot: ``LayerKV.adopt`` copies over it);
* attention runs over each slot's whole room, masked to the slot's entries (the eager path narrows
  to the longest member: a shape that changes every step);
* the inputs are read from buffers that the host fills before each step: the new tokens, their
  positions, and where each slot's entry goes in each layer (``at``, from which the graph builds the
  mask).

It serves steps in which every running request is a member of a slot group and no policy works inside a
decode step (``fixed_shape_step``): no unpruned-prompt end to compute, no choice of rows or keys, no scoring
per layer (``Policy.scores_in_decode``). Work between steps is fine when it keeps the slots: ST3's annealing
hides evicted entries (``LayerKV.keep_top_visual``), and the step masks them out by their ranks, read from
one more buffer (the rank from which each layer hides, per slot); ZipVL's packed entries are dequantized in
front of the float slots, and only its steps that fill a window of new tokens (they score and pack it) decode
eagerly. Several slot groups (requests too different in size for one batch) are one step: each group attends
over its own slots, one call per group and layer. On CUDA the step is captured on the groups' first such step
(after two eager warm-ups on a side stream, which compute that step) and replayed while the groups stay the same;
new groups (``form_groups``), or a group fewer, capture again. Where capture fails the same function runs eagerly;
off the GPU it runs only when ``Engine.decode_graphs`` is turned on, which is how the tests check it on a CPU.
"""

from __future__ import annotations

import logging

import torch

from glimpse.pipeline.batch_kv import slot_mask
from glimpse.pipeline.cache import NO_LIMIT

log = logging.getLogger(__name__)


def fixed_shape_step(running: list, groups: list) -> bool:
    """Whether this step can run as the fixed-shape step: every request is in one of the slot groups (so its cache
    is all float and its policy picks no rows or keys per layer) and none has a policy that scores per layer."""
    return (bool(groups) and sum(len(group.members) for group in groups) == len(running)
            and not any(r.policy.scores_in_decode() for r in running))


class SlotStep:
    """The fixed-shape decode step of a list of slot groups (``pipeline/batch_kv.py``), kept as the first group's
    ``fixed_step`` while the groups are the ones it was made for: input buffers over every slot of every group,
    group after group, and on CUDA the captured graph and its output."""

    def __init__(self, groups: list, positions_rows: int):
        device = groups[0].keys[0].device
        # The groups' tokens, not the groups: the first group holds this step, and a reference back to it would be
        # a cycle that keeps a finished batch's slots alive until the garbage collector runs.
        self.made_for = [group.token for group in groups]
        self.spans, start = [], 0  # per group, its slots' rows in the step
        for group in groups:
            self.spans.append(slice(start, start + group.keys[0].shape[0]))
            start += group.keys[0].shape[0]
        count, layers = start, len(groups[0].keys)
        self.tokens = torch.zeros(1, count, dtype=torch.long, device=device)
        self.positions = torch.zeros(positions_rows, count, dtype=torch.long, device=device)
        self.at = torch.zeros(layers, count, dtype=torch.long, device=device)  # where each slot's entry goes
        # Per layer and slot, the rank from which ST3's evicted entries are masked out (groups with ranks only).
        ranked = any(group.ranks is not None for group in groups)
        self.limits = torch.zeros(layers, count, dtype=torch.int32, device=device) if ranked else None
        self.every_slot = [torch.arange(span.stop - span.start, device=device) for span in self.spans]
        self.graph: "torch.cuda.CUDAGraph | None" = None
        self.logits: torch.Tensor | None = None  # the graph's output (replays write it)

    def serves(self, groups: list) -> bool:
        """Whether this step was made for exactly these groups, in this order (its buffers and graph are theirs)."""
        return len(groups) == len(self.made_for) and all(g.token is t for g, t in zip(groups, self.made_for))

    def run(self, engine, groups: list) -> torch.Tensor:
        """One step of the groups' members: (members, vocab) logits, group after group, each in slot order.
        Records the entries written in each member's cache."""
        self._fill(groups)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        elif engine.device.type == "cuda" and engine.decode_graphs:
            logits = self._capture(engine, groups)
        else:
            logits = self.forward(engine, groups)
        for group in groups:
            for layer_idx in range(len(group.keys)):
                group.record_written(layer_idx)
        if all(group.all_slots for group in groups):
            return logits
        members = torch.cat([group.slots + span.start for group, span in zip(groups, self.spans)])
        return logits.index_select(0, members)

    def _fill(self, groups: list) -> None:
        """The host's part of a step: the inputs of every slot (zeros for a free one), in one copy each."""
        slots = [request for group in groups for request in group.requests]
        tokens, positions = [0] * len(slots), [[0] * len(slots) for _ in range(self.positions.shape[0])]
        for slot, request in enumerate(slots):
            if request is None:
                continue
            tokens[slot] = request.next_token
            for row, start in enumerate(_first_position(request)):
                positions[row][slot] = start + request.ctx.generated
        at = [[0 if r is None else r.ctx.cache.layers[layer_idx].slot_length() for r in slots]
              for layer_idx in range(self.at.shape[0])]
        self.tokens.copy_(torch.tensor([tokens]), non_blocking=True)
        self.positions.copy_(torch.tensor(positions), non_blocking=True)
        self.at.copy_(torch.tensor(at), non_blocking=True)
        if self.limits is not None:
            limits = [[limit for group in groups for limit in (
                group.rank_limits(layer_idx) if group.ranks is not None else (NO_LIMIT,) * len(group.requests))]
                for layer_idx in range(self.at.shape[0])]
            self.limits.copy_(torch.tensor(limits, dtype=torch.int32), non_blocking=True)

    def forward(self, engine, groups: list) -> torch.Tensor:
        """The step itself, from the buffers: (slots, vocab) logits, free slots' rows included."""
        adapter = engine.adapter
        hidden = adapter.embed_tokens(self.tokens)  # (1, slots, d)
        position_embeddings = adapter.rotary(hidden, self.positions)
        for layer_idx, layer in enumerate(adapter.layers):
            hidden = engine.run_layer(layer, hidden, position_embeddings, FixedSlotsLayer(self, groups, layer_idx))
        return adapter.lm_head(adapter.norm(hidden))[0].float()

    def _capture(self, engine, groups: list) -> torch.Tensor:
        """Compute this step eagerly (twice, on a side stream: the warm-up capture needs; writing the same
        entries twice is harmless), then record it as a graph for the next steps."""
        device = engine.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side):
                for _ in range(2):
                    logits = self.forward(engine, groups)
        finally:  # a warm-up that failed (out of memory) is undone and run again on the main stream: after this one
            torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the vision worker may use the GPU from its own thread meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self.forward(engine, groups)
        except Exception as error:  # noqa: BLE001 — an architecture whose step cannot be captured decodes eagerly
            log.warning("decode graphs off for %s: capture failed (%s)", engine.model_id, error)
            engine.decode_graphs, engine.decode_graph_error = False, f"{type(error).__name__}: {error}"
            self.logits = None
            return logits
        self.graph = graph
        return logits


def _first_position(request) -> list[int]:
    """The request's first generated token's position (one per position row), read from the device once."""
    if request.host_position is None:
        request.host_position = request.ctx.next_position[:, 0].tolist()
    return request.host_position


class FixedSlotsLayer:
    """One layer of the fixed-shape step (a ``pipeline.attention.LayerCall``): each slot's new entry is
    written at ``at``, and each slot attends to its entries over its group's whole room, masked; one call per
    group."""

    def __init__(self, step: SlotStep, groups: list, layer_idx: int):
        self.step, self.groups, self.layer_idx = step, groups, layer_idx

    def attend(self, module, query, key, value, kernel) -> torch.Tensor:
        outputs = [self._attend_group(group, span, every, module, query[:, :, span], key[:, :, span],
                                      value[:, :, span], kernel)
                   for group, span, every in zip(self.groups, self.step.spans, self.step.every_slot)]
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]  # (1, slots, heads, head_dim)

    def _attend_group(self, group, span, every, module, query, key, value, kernel) -> torch.Tensor:
        keys, values, at = group.keys[self.layer_idx], group.values[self.layer_idx], self.step.at[self.layer_idx, span]
        keys[every, :, at] = key[0].transpose(0, 1)  # (slots, kv_heads, head_dim)
        values[every, :, at] = value[0].transpose(0, 1)
        query = query.transpose(0, 2)  # (slots, heads, 1, head_dim)
        ranks = None if group.ranks is None else group.ranks[self.layer_idx]
        limit = None if ranks is None else self.step.limits[self.layer_idx, span]
        if group.packed_layout(self.layer_idx) is not None:  # ZipVL's packed slots, with the float ones
            out = group.attend_with_packed(self.layer_idx, query, keys, values, at, kernel, module.scaling,
                                           ranks, limit)
        else:
            mask = slot_mask(at, keys.shape[2], query.dtype, ranks, limit)  # the whole room, each slot's own
            out = kernel(query, keys, values, mask)
        return out.transpose(0, 1)  # (1, slots, heads, head_dim)

    def attention_output(self, output: torch.Tensor) -> None:
        pass
