"""Decode-time policies: ST3's Visual Token Annealing, ZipVL's mixed-precision KV, LazyLLM's
revival from the Aux Cache; batched decode."""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import threading
import weakref

import pytest
import torch

from glimpse.bench import OperatorCount
from glimpse.pipeline import load_engine
from glimpse.pipeline.adapters import TEXT
from glimpse.pipeline.batch_kv import FREE_STEPS_PER_SLOT, BatchKV, decodes_plainly, form_groups, serve_step
from glimpse.pipeline.cache import Growing, KVCache, LayerKV
from glimpse.pipeline.engine import Engine, Sampling
from glimpse.pipeline.metrics import MemoryMeter
from glimpse.pipeline.quant import dequantize, quantize
from glimpse.pruning import ST3, LazyLLM, NoPruning, ZipVL, make_policy
from glimpse.pruning.st3 import anneal_share
from conftest import DEEP_LAYERS
from tiny_models import build_llava, reference_inputs

LAYERS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("decode") / "llava", layers=LAYERS)


def _messages(media):
    return [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                         {"type": "text", "text": "Describe the picture."}]}]


def _endless(engine):
    engine.eos_token_ids = set()  # decode exactly max_new_tokens: the schedule is what is tested
    return engine


def test_annealing_schedules_are_the_papers():
    assert anneal_share("cosine", 0, 50) == 1.0
    assert anneal_share("cosine", 25, 50) == pytest.approx(math.cos(math.pi / 4))
    assert anneal_share("cosine", 50, 50) == 0.0 and anneal_share("cosine", 70, 50) == 0.0
    assert anneal_share("linear", 10, 50) == pytest.approx(0.8)
    assert anneal_share("exponential", 10, 30) == pytest.approx(math.exp(-1))
    # The paper's exponential decay (its Table 8, sigma = 20, 10, 5) has no cut-off at tau as the other two have:
    # e^(-g / sigma) at every length (sigma = tau / 3 here, docs/pruning.md).
    assert anneal_share("exponential", 45, 30) == pytest.approx(math.exp(-4.5))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_vta_keeps_ceil_beta_of_each_layers_prefill_visual_kv_and_all_text(llava, media, schedule):
    engine = _endless(load_engine(str(llava), device="cpu"))
    messages = _messages(media)
    prompt = engine.prepare(messages)
    V, T = prompt.token_counts()["image"], len(prompt)
    tau, new = 6, 10
    result = engine.generate(messages, policy=ST3(anneal_tau=tau, anneal=schedule), max_new_tokens=new)
    assert len(result.token_ids) == new
    series = result.metrics["visual_kv_per_step"]  # step g = 1 .. new - 1 (the last token is not fed back)
    assert series == [LAYERS * math.ceil(anneal_share(schedule, g, tau) * V - 1e-9) for g in range(1, new)]
    assert series[tau - 1:] == [0] * (new - tau)  # nothing visual from g = tau on

    baseline = engine.generate(messages, policy=NoPruning(), max_new_tokens=new)
    per_entry = baseline.metrics["kv_bytes"] / (LAYERS * (T + new - 1))
    # At the end every layer holds exactly the text prompt and the generated tokens: real bytes.
    assert result.metrics["kv_bytes"] == pytest.approx(per_entry * LAYERS * (T - V + new - 1))
    steps = result.metrics["kv_bytes_per_step"]
    assert steps[-1] < baseline.metrics["kv_bytes_per_step"][-1] and len(steps) == new - 1


def test_vta_evicts_even_a_single_entry_when_ceil_beta_v_falls_by_one(llava, media):
    """With tau long beside V, ceil(beta(g) V) falls one entry at a time; every step still keeps exactly
    ceil(beta(g) V_l) visual entries in each layer (ST3 Eq. 7-8), none left over from the step before."""
    engine = _endless(load_engine(str(llava), device="cpu"))
    messages = _messages(media)
    V = engine.prepare(messages).token_counts()["image"]
    tau, new = 3 * V, 12
    series = engine.generate(messages, policy=ST3(anneal_tau=tau), max_new_tokens=new).metrics["visual_kv_per_step"]
    expected = [LAYERS * math.ceil(anneal_share("cosine", g, tau) * V - 1e-9) for g in range(1, new)]
    assert any(a - b == LAYERS for a, b in zip(expected, expected[1:]))  # some step evicts one entry per layer
    assert series == expected


def test_vta_ranks_visual_kv_by_the_last_tokens_prefill_attention(llava, media):
    engine = _endless(load_engine(str(llava), device="cpu", attn="eager"))
    prompt = engine.prepare(_messages(media))
    policy = ST3(anneal_tau=8)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
        attentions = engine.model(**reference_inputs(engine, prompt), output_attentions=True).attentions
    visual = (prompt.modality != TEXT).nonzero().squeeze(1)
    policy.decode_step(4, ctx)  # beta = cos(pi/4): keep the top ceil(0.707 V) in every layer
    keep = math.ceil(math.cos(math.pi / 4) * len(visual) - 1e-9)
    for layer_idx in range(LAYERS):
        scores = attentions[layer_idx][0, :, -1].mean(dim=0)[visual]
        expected = visual[scores.argsort(descending=True)[:keep]]
        entries = ctx.cache.layers[layer_idx]
        kept = entries.index[entries.modality != TEXT]
        assert sorted(kept.tolist()) == sorted(expected.tolist())
        assert int((entries.modality == TEXT).sum()) == len(prompt) - len(visual)  # text untouched
        assert entries.key.shape[-2] == len(entries.index)  # the tensors really shrank


def test_decoding_after_the_visual_kv_is_gone_equals_a_model_that_hides_vision_from_new_tokens(llava, media):
    engine = _endless(load_engine(str(llava), device="cpu", attn="eager"))
    messages = _messages(media)
    new = 6
    result = engine.generate(messages, policy=ST3(anneal_tau=1), max_new_tokens=new)  # beta(1) = 0
    assert result.metrics["visual_kv_per_step"] == [0] * (new - 1)

    # Reference: transformers' own layers over prompt + generated tokens, where the generated
    # tokens cannot see the visual tokens as keys (the prompt tokens saw them in prefill).
    prompt = engine.prepare(messages)
    adapter, T = engine.adapter, len(prompt)
    generated = torch.tensor(result.token_ids[:-1])
    with torch.no_grad():
        hidden = torch.cat([engine.embed_prompt(prompt), adapter.embed_tokens(generated)[None]], dim=1)
        N = hidden.shape[1]
        cos, sin = adapter.rotary(hidden, torch.arange(N)[None])
        allowed = torch.ones(N, N, dtype=torch.bool).tril()
        visual = (prompt.modality != TEXT).nonzero().squeeze(1)
        allowed[T:, visual] = False
        mask = torch.zeros(N, N).masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None, None]
        for layer in adapter.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin))
        logits = adapter.lm_head(adapter.norm(hidden))[0]
    assert logits[T - 1:].argmax(dim=-1).tolist() == result.token_ids
    unpruned = engine.generate(messages, policy=NoPruning(), max_new_tokens=new)
    assert unpruned.metrics["visual_kv_per_step"] == [LAYERS * len(visual)] * (new - 1)


# ---------------------------------------------------------------------------- helpers
def _answer(engine, messages, policy, new):
    """Prefill and decode ``new`` tokens; return the request with its caches (engine internals)."""
    with torch.inference_mode():
        request = engine.start(messages, policy, 0.0, new, Sampling())
        for _ in engine._decode_loop([request], MemoryMeter(engine.device)):
            pass
    return request


