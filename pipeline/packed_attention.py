"""A decode step's attention over ZipVL's packed KV slots and the float slots in one pass, with no float copy of
the packed entries: each key and value is unpacked in registers, attended, and dropped (a Triton kernel, on CUDA).

Why: a batch's decode step otherwise dequantizes every packed tensor into a float buffer and copies the float slots
behind it, at every layer (``BatchKV.with_packed``), then attends over that buffer. Per step it writes and reads
again about twice the float size of the whole cache, where the packed bytes are (bits + 1) / 16 of it: at batch 16
on LLaVA-1.5-7B that is more memory traffic than the unpruned step's whole KV read, so the packed KV that saves
memory costs decode time. Here the step reads the packed bytes once.

How: flash-decoding. Every (slot, key/value head, split of the tokens) is one program; it unpacks a block of
tokens' codes with their group's scale and minimum (in float32, as ``quant.dequantize`` computes them), scores
the block against the query heads that read that key/value head, and keeps a running maximum, sum and weighted
value sum (an online softmax). Each segment — one per packed bit width, then the float slots — gives those
partial results, and ``merge`` combines them into the softmax over all of them, exactly as one softmax over the
concatenation: ``out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i``. The float slots' entries past a slot's
length, and ST3's entries ranked past what their layer keeps, are masked as ``slot_mask`` masks them.

The kernel computes plain scaled dot-product attention (no soft-capping, no sliding window, no dropout), which is
what every supported architecture's decode attention is. It runs on CUDA where Triton is importable
(``available``); the CPU keeps the dequantize-then-attend path, and the tests run the kernel through Triton's
interpreter (``TRITON_INTERPRET=1``) against that path.
"""

from __future__ import annotations

import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the dequantize-then-attend path (pipeline/batch_kv.py)
    triton = None

log = logging.getLogger(__name__)

BLOCK_TOKENS = 32  # tokens a program unpacks and scores at a time
FLOAT = 16  # the kernel's "bit width" of a float segment (``BITS``)


# Off: every step dequantizes first (a benchmark's "before" side, or after the kernel failed to build: ``failure``).
enabled = True
failure: str | None = None


def available(device: torch.device, head_dim: int = 128) -> bool:
    """Whether a step on ``device`` can attend with the kernel: CUDA and Triton (or Triton's interpreter), and a head
    size it tiles (a power of two from 16 on: every supported architecture's)."""
    if triton is None or not enabled or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def disable(error: Exception) -> None:
    """The kernel failed (a GPU or Triton it does not build on): every later step dequantizes first."""
    global enabled, failure
    enabled, failure = False, f"{type(error).__name__}: {error}"
    log.warning("packed KV attention kernel off, dequantizing first instead: %s", failure)


