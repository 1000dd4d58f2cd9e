"""The decode attention kernel over ZipVL's packed KV slots (pipeline/packed_attention.py), which a GPU runs instead
of dequantizing every packed tensor first: it must attend exactly as dequantizing first does.

The kernel is Triton; on this CPU it runs through Triton's interpreter, which Triton chooses when a kernel is
defined, so these checks run in a subprocess with ``TRITON_INTERPRET=1`` (``test_the_kernel_under_tritons_interpreter``
starts it; the tests it runs are skipped in the main run)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inside = pytest.mark.skipif(not INTERPRETED, reason="run by test_the_kernel_under_tritons_interpreter")


def test_the_kernel_under_tritons_interpreter():
    if INTERPRETED:
        pytest.skip("already inside")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" in result.stdout  # the checks ran, this one skipped itself


def _case(slots, heads, kv_heads, dtype, float_room, rooms, seed=0):
    from glimpse.pipeline.quant import quantize

    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    head_dim = 64
    parts = [(quantize(rand(slots, kv_heads, room, head_dim), bits, 32),
              quantize(rand(slots, kv_heads, room, head_dim), bits, 32)) for bits, room in rooms]
    # Each slot holds a different count of each part's entries: none, all, and between.
    held = torch.stack([torch.randint(0, room + 1, (slots,), generator=generator) for _, room in rooms], dim=1)
    held[0] = torch.tensor([count for _, count in rooms])
    if slots > 1:
        held[1, 0] = 0
    keys, values = rand(slots, kv_heads, float_room, head_dim), rand(slots, kv_heads, float_room, head_dim)
    at = torch.randint(0, float_room, (slots,), generator=generator)  # each slot sees its float entries up to at
    at[0] = 0
    query = rand(slots, heads, 1, head_dim)
    ranks = torch.randint(-1, float_room, (slots, float_room), generator=generator, dtype=torch.int32)
    limit = torch.randint(1, float_room, (slots,), generator=generator, dtype=torch.int32)
    limit[0] = 2**31 - 1
    return query, parts, held, keys, values, at, ranks, limit


def _dequantized_first(query, parts, held, keys, values, at, ranks, limit, exact=False):
    """What a step does without the kernel (``BatchKV.attend_with_packed`` on a CPU): every part dequantized in
    front of the float slots, one masked attention (transformers' eager); ``exact``: all of it in float32, the
    packed entries dequantized to float32 (the quantization's own values)."""
    from glimpse.pipeline.attention import eager_attention
    from glimpse.pipeline.batch_kv import slot_mask
    from glimpse.pipeline.quant import dequantize

    if exact:
        parts = [(dataclasses.replace(k, dtype=torch.float32), dataclasses.replace(v, dtype=torch.float32))
                 for k, v in parts]
        query, keys, values = query.float(), keys.float(), values.float()
    all_keys = torch.cat([dequantize(k) for k, _ in parts] + [keys], dim=2)
    all_values = torch.cat([dequantize(v) for _, v in parts] + [values], dim=2)
    mask = slot_mask(at, keys.shape[2], query.dtype, ranks, limit, (held, [k.tokens for k, _ in parts]))
    return eager_attention(None, query, all_keys, all_values, mask, query.shape[-1] ** -0.5)[0]


@inside
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])  # grouped-query heads, and one query head per key head
@pytest.mark.parametrize("ranked", [False, True])
def test_the_kernel_attends_as_dequantizing_first(dtype, heads, kv_heads, ranked):
    from glimpse.pipeline import packed_attention

    query, parts, held, keys, values, at, ranks, limit = _case(3, heads, kv_heads, dtype, 50, [(4, 40), (2, 70)])
    if not ranked:
        ranks = limit = None
    got = packed_attention.attend(query, parts, held, keys, values, at + 1, query.shape[-1] ** -0.5, ranks, limit)
    assert got.shape == (3, 1, heads, 64) and got.dtype == dtype
    first = _dequantized_first(query, parts, held, keys, values, at, ranks, limit)
    if dtype == torch.float32:
        torch.testing.assert_close(got, first, atol=2e-6, rtol=1e-5)
    else:  # in bfloat16: as close to the float32 result as dequantizing first is, or closer
        exact = _dequantized_first(query, parts, held, keys, values, at, ranks, limit, exact=True)
        error, error_first = (got.float() - exact).abs().max(), (first.float() - exact).abs().max()
        assert error <= error_first and error <= 2**-8 * exact.abs().max()  # the output's own rounding


@inside
def test_splits_of_a_long_slot_combine_into_one_softmax():
    """One slot and one key/value head: its tokens are split among several programs (flash-decoding), whose
    partial softmaxes ``merge`` combines; a split past a slot's entries contributes nothing."""
    from glimpse.pipeline import packed_attention

    query, parts, held, keys, values, at, _, _ = _case(1, 2, 1, torch.float32, 300, [(4, 500), (2, 20)], seed=1)
    assert packed_attention._splits(query.device, 1, 500) > 1 and packed_attention._splits(query.device, 1, 300) > 1
    held[0, 0] = 130  # the later splits of the 4-bit part hold nothing of this slot
    at[0] = 299
    got = packed_attention.attend(query, parts, held, keys, values, at + 1, 64 ** -0.5)
    torch.testing.assert_close(got, _dequantized_first(query, parts, held, keys, values, at, None, None),
                               atol=2e-6, rtol=1e-5)


@inside
@pytest.mark.parametrize("graphs", [False, True])
def test_zipvl_decodes_the_same_tokens_with_the_kernel(checkpoints, media, monkeypatch, graphs):
    """End to end: ZipVL's requests in packed slots, windows packed every 3 tokens, eagerly and with the fixed-shape
    step: the kernel gives each request the tokens and KV bytes of dequantizing first."""
    from glimpse.pipeline import load_engine, packed_attention
    from glimpse.pruning import ZipVL

    engine = load_engine(str(checkpoints["llava"]), device="cpu")  # ZipVL packs each layer alike: no depth needed
    engine.decode_graphs = graphs
    conversations = [[{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                   {"type": "text", "text": "Describe it."}]}],
                     [{"role": "user", "content": "Write one line about the sea."}]]
    packed = lambda: dataclasses.replace(ZipVL.from_speed(0.5), requantize_every=3)  # noqa: E731
    calls = []
    attend = packed_attention.attend
    monkeypatch.setattr(packed_attention, "attend", lambda *args: (calls.append(1), attend(*args))[1])
    fused = engine.generate_batch(conversations, policy=packed(), max_new_tokens=8, ignore_eos=True)
    assert calls and packed_attention.failure is None  # the kernel served the packed steps, and never failed
    monkeypatch.setattr(packed_attention, "enabled", False)
    first = engine.generate_batch(conversations, policy=packed(), max_new_tokens=8, ignore_eos=True)
    for one, other in zip(fused, first):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes_per_step"] == other.metrics["kv_bytes_per_step"]