def _packed_bytes(entries, kv_heads, head_dim, bits, group):
    """Bytes of ``entries`` keys + values at ``bits``: packed codes plus float16 scale and min per group."""
    values = entries * kv_heads * head_dim
    return 2 * (values * bits // 8 + 2 * 2 * values // group)


# ---------------------------------------------------------------------------- ZipVL mixed-precision KV
def test_zipvl_packs_each_layers_prefill_kv_by_its_important_split(llava, media):
    engine = load_engine(str(llava), device="cpu")
    prompt = engine.prepare(_messages(media))
    policy = ZipVL(tau_image=0.9, important_bits=4, other_bits=2)
    with torch.inference_mode():
        _, ctx = engine.prefill(prompt, policy)
        floats = [layer.keys_values() for layer in ctx.cache.layers]
        policy.decode_step(1, ctx)  # before the first decode step
    cfg = engine.adapter.text_config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    group = policy.resolved["kv_group"]
    assert head_dim % group == 0
    restricted = 0
    for layer, important, (key, value) in zip(ctx.cache.layers, ctx.attention_per_layer, floats):
        assert layer.tail_entries() == 0 and [k.bits for k, _ in layer.packed] == [4, 2]
        high, low = layer.packed[0][0].tokens, layer.packed[1][0].tokens
        expected = set(range(len(prompt))) if important is None else set(important.tolist())
        restricted += important is not None
        assert set(layer.index[:high].tolist()) == expected and high + low == len(prompt)
        # The bytes held are exactly the packed codes plus scales: nothing float is left behind.
        assert layer.nbytes() == (_packed_bytes(high, kv_heads, head_dim, 4, group)
                                  + _packed_bytes(low, kv_heads, head_dim, 2, group))
        # Dequantized entries match the float ones within half a quantization step of their group.
        got_key, _ = layer.keys_values()
        want = key[:, :, layer.index]
        for rows, bits in ((slice(0, high), 4), (slice(high, None), 2)):
            groups = want[:, :, rows].reshape(*want[:, :, rows].shape[:-1], -1, group)
            step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
            error = (got_key[:, :, rows] - want[:, :, rows]).reshape(groups.shape).abs()
            assert (error <= (step * 0.502 + 1e-3).unsqueeze(-1)).all()
    assert restricted > 0  # tau 0.9 made some layer's split a real one


def test_zipvl_packed_kv_without_sparse_prefill_keeps_every_prompt_token_at_the_high_bits(llava, media):
    """Section 4.2: the KV of important tokens gets the high bit width. A layer where every token took part in
    attention (p = n; tau = 1 is the slider's ``packed_kv`` candidate, pruning.frontier) has every token important,
    so its prefill KV is packed at ``important_bits`` only, none at ``other_bits``."""
    engine = load_engine(str(llava), device="cpu")
    prompt = engine.prepare(_messages(media))
    policy = ZipVL(tau_image=1.0, tau_video=1.0, important_bits=4, other_bits=2)
    with torch.inference_mode():
        _, ctx = engine.prefill(prompt, policy)
        policy.decode_step(1, ctx)
    assert all(rows is None for rows in ctx.attention_per_layer)
    for layer in ctx.cache.layers:
        assert layer.tail_entries() == 0 and layer.packed_counts() == {4: len(prompt)}


@pytest.mark.parametrize("prompt_keys", [0, 6])
def test_zipvl_packs_every_window_of_new_tokens_by_the_new_tokens_attention(prompt_keys):
    """Algorithm 1, decode: once ``requantize_every`` new entries sit in float, the new token's
    attention over them picks the high-bit ones (Eq. 6-8 with tau); all of them get packed. Its attention is a
    distribution over the window: with ``prompt_keys`` earlier tokens taking most of it (as a prompt does), the
    window's share is renormalised before Eq. 6, or tau is never reached and every entry is "important"."""
    from dataclasses import replace
    from types import SimpleNamespace

    from glimpse.pipeline.engine import LayerView

    g = torch.Generator().manual_seed(0)
    head_dim, window = 16, 10
    keys = torch.randn(1, 1, window, head_dim, generator=g) * 0.1
    keys[0, 0, [2, 7]] = 3.0  # the query below attends almost only to these two
    layer = LayerKV()
    layer.append(keys, torch.randn(1, 1, window, head_dim, generator=g))
    layer.index, layer.modality = torch.arange(100, 100 + window), torch.zeros(window, dtype=torch.long)
    policy = ZipVL(tau_image=0.9, important_bits=4, other_bits=2, requantize_every=window)
    policy.resolved = {"tau": 0.9}
    query = torch.full((1, 1, 1, head_dim), 3.0)
    cache = KVCache(1)
    cache.layers[0] = layer
    new = torch.tensor([100 + window])
    before = torch.full((1, 1, prompt_keys, head_dim), 4.0)  # attended far more than the window's two
    seen_keys, seen = torch.cat([before, keys], dim=2), torch.cat([torch.arange(prompt_keys), layer.index])
    ctx = SimpleNamespace(cache=cache, layer=LayerView(0, new, torch.zeros(1, dtype=torch.long), query, seen_keys,
                                                       head_dim ** -0.5, seen))
    policy.decode_score(0, ctx)
    assert layer.tail_entries() == 0
    assert [k.bits for k, _ in layer.packed] == [4, 2]
    assert layer.index[:2].tolist() == [102, 107]  # the important ones, packed at 4 bits
    assert sorted(layer.index.tolist()) == list(range(100, 100 + window))

    layer.append(keys[:, :, :3], keys[:, :, :3])  # fewer than a window: they stay float
    layer.index = torch.cat([layer.index, torch.arange(200, 203)])
    ctx.layer = replace(ctx.layer, keys=layer.keys_values()[0], key_index=layer.index.clone())
    policy.decode_score(0, ctx)
    assert layer.tail_entries() == 3


def test_zipvl_generation_packs_new_tokens_in_windows_and_holds_fewer_bytes(llava, media):
    engine = _endless(load_engine(str(llava), device="cpu"))
    messages = _messages(media)
    new, every = 14, 5
    request = _answer(engine, messages, ZipVL(tau_image=0.9, important_bits=4, other_bits=2,
                                              requantize_every=every), new)
    fed = new - 1  # the last token is never fed back
    for layer in request.ctx.cache.layers:
        assert layer.tail_entries() == fed % every  # windows of 5 packed, the rest still float
        assert len(layer) == len(request.prompt) + fed
    baseline = engine.generate(messages, policy=NoPruning(), max_new_tokens=new)
    steps = request.ctx.kv_bytes_per_step
    assert max(steps) < baseline.metrics["kv_bytes_per_step"][0] / 3  # 2-4 bits + scales vs float32


def test_zipvl_at_speed_0_keeps_full_precision_and_the_papers_bits_from_speed_half(llava, media):
    assert ZipVL.from_speed(0.0).important_bits is None
    assert (ZipVL.from_speed(0.5).important_bits, ZipVL.from_speed(0.5).other_bits) == (4, 2)
    engine = _endless(load_engine(str(llava), device="cpu"))
    messages = _messages(media)
    request = _answer(engine, messages, ZipVL.from_speed(0.0), 6)
    assert all(not layer.packed for layer in request.ctx.cache.layers)
    baseline = engine.generate(messages, policy=NoPruning(), max_new_tokens=6)
    assert request.tokens == baseline.token_ids


def test_evicting_entries_works_across_packed_segments_and_the_float_tail():
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(1, 2, 12, 32, generator=g), torch.randn(1, 2, 12, 32, generator=g)
    layer = LayerKV()
    layer.append(key, value)
    layer.index, layer.modality = torch.arange(12), torch.zeros(12, dtype=torch.long)
    layer.pack(torch.tensor([1, 5, 9]), 4, 32)
    layer.pack(torch.tensor([0, 2]), 2, 32)  # tail positions after the first pack: tokens 0 and 3
    assert layer.index.tolist() == [1, 5, 9, 0, 3, 2, 4, 6, 7, 8, 10, 11]
    before, _ = layer.keys_values()
    rows = torch.tensor([0, 2, 4, 7, 11])  # tokens 1, 9, 3, 6, 11
    layer.keep(rows)
    assert layer.index.tolist() == [1, 9, 3, 6, 11]
    assert torch.equal(layer.keys_values()[0], before[:, :, rows])
    assert layer.nbytes() == (quantize(key[:, :, :2], 4).nbytes() * 2 + quantize(key[:, :, :1], 2).nbytes() * 2
                              + 2 * 2 * 2 * 32 * 4)
    assert torch.equal(dequantize(layer.packed[0][0]), dequantize(quantize(key[:, :, [1, 9]], 4)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_keys_and_values_read_back_as_concatenating_every_part_would_give(dtype):
    """Reading a cache of packed segments and a float tail writes each part straight into one buffer;
    the result is exactly the dequantized parts concatenated and indexed, for all rows or any subset in
    any order (the order decides which key_index each key has), in float32 and in bfloat16 (the values
    rounded once, as they are stored)."""
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(1, 2, 20, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g)
    layer = LayerKV()
    layer.append(key.to(dtype), value.to(dtype))
    layer.index, layer.modality = torch.arange(20), torch.zeros(20, dtype=torch.long)
    layer.pack(torch.tensor([0, 3, 4, 9]), 4, 32)
    layer.pack(torch.tensor([1, 2, 10]), 2, 32)
    layer.append(torch.randn(1, 2, 2, 32, generator=g).to(dtype), torch.randn(1, 2, 2, 32, generator=g).to(dtype))
    keys = torch.cat([*[dequantize(k) for k, _ in layer.packed], layer.key], dim=-2)
    values = torch.cat([*[dequantize(v) for _, v in layer.packed], layer.value], dim=-2)
    for rows in [None, torch.tensor([0, 1, 5, 6, 7, 20, 21]), torch.tensor([21, 2, 8, 0, 15, 5]),
                 torch.tensor([4, 5, 6])]:
        got_keys, got_values = layer.keys_values(rows)
        want = slice(None) if rows is None else rows
        assert torch.equal(got_keys, keys[:, :, want]) and torch.equal(got_values, values[:, :, want])

def test_decode_appends_write_in_place_and_copy_the_tail_once_per_grow_steps():
    """The cache is not re-concatenated per token: a step's entry goes into spare room of the tail buffer,
    which is reallocated (one copy) only when GROW steps have filled it, with every entry kept."""
    g = torch.Generator().manual_seed(3)
    prompt_key, prompt_value = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    layer = LayerKV()
    layer.append(prompt_key, prompt_value)
    assert layer.key.data_ptr() == prompt_key.data_ptr()  # the prompt's entries are kept as they come
    steps = [(torch.randn(1, 2, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g))
             for _ in range(2 * Growing.GROW + 3)]
    layer.add_records(torch.arange(40), torch.zeros(40, dtype=torch.long))
    storages, record_storages = [], set()
    for i, (key, value) in enumerate(steps):
        layer.append(key, value)
        layer.add_records(torch.tensor([40 + i]), torch.tensor([0]))
        storages.append(layer.key.untyped_storage().data_ptr())
        record_storages.add(layer.index.untyped_storage().data_ptr())
    reallocations = sum(a != b for a, b in zip(storages, storages[1:])) + 1  # the first step reallocates
    assert reallocations == math.ceil(len(steps) / (Growing.GROW + 1))
    # the token records (original index, modality) grow the same way, every entry kept
    assert len(record_storages) <= 3 and torch.equal(layer.index, torch.arange(40 + len(steps)))
    keys, values = layer.keys_values()
    assert torch.equal(keys, torch.cat([prompt_key, *[k for k, _ in steps]], dim=-2))
    assert torch.equal(values, torch.cat([prompt_value, *[v for _, v in steps]], dim=-2))
    # nbytes counts the entries held, not the buffer's spare room
    assert layer.nbytes() == 2 * keys.numel() * keys.element_size()


# ---------------------------------------------------------------------------- LazyLLM revival
class _Watching(LazyLLM):
    """LazyLLM that records, per decode step and layer, the tokens the new token attended to."""

    def plan(self, ctx):
        super().plan(ctx)
        self.seen: list[dict[int, list[int]]] = []

    def decode_score(self, layer_idx, ctx):
        if layer_idx == 0:
            self.seen.append({})
        self.seen[-1][layer_idx] = sorted(ctx.layer.key_index.tolist())
        super().decode_score(layer_idx, ctx)


@pytest.fixture(scope="module")
def deep_llava(deep_checkpoints):
    return _endless(load_engine(str(deep_checkpoints["llava"]), device="cpu"))


def test_a_lazyllm_decode_step_joins_rows_and_computes_rope_only_where_a_layer_changes_them(deep_llava, media):
    """LazyLLM reselects at a few layers; at the others every request's rows are what the layer before computed,
    and the step goes on with that layer's output and RoPE (joining and recomputing them cost a dozen operators a
    layer, per step). The answer is the same either way: the batched-vs-alone and revival tests hold it."""
    engine, messages = deep_llava, _messages(media)
    policies = [LazyLLM(percentiles=(0.4, 0.5, 0.6), decode_reselect=True) for _ in range(2)]
    computed = []
    rotary = engine.adapter.rotary
    engine.adapter.rotary = lambda hidden, positions: computed.append(positions.shape[-1]) or rotary(hidden, positions)
    try:
        with torch.inference_mode():
            requests = [engine.start(messages, policy, 1.0, 8, Sampling()) for policy in policies]
            engine.decode_step(requests)  # both decode from here
            computed.clear()
            engine.decode_step(requests)
    finally:
        del engine.adapter.rotary
    layers = len(engine.adapter.layers)
    reselecting = {layer for layer, k in policies[0].schedule.items() if k > 0}
    assert 0 < len(reselecting) < layers - 1
    assert len(computed) <= 1 + len(reselecting), (computed, sorted(reselecting))


def test_lazyllm_revives_pruned_tokens_once_per_layer_from_the_aux_cache_at_their_original_position(
        deep_llava, media):
    engine, messages, new = deep_llava, _messages(media), 8
    paper = dict(percentiles=(0.4, 0.5, 0.6), decode_reselect=True)  # the paper's per-step re-selection
    policy = _Watching(**paper)
    with torch.inference_mode():
        _, prefilled = engine.prefill(engine.prepare(messages), LazyLLM(**paper))
    parked = {layer: entry[0].tolist() for layer, entry in prefilled.aux_cache.layers.items()}
    request = _answer(engine, messages, policy, new)
    ctx, T, L = request.ctx, len(request.prompt), len(engine.adapter.layers)
    assert ctx.revived > 0, "no pruned token was ever selected again"

    adapter = engine.adapter
    for layer_idx, layer in enumerate(ctx.cache.layers):
        index = layer.index.tolist()
        assert len(index) == len(set(index)), f"a token was computed twice in layer {layer_idx}"
        aux = ctx.aux_cache.get(layer_idx)
        if aux is not None:  # a token has a key/value or an Aux Cache entry here, never both
            assert not set(aux[0].tolist()) & set(index)
    # Revived tokens: their keys in a pruning layer are that layer's k_proj of the hidden state
    # the Aux Cache held, rotated at the token's original position.
    checked = 0
    with torch.no_grad():
        for layer_idx, tokens in parked.items():
            layer = ctx.cache.layers[layer_idx]
            revived = [t for t in tokens if t in set(layer.index.tolist())]
            if not revived:
                continue
            held = prefilled.aux_cache.get(layer_idx)
            rows = torch.tensor([held[0].tolist().index(t) for t in revived])
            hidden = held[1][rows][None]
            attn = adapter.layers[layer_idx].self_attn
            normed = adapter.layers[layer_idx].input_layernorm(hidden)
            cos, sin = adapter.rotary(hidden, ctx.positions[:, torch.tensor(revived)])
            # k_proj and the model's own RoPE function, as the layer's forward applies them
            key = attn.k_proj(normed).view(*normed.shape[:-1], -1, attn.head_dim).transpose(1, 2)
            _, key = sys.modules[type(attn).__module__].apply_rotary_pos_emb(key, key, cos, sin)
            where = torch.tensor([layer.index.tolist().index(t) for t in revived])
            assert torch.allclose(layer.keys_values()[0][:, :, where], key, atol=1e-5)
            checked += len(revived)
    assert checked > 0
    # Never more token computations than the unpruned model's.
    assert sum(int(a.shape[0]) for a in ctx.active_per_layer) + ctx.revived <= L * T

    # Every step re-selects at each pruning layer: the new token sees ceil((1 - k) n) of the n
    # tokens it saw in the previous layer, nested, and all of them before the first pruning layer.
    schedule = policy.schedule
    for step in policy.seen:
        assert step[0] == list(range(T)) + [i for i in step[0] if i >= T]
        for layer_idx in range(1, L):
            if layer_idx in schedule:
                n, k = len(step[layer_idx - 1]), schedule[layer_idx]
                assert len(step[layer_idx]) == n - math.floor(k * n)
                assert set(step[layer_idx]) <= set(step[layer_idx - 1])
            else:
                assert step[layer_idx] == step[layer_idx - 1] or layer_idx < min(schedule)


def test_lazyllm_decode_keeps_what_the_new_token_attended_to_most_in_the_layer_before_each_pruning_layer(
        deep_llava, media):
    """Algorithm 1 in decode: at pruning layer l a step keeps the tokens that the new token attended to most in
    layer l - 1 (mean over heads, over the tokens it saw there) and prunes the rest, floor(k n) of them. Checked
    against that attention computed here from layer l - 1's own q_proj and RoPE and the keys its cache holds."""
    engine, messages = deep_llava, _messages(media)
    adapter = engine.adapter
    policy = _Watching(percentiles=(0.4, 0.5, 0.6), decode_reselect=True)
    queries: dict[int, torch.Tensor] = {}  # layer -> its last call's query of the step's last row: the new token
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda module, args, out, at=at: queries.__setitem__(at, out[0, -1].detach().clone()))
        for at, layer in enumerate(adapter.layers)]
    try:
        request = _answer(engine, messages, policy, 5)
    finally:
        for hook in hooks:
            hook.remove()
    step, ctx = policy.seen[-1], request.ctx  # the last step's: the caches are as it left them
    new_token = step[0][-1]
    checked = 0
    for layer_idx, k in policy.schedule.items():
        seen = step[layer_idx - 1]
        attn = adapter.layers[layer_idx - 1].self_attn
        cache = ctx.cache.layers[layer_idx - 1]
        index = cache.index.tolist()
        with torch.no_grad():
            keys = cache.keys_values()[0][0][:, [index.index(t) for t in seen]].float()  # (kv_heads, n, head_dim)
            query = queries[layer_idx - 1].view(1, 1, -1, attn.head_dim).transpose(1, 2)  # (1, heads, 1, head_dim)
            cos, sin = adapter.rotary(query, torch.tensor([[new_token]]))  # (LLaVA's position: the token's index)
            query, _ = sys.modules[type(attn).__module__].apply_rotary_pos_emb(query, query, cos, sin)
            query = query[0, :, 0].float().view(keys.shape[0], -1, attn.head_dim)  # head h reads kv head h // groups
            attention = ((query @ keys.transpose(1, 2)) * attn.scaling).softmax(-1).reshape(-1, len(seen)).mean(0)
        by_token = dict(zip(seen, attention.tolist()))
        kept, pruned = set(step[layer_idx]), set(seen) - set(step[layer_idx])
        assert new_token in kept and len(pruned) == math.floor(k * len(seen))
        assert max(by_token[t] for t in pruned) <= min(by_token[t] for t in kept - {new_token}) + 1e-6, layer_idx
        checked += 1
    assert checked == len(policy.schedule) == 3


def test_revived_rows_attend_to_every_entry_the_step_picks_and_to_each_other_causally(deep_llava):
    """LazyLLM's revival (its Section 3.3): revived tokens are appended after the sequence with their original
    positions, so they "attend to all tokens selected in previous generation steps", later positions included, and
    the step's rows (revived tokens, then the new token) attend to each other causally."""
    from types import SimpleNamespace

    from glimpse.pipeline.attention import eager_attention
    from glimpse.pipeline.engine import DecodeRows

    engine = deep_llava
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, cached, picked = 4, 2, 16, 6, torch.tensor([0, 2, 3, 5])
    layer = LayerKV()
    layer.append(torch.randn(1, kv_heads, cached, head_dim, generator=g), torch.randn(1, kv_heads, cached, head_dim,
                                                                                     generator=g))
    layer.index, layer.modality = torch.tensor([0, 1, 4, 5, 6, 8]), torch.zeros(cached, dtype=torch.long)
    cache = KVCache(1)
    cache.layers[0] = layer
    old_keys, old_values = layer.keys_values()
    policy = SimpleNamespace(decode_attend=lambda layer_idx, ctx: picked, implements=lambda callback: False)
    request = SimpleNamespace(ctx=SimpleNamespace(cache=cache), policy=policy)
    rows = DecodeRows(torch.tensor([2, 3, 9]), torch.zeros(3, dtype=torch.long), torch.tensor([[2, 3, 9]]),
                      torch.zeros(1, 3, 8))  # tokens 2 and 3 revived, 9 the new one
    query = torch.randn(1, heads, 3, head_dim, generator=g)
    key, value = torch.randn(1, kv_heads, 3, head_dim, generator=g), torch.randn(1, kv_heads, 3, head_dim, generator=g)
    scaling = head_dim ** -0.5

    def kernel(q, k, v, mask):
        return eager_attention(None, q, k, v, mask, scaling)[0]

    out = engine.decode_attention(0, None, query, key, value, rows, request, kernel)
    for row in range(3):  # each row on its own: the picked entries, then the rows up to itself
        keys = torch.cat([old_keys[:, :, picked], key[:, :, : row + 1]], dim=2)
        values = torch.cat([old_values[:, :, picked], value[:, :, : row + 1]], dim=2)
        expected = eager_attention(None, query[:, :, row:row + 1], keys, values, None, scaling)[0]
        torch.testing.assert_close(out[:, row:row + 1], expected, atol=1e-6, rtol=1e-5)
    assert layer.index.tolist() == [0, 1, 4, 5, 6, 8, 2, 3, 9]  # their entries joined the cache


def test_the_sliders_lazyllm_prunes_in_prefill_only_and_decode_attends_to_what_prefill_left(deep_llava, media):
    """Without the paper's re-selection, decode is plain decoding over the caches prefill left: each layer's KV
    holds that layer's prefill tokens and every generated one, nothing is revived, and no Aux Cache is kept."""
    engine, messages = deep_llava, _messages(media)
    policy = LazyLLM.from_speed(1.0)
    assert not policy.decode_reselect  # the paper's per-step re-selection is opt-in: decode_reselect=True
    request = _answer(engine, messages, policy, 6)
    assert request.ctx.revived == 0 and request.ctx.aux_cache.nbytes() == 0
    T = len(request.prompt)
    generated = set(range(T, T + len(request.tokens) - 1))  # the last token has no entry yet
    with torch.inference_mode():
        held = [set(request.ctx.cache.tokens(layer_idx).tolist()) for layer_idx in range(len(request.ctx.cache.layers))]
    for layer_idx, active in enumerate(request.ctx.active_per_layer):
        assert held[layer_idx] == set(active.tolist()) | generated
    assert len(request.ctx.active_per_layer[-1]) < T  # it pruned


def test_lazyllm_at_speed_0_decodes_exactly_like_no_pruning(deep_llava, media):
    messages = _messages(media)
    pruned = deep_llava.generate(messages, policy=LazyLLM.from_speed(0.0), max_new_tokens=8)
    assert pruned.metrics["revived_tokens"] == 0
    assert pruned.token_ids == deep_llava.generate(messages, policy=NoPruning(), max_new_tokens=8).token_ids


# ---------------------------------------------------------------------------- batched decode
@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
@pytest.mark.parametrize("policy", ["none", "auto", "lazyllm", "zipvl", "st3"])
def test_batched_decode_equals_one_by_one(deep_checkpoints, media, arch, policy):
    engine = load_engine(str(deep_checkpoints[arch]), device="cpu")
    conversations = [
        _messages(media),
        [{"role": "user", "content": "Write one line about the sea."}],
        [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                      {"type": "text", "text": "What colours? Answer in a long sentence please."}]}],
    ]
    if arch == "qwen2_vl":
        conversations.append([{"role": "user", "content": [{"type": "video", "video": str(media["video"])},
                                                           {"type": "text", "text": "What happens?"}]}])
    speed = 0.0 if policy == "none" else 1.0
    batched = engine.generate_batch(conversations, policy=policy, speed=speed, max_new_tokens=12)
    assert [r.metrics["batch_size"] for r in batched] == [len(conversations)] * len(conversations)
    for conversation, together in zip(conversations, batched):
        alone = engine.generate(conversation, policy=policy, speed=speed, max_new_tokens=12)
        assert together.token_ids == alone.token_ids
        assert together.finish_reason == alone.finish_reason
        assert together.metrics["kv_bytes"] == alone.metrics["kv_bytes"]


