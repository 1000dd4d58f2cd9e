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

It serves steps in which every running request is a member of the slots and no policy works inside a
decode step (``fixed_shape_step``): no unpruned-prompt end to compute, no choice of rows or keys, no scoring
per layer (``Policy.scores_in_decode``). Work between steps is fine when it keeps the slots: ST3's annealing
hides evicted entries (``LayerKV.keep_top_visual``), and the step masks them out by their ranks, read from
one more buffer (the rank from which each layer hides, per slot); ZipVL's packed entries are dequantized in
front of the float slots, and only its steps that fill a window of new tokens (they score and pack it) decode
eagerly. On CUDA it is captured on the batch's first such step (after two eager
warm-ups on a side stream, which compute that step) and replayed while the batch keeps its slots; a
new batch (``BatchKV.form``) captures again. Where capture fails the same function runs eagerly; off the GPU
it runs only when ``Engine.decode_graphs`` is turned on, which is how the tests check it on a CPU.
"""

from __future__ import annotations

import logging

import torch

from glimpse.pipeline.batch_kv import slot_mask

log = logging.getLogger(__name__)


def fixed_shape_step(running: list, slots) -> bool:
    """Whether this step can run as the fixed-shape step: every request is in the slots (so its cache is all
    float and its policy picks no rows or keys per layer) and none has a policy that scores per layer."""
    return (slots is not None and len(slots.members) == len(running)
            and not any(r.policy.scores_in_decode() for r in running))


class SlotStep:
    """The fixed-shape decode step of one ``BatchKV`` (its ``fixed_step``): input buffers, and on CUDA the
    captured graph and its output."""

    def __init__(self, slots, positions_rows: int):
        device = slots.keys[0].device
        count, layers = slots.keys[0].shape[0], len(slots.keys)
        self.tokens = torch.zeros(1, count, dtype=torch.long, device=device)
        self.positions = torch.zeros(positions_rows, count, dtype=torch.long, device=device)
        self.at = torch.zeros(layers, count, dtype=torch.long, device=device)  # where each slot's entry goes
        # Per layer and slot, the rank from which ST3's evicted entries are masked out (batches with ranks only).
        self.limits = None if slots.ranks is None else torch.zeros(layers, count, dtype=torch.int32, device=device)
        self.every_slot = torch.arange(count, device=device)
        self.graph: "torch.cuda.CUDAGraph | None" = None
        self.logits: torch.Tensor | None = None  # the graph's output (replays write it)

    def run(self, engine, slots) -> torch.Tensor:
        """One step of the members of ``slots``: (members, vocab) logits in slot order. Records the entries
        written in each member's cache."""
        self._fill(slots)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        elif engine.device.type == "cuda" and engine.decode_graphs:
            logits = self._capture(engine, slots)
        else:
            logits = self.forward(engine, slots)
        for layer_idx in range(len(slots.keys)):
            slots.record_written(layer_idx)
        return logits if slots.all_slots else logits.index_select(0, slots.slots)

    def _fill(self, slots) -> None:
        """The host's part of a step: the inputs of every slot (zeros for a free one), in one copy each."""
        count, layers = self.tokens.shape[1], self.at.shape[0]
        tokens, positions, at = [0] * count, [[0] * count for _ in range(self.positions.shape[0])], []
        for slot, request in enumerate(slots.requests):
            if request is None:
                continue
            tokens[slot] = request.next_token
            for row, start in enumerate(_first_position(request)):
                positions[row][slot] = start + request.ctx.generated
        for layer_idx in range(layers):
            at.append([0 if r is None else r.ctx.cache.layers[layer_idx].slot_length() for r in slots.requests])
        self.tokens.copy_(torch.tensor([tokens]), non_blocking=True)
        self.positions.copy_(torch.tensor(positions), non_blocking=True)
        self.at.copy_(torch.tensor(at), non_blocking=True)
        if self.limits is not None:
            limits = [slots.rank_limits(layer_idx) for layer_idx in range(layers)]
            self.limits.copy_(torch.tensor(limits, dtype=torch.int32), non_blocking=True)

    def forward(self, engine, slots) -> torch.Tensor:
        """The step itself, from the buffers: (slots, vocab) logits, free slots' rows included."""
        adapter = engine.adapter
        hidden = adapter.embed_tokens(self.tokens)  # (1, slots, d)
        position_embeddings = adapter.rotary(hidden, self.positions)
        for layer_idx, layer in enumerate(adapter.layers):
            hidden = engine.run_layer(layer, hidden, position_embeddings, FixedSlotsLayer(self, slots, layer_idx))
        return adapter.lm_head(adapter.norm(hidden))[0].float()

    def _capture(self, engine, slots) -> torch.Tensor:
        """Compute this step eagerly (twice, on a side stream: the warm-up capture needs; writing the same
        entries twice is harmless), then record it as a graph for the next steps."""
        device = engine.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                logits = self.forward(engine, slots)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the vision worker may use the GPU from its own thread meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = self.forward(engine, slots)
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
    written at ``at``, and each slot attends to its entries over the whole room, masked."""

    def __init__(self, step: SlotStep, slots, layer_idx: int):
        self.step, self.slots, self.layer_idx = step, slots, layer_idx

    def attend(self, module, query, key, value, kernel) -> torch.Tensor:
        keys, values = self.slots.keys[self.layer_idx], self.slots.values[self.layer_idx]
        at, every = self.step.at[self.layer_idx], self.step.every_slot
        keys[every, :, at] = key[0].transpose(0, 1)  # (slots, kv_heads, head_dim)
        values[every, :, at] = value[0].transpose(0, 1)
        query = query.transpose(0, 2)  # (slots, heads, 1, head_dim)
        ranks = None if self.step.limits is None else self.slots.ranks[self.layer_idx]
        limit = None if ranks is None else self.step.limits[self.layer_idx]
        if self.slots.packed_layout(self.layer_idx) is not None:  # ZipVL's packed slots, with the float ones
            out = self.slots.attend_with_packed(self.layer_idx, query, keys, values, at, kernel, module.scaling,
                                                ranks, limit)
        else:
            mask = slot_mask(at, keys.shape[2], query.dtype, ranks, limit)  # the whole room, each slot's own
            out = kernel(query, keys, values, mask)
        return out.transpose(0, 1)  # (1, slots, heads, head_dim)

    def attention_output(self, output: torch.Tensor) -> None:
        pass