def attend(query: torch.Tensor, parts: list, held: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           length: torch.Tensor, scaling: float, ranks: torch.Tensor | None = None,
           limit: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each slot's new token over its packed entries and its float entries.

    ``query`` (slots, heads, 1, head_dim); ``parts`` a list of (key, value) ``QuantizedTensor`` pairs, one per bit
    width, each (slots, kv_heads, room, ...); ``held`` (slots, parts): the entries each slot holds in each part;
    ``keys``/``values`` the float slots (slots, kv_heads, room, head_dim), of which slot i sees the first
    ``length[i]``, except those whose ``ranks`` are ``limit[i]`` or more. Returns (slots, 1, heads, head_dim) in
    the query's dtype, as the attention kernels do."""
    partials = [_segment(query, key, value, held[:, i], scaling) for i, (key, value) in enumerate(parts)]
    partials.append(_segment(query, keys, values, length, scaling, ranks, limit))
    return merge(partials).to(query.dtype)


def merge(partials: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One softmax over all segments' tokens from each piece's running maximum m (slots, heads, pieces), sum of
    weights l and weighted value sum acc (slots, heads, pieces, head_dim): (slots, 1, heads, head_dim), float32."""
    maximum, total, weighted = (torch.cat(t, dim=2) for t in zip(*partials))
    scale = torch.exp(maximum - maximum.amax(dim=2, keepdim=True))  # 0 for an empty piece
    out = (scale.unsqueeze(-1) * weighted).sum(dim=2) / (scale * total).sum(dim=2).unsqueeze(-1)
    return out.unsqueeze(1)


def _splits(device: torch.device, programs: int, room: int) -> int:
    """Splits of the tokens per (slot, key/value head): enough programs for twice the GPU's multiprocessors, each
    with at least a few blocks of tokens (flash-decoding's split-K: at batch 1 there is one program per head)."""
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    most = max(1, triton.cdiv(room, 4 * BLOCK_TOKENS))
    return max(1, min(most, triton.cdiv(2 * units, programs)))


def _segment(query, key, value, length, scaling, ranks=None, limit=None):
    """The partial results of one segment (a packed ``QuantizedTensor`` pair, or float tensors)."""
    packed = not isinstance(key, torch.Tensor)
    data_k, data_v = (key.packed, value.packed) if packed else (key, value)
    slots, kv_heads, room = data_k.shape[:3]
    assert data_v.stride() == data_k.stride(), "keys and values are read with the same strides"
    heads, head_dim = query.shape[1], query.shape[3]
    groups = heads // kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    splits = _splits(query.device, slots * kv_heads, room)
    chunk = triton.cdiv(triton.cdiv(room, splits), BLOCK_TOKENS) * BLOCK_TOKENS
    shape = (slots, heads, splits)
    maximum = torch.empty(shape, dtype=torch.float32, device=query.device)
    total = torch.empty(shape, dtype=torch.float32, device=query.device)
    weighted = torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device)
    scale_k, min_k, scale_v, min_v = ((key.scale, key.minimum, value.scale, value.minimum) if packed else
                                      (data_k, data_k, data_v, data_v))  # unread for a float segment
    ranked = ranks is not None
    _decode_segment[(slots, kv_heads, splits)](
        query, data_k, scale_k, min_k, data_v, scale_v, min_v, length,
        ranks if ranked else length, limit if ranked else length,
        maximum, total, weighted, scaling, chunk,
        query.stride(0), query.stride(1),
        data_k.stride(0), data_k.stride(1), data_k.stride(2),
        scale_k.stride(0), scale_k.stride(1), scale_k.stride(2),
        length.stride(0), ranks.stride(0) if ranked else 0,
        GROUPS=groups, GROUPS_PAD=max(16, triton.next_power_of_2(groups)), HEAD_DIM=head_dim,
        BITS=key.bits if packed else FLOAT, GROUP=key.group if packed else head_dim, RANKED=ranked,
        BLOCK=BLOCK_TOKENS)
    return maximum, total, weighted


if triton is not None:
    @triton.jit
    def _decode_segment(q_ptr, k_ptr, k_scale_ptr, k_min_ptr, v_ptr, v_scale_ptr, v_min_ptr, length_ptr,
                        rank_ptr, limit_ptr, max_ptr, total_ptr, weighted_ptr, scaling, chunk,
                        stride_q_slot, stride_q_head, stride_slot, stride_head, stride_token,
                        stride_scale_slot, stride_scale_head, stride_scale_token, stride_length, stride_rank_slot,
                        GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
                        GROUP: tl.constexpr, RANKED: tl.constexpr, BLOCK: tl.constexpr):
        slot = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a batch's float slots may pass 2**31 values
        kv_head, split = tl.program_id(1), tl.program_id(2)
        splits = tl.num_programs(2)
        group = tl.arange(0, GROUPS_PAD)
        channel = tl.arange(0, HEAD_DIM)
        reads = group < GROUPS  # query heads kv_head // GROUPS, padded to a tile tl.dot takes
        heads = kv_head * GROUPS + group
        query = tl.load(q_ptr + slot * stride_q_slot + heads[:, None] * stride_q_head + channel[None, :],
                        mask=reads[:, None], other=0.0).to(tl.float32)
        length = tl.load(length_ptr + slot * stride_length).to(tl.int32)  # the loop's bounds in one integer type
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        if RANKED:
            limit = tl.load(limit_ptr + slot)
        # Finite before any token, so that an empty split's weights come out exactly 0 (-inf: exp(-inf + inf)).
        maximum = tl.full((GROUPS_PAD,), -1e30, tl.float32)
        total = tl.zeros((GROUPS_PAD,), tl.float32)
        weighted = tl.zeros((GROUPS_PAD, HEAD_DIM), tl.float32)
        base = slot * stride_slot + kv_head * stride_head
        scale_base = slot * stride_scale_slot + kv_head * stride_scale_head
        for first in range(start, end, BLOCK):
            token = first + tl.arange(0, BLOCK)
            valid = token < end
            if RANKED:  # ST3's hidden entries: ranked at or past what the layer keeps (UNRANKED is -1)
                rank = tl.load(rank_ptr + slot * stride_rank_slot + token, mask=valid, other=0)
                valid = valid & (rank < limit)
            keys = _tokens(k_ptr, k_scale_ptr, k_min_ptr, base, scale_base, stride_token, stride_scale_token,
                           token, valid, channel, BITS, GROUP)
            scores = tl.dot(query, tl.trans(keys), input_precision="ieee") * scaling  # (GROUPS_PAD, BLOCK)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_maximum = tl.maximum(maximum, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_maximum[:, None])
            rescale = tl.exp(maximum - new_maximum)
            values = _tokens(v_ptr, v_scale_ptr, v_min_ptr, base, scale_base, stride_token, stride_scale_token,
                             token, valid, channel, BITS, GROUP)
            total = total * rescale + tl.sum(weights, axis=1)
            weighted = weighted * rescale[:, None] + tl.dot(weights, values, input_precision="ieee")
            maximum = new_maximum
        out = (slot * GROUPS * tl.num_programs(1) + heads) * splits + split  # (slots, heads, splits)
        tl.store(max_ptr + out, maximum, mask=reads)
        tl.store(total_ptr + out, total, mask=reads)
        tl.store(weighted_ptr + out[:, None] * HEAD_DIM + channel[None, :], weighted, mask=reads[:, None])

    @triton.jit
    def _tokens(data_ptr, scale_ptr, min_ptr, base, scale_base, stride_token, stride_scale_token, token, valid,
                channel, BITS: tl.constexpr, GROUP: tl.constexpr):
        """(BLOCK, HEAD_DIM) float32 keys or values of ``token``: loaded, or unpacked as ``quant.dequantize``
        computes them (code * scale + min, in float32, not rounded to the model's dtype as its buffer holds them);
        0 where not ``valid``."""
        row = data_ptr + base + token[:, None] * stride_token
        if BITS == 16:  # FLOAT
            tokens = tl.load(row + channel[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        else:  # channel c: BITS bits from bit (c % per byte) * BITS of byte c // per byte (quant.py packs so)
            byte = tl.load(row + (channel // (8 // BITS))[None, :], mask=valid[:, None], other=0).to(tl.int32)
            code = (byte >> ((channel % (8 // BITS)) * BITS)[None, :]) & ((1 << BITS) - 1)
            where = scale_base + token[:, None] * stride_scale_token + (channel // GROUP)[None, :]
            scale = tl.load(scale_ptr + where, mask=valid[:, None], other=0.0).to(tl.float32)
            minimum = tl.load(min_ptr + where, mask=valid[:, None], other=0.0).to(tl.float32)
            tokens = code.to(tl.float32) * scale + minimum
        return tokens