def test_streamed_deltas_join_to_the_whole_answer_and_decoding_stays_linear():
    """The streaming detokenizer never emits half a character (byte-level tokens split 日本語 and é),
    its deltas join to exactly what decoding the whole answer gives (special tokens skipped), and the
    tokens it decodes over a long answer grow linearly with its length, not quadratically."""
    from glimpse.pipeline.engine import _IncrementalDecoder
    from glimpse.pipeline.random_checkpoint import QWEN_SPECIAL_TOKENS, make_tokenizer

    tok = make_tokenizer(QWEN_SPECIAL_TOKENS, eos="<|im_end|>")
    ids = tok("A red circle, 日本語 and émigré, then a blue square. " * 30)["input_ids"]
    ids += [tok.convert_tokens_to_ids("<|im_end|>")]
    real_decode, decoded = tok.decode, []
    tok.decode = lambda tokens, **kwargs: decoded.append(len(tokens)) or real_decode(tokens, **kwargs)
    stream = _IncrementalDecoder(tok)
    pieces = [stream.push(token) for token in ids]
    pieces.append(stream.flush())
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == real_decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and sum(decoded) < 10 * len(ids)  # re-decoding the answer each step: ~n^2 / 2


# ---------------------------------------------------------------------------- KV slots (pipeline/batch_kv.py)
def _spy_slots(monkeypatch):
    """Count what the KV slots did: every batch formed (its members and room) and every attention call."""
    seen = {"formed": [], "calls": 0}
    init, attend = BatchKV.__init__, BatchKV.attend

    def spy_init(self, requests):
        init(self, requests)
        seen["formed"].append((len(requests), self._room()))

    def spy_attend(self, *args, **kwargs):
        seen["calls"] += 1
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(BatchKV, "__init__", spy_init)
    monkeypatch.setattr(BatchKV, "attend", spy_attend)
    return seen


def test_a_slot_holds_a_bounded_share_of_a_long_budget_and_a_longer_answer_moves_on_exactly(
        deep_checkpoints, media, monkeypatch):
    """Found from outside: slots had room for the whole budget, so max_new_tokens=10**9 allocated the rest of the
    context for every request (8 two-token answers: 3.2 GB). A slot now holds ``ANSWER_ROOM`` more tokens at most;
    an answer longer than that leaves its slot and the batch forms again, with the same tokens as one by one."""
    from glimpse.pipeline import batch_kv

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}]]
    seen = _spy_slots(monkeypatch)
    engine.generate_batch(conversations, max_new_tokens=10**9, policy="none")
    longest = max(len(engine.prepare(c)) for c in conversations)
    per_slot_layer = seen["formed"][0][1] / (len(conversations) * len(engine.adapter.layers))
    assert per_slot_layer <= (longest + batch_kv.ANSWER_ROOM + 1) * batch_kv.SLACK + 1

    monkeypatch.setattr(batch_kv, "ANSWER_ROOM", 4)  # answers of 12 tokens outgrow their slots twice
    _endless(engine)
    seen["formed"].clear()
    together = engine.generate_batch(conversations, max_new_tokens=12, policy="none")
    alone = [engine.generate(c, max_new_tokens=12, policy="none") for c in conversations]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert len(seen["formed"]) >= 3


@pytest.mark.parametrize("graphs", [False, True])
def test_answers_that_outgrow_their_slots_room_move_on_and_answer_as_alone(deep_checkpoints, monkeypatch, graphs):
    """Found from outside: a slot has room for ``ANSWER_ROOM`` more tokens (and SLACK), but nothing moved a member
    out of a full slot, so two text questions asked with max_new_tokens=1400 stopped with an IndexError after about
    1180 steps (the next entry written past the slot's room). Shrunk here: an answer longer than its slot's room
    forms the batch again and every answer is the one it gets alone."""
    from glimpse.pipeline import batch_kv

    engine = _endless(load_engine(str(deep_checkpoints["llava"]), device="cpu"))
    monkeypatch.setattr(batch_kv, "ANSWER_ROOM", 2)
    conversations = [[{"role": "user", "content": "Say hi."}],
                     [{"role": "user", "content": "Write one line about the sea please now."}]]
    engine.decode_graphs = graphs
    together = engine.generate_batch(conversations, policy="none", max_new_tokens=30)
    alone = [engine.generate(c, policy="none", max_new_tokens=30) for c in conversations]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("policy,speed", [("none", 0.0), ("fastv", 0.8), ("st3", 1.0), ("lazyllm", 1.0)])
def test_requests_in_kv_slots_decode_as_each_on_its_own_cache(deep_checkpoints, media, monkeypatch, policy, speed):
    """Prompts of different lengths (and, pruned, different lengths per layer) share one attention call per layer
    over their slots, masked to each one's own entries: the answers and the KV each holds are those of decoding
    every request over its own cache, and every request of the batch was in the slots."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}],
                     [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                   {"type": "text", "text": "What colours? Answer at length."}]}]]
    engine.decode_slots = False
    separate = engine.generate_batch(conversations, policy=policy, speed=speed, max_new_tokens=10, ignore_eos=True)
    engine.decode_slots = True
    seen = _spy_slots(monkeypatch)
    slotted = engine.generate_batch(conversations, policy=policy, speed=speed, max_new_tokens=10, ignore_eos=True)
    assert seen["formed"] and seen["formed"][0][0] == len(conversations)
    assert seen["calls"] == 9 * DEEP_LAYERS  # every step after the first token, every layer
    assert engine.slot_groups == []  # the slots went with the batch
    for one, other in zip(slotted, separate):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes"] == other.metrics["kv_bytes"]
        assert one.metrics["visual_kv_per_step"] == other.metrics["visual_kv_per_step"]


@pytest.mark.parametrize("policy,speed,step", [("none", 0.0, "slots"), ("none", 0.0, "own caches"),
                                               ("st3", 1.0, "slots"), ("st3", 1.0, "fixed shape"),
                                               ("zipvl", 1.0, "slots"), ("fastv", 0.8, "own caches")])
def test_a_decode_step_that_runs_out_of_memory_part_way_is_undone_and_the_answers_are_as_with_memory_to_spare(
        deep_checkpoints, media, policy, speed, step):
    """A decode pass of three requests that runs out of memory half-way through the model, after the first layers
    wrote the step's KV entries, is undone for every request (``KVCache.undo_append``) and run again in smaller
    parts until it fits: without KV slots, then two requests, then one at a time. The answers, the KV each request
    holds after every step and its visual KV are those of the same batch with memory to spare (ST3's evicted
    entries hidden in slots, ZipVL's packed KV included). The steps after the first run one request at a time
    straight away: the refused passes (with slots, without them, of two) are all of the first step's."""
    from tiny_models import RunsOutOfMemory

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    engine.decode_slots, engine.decode_graphs = step != "own caches", step == "fixed shape"
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}],
                     [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                   {"type": "text", "text": "What colours? Answer at length."}]}]]
    kwargs = dict(policy=policy, speed=speed, max_new_tokens=10, ignore_eos=True)
    spare = engine.generate_batch(conversations, **kwargs)
    # Two or three rows: only a decode step of two or three requests (every prompt is longer).
    with RunsOutOfMemory(engine.adapter.layers[DEEP_LAYERS // 2].mlp, "cpu", lambda rows: 2 <= rows <= 3) as fault:
        short = engine.generate_batch(conversations, **kwargs)
    assert len(fault.refused) == (2 if step == "own caches" else 3)
    for one, other in zip(short, spare):
        assert one.token_ids == other.token_ids
        for series in ("kv_bytes_per_step", "visual_kv_per_step"):
            assert one.metrics[series] == other.metrics[series]
    assert engine.pass_limit is None and engine.slot_groups == []  # gone with the batch
    assert [r.token_ids for r in engine.generate_batch(conversations, **kwargs)] == [r.token_ids for r in spare]


def test_a_request_whose_step_cannot_be_undone_ends_alone_when_memory_runs_out(deep_checkpoints, media):
    """LazyLLM, as its paper decodes, revives pruned prompt tokens inside a decode step (their hidden states leave
    its aux cache): a pass
    that runs out of memory cannot be undone for it, so it ends, saying so, while the requests beside it are undone
    and answer as they would have."""
    from tiny_models import RunsOutOfMemory

    from glimpse.pipeline import OutOfMemory

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}]]
    policies = [LazyLLM(percentiles=(0.4, 0.5, 0.6), decode_reselect=True), NoPruning()]  # the paper's revival
    spare = engine.generate(conversations[1], policy="none", max_new_tokens=8, ignore_eos=True)
    with torch.inference_mode():
        requests = [engine.start(c, p, 0.0, 8, Sampling(False, 1.0, 1.0, None), ignore_eos=True)
                    for c, p in zip(conversations, policies)]
    # Every decode step of both requests (LazyLLM's revived tokens add rows) runs out of memory.
    with RunsOutOfMemory(engine.adapter.layers[DEEP_LAYERS // 2].mlp, "cpu", lambda rows: rows >= 2) as fault, \
            torch.inference_mode():
        running, answer = list(requests), []
        while running:
            for request in running:
                if request is requests[0] and request.error is not None:
                    with pytest.raises(OutOfMemory, match="decoding 2 requests together"):
                        engine.take_token(request)
                elif (token := engine.take_token(request)) is not None and request is requests[1]:
                    answer.append(token)
            running = [request for request in running if not request.done]
            if running:
                engine.decode_step(running)
    engine.batch_ended()
    assert fault.refused and requests[0].finish == "error" and requests[0].error is None  # raised, and only once
    assert answer == spare.token_ids


def test_a_shortage_of_memory_lasts_while_the_requests_that_met_it_decode(deep_checkpoints, media):
    """After a step ran out of memory, its requests decode without KV slots and in smaller parts, and so does a
    request that joins them; once all of them have ended, the requests still decoding get their slots back, also
    on a server that is never idle between them."""
    from tiny_models import RunsOutOfMemory

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}],
                     [{"role": "user", "content": "And one about the hills."}]]
    with torch.inference_mode():
        met = [engine.start(c, "none", 0.0, 8, Sampling(False, 1.0, 1.0, None)) for c in conversations[:2]]
        with RunsOutOfMemory(engine.adapter.layers[1].mlp, "cpu", lambda rows: rows == 2) as fault:
            assert engine.decode_step(met)
        assert len(fault.refused) == 2 and all(request.short_of_memory for request in met)
        assert engine.pass_limit == 1
        later = engine.start(conversations[2], "none", 0.0, 8, Sampling(False, 1.0, 1.0, None))
        assert not engine.decode_step([*met, later])
        assert engine.slot_groups == [] and engine.pass_limit == 1 and not later.short_of_memory
        engine.decode_step([met[1], later])
        assert engine.slot_groups == []
        engine.decode_step([later])  # the two that ran out of memory have ended
        assert engine.pass_limit is None and [group.members for group in engine.slot_groups] == [[later]]
    engine.batch_ended()


def test_kv_slots_take_only_requests_that_fit_together_and_decode_plainly(deep_checkpoints, media):
    """A batch is as long as its longest member needs: a prompt many times longer than the others is left to
    decode on its own cache, and so is LazyLLM with the paper's re-selection (it revives prompt tokens in decode);
    the slider's LazyLLM, which prunes in prefill only, decodes plainly (and as a graph), and so does ZipVL's packed
    KV (in packed slots)."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    short = [{"role": "user", "content": "Say hi."}]
    long = [{"role": "user", "content": "Read this. " + "The sea is calm and blue today. " * 60}]
    with torch.inference_mode():
        started = [engine.start(c, "none", 0.0, 8, Sampling()) for c in (short, short, long)]
        formed = BatchKV.form(started)
        assert formed.requests == started[:2]
        assert all(formed.holds(layer) for r in started[:2] for layer in r.ctx.cache.layers)
        assert not any(formed.holds(layer) for layer in started[2].ctx.cache.layers)
        sliders_lazy = engine.start(_messages(media), "lazyllm", 1.0, 8, Sampling())  # prunes in prefill only
        papers_lazy = engine.start(_messages(media), make_policy("lazyllm", 1.0, {"decode_reselect": True}), 1.0, 8,
                                   Sampling())
        zipvl = engine.start(_messages(media), "zipvl", 1.0, 8, Sampling())
        zipvl.policy.decode_step(1, zipvl.ctx)  # packs the prefill KV, as the first decode step does
        assert ([decodes_plainly(r) for r in (started[0], sliders_lazy, papers_lazy, zipvl)]
                == [True, True, False, True])
        assert not sliders_lazy.policy.scores_in_decode() and papers_lazy.policy.scores_in_decode()


def test_kv_slots_take_the_most_requests_that_fit_together(deep_checkpoints):
    """Of requests of mixed sizes, the slots take the most that fit together (the largest need at most ``WASTE``
    times the mean), and of those the most entries: every subset checked. Two short questions beside six longer
    prompts: all eight share the slots (taking the smallest first and stopping at the first that did not fit kept
    the two short ones and left the six to decode one by one)."""
    import itertools

    from glimpse.pipeline.batch_kv import WASTE, _need

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    text = lambda repeats: [{"role": "user", "content": "Read. " + "The sea is calm. " * repeats}]  # noqa: E731
    with torch.inference_mode():
        for mix in ((0, 0, 6, 6, 6, 6, 6, 6), (0, 0, 0, 0, 0, 0, 30, 30), (1, 3, 6, 12, 30), (0, 12, 12, 30, 30)):
            requests = [engine.start(text(k), "none", 0.0, 8, Sampling()) for k in mix]
            needs = [_need(r) for r in requests]
            best = max((len(subset), sum(needs[i] for i in subset))
                       for count in range(1, len(mix) + 1) for subset in itertools.combinations(range(len(mix)), count)
                       if count * max(needs[i] for i in subset) <= WASTE * sum(needs[i] for i in subset))
            batch = BatchKV.form(requests)
            taken = [next(i for i, r in enumerate(requests) if r is member) for member in batch.requests]
            assert (len(taken), sum(needs[i] for i in taken)) == best, (mix, needs, taken)
            if mix[:2] == (0, 0) and mix[2] == 6:
                assert len(taken) == 8
            serve_step([batch], [])  # the slots go: the next mix forms its own


def test_requests_too_different_for_one_batch_decode_in_slot_groups(deep_checkpoints, monkeypatch):
    """Six short questions beside two long prompts do not fit one batch (``WASTE``): the two long ones take a slot
    group of their own, so every step attends in two calls per layer, one per group, and no request attends on its
    own cache. Each group forms once: before 2026-12-02 one batch of slots existed at a time, the two decoded
    request by request, and the batch formed again at every step (a copy of every member's entries), because
    requests outside it looked like newcomers that fit no free slot. The answers and KV are those of decoding
    every request on its own cache."""
    from glimpse.pipeline.batch_kv import WASTE, _need

    engine = _endless(load_engine(str(deep_checkpoints["llava"]), device="cpu"))
    text = lambda repeats: [{"role": "user", "content": "Read. " + "The sea is calm. " * repeats}]  # noqa: E731
    conversations = [text(0)] * 6 + [text(30)] * 2
    with torch.inference_mode():
        needs = [_need(engine.start(c, "none", 0.0, 8, Sampling())) for c in conversations]
    assert len(needs) * max(needs) > WASTE * sum(needs)  # they do not fit one batch
    engine.decode_slots = False
    own = engine.generate_batch(conversations, policy="none", max_new_tokens=8)
    engine.decode_slots = True
    seen = _spy_slots(monkeypatch)
    alone = []
    decode_attention = Engine.decode_attention
    monkeypatch.setattr(Engine, "decode_attention",
                        lambda self, *args: (alone.append(1), decode_attention(self, *args))[1])
    grouped = engine.generate_batch(conversations, policy="none", max_new_tokens=8)
    assert sorted(members for members, _ in seen["formed"]) == [2, 6]
    assert seen["calls"] == 2 * 7 * DEEP_LAYERS and not alone  # two groups, every step after the first token
    assert engine.slot_groups == []
    for one, other in zip(grouped, own):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes_per_step"] == other.metrics["kv_bytes_per_step"]


def test_slot_groups_keep_serving_as_requests_come_and_go(deep_checkpoints):
    """Between steps the groups serve who is left: a group whose members all left goes and the other keeps its
    slots (no copy), a newcomer takes a free slot of the group it fits, and one that fits no free slot makes every
    group form again, together: the best grouping of all of them."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    text = lambda repeats: [{"role": "user", "content": "Read. " + "The sea is calm. " * repeats}]  # noqa: E731
    with torch.inference_mode():
        short = [engine.start(text(0), "none", 0.0, 8, Sampling()) for _ in range(4)]
        long = [engine.start(text(30), "none", 0.0, 8, Sampling()) for _ in range(3)]
        groups = form_groups(short[:3] + long[:1])  # a long one beside three short would make 4 slots of its length
        short_group, long_group = groups
        assert short_group.members == short[:3] and long_group.members == long[:1]
        assert serve_step(groups, short[:2] + long[:1]) == groups  # a short one left: its slot is free
        assert serve_step(groups, short[:2] + long[:1] + short[3:]) == groups  # and a short newcomer takes it
        assert short_group.members == [short[0], short[1], short[3]]
        # The long one leaves as another arrives: the newcomer takes the slot freed in the same step.
        assert serve_step(groups, short[:2] + short[3:] + long[1:2]) == groups and long_group.members == long[1:2]
        served = serve_step(groups, short[:2] + short[3:])  # the long one is done: its group goes, the other stays
        assert served == [short_group] and short_group.members == [short[0], short[1], short[3]]
        assert serve_step(served, short[:2] + short[3:] + long[2:]) is None  # a long newcomer fits no free slot
        assert [g.members for g in form_groups(short[:2] + short[3:] + long[2:])] == [short[:2] + short[3:], long[2:]]


def test_a_free_slot_beside_a_larger_group_waits_as_long_as_forming_every_group_again_would_cost(deep_checkpoints):
    """Rent or buy, with groups: a free slot is given back once it has cost (its room at every step) twice what
    forming again copies, and forming again copies every group. A short question's free slot beside a long
    prompt's group therefore waits more than the two steps per slot it would wait in a batch of its own."""
    from glimpse.pipeline.batch_kv import FREE_STEPS_PER_SLOT

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    text = lambda repeats: [{"role": "user", "content": "Read. " + "The sea is calm. " * repeats}]  # noqa: E731
    with torch.inference_mode():
        short = [engine.start(text(0), "none", 0.0, 8, Sampling()) for _ in range(3)]
        long = engine.start(text(30), "none", 0.0, 8, Sampling())
        groups = form_groups(short + [long])
        short_group = groups[0]
        patience = FREE_STEPS_PER_SLOT * sum(g._room() for g in groups) // (short_group._room() // 3)
        assert patience > FREE_STEPS_PER_SLOT * 3
        for _ in range(patience):  # the third short question left: its slot waits for a newcomer
            assert serve_step(groups, short[:2] + [long]) == groups
        assert serve_step(groups, short[:2] + [long]) is None  # and then goes back: every group forms again


@pytest.mark.parametrize("reader", [False, True])
def test_st3_evicting_from_kv_slots_gives_the_memory_back(deep_checkpoints, media, monkeypatch, reader):
    """ST3 anneals the visual KV away during the answer: in slots its evictions are hidden (masked by rank), and
    once the slots are more than twice what the requests need they are formed again, smaller, the hidden entries
    left behind; the annealing goes on in the new slots. The answers and KV counts are those of decoding on each
    request's own cache, where evicted entries go at once — also when something reads the entries between steps
    (``reader``), which removes the hidden ones from the slot there and then."""
    engine = load_engine(str(deep_checkpoints["qwen2_vl"]), device="cpu")
    conversations = [[{"role": "user", "content": [{"type": "video", "video": str(media["video"])},
                                                   {"type": "text", "text": "What happens?"}]}]] * 2
    engine.decode_slots = False
    own = engine.generate_batch(conversations, policy=ST3(anneal_tau=10.0), max_new_tokens=14, ignore_eos=True)
    engine.decode_slots = True
    seen = _spy_slots(monkeypatch)
    if reader:
        step = Engine.decode_step

        def read_every_layer_first(self, running):
            for request in running:
                for layer in request.ctx.cache.layers:
                    layer.index  # noqa: B018 — a read: the hidden entries leave storage
            return step(self, running)

        monkeypatch.setattr(Engine, "decode_step", read_every_layer_first)
    slotted = engine.generate_batch(conversations, policy=ST3(anneal_tau=10.0), max_new_tokens=14, ignore_eos=True)
    rooms = [room for _, room in seen["formed"]]
    assert len(rooms) >= 2 and rooms[-1] < rooms[0] / 2
    for one, other in zip(slotted, own):
        assert one.token_ids == other.token_ids
        assert one.metrics["visual_kv_per_step"] == other.metrics["visual_kv_per_step"]
        assert one.metrics["kv_bytes_per_step"] == other.metrics["kv_bytes_per_step"]
    series = slotted[0].metrics["visual_kv_per_step"]
    assert series[-1] == 0 and len(set(series)) > 5  # annealed step by step, to nothing


def test_a_request_that_arrives_takes_a_freed_slot_and_a_finished_batch_frees_its_slots_at_once(
        deep_checkpoints, media, monkeypatch):
    """Continuous batching: a request that leaves frees its slot and one that arrives takes it (a copy of its own
    entries, not a new batch); the free slot takes no part in the answers, and one nobody takes goes back after two
    steps per slot. When the batch is done its slots are freed at once, not when the garbage collector next runs
    (no reference cycle holds them)."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    question = [{"role": "user", "content": "Say hi."}]
    with torch.inference_mode():
        first, second, third, fourth = (engine.start(question, "none", 0.0, 8, Sampling()) for _ in range(4))
        batch = BatchKV.form([first, second, third])
        room = batch._room()
        assert serve_step([batch], [first, third]) == [batch]  # the second left: its slot is free, the batch stays
        assert batch.members == [first, third] and not batch.all_slots
        assert serve_step([batch], [first, third, fourth]) == [batch]  # the fourth arrived: it takes the free slot
        assert batch.members == [first, fourth, third] and batch.all_slots and batch._room() == room
        assert all(batch.holds(layer) for layer in fourth.ctx.cache.layers)
        # Two of three left: their slots wait for newcomers (a server's clients come and go) ...
        for _ in range(FREE_STEPS_PER_SLOT * 3 - 1):
            assert serve_step([batch], [first]) == [batch]
        # ... one that comes in that time takes a slot without a new batch ...
        fifth = engine.start(question, "none", 0.0, 8, Sampling())
        assert serve_step([batch], [first, fifth]) == [batch]
        assert batch.members == [first, fifth] and batch._room() == room
        # ... and once the other slot has been free for two steps per slot, its memory goes back: form anew.
        assert serve_step([batch], [first, fifth]) is None
    seen = _spy_slots(monkeypatch)
    formed = []
    init = BatchKV.__init__

    def keep_a_weak_reference(self, requests):
        init(self, requests)
        formed.append(weakref.ref(self.keys[0]))

    monkeypatch.setattr(BatchKV, "__init__", keep_a_weak_reference)
    gc.disable()
    try:
        results = engine.generate_batch([question, _messages(media)], policy="none", max_new_tokens=6)
        del results
        assert formed and all(slot() is None for slot in formed)
    finally:
        gc.enable()
    assert seen["calls"] > 0


def test_a_stream_its_client_leaves_gives_its_slots_back(deep_checkpoints, media):
    """A client that drops its stream mid-answer closes the generator: the engine lets go of the KV slots then,
    not at the next request."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    stream = engine.stream(_messages(media), policy="none", max_new_tokens=20, ignore_eos=True)
    next(stream), next(stream), next(stream)  # decoding, in slots
    assert engine.slot_groups
    stream.close()
    assert engine.slot_groups == []
    assert not engine._lock.locked()


# ---------------------------------------------------------------------------- the fixed-shape step (decode_graph.py)
@pytest.mark.parametrize("arch,policy,speed", [("llava", "none", 0.0), ("qwen2_vl", "none", 0.0),
                                               ("qwen2_vl", "divprune", 1.0), ("llava", "st3", 1.0)])
def test_the_fixed_shape_decode_step_answers_as_the_slots_do(deep_checkpoints, media, monkeypatch, arch, policy, speed):
    """The step a CUDA graph captures (every slot, whole room, masked; inputs from buffers) gives each request
    the tokens, logits and KV of the eager slot step, with prompts of different lengths and (Qwen2-VL) 3-row
    positions. It serves every step in which no policy scores during decode: ST3's annealing too, whose evicted
    entries it masks out by their ranks."""
    from glimpse.pipeline.decode_graph import SlotStep

    engine = load_engine(str(deep_checkpoints[arch]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}],
                     [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                   {"type": "text", "text": "What colours? Answer at length."}]}]]
    eager = engine.generate_batch(conversations, policy=policy, speed=speed, max_new_tokens=8, ignore_eos=True)
    steps = []
    forward = SlotStep.forward
    monkeypatch.setattr(SlotStep, "forward", lambda self, *a: (steps.append(self), forward(self, *a))[1])
    engine.decode_graphs = True
    fixed = engine.generate_batch(conversations, policy=policy, speed=speed, max_new_tokens=8, ignore_eos=True)
    assert len(steps) == 7  # every step after the first token
    for one, other in zip(fixed, eager):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes"] == other.metrics["kv_bytes"]
        assert one.metrics["visual_kv_per_step"] == other.metrics["visual_kv_per_step"]


def test_slot_groups_decode_in_one_fixed_shape_step_as_on_their_own_caches(deep_checkpoints, media, monkeypatch):
    """Short text questions beside long image prompts make two slot groups; the fixed-shape step (a CUDA graph on
    a GPU) computes both in one step, each group attending over its own slots, ST3's evicted entries masked by
    rank in the group that has them: the answers and KV counts of decoding every request on its own cache."""
    from glimpse.pipeline.decode_graph import SlotStep

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    long = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                         {"type": "text", "text": "Read. " + "The sea is calm. " * 30}]}]
    conversations = [[{"role": "user", "content": "Say hi."}]] * 6 + [long] * 2
    engine.decode_slots = False
    own = engine.generate_batch(conversations, policy=ST3(anneal_tau=4), max_new_tokens=8, ignore_eos=True)
    engine.decode_slots = True
    steps = []
    forward = SlotStep.forward
    monkeypatch.setattr(SlotStep, "forward", lambda self, *a: (steps.append(self), forward(self, *a))[1])
    engine.decode_graphs = True
    fixed = engine.generate_batch(conversations, policy=ST3(anneal_tau=4), max_new_tokens=8, ignore_eos=True)
    assert len(steps) == 7 and all(len(step.spans) == 2 for step in steps)  # every step, both groups in it
    assert steps[0].limits is not None  # one group's requests anneal, the other's have no visual entries
    for one, other in zip(fixed, own):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes_per_step"] == other.metrics["kv_bytes_per_step"]
        assert one.metrics["visual_kv_per_step"] == other.metrics["visual_kv_per_step"]
    assert fixed[-1].metrics["visual_kv_per_step"][-1] == 0 < fixed[-1].metrics["visual_kv_per_step"][0]


@pytest.mark.parametrize("make_policy", [lambda: ST3(anneal_tau=3), lambda: ST3(anneal_tau=5, anneal="linear"),
                                         lambda: ZipVL(tau_image=0.9, tau_video=0.9)])
def test_policies_that_work_between_steps_decode_in_the_fixed_shape_step_as_on_their_own_caches(
        deep_checkpoints, media, monkeypatch, make_policy):
    """ST3 evicts visual KV before every step until its annealing has removed all of it (step tau); ZipVL without
    packed KV does nothing in decode. Neither works inside a step, so every step is the fixed-shape one (a CUDA
    graph on a GPU). ST3's evicted entries are only hidden in the slots (masked by rank, freed when the batch
    forms again): the answers and KV counts are those of decoding each request on its own cache, where evicted
    entries are removed at once."""
    from glimpse.pipeline.decode_graph import SlotStep

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}]]
    engine.decode_slots = False  # each request attends over its own cache: evictions remove entries at once
    own = engine.generate_batch(conversations, policy=make_policy(), max_new_tokens=8, ignore_eos=True)
    engine.decode_slots = True
    steps = []
    forward = SlotStep.forward
    monkeypatch.setattr(SlotStep, "forward", lambda self, *a: (steps.append(self), forward(self, *a))[1])
    engine.decode_graphs = True
    fixed = engine.generate_batch(conversations, policy=make_policy(), max_new_tokens=8, ignore_eos=True)
    assert len(steps) == 7  # decode steps g = 1 .. 7 (they feed tokens 1 .. 7)
    for one, other in zip(fixed, own):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes"] == other.metrics["kv_bytes"]
        assert one.metrics["visual_kv_per_step"] == other.metrics["visual_kv_per_step"]
    policy = make_policy()
    if isinstance(policy, ST3):  # the annealing removed every visual entry by step tau, and some before
        tau = int(policy.anneal_tau)
        series = fixed[0].metrics["visual_kv_per_step"]
        assert series[tau - 1:] == [0] * (8 - tau) and 0 < series[1] < series[0]


@pytest.mark.parametrize("graphs", [False, True])
def test_zipvl_packed_kv_decodes_in_packed_slots_as_on_its_own_cache(deep_checkpoints, media, monkeypatch, graphs):
    """ZipVL's 4/2-bit KV in a batch's packed slots (one packed tensor per bit width and layer, a slot per request,
    dequantized at once for the batch): the tokens and KV bytes per step of decoding each request on its own cache,
    across windows of new tokens packed as the answer goes (every 3 here): a packed window moves a cache out of
    its slots, and it takes one again. With the fixed-shape step, every step that fills no window is one (a CUDA
    graph on a GPU); those that fill one score inside the step and run eagerly."""
    from glimpse.pipeline.decode_graph import SlotStep

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    conversations = [_messages(media), [{"role": "user", "content": "Write one line about the sea."}],
                     [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                   {"type": "text", "text": "What colours? Answer at length."}]}]]
    packed = lambda: dataclasses.replace(ZipVL.from_speed(0.5), requantize_every=3)  # noqa: E731
    engine.decode_slots = False
    own = engine.generate_batch(conversations, policy=packed(), max_new_tokens=10, ignore_eos=True)
    engine.decode_slots = True
    seen = _spy_slots(monkeypatch)
    parts = []
    init = BatchKV.__init__
    monkeypatch.setattr(BatchKV, "__init__", lambda self, requests: (init(self, requests),
                                                                     parts.append(list(self.parts[0])))[0])
    adopted = []
    adopt = LayerKV.adopt_packed
    monkeypatch.setattr(LayerKV, "adopt_packed", lambda self, *a, **k: (adopted.append(self), adopt(self, *a, **k))[1])
    steps = []
    forward = SlotStep.forward
    monkeypatch.setattr(SlotStep, "forward", lambda self, *a: (steps.append(self), forward(self, *a))[1])
    engine.decode_graphs = graphs
    slotted = engine.generate_batch(conversations, policy=packed(), max_new_tokens=10, ignore_eos=True)
    assert parts and all(bits == [4, 2] for bits in parts)  # the members' packed entries had packed slots
    assert seen["calls"] > 0 and len(adopted) > 2 * len(conversations) * DEEP_LAYERS  # back in slots after windows
    for one, other in zip(slotted, own):
        assert one.token_ids == other.token_ids
        assert one.metrics["kv_bytes_per_step"] == other.metrics["kv_bytes_per_step"]
    # Steps g = 1 .. 9: those whose new entry is a window's third (g = 3, 6, 9) score inside the step.
    assert len(steps) == (6 if graphs else 0)


def test_a_packed_decode_step_in_slots_runs_the_same_operators_for_any_batch_size(deep_checkpoints, media):
    """What a batch of ZipVL requests costs the host per step beyond the unpruned step does not grow with the
    batch: its packed slots are dequantized and attended at once (per request it ran about 80 operators a layer,
    the host's bound on a GPU). Counted with torch's dispatcher, one step after the first."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    counts = {}
    step = Engine.decode_step

    def counted(policy, batch):
        seen = []

        def spy(self, running):
            if len(seen) == 2:
                with OperatorCount() as operators:
                    step(self, running)
                counts[policy, batch] = operators.count
            seen.append(1)
            if len(seen) != 3:
                step(self, running)

        Engine.decode_step = spy
        try:
            engine.generate_batch([_messages(media)] * batch, policy=policy, speed=0.5, max_new_tokens=6,
                                  ignore_eos=True)
        finally:
            Engine.decode_step = step

    for policy in ("none", "zipvl"):
        for batch in (2, 4):
            counted(policy, batch)
    assert counts["zipvl", 4] - counts["zipvl", 2] == counts["none", 4] - counts["none", 2]
    assert counts["zipvl", 2] > counts["none", 2]  # it does dequantize


def test_the_fixed_shape_step_serves_requests_that_come_and_go(deep_checkpoints, media, monkeypatch):
    """Continuous batching with the fixed-shape step: requests that finish — or whose client leaves mid-answer —
    free their slots (whose rows the step then computes and drops) and later ones take them; every answer is
    the one it gets alone."""
    from glimpse.pipeline.scheduler import Scheduler

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    question = [{"role": "user", "content": "Say hi."}]
    cases = [(question, 3), (_messages(media), 9), (question, 5), (question, 7), (_messages(media), 4)]
    alone = [engine.generate(c, policy="none", max_new_tokens=n, ignore_eos=True) for c, n in cases]
    from glimpse.pipeline.decode_graph import SlotStep

    full = []  # per fixed-shape step: whether every slot was taken
    run = SlotStep.run
    monkeypatch.setattr(SlotStep, "run", lambda self, engine, groups: (
        full.append(all(group.all_slots for group in groups)), run(self, engine, groups))[1])
    engine.decode_graphs = True
    scheduler = Scheduler(engine, max_batch=3, queue_size=8, start=False)  # all queued before the loop runs
    leaving = scheduler.submit(question, policy="none", max_new_tokens=40, ignore_eos=True)
    tickets = [scheduler.submit(c, policy="none", max_new_tokens=n, ignore_eos=True) for c, n in cases]
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        chunks = leaving.chunks(timeout=60)
        next(chunks), next(chunks), next(chunks)
        leaving.cancel.set()  # its client left
        left = [c for c in chunks][-1].result
        results = [t.result(timeout=120) for t in tickets]
    finally:
        scheduler.close()
        loop.join(timeout=60)
    assert left.finish_reason == "cancelled" and len(left.token_ids) < 40
    assert max(r.metrics["batch_size"] for r in results) == 3
    assert True in full and False in full  # steps with every slot taken, and with a freed one
    for together, single in zip(results, alone):
        assert together.token_ids == single.token_ids


@pytest.mark.parametrize("graphs", [False, True])
def test_clients_leaving_two_slot_groups_mid_answer_free_their_slots_and_the_others_answer_as_alone(
        deep_checkpoints, monkeypatch, graphs):
    """A served batch too mixed for one batch of slots (short questions beside long prompts: two slot groups), and
    one client of each group leaves mid-answer (its stream cancels on its third chunk, from the scheduler's own
    thread, so at a known step). From the next step on neither leaver holds a slot, the groups keep serving the
    others, every other answer is the one it gets alone, and a request sent afterwards is served as alone too."""
    from glimpse.pipeline.scheduler import Scheduler

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    short = [{"role": "user", "content": "Read. "}]
    long = [{"role": "user", "content": "Read. " + "The sea is calm. " * 30}]
    cases = [(short, 14), (short, 11), (long, 12), (long, 9)]
    later = (long, 6)
    alone = [engine.generate(c, policy="none", max_new_tokens=n, ignore_eos=True) for c, n in [*cases, later]]
    steps = []  # per decode step: the members of each slot group, by id
    decode_step = Engine.decode_step
    monkeypatch.setattr(Engine, "decode_step", lambda self, running: (
        decode_step(self, running), steps.append([{id(r) for r in g.members} for g in self.slot_groups]))[0])
    engine.decode_graphs = graphs
    scheduler = Scheduler(engine, max_batch=8, queue_size=8, start=False)  # all queued before the loop runs
    left, cancelled_at = {}, {}

    def leave_on_third_chunk(name):
        seen = []

        def sink(chunk):
            seen.append(chunk)
            if len(seen) == 3:
                cancelled_at[name] = len(steps)  # the client leaves after this many steps
                tickets[name].cancel.set()
            if getattr(chunk, "result", None) is not None:
                left[name] = chunk.result
        return sink

    tickets = {}
    for name, conversation in (("short", short), ("long", long)):
        tickets[name] = scheduler.submit(conversation, policy="none", max_new_tokens=60, ignore_eos=True,
                                         sink=leave_on_third_chunk(name))
    staying = [scheduler.submit(c, policy="none", max_new_tokens=n, ignore_eos=True) for c, n in cases]
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        results = [t.result(timeout=120) for t in staying]
        after = scheduler.submit(later[0], policy="none", max_new_tokens=later[1], ignore_eos=True).result(timeout=120)
    finally:
        scheduler.close()
        loop.join(timeout=60)
    assert sorted(left) == ["long", "short"]
    for name, ticket in tickets.items():
        assert left[name].finish_reason == "cancelled" and len(left[name].token_ids) < 60
        leaver, at = id(ticket.request), cancelled_at[name]
        assert len(steps[at - 1]) == 2 and any(leaver in group for group in steps[at - 1])  # two groups, it in one
        assert not any(leaver in group for step in steps[at + 1:] for group in step)  # its slot freed
        assert any(len(step) == 2 for step in steps[at + 1:])  # and both groups decoded on
    for together, single in zip([*results, after], alone):
        assert together.token_ids == single.token_ids


@pytest.mark.parametrize("graphs", [False, True])
def test_st3_requests_come_and_go_beside_other_policies_and_answer_as_alone(deep_checkpoints, media, graphs):
    """Continuous batching with ST3 annealing in the slots beside unpruned, ZipVL (packed, on its own cache) and
    prefill-only requests: requests arrive while others anneal, one leaves mid-answer; every answer and its visual
    KV per step are what the request gets alone. A batch formed without ranked entries takes no ST3 newcomer into
    a free slot (its step has no rank mask): the batch forms again."""
    from glimpse.pipeline.scheduler import Scheduler

    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    image, question = _messages(media), [{"role": "user", "content": "Say hi."}]
    with torch.inference_mode():
        plain = [engine.start(image, "none", 0.0, 8, Sampling()) for _ in range(4)]
        annealing = engine.start(image, ST3(anneal_tau=4.0), 0.0, 8, Sampling())
        annealing.policy.decode_step(1, annealing.ctx)  # ranks its visual entries, as its first decode step does
        batch = BatchKV.form(plain[:3])
        assert batch.ranks is None and serve_step([batch], [plain[0], plain[1], annealing]) is None
        batch = BatchKV.form(plain[:3])
        # An unranked newcomer takes the free slot.
        assert serve_step([batch], [plain[0], plain[1], plain[3]]) == [batch]
        assert BatchKV.form([plain[0], annealing]).ranks is not None
    cases = [(question, "none", 0.0, 6), (image, ST3(anneal_tau=4.0), 0.0, 9), (image, "zipvl", 1.0, 7),
             (image, "st3", 1.0, 5), (question, "none", 0.0, 8), (image, ST3(anneal_tau=6.0, anneal="linear"), 0.0, 10),
             (image, "divprune", 1.0, 6)]
    alone = [engine.generate(c, policy=p, speed=s, max_new_tokens=n, ignore_eos=True) for c, p, s, n in cases]
    engine.decode_graphs = graphs
    scheduler = Scheduler(engine, max_batch=4, queue_size=16, start=False)  # all queued before the loop runs
    leaving = scheduler.submit(image, policy=ST3(anneal_tau=5.0), max_new_tokens=40, ignore_eos=True)
    tickets = [scheduler.submit(c, policy=p, speed=s, max_new_tokens=n, ignore_eos=True) for c, p, s, n in cases]
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        chunks = leaving.chunks(timeout=60)
        next(chunks), next(chunks), next(chunks)
        leaving.cancel.set()  # its client left while it annealed
        left = [c for c in chunks][-1].result
        results = [t.result(timeout=120) for t in tickets]
    finally:
        scheduler.close()
        loop.join(timeout=60)
    assert left.finish_reason == "cancelled"
    assert max(r.metrics["batch_size"] for r in results) == 4
    for together, single in zip(results, alone):
        assert together.token_ids == single.token_ids
        assert together.metrics["visual_kv_per_step"] == single.metrics["visual_kv_per_step"]


def test_a_layer_s_visual_entry_count_follows_appends_written_entries_and_evictions():
    """The count every decode step records (the metrics' visual KV): kept as records come, written in place or
    appended, and recounted after an eviction — always the number of image and video entries the layer holds."""
    from glimpse.common import Modality

    generator = torch.Generator().manual_seed(0)
    layer, held = LayerKV(), []  # held: the modality of each entry, in storage order
    next_index = 0
    for step in range(60):
        action = step % 5
        if action in (0, 1, 2):  # append a few or many (a prefill's records, a decode step's, revived rows)
            n = [1, 3, 100][action]
            modality = torch.randint(0, 3, (n,), generator=generator)
            layer.append(torch.randn(1, 1, n, 4), torch.randn(1, 1, n, 4))
            layer.add_records(torch.arange(next_index, next_index + n), modality)
            held += modality.tolist()
            next_index += n
        elif action == 3 and held:  # an entry written in place by a batched step
            # The slot's owner writes the entry into the room after the last one, then says so.
            layer._key.buffer = torch.cat([layer._key.view(), torch.randn(1, 1, 1, 4)], dim=-2)
            layer._value.buffer = torch.cat([layer._value.view(), torch.randn(1, 1, 1, 4)], dim=-2)
            kind = int(torch.randint(0, 3, (1,), generator=generator))
            layer.written_in_place(next_index, kind)
            held.append(kind)
            next_index += 1
        elif held:  # ST3's eviction: keep a random half
            rows = torch.sort(torch.randperm(len(held), generator=generator)[: len(held) // 2]).values
            layer.keep(rows)
            held = [held[i] for i in rows.tolist()]
        assert layer.visual_entries() == sum(m != Modality.TEXT for m in held), step
    assert layer.modality.tolist() == held

    # Reading it after a decode step's append runs no operator (it is read at every step, for every layer).
    layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    layer.add_records(torch.tensor([next_index]), torch.tensor([Modality.TEXT]))

    with torch.no_grad(), OperatorCount() as operators:
        assert layer.visual_entries() == sum(m != Modality.TEXT for m in held)
    assert operators.count == 0


def _ranked_layer(seed: int, slot: bool):
    """A layer of 12 entries, tokens 2-8 visual and ranked (5 first, then 2, 8, 3, 7, 4, 6), optionally in a slot."""
    from glimpse.common import Modality

    generator = torch.Generator().manual_seed(seed)
    layer = LayerKV()
    layer.append(torch.randn(1, 2, 12, 4, generator=generator), torch.randn(1, 2, 12, 4, generator=generator))
    modality = torch.zeros(12, dtype=torch.long)
    modality[2:9] = Modality.IMAGE
    layer.add_records(torch.arange(12), modality)
    layer.rank_visual(torch.tensor([5, 2, 8, 3, 7, 4, 6]))
    owner = object()
    if slot:
        layer.adopt(torch.zeros(1, 2, 20, 4), torch.zeros(1, 2, 20, 4), owner)
    return layer, owner


def test_annealing_in_a_slot_hides_entries_at_once_with_no_operator_and_removes_them_when_read():
    """ST3's eviction in a decode batch's slot: the layer's counts (entries, bytes, visual entries) drop at once,
    and it runs no tensor operator (nothing per layer and request on the host, and the step keeps its shapes);
    the entries leave storage when anything reads the layer, compacted in place in the slot, and what is read then
    is what removing them at once gives. Outside a slot they go at once. Never more is kept than before."""
    in_slot, owner = _ranked_layer(0, slot=True)
    alone, _ = _ranked_layer(0, slot=False)
    with torch.no_grad(), OperatorCount() as operators:
        in_slot.keep_top_visual(3)
        counts = len(in_slot), in_slot.visual_entries(), in_slot.nbytes(), in_slot.slot_length()
    assert operators.count == 0
    alone.keep_top_visual(3)
    assert alone.slot_length() == 8  # removed at once: 5 text entries and tokens 5, 2, 8
    assert counts == (8, 3, alone.nbytes(), 12)  # counted as gone, still stored
    assert in_slot.index.tolist() == alone.index.tolist() == [0, 1, 2, 5, 8, 9, 10, 11]
    assert in_slot.slot_length() == 8 and in_slot.slot_of(owner)  # compacted in its slot
    assert torch.equal(in_slot.key, alone.key) and torch.equal(in_slot.value, alone.value)
    in_slot.keep_top_visual(5)  # more than it keeps: nothing comes back
    assert len(in_slot) == 8 and in_slot.visual_entries() == 3
    in_slot.keep_top_visual(0)
    assert in_slot.modality.tolist() == [0] * 5 and in_slot.index.tolist() == [0, 1, 9, 10, 11]


def test_each_record_names_its_entry_after_packed_entries_move_into_a_slots_packed_tensors():
    """A layer's records say, per stored entry, which token it is (policies find entries through them). Joining a
    decode batch moves packed entries into one packed tensor per bit width, so segments of the same width written
    apart (4-bit, 2-bit, 4-bit: ZipVL's windows) come together: every record must still name its own entry."""
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(1, 2, 10, 32, generator=g), torch.randn(1, 2, 10, 32, generator=g)
    layer = LayerKV()
    layer.append(key, value)
    layer.add_records(torch.arange(10), torch.zeros(10, dtype=torch.long))
    layer.pack(torch.tensor([1, 6]), 4, 32)
    layer.pack(torch.tensor([0, 2]), 2, 32)
    layer.pack(torch.tensor([0]), 4, 32)
    before_keys, before_values = layer.keys_values()
    by_token = {int(t): (before_keys[:, :, i], before_values[:, :, i]) for i, t in enumerate(layer.index)}
    parts = {}
    for bits in (4, 2):
        k, v = next((k, v) for k, v in layer.packed if k.bits == bits)
        parts[bits] = (k.slots(1, 8), v.slots(1, 8))
    layer.adopt_packed(parts, owner=object())
    keys, values = layer.keys_values()
    assert sorted(layer.index.tolist()) == list(range(10))
    for i, token in enumerate(layer.index.tolist()):
        assert torch.equal(keys[:, :, i], by_token[token][0]) and torch.equal(values[:, :, i], by_token[token][1])


def test_a_slots_mask_shows_exactly_the_entries_its_annealed_layer_still_holds():
    """ST3's evictions in a slot are hidden by rank (``slot_mask``): after keeping the 3 best ranked visual entries,
    the step sees exactly the entries the layer says it holds, which are those removing the rest at once leaves:
    the entry ranked 3 (the first one past what is kept) hidden too."""
    from glimpse.pipeline.batch_kv import slot_mask
    from glimpse.pipeline.cache import UNRANKED

    in_slot, _ = _ranked_layer(0, slot=True)
    alone, _ = _ranked_layer(0, slot=False)
    row = torch.full((20,), UNRANKED, dtype=torch.int32)
    in_slot.show_ranks(row)
    for count in (5, 3, 0):
        in_slot.keep_top_visual(count)
        alone.keep_top_visual(count)
        mask = slot_mask(torch.tensor([11]), 12, torch.float32, row[None],
                         torch.tensor([in_slot.rank_limit], dtype=torch.int32))
        visible = (mask[0, 0, 0] == 0).nonzero().squeeze(1).tolist()  # stored at their token's position
        assert len(visible) == len(in_slot)
        assert visible == alone.index.tolist()


def test_a_newcomer_larger_than_a_free_slot_does_not_take_it_and_the_batch_forms_again(deep_checkpoints):
    """A free slot is taken only by a request whose entries and answer room fit it: a long prompt arriving where a
    short question left fits no free slot, so the step's slots form again (``serve_step`` is None), and the slots
    of the new groups hold every request."""
    engine = load_engine(str(deep_checkpoints["llava"]), device="cpu")
    text = lambda repeats: [{"role": "user", "content": "Read. " + "The sea is calm. " * repeats}]  # noqa: E731
    with torch.inference_mode():
        short = [engine.start(text(0), "none", 0.0, 8, Sampling()) for _ in range(3)]
        long = engine.start(text(30), "none", 0.0, 8, Sampling())
        batch = BatchKV.form(short)
        assert serve_step([batch], short[:2]) == [batch]  # the third left: its slot is free
        assert serve_step([batch], short[:2] + [long]) is None  # too large for it
        assert not any(batch.holds(layer) for layer in long.ctx.cache.layers)
        groups = form_groups(short[:2] + [long])
        assert all(any(g.holds(layer) for g in groups) for r in short[:2] + [long] for layer in r.ctx.cache.layers)
