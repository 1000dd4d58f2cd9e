"""Prefill pruning: each policy does what its paper defines, speed 0 is exact, and physically
dropping tokens equals masking them."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ARCHS, DEEP_LAYERS
from glimpse.pipeline import load_engine
from glimpse.pipeline.adapters import TEXT
from glimpse.pruning import DASH, DivPrune, POLICIES, FastV, Frontier, HiDivDrop, LazyLLM, NoPruning, Pipeline, Point, ST3, ZipVL, make_policy
from glimpse.pruning.frontier import design_pipeline_members
from glimpse.pruning.zipvl import important_count
from tiny_models import masked_reference, reference_inputs

@pytest.fixture(scope="module")
def deep(deep_checkpoints) -> dict:
    return deep_checkpoints


def _image_messages(media, question="What is in this picture? Describe the image in detail."):
    return [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                         {"type": "text", "text": question}]}]


def _reference_attention(engine, prompt) -> tuple:
    """Every layer's full attention probabilities from transformers' own eager forward."""
    assert engine.attn_implementation == "eager"  # only eager attention returns probabilities
    inputs = reference_inputs(engine, prompt)
    with torch.no_grad():
        out = engine.model(**inputs, output_attentions=True)
    return out.attentions  # per layer (1, heads, T, T)


def _visual(prompt) -> torch.Tensor:
    return (prompt.modality != TEXT).nonzero().squeeze(1)


# ---------------------------------------------------------------------------------------- DASH
@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_dash_halts_exactly_the_lowest_attention_deltas_and_they_skip_every_deeper_layer(deep, media, arch):
    engine = load_engine(str(deep[arch]), device="cpu", attn="sdpa")
    prompt = engine.prepare(_image_messages(media))
    T, L = len(prompt), DEEP_LAYERS
    policy = DASH(rho=0.6, keep_first=3, keep_last=2)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    l_s = policy.params()["start_layer"]
    assert l_s == math.floor(0.4 * L)

    # Hand-computed score: ||U_t||_2 with U the attention output (after o_proj, before the
    # residual add) of layer l_s - 1 in transformers' own forward.
    captured = {}
    attn = engine.model.model.language_model.layers[l_s - 1].self_attn
    hook = attn.register_forward_hook(lambda m, args, out: captured.update(U=out[0][0]))
    try:
        with torch.no_grad():
            engine.model(**reference_inputs(engine, prompt))
    finally:
        hook.remove()
    delta = captured["U"].float().norm(dim=-1)
    eligible = torch.arange(3, T - 2)
    count = round(0.6 * (T - 5))
    expected_halted = eligible[delta[eligible].argsort()[:count]].sort().values

    assert policy.halted.tolist() == expected_halted.tolist()
    counts = [len(a) for a in ctx.active_per_layer]
    assert counts == [T] * l_s + [T - count] * (L - l_s)
    for layer_idx in range(l_s, L):  # no deeper layer receives a halted token, not even as a key
        assert not torch.isin(ctx.cache.layers[layer_idx].index, expected_halted).any()
    assert torch.isin(expected_halted, ctx.cache.layers[l_s - 1].index).all()


def test_dash_keeps_its_guards_and_halts_nothing_on_short_prompts(checkpoints, media):
    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, DASH(rho=0.6))  # default guards 64 + 32 cover the whole prompt
    assert [len(a) for a in ctx.active_per_layer] == [len(prompt)] * len(engine.adapter.layers)
    policy = DASH(rho=0.9, keep_first=10, keep_last=5)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    last = ctx.active_per_layer[-1].tolist()
    T = len(prompt)
    assert set(range(10)) | set(range(T - 5, T)) <= set(last)


# ---------------------------------------------------------------------------------------- ZipVL
def test_zipvl_p_is_the_fewest_tokens_reaching_tau():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=generator) * 3
    probs = logits.softmax(dim=-1)  # 6 probe rows over 40 tokens, each row sums to 1
    mass = probs.sum(dim=0).sort(descending=True).values
    for tau in (0.5, 0.8, 0.9, 0.96, 0.99):
        p = important_count(probs, tau)
        assert mass[:p].sum() >= tau * 6 - 1e-5
        assert p == 1 or mass[: p - 1].sum() < tau * 6
    assert important_count(probs, 1.0) == 40

    # A constructed pattern: every row puts 0.5 on token 0, 0.3 on token 1, the rest spread thin.
    pattern = torch.full((4, 10), 0.2 / 8)
    pattern[:, 0], pattern[:, 1] = 0.5, 0.3
    assert important_count(pattern, 0.5) == 1
    assert important_count(pattern, 0.8) == 2
    assert important_count(pattern, 0.81) == 3


def test_zipvl_important_tokens_are_eq_6_to_8_over_each_layers_full_attention(checkpoints, media):
    """Each layer's important set, recomputed from that layer's full attention matrix (the first layer's
    from transformers' own eager forward): the probe rows' mean over heads, p by Eq. 6, importance by Eq. 7
    (column sum over the probe rows that see the token), the top p by Eq. 8 with the last token always in."""
    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    T, tau = len(prompt), 0.9
    policy = ZipVL(tau_image=tau, recent_probes=8, random_probes=8)  # 16 probes of T, random ones among them
    seen = []
    choose = policy.attention_rows

    def recorded(layer_idx, ctx):
        rows = choose(layer_idx, ctx)
        seen.append((ctx.layer.queries.clone(), ctx.layer.keys.clone(), ctx.layer.scaling, rows))
        return rows

    policy.attention_rows = recorded
    with torch.no_grad():
        engine.prefill(prompt, policy)
    first_layer = _reference_attention(engine, prompt)[0][0].float()  # (heads, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for layer_idx, (queries, keys, scaling, rows) in enumerate(seen):
        keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
        full = (queries[0] @ keys[0].transpose(1, 2) * scaling).masked_fill(future, float("-inf")).softmax(dim=-1)
        if layer_idx == 0:
            assert torch.allclose(full, first_layer, atol=1e-5)
        probes = policy.probe_rows(layer_idx, T, "cpu")
        assert len(probes) == 16 and probes.unique().numel() == 16 and int(probes[-1]) == T - 1
        mass = full[:, probes].mean(dim=0).sum(dim=0)  # a_j: column sums of A' (they add up to the 16 rows)
        reached = mass.sort(descending=True).values.cumsum(dim=0) >= tau * 16 - 1e-6
        p = int(reached.float().argmax()) + 1  # Eq. 6: the fewest tokens whose mass reaches tau * r
        assert policy.telemetry["important_per_layer"][layer_idx] == p
        if p == T:
            assert rows is None
            continue
        importance = mass / (probes[:, None] >= torch.arange(T)[None, :]).sum(dim=0).clamp(min=1)  # Eq. 7
        expected = importance.topk(p).indices  # Eq. 8
        if T - 1 not in expected:
            expected[-1] = T - 1
        assert rows.tolist() == expected.sort().values.tolist()
    assert any(rows is not None for *_, rows in seen)  # some layer did restrict its attention


def test_zipvl_skips_attention_of_unimportant_tokens_while_their_ffn_runs(checkpoints, media):
    engine = load_engine(str(checkpoints["llava_next"]), device="cpu", attn="sdpa")
    prompt = engine.prepare(_image_messages(media))
    T = len(prompt)
    seen = {"q": [], "out": [], "mlp": []}
    layers = engine.adapter.layers
    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen["q"].append(a[0].shape[1]))
             for layer in layers]
    hooks += [layer.self_attn.register_forward_hook(lambda m, a, out: seen["out"].append(out[0][0].clone()))
              for layer in layers]
    hooks += [layer.mlp.register_forward_pre_hook(lambda m, a: seen["mlp"].append(a[0].shape[1])) for layer in layers]
    policy = ZipVL(tau_image=0.9)
    try:
        with torch.no_grad():
            _, ctx = engine.prefill(prompt, policy)
    finally:
        for hook in hooks:
            hook.remove()
    important = policy.telemetry["important_per_layer"]
    assert len(important) == len(layers) and min(important) < T
    assert seen["q"] == [T] * len(layers)  # queries/keys/values for every token (the cache holds them all)
    assert seen["mlp"] == [T] * len(layers)  # the FFN stays dense
    assert ctx.cache.lengths() == [T] * len(layers)
    for rows, p, out in zip(ctx.attention_per_layer, important, seen["out"]):
        assert rows is None if p == T else (len(rows) == p and int(rows[-1]) == T - 1)
        # an attention update for the important tokens only: the others' is exactly zero
        attends = (out != 0).any(dim=-1)
        assert attends.sum() == p and (rows is None or bool(attends[rows].all()))


def test_zipvl_with_tau_one_drops_nothing(checkpoints, media):
    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    messages = _image_messages(media)
    exact = engine.generate(messages, policy="none", max_new_tokens=6)
    result = engine.generate(messages, policy=ZipVL(tau_image=1.0), max_new_tokens=6)
    assert result.token_ids == exact.token_ids
    assert result.metrics["attention_tokens_per_layer"] == result.metrics["active_tokens_per_layer"]


def test_zipvl_takes_its_video_tau_for_a_prompt_with_a_video_and_its_image_tau_otherwise(checkpoints, media):
    """The paper sets tau by modality (0.975 video, 0.96 image): a video prompt under the image's tau was found
    only through the slider's printed table."""
    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    video = [{"role": "user", "content": [{"type": "video", "video": str(media["video"])},
                                          {"type": "text", "text": "What happens?"}]}]
    for messages, tau in ((_image_messages(media), 0.9), (video, 0.8)):
        policy = ZipVL(tau_image=0.9, tau_video=0.8)
        with torch.no_grad():
            engine.prefill(engine.prepare(messages), policy)
        assert policy.params()["tau"] == tau


# ---------------------------------------------------------------------------------------- ST3
@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_st3_keeps_the_eq9_share_of_visual_tokens_never_prunes_text_or_before_layer_3(deep, media, arch):
    engine = load_engine(str(deep[arch]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    visual = _visual(prompt)
    V, L = len(visual), DEEP_LAYERS
    policy = ST3(first_drop=0.5, end_keep=0.1)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    params = policy.params()
    P, R, S = params["first_drop"], params["drop_step"], params["stride"]
    C = 1 - math.floor((L - 3) / S) * R - P  # Eq. 9
    assert C == pytest.approx(0.1)

    def visual_count(active):
        return int(torch.isin(active, visual).sum())

    counts = [visual_count(a) for a in ctx.active_per_layer]
    assert counts[:4] == [V, V, V, V - math.floor(P * V)]  # nothing before layer 3, P at layer 3
    assert counts[-1] == V - math.floor((1 - C) * V + 1e-9)
    assert all(b <= a for a, b in zip(counts, counts[1:]))
    changes = [layer for layer in range(1, L) if counts[layer] != counts[layer - 1]]
    assert changes == [layer for layer in range(3, L) if (layer - 3) % S == 0]
    text = (prompt.modality == TEXT).nonzero().squeeze(1)
    for active in ctx.active_per_layer:
        assert torch.isin(text, active).all()  # text is never pruned

    # The first drop keeps the visual tokens the last token attended to most in layer 2.
    attention = _reference_attention(engine, prompt)[2][0, :, -1].mean(dim=0)
    dropped = visual[attention[visual].argsort()[: math.floor(P * V)]]
    assert set(ctx.active_per_layer[3].tolist()) == set(range(len(prompt))) - set(dropped.tolist())


def test_st3_paper_setting_ends_at_one_percent_on_32_layers():
    from glimpse.pruning.st3 import default_stride

    assert default_stride(32, 3) == 7
    policy = ST3.from_speed(1.0)
    assert (policy.first_drop, policy.end_keep) == (0.5, pytest.approx(0.01))
    # R = (1 - P - C) / floor((32 - 3) / 7) = 12.25%, the paper's value.
    assert (1 - policy.first_drop - policy.end_keep) / math.floor(29 / 7) == pytest.approx(0.1225)
    for depth in range(4, 81):
        stride = default_stride(depth, 3)
        assert len(range(3 + stride, depth, stride)) == math.floor((depth - 3) / stride)  # Eq. 9 is exact


# ---------------------------------------------------------------------------------------- LazyLLM
@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_lazyllm_keeps_the_right_percentile_per_pruning_layer_nested(deep, media, arch):
    engine = load_engine(str(deep[arch]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    T = len(prompt)
    policy = LazyLLM(percentiles=(0.3, 0.4, 0.5))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    layers = policy.params()["prune_layers"]
    assert layers == [3, 6, 9]  # 1/4, 1/2, 3/4 of 12 layers
    active = ctx.active_per_layer
    for before, after in zip(active, active[1:]):
        assert torch.isin(after, before).all()  # nested
    for layer, k in zip(layers, (0.3, 0.4, 0.5)):
        n = len(active[layer - 1])
        assert len(active[layer]) == math.ceil((1 - k) * n) == n - math.floor(k * n)
        pruned = active[layer - 1][~torch.isin(active[layer - 1], active[layer])]
        index, hidden = ctx.aux_cache.get(layer)
        assert sorted(index.tolist()) == sorted(pruned.tolist())  # their states wait in the Aux Cache
        assert hidden.shape == (len(pruned), engine.adapter.text_config.hidden_size)
    for layer in range(1, L := DEEP_LAYERS):
        if layer not in layers:
            assert len(active[layer]) == len(active[layer - 1])

    # The first pruning layer drops the lowest last-token attention (mean over heads) of layer 2.
    attention = _reference_attention(engine, prompt)[layers[0] - 1][0, :, -1].mean(dim=0)
    scores = attention.clone()
    scores[-1] = float("inf")
    dropped = scores.argsort()[: math.floor(0.3 * T)]
    assert set(active[layers[0]].tolist()) == set(range(T)) - set(dropped.tolist())
    assert L == len(active)



def test_lazyllm_without_text_pruning_drops_the_least_attended_share_of_the_visual_tokens_only(deep, media):
    """``prune_text=False`` (a calibration candidate for VLMs): at each pruning layer floor(k V) of the V visual
    tokens still active go, those the last token attended to least in the layer before; text never does."""
    engine = load_engine(str(deep["llava"]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    visual, text = _visual(prompt), (prompt.modality == TEXT).nonzero().squeeze(1)
    shares = (30, 40, 50)  # percent
    policy = LazyLLM(percentiles=tuple(k / 100 for k in shares), prune_text=False, decode_reselect=False)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    active, layers = ctx.active_per_layer, policy.params()["prune_layers"]
    for tokens in active:
        assert torch.isin(text, tokens).all()
    for layer, k in zip(layers, shares):
        V = int(torch.isin(active[layer - 1], visual).sum())
        assert int(torch.isin(active[layer], visual).sum()) == V - V * k // 100
    attention = _reference_attention(engine, prompt)[layers[0] - 1][0, :, -1].mean(dim=0)
    dropped = visual[attention[visual].argsort()[: len(visual) * shares[0] // 100]]
    assert set(active[layers[0]].tolist()) == set(range(len(prompt))) - set(dropped.tolist())


def test_lazyllm_prunes_floor_k_n_as_decimal_arithmetic_gives_it(deep, media):
    """"Exactly floor(k n) of the n active tokens are pruned": computed in binary floating point, 0.35 x 180 is
    62.999..., and 62 were pruned where the rule says 63 (an outside pass). A share k whose product with this
    prompt's length is a whole number in decimals but falls short of it in floating point prunes that number."""
    engine = load_engine(str(deep["llava"]), device="cpu", attn="eager")
    for more in range(100):  # a question long enough that such a share of the prompt exists (0.35 of 180, ...)
        prompt = engine.prepare(_image_messages(media, "What is in this picture?" + " Say more." * more))
        T = len(prompt)
        shares = [k for k in range(1, 100) if math.floor(k / 100 * T) != k * T // 100]
        if shares:
            break
    k = shares[0] / 100
    policy = LazyLLM(percentiles=(k, k, k))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    first = policy.params()["prune_layers"][0]
    assert len(ctx.active_per_layer[first]) == T - shares[0] * T // 100

def test_lazyllm_stored_hidden_states_are_what_entered_the_pruning_layer(deep, media):
    engine = load_engine(str(deep["llava"]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, LazyLLM(percentiles=(0.5, 0.0, 0.0)))
        out = engine.model(**reference_inputs(engine, prompt), output_hidden_states=True)
    index, hidden = ctx.aux_cache.get(3)
    # hidden_states[3] is the input of layer 3, with every token computed through layers 0-2.
    torch.testing.assert_close(hidden, out.hidden_states[3][0, index], atol=1e-4, rtol=0)


def test_lazyllm_aux_cache_holds_what_left_the_layer_before_at_every_pruning_layer(deep, media):
    """The Aux Cache of pruning layer l holds, for each token pruned there, its hidden state as it entered l: the
    output of layer l - 1 for that token (LazyLLM Section 3.3, "Aux Cache"), at every pruning layer, not only the
    first one (where the active set is still the whole prompt, so a position in it is the token's index)."""
    engine = load_engine(str(deep["llava"]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    policy = LazyLLM(percentiles=(0.3, 0.4, 0.5), decode_reselect=True)
    outputs: dict[int, torch.Tensor] = {}

    def keep(at):
        return lambda module, args, out: outputs.__setitem__(at, (out[0] if isinstance(out, tuple) else out)[0].clone())

    hooks = [layer.register_forward_hook(keep(at)) for at, layer in enumerate(engine.adapter.layers)]
    try:
        with torch.no_grad():
            _, ctx = engine.prefill(prompt, policy)
    finally:
        for hook in hooks:
            hook.remove()
    layers = policy.params()["prune_layers"]
    assert len(layers) == 3
    for layer in layers:
        index, hidden = ctx.aux_cache.get(layer)
        before = ctx.active_per_layer[layer - 1].tolist()
        rows = torch.tensor([before.index(t) for t in index.tolist()])
        torch.testing.assert_close(hidden, outputs[layer - 1][rows], atol=0, rtol=0)


def test_lazyllm_default_pruning_layers_are_the_depth_fractions_rounded():
    """SPEC: layer numbers scale with depth L (round, at least 1). 1/4, 1/2 and 3/4 of 27 layers are 6.75, 13.5 and
    20.25: layers 7, 14 and 20 (13.5 rounds to 14 half-up and half-even alike). The docs' tables (28, 32, 36 layers)
    have whole quarters only, so rounding down passed them."""
    from types import SimpleNamespace

    policy = LazyLLM.from_speed(1.0)
    policy.plan(SimpleNamespace(num_layers=27, modality=torch.zeros(50, dtype=torch.long)))
    assert policy.params()["prune_layers"] == [7, 14, 20]


def test_st3_starts_at_layer_3_down_to_4_layers_and_at_the_last_layer_below():
    """ST3 keeps layers 0-2 whole and drops P at layer 3 (the paper's "4-th layer") on any model that has a layer 3;
    a shallower model starts at its last layer (docs/pruning.md)."""
    from types import SimpleNamespace

    modality = torch.tensor([1] * 40 + [0] * 10)
    for L, start in ((4, 3), (5, 3), (12, 3), (3, 2), (2, 1)):
        policy = ST3(first_drop=0.5, end_keep=0.1)
        policy.plan(SimpleNamespace(num_layers=L, modality=modality))
        assert policy.params()["start_layer"] == start and min(policy.params()["prune_layers"]) == start, L


# ---------------------------------------------------------------------------------------- FastV
@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_fastv_drops_floor_r_of_the_image_tokens_and_in_its_text_adaptation_of_every_token_but_the_last(
        deep, media, ratio):
    """FastV drops R of the V image tokens at layer K, floor(R V); its text adaptation (DASH's appendix) R of the
    T - 1 tokens before the last. (Only R = 0.5 on an even count was checked, where floor((V + 1) / 2) passed.)"""
    engine = load_engine(str(deep["llava"]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    T, V, percent = len(prompt), len(_visual(prompt)), round(ratio * 100)
    for policy, dropped in ((FastV(ratio=ratio), V * percent // 100),
                            (FastV(ratio=ratio, text=True), (T - 1) * percent // 100)):
        with torch.no_grad():
            _, ctx = engine.prefill(prompt, policy)
        assert len(ctx.active_per_layer[policy.params()["layer"]]) == T - dropped, policy


def test_fastv_drops_r_of_the_image_tokens_with_least_attention_at_layer_k(deep, media):
    engine = load_engine(str(deep["llava"]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    visual = _visual(prompt)
    policy = FastV.from_speed(0.5)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    K = policy.params()["layer"]
    assert K == max(1, round(2 * DEEP_LAYERS / 32)) and policy.ratio == 0.5
    attention = _reference_attention(engine, prompt)[K - 1][0, :, -1].mean(dim=0)
    dropped = visual[attention[visual].argsort()[: len(visual) // 2]]
    T = len(prompt)
    expected = [T] * K + [T - len(dropped)] * (DEEP_LAYERS - K)
    assert [len(a) for a in ctx.active_per_layer] == expected
    assert set(ctx.active_per_layer[K].tolist()) == set(range(T)) - set(dropped.tolist())


def test_fastv_merge_folds_each_dropped_token_into_its_most_similar_kept_one(deep, media):
    """Merging drops the same tokens as FastV does; each kept visual token then enters layer K as the
    mean of itself and the dropped visual tokens whose state (entering layer K) is closest to its own."""
    engine = load_engine(str(deep["llava"]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        _, dropping = engine.prefill(prompt, FastV(ratio=0.5))
        policy = FastV(ratio=0.5, merge=True)
        K = max(1, round(2 * DEEP_LAYERS / 32))
        captured = {}
        norm = engine.adapter.layers[K].input_layernorm
        hook = norm.register_forward_hook(lambda m, args, out: captured.update(h=args[0][0]))
        try:
            _, merging = engine.prefill(prompt, policy)
        finally:
            hook.remove()
        states = engine.model(**reference_inputs(engine, prompt), output_hidden_states=True).hidden_states[K][0]
    kept = merging.active_per_layer[K]
    assert torch.equal(kept, dropping.active_per_layer[K])
    visual = _visual(prompt)
    gone = visual[~torch.isin(visual, kept)]
    stays = visual[torch.isin(visual, kept)]
    unit = torch.nn.functional.normalize(states, dim=-1)
    into = (unit[gone] @ unit[stays].T).argmax(dim=1)
    expected = states.clone()
    for j, token in enumerate(stays.tolist()):
        members = torch.cat([torch.tensor([token]), gone[into == j]])
        expected[token] = states[members].mean(dim=0)
    assert (into.bincount(minlength=len(stays)) > 0).any()  # something was merged
    torch.testing.assert_close(captured["h"], expected[kept], atol=1e-4, rtol=0)


def test_the_selection_helpers_pick_as_their_definitions_and_never_wait_for_the_device():
    """``lowest_visual``, ``lowest_except`` and ``without`` run at every pruning layer of ST3, LazyLLM, FastV and
    HiDivDrop: the visual tokens of lowest score (ties: the earlier), the lowest but the last, and a set minus some
    positions, as a boolean mask would give them, but with no data-dependent shape the host must read from the
    device first and no Python value copied in from the host."""
    from types import SimpleNamespace

    from host_waits import HostWaits
    from glimpse.pruning.base import lowest_except, lowest_visual, without

    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        T = 60
        modality = torch.where(torch.rand(T, generator=generator) < 0.6, 1, 0)
        modality[-1] = 0
        active = torch.sort(torch.randperm(T, generator=generator)[:40]).values
        # Few distinct scores (ties), an infinite one now and then (a score some policies give to keep a token).
        scores = torch.randint(0, 6, (T,), generator=generator).float()
        scores[torch.randint(0, T, (3,), generator=generator)] = float("inf")
        ctx = SimpleNamespace(modality=modality)
        visual = (modality[active] != 0).nonzero().squeeze(1)
        count = int(torch.randint(0, len(visual) + 1, (1,), generator=generator))
        with torch.no_grad(), HostWaits() as counter:  # not inference_mode: its item() calls bypass the mode
            picked = lowest_visual(active, ctx, scores, count)
            kept = without(active, picked)
            any_lowest = lowest_except(scores, count)  # LazyLLM's and FastV's text pruning: never the last token
        assert counter.count == 0
        with_last_out = scores.clone()
        with_last_out[-1] = float("inf")
        assert any_lowest.tolist() == torch.sort(with_last_out, stable=True).indices[:count].tolist()
        expected = visual[torch.sort(scores[active[visual]], stable=True).indices[:count]].sort().values
        assert picked.tolist() == expected.tolist()
        mask = torch.ones(len(active), dtype=torch.bool)
        mask[expected] = False
        assert kept.tolist() == active[mask].tolist()


# ---------------------------------------------------------------------------------------- DivPrune
def _greedy_max_min(features: torch.Tensor, count: int) -> list[int]:
    """DivPrune's rule written out on the whole distance matrix: first the token whose nearest other token
    is farthest, then each time the token farthest from its nearest chosen one (ties: the earlier)."""
    unit = torch.nn.functional.normalize(features.float(), dim=-1)
    n = features.shape[0]
    others = 1.0 - unit @ unit.T + torch.diag(torch.full((n,), float("inf")))
    chosen = [int(others.min(dim=1).values.argmax())]
    # Distances to a chosen token as one vector each, as the policy computes them: equal features (a still
    # video's repeated frames) then tie exactly in both, not up to the rounding of two different products.
    to = {chosen[0]: 1.0 - unit @ unit[chosen[0]]}
    while len(chosen) < count:
        rest = [i for i in range(n) if i not in chosen]
        pick = max(rest, key=lambda i: (min(float(to[j][i]) for j in chosen), -i))
        chosen.append(pick)
        to[pick] = 1.0 - unit @ unit[pick]
    return sorted(chosen)


def test_divprune_keeps_one_token_of_each_group_of_near_duplicates():
    """Three objects, each seen by several near-identical cells: keeping three keeps one of each, where a
    ranking by any per-token score could keep three cells of one object."""
    from glimpse.pruning.divprune import max_min_diverse
    torch.manual_seed(0)
    centres = torch.eye(3, 8)
    features = torch.cat([centres[i] + 0.01 * torch.randn(5, 8) for i in (0, 1, 2)])  # rows 0-4, 5-9, 10-14
    chosen = max_min_diverse(features[None], 3)[0]
    assert sorted(int(i) // 5 for i in chosen) == [0, 1, 2]
    assert max_min_diverse(features[None], 7)[0].tolist() == _greedy_max_min(features, 7)
    assert max_min_diverse(features[None], 20)[0].tolist() == list(range(15))
    # Sets chosen side by side are each chosen as if alone.
    other = features.flip(0) * 2.0 + 0.05 * torch.randn(15, 8)
    both = max_min_diverse(torch.stack([features, other]), 4)
    assert both.tolist() == [_greedy_max_min(features, 4), _greedy_max_min(other, 4)]


def test_divprune_says_a_share_under_one_percent_as_it_is_not_as_zero():
    """keep=1e-9 was described as "keeps the 0% most diverse visual tokens", though one of each image is kept."""
    from glimpse.pruning.divprune import kept_count

    assert "keeps the 1e-07% (at least one) most diverse" in DivPrune(keep=1e-9).summary()
    assert kept_count(1e-9, 256) == 1
    assert "keeps the 25% most diverse" in DivPrune(keep=0.25).summary()


def test_divprune_waits_for_the_device_as_often_for_a_hundred_picks_as_for_two():
    """The greedy loop picks one token per step; a step that made the host wait (a Python value written through
    an index, copied from host memory on a GPU) would cost a wait per kept token."""
    from host_waits import HostWaits
    from glimpse.pruning.divprune import max_min_diverse

    features = torch.randn(2, 1500, 16)  # two sets, and more rows than one block of the nearest-row search
    waits = {}
    for count in (2, 100):
        with torch.no_grad(), HostWaits() as counter:  # not inference_mode: its item() calls bypass the mode
            chosen = max_min_diverse(features, count)
        assert chosen.shape == (2, count)
        waits[count] = counter.count
    assert waits[2] == waits[100], waits


def test_divprune_refuses_a_share_outside_zero_one_or_of_the_wrong_type_before_any_work(checkpoints, media):
    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    for keep in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"DivPrune keep must be in \(0, 1\]"):
            engine.generate(_image_messages(media), policy=DivPrune(keep=keep), max_new_tokens=1)
    with pytest.raises(ValueError, match="keep must be float"):
        make_policy("divprune", 1.0, {"keep": "most"})


def test_every_numeric_parameter_refuses_nan_and_infinity():
    """JSON readers (the API's, the overrides box's) take NaN and Infinity; NaN passes a range check written
    as ``if x < low: raise`` (ST3's first_drop did), so no policy may take a non-finite number."""
    from dataclasses import fields

    checked = 0
    for name, policy_class in POLICIES.items():
        for field in fields(policy_class):
            kind = str(field.type)
            if not field.init or "float" not in kind:
                continue
            for bad in (math.nan, math.inf, -math.inf):
                value = [bad] if kind.startswith("tuple") else bad
                with pytest.raises(ValueError, match=f"{field.name} must be (a finite number|finite numbers)"):
                    make_policy(name, 0.5, {field.name: value})
            checked += 1
    assert checked >= 10  # every policy with a numeric parameter took part


def test_no_parameter_value_fails_as_anything_but_a_clear_error(deep_checkpoints, media):
    """Every policy parameter set to values at and past its edges either answers or is refused with a
    UserError (the API's 400, the chat's warning): found by fuzzing from outside, ZipVL's bit widths and probe
    counts, an empty HiDivDrop keep and a negative ST3 start layer (which asked for gigabytes) were 500s."""
    from dataclasses import fields

    from glimpse.common import UserError

    engine = load_engine(str(deep_checkpoints["qwen2_vl"]), device="cpu")
    edges = {"int": [-1, 0, 10**9, -10**9], "float": [-1.0, 0.0, 2.0, 1e300],
             "tuple[int": [[], [-1], [10**9]], "tuple[float": [[], [-1.0], [2.0, 2.0, 2.0]]}
    failures, tried = [], 0
    for name, policy_class in POLICIES.items():
        for field in fields(policy_class):
            kind = str(field.type)
            values = next((v for k, v in edges.items() if kind.startswith(k) and field.init), [])
            for value in values:
                tried += 1
                try:
                    engine.generate(_image_messages(media), policy=make_policy(name, 1.0, {field.name: value}),
                                    max_new_tokens=2)
                except UserError:
                    pass
                except Exception as error:  # noqa: BLE001 — what the test looks for
                    failures.append(f"{name}.{field.name}={value!r}: {type(error).__name__}: {error}")
    assert tried >= 100 and not failures, failures


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_divprune_keeps_the_most_diverse_visual_inputs_and_the_rest_skip_every_layer(deep, media, arch):
    """The kept set is DivPrune's greedy max-min selection over the vision encoder's outputs (the decoder's
    inputs, not the placeholders): round(keep n) of each image enter layer 0, the others are in no layer's
    computation nor its KV cache, and every text token goes through."""
    engine = load_engine(str(deep[arch]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        (rows, features, _), = engine.encode_media(prompt)
        policy = DivPrune(keep=0.3)
        _, ctx = engine.prefill(prompt, policy)
    kept = rows[_greedy_max_min(features, round(0.3 * rows.shape[0]))]
    text = (prompt.modality == TEXT).nonzero().squeeze(1)
    expected = torch.cat([text, kept]).sort().values
    for layer_idx in range(DEEP_LAYERS):
        assert torch.equal(ctx.active_per_layer[layer_idx], expected), layer_idx
        assert not torch.isin(ctx.cache.layers[layer_idx].index, rows[~torch.isin(rows, kept)]).any()
    assert policy.observed()["num_dropped"] == rows.shape[0] - kept.shape[0]


def test_divprune_selects_each_video_frame_on_its_own(deep, media):
    """Each frame keeps its own share (the test clip's flat frames have equal features, whose ties the greedy
    rule may break either way, so the rule itself is checked on the image above)."""
    engine = load_engine(str(deep["qwen2_vl"]), device="cpu")
    prompt = engine.prepare([{"role": "user", "content": [{"type": "video", "video": str(media["video"])},
                                                          {"type": "text", "text": "What happens?"}]}])
    item = prompt.media[0]
    frames, per_frame = item.grid[0], item.num_tokens // item.grid[0]
    assert frames > 1 and per_frame * frames == item.num_tokens
    rows = _visual(prompt)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, DivPrune(keep=0.25))
        _, whole = engine.prefill(prompt, DivPrune(keep=0.25, per_frame=False))
    kept = [int(torch.isin(rows[f * per_frame:(f + 1) * per_frame], ctx.active_per_layer[0]).sum()) for f in range(frames)]
    assert kept == [round(0.25 * per_frame)] * frames
    assert int(torch.isin(rows, whole.active_per_layer[0]).sum()) == round(0.25 * len(rows))
    text = (prompt.modality == TEXT).nonzero().squeeze(1)
    assert torch.isin(text, ctx.active_per_layer[-1]).all()


def test_a_pruned_text_token_is_set_aside_not_merged():
    """``merge_into_kept`` folds pruned *visual* tokens into kept ones; "pruned text tokens are not merged" (LazyLLM
    with merge=True prunes text too): their states and the kept tokens' sizes stay as they were."""
    from types import SimpleNamespace

    from glimpse.pruning.base import merge_into_kept

    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.5, 0.5]])[None]
    ctx = SimpleNamespace(hidden=hidden.clone(), modality=torch.tensor([1, 1, 0, 0]))  # two visual, two text
    sizes = torch.ones(4)
    merge_into_kept(ctx, torch.arange(4), torch.tensor([2]), sizes)  # a text token pruned
    torch.testing.assert_close(ctx.hidden, hidden)
    assert sizes.tolist() == [1.0] * 4


def test_a_pipeline_intersects_its_members_attention_rows_and_decode_keys_and_joins_their_encoder_skips():
    """The composition rules (pruning/compose.py): a token takes part in attention, or is attended to in decode,
    only where every member lets it; a token's encoding is skipped where any member skips it. (One built-in
    policy implements each today; a user's policy beside it is composed by these rules.)"""
    class Choosing(NoPruning):
        def __init__(self, rows):
            super().__init__()
            self.rows = torch.tensor(rows)

        def attention_rows(self, layer_idx, ctx):
            return self.rows

        def decode_attend(self, layer_idx, ctx):
            return self.rows

        def skip_encoding(self, ctx):
            return self.rows

    pipeline = Pipeline(policies=(Choosing([0, 1, 2, 5]), Choosing([1, 2, 3, 5])))
    assert pipeline.attention_rows(0, None).tolist() == [1, 2, 5]
    assert pipeline.decode_attend(0, None).tolist() == [1, 2, 5]
    assert pipeline.skip_encoding(None).tolist() == [0, 1, 2, 3, 5]


def test_a_pipeline_chains_its_members_decode_rows_and_checks_every_member():
    """compose.py: ``decode_rows`` chains (each member sees the rows the previous ones chose), and a parameter out of
    range in any member, not only the first, is refused before anything runs (``auto``'s overrides name a member)."""
    from glimpse.common import UserError

    class Adding(NoPruning):
        def __init__(self, extra):
            super().__init__()
            self.extra = extra

        def decode_rows(self, layer_idx, rows, ctx):
            return rows + [self.extra]

    assert Pipeline(policies=(Adding(1), Adding(2))).decode_rows(0, [0], None) == [0, 1, 2]
    # a step scores where any member scores: ZipVL filling a window behind a member that never scores (the slider's
    # st3 + zipvl packed-KV candidate) still packs it, in a decode batch's slots too (engine: scores_in_decode)
    packing = ZipVL(important_bits=4, other_bits=2)
    packing.fills_window = True
    assert packing.scores_in_decode() and Pipeline(policies=(NoPruning(), packing)).scores_in_decode()
    frontier = Frontier([Point(design_pipeline_members(0.5), agreement=0.95, flops_ratio=0.5, e2e_ratio=0.6)])
    for member, param, value in (("dash", "rho", 1.5), ("st3", "stride", 0)):  # the design pipeline's 2nd and 3rd
        with pytest.raises(UserError, match=param):
            make_policy("auto", 0.5, {f"{member}.{param}": value}, frontier=frontier)
    with pytest.raises(UserError, match="rho"):
        Pipeline(policies=(NoPruning(), DASH(rho=1.5))).check(8)


def test_divprune_behind_another_member_chooses_among_the_real_visual_inputs(deep, media):
    """DivPrune picks by the visual inputs themselves (the projector's output): behind another member of a pipeline
    (RLT's candidates, any user's) it must still read them, and choose as it does alone."""
    engine = load_engine(str(deep["qwen2_vl"]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        _, alone = engine.prefill(prompt, DivPrune(keep=0.4))
        _, behind = engine.prefill(prompt, Pipeline(policies=(NoPruning(), DivPrune(keep=0.4))))
    assert behind.active_per_layer[0].tolist() == alone.active_per_layer[0].tolist()


def test_dash_never_halts_the_last_prompt_token_even_without_its_guards(deep, media):
    """The last prompt token always stays (it makes the first answer token), by DASH's own rule, not only by its
    guards: with both set to 0 and rho near 1 it still runs through every layer (were it halted, the engine would
    fail the request: "a policy dropped the last prompt token")."""
    engine = load_engine(str(deep["qwen2_vl"]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, DASH(rho=0.99, keep_first=0, keep_last=0))
    assert all(int(active[-1]) == len(prompt) - 1 for active in ctx.active_per_layer)


def test_a_token_merged_twice_is_the_plain_mean_of_everything_it_holds():
    """Two merge stages (LazyLLM prunes at several layers): sizes carry over, so the last kept token
    is the mean of all three originals, not a mean of means."""
    from types import SimpleNamespace
    from glimpse.pruning.base import merge_into_kept
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.2]), torch.tensor([1.0, 0.4])
    ctx = SimpleNamespace(hidden=torch.stack([a, b, c, torch.tensor([0.0, 1.0])])[None],
                          modality=torch.tensor([1, 1, 1, 0]))
    sizes = torch.ones(4)
    active = torch.arange(4)
    merge_into_kept(ctx, active, torch.tensor([0]), sizes)  # a joins b, its nearest
    torch.testing.assert_close(ctx.hidden[0, 1], (a + b) / 2)
    merge_into_kept(ctx, active[1:], torch.tensor([0]), sizes)  # b (holding a) joins c
    torch.testing.assert_close(ctx.hidden[0, 2], (a + b + c) / 3)
    assert sizes.tolist() == [1.0, 2.0, 3.0, 1.0]
    torch.testing.assert_close(ctx.hidden[0, 3], torch.tensor([0.0, 1.0]))  # text is never touched


# ---------------------------------------------------------------------------------------- slider
@pytest.mark.parametrize("arch", ARCHS)
def test_every_policy_at_speed_zero_equals_no_pruning_token_for_token(checkpoints, media, arch):
    engine = load_engine(str(checkpoints[arch]), device="cpu")
    messages = _image_messages(media)
    exact = engine.generate(messages, policy="none", max_new_tokens=8)
    for name in ["auto", *POLICIES]:
        result = engine.generate(messages, policy=name, speed=0.0, max_new_tokens=8)
        assert result.token_ids == exact.token_ids, name
        assert result.metrics["prefill_flops"] == result.metrics["prefill_flops_baseline"], name


@pytest.mark.parametrize("name", ["auto", *POLICIES])
def test_flops_proxy_never_rises_with_speed(deep, media, name):
    engine = load_engine(str(deep["qwen2_vl"]), device="cpu")
    messages = _image_messages(media)
    if name == "rlt":  # it prunes only what repeats in a video
        messages = [{"role": "user", "content": [{"type": "video", "video": str(media["moving_square"])},
                                                 {"type": "text", "text": "What moves?"}]}]
    flops = []
    for speed in (0.0, 0.25, 0.5, 0.75, 1.0):
        policy = make_policy(name, speed, {"keep_first": 4, "keep_last": 4} if name == "dash" else {})
        result = engine.generate(messages, policy=policy, max_new_tokens=1)
        flops.append(result.metrics["prefill_flops"])
    assert all(b <= a for a, b in zip(flops, flops[1:])), flops
    if name != "none":
        assert flops[-1] < flops[0]


def test_speed_outside_zero_one_and_unknown_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="speed"):
        make_policy("dash", 1.5)
    with pytest.raises(ValueError, match="no parameter"):
        make_policy("dash", 0.5, {"rhoo": 0.3})
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic", 0.5)
    assert make_policy("dash", 0.5, {"rho": 0.3}).rho == 0.3
    # auto's overrides name a member of the configuration its frontier picks at that speed
    frontier = Frontier([Point(design_pipeline_members(0.5), agreement=0.95, flops_ratio=0.5, e2e_ratio=0.6)])
    members = {p.name: p for p in make_policy("auto", 0.5, {"dash.start_layer": 5}, frontier=frontier).policies}
    assert members["dash"].start_layer == 5 and set(members) == {"hidivdrop", "dash", "st3"}
    with pytest.raises(ValueError, match="members at speed 0.5: hidivdrop, dash, st3"):
        make_policy("auto", 0.5, {"lazyllm.percentiles": [0.1, 0.1, 0.1]}, frontier=frontier)
    # At speed 0 auto runs nothing: the message says so and what to do, not "its members at speed 0: none: ..."
    with pytest.raises(ValueError, match=r"^auto prunes nothing at speed 0, so it has no parameters to set "
                                         r"\('divprune.keep'\); raise the speed, or choose the policy by name"):
        make_policy("auto", 0.0, {"divprune.keep": 0.3}, frontier=frontier)
    with pytest.raises(ValueError, match=r"^none has no parameters to set \(got x\)$"):  # not "its parameters: "
        make_policy("none", 0.5, {"x": 1})


# Values each policy once took without a word: a stride of 0 read as "the default", a negative DASH guard, a
# quantization group of 0, the video tau checked only on prompts with a video, fractions past the whole depth.
OUT_OF_RANGE = [("dash", "keep_first", -1), ("zipvl", "group", 0), ("zipvl", "tau_video", 2.0), ("st3", "stride", 0),
                ("hidivdrop", "exit_fraction", 1.5), ("lazyllm", "depth_fractions", [0.25, 0.5, 1.5]),
                ("st3", "drop_step", -0.1),
                # An outside pass: a seed torch cannot take (seed * 100003 + layer past 2**64) was an internal error, and
                # an ST3 tau of 5e-324 answer tokens a ZeroDivisionError in decode (the exponential schedule's tau / 3).
                ("zipvl", "seed", 2**62), ("zipvl", "seed", -1), ("st3", "anneal_tau", 5e-324), ("st3", "anneal_tau", 0.5),
                # ... and an ST3 start layer of 0, reported as "P at layer 0" and never applied; a LazyLLM layer given
                # twice and an empty HiDivDrop filter_layers, dropped or replaced without a word; ST3's P + C past 1,
                # which needs no depth, refused only once the model had loaded
                ("st3", "start_layer", 0), ("lazyllm", "prune_layers", [8, 8, 9]), ("hidivdrop", "filter_layers", []),
                ("st3", "end_keep", 0.9),
                # k is a percentile in [0, 1): k = 1 would prune every token, the last one too
                ("lazyllm", "percentiles", [0.4, 0.5, 1.0]),
                # DASH's rho is in [0, 1) (the paper's Section 3: rho = 1 halts every eligible token), its guards are
                # counts, and ZipVL's tau is in (0, 1] (tau 0 reaches Eq. 6 with no token at all)
                ("dash", "rho", 1.0), ("dash", "keep_last", -1), ("zipvl", "tau_image", 0.0),
                # ... and the important tokens' KV at fewer bits than the others' (the paper's Section 4.2 inverted)
                ("zipvl", "other_bits", 8)]
# Layer numbers past the model's last layer, once silently clamped or never reached (the policy did nothing).
PAST_THE_LAST_LAYER = [("dash", "start_layer", 1000), ("st3", "start_layer", 1000), ("fastv", "layer", 1000),
                       ("lazyllm", "prune_layers", [1, 2, 1000]), ("hidivdrop", "filter_layers", [1, 2, 3, 1000])]


def test_a_parameter_out_of_range_is_refused_before_a_model_loads_and_a_layer_past_the_last_before_any_work(
        checkpoints, media):
    """What needs no model is refused by ``make_policy`` (the CLI calls it before loading); a layer number is
    refused by the engine with the model's depth, before the picture is decoded — never silently ignored."""
    from glimpse.common import UserError

    for name, param, value in OUT_OF_RANGE:
        with pytest.raises(UserError, match=param):
            make_policy(name, 0.5, {param: value})
    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    L = len(engine.adapter.layers)
    for name, param, value in PAST_THE_LAST_LAYER:
        policy = make_policy(name, 0.5, {param: value})  # no model yet: any layer number of at least 1 may be
        with pytest.raises(UserError, match=rf"{param} must be in \[\d, {L - 1}\] on this {L}-layer model"):
            engine.make_policy(name, 0.5, {param: value})
        with pytest.raises(UserError, match=f"on this {L}-layer model"):
            engine.generate(_image_messages(media), policy=policy, max_new_tokens=1)
    assert ST3.from_speed(1.0).start_layer is None  # the paper's layer 3, or the last on a shallower model
    # depth fractions set by hand that put a layer past the last: the request ran unpruned, "LazyLLM off"
    with pytest.raises(UserError, match=rf"depth_fractions \[0.99\] put a pruning layer past the last layer"):
        engine.make_policy("lazyllm", 0.5, {"depth_fractions": [0.25, 0.5, 0.99]})
    # P + C past 1 was refused as the prefill planned, after the picture was decoded, as "R=-0.0667 ... prune more
    # than all" (an outside pass): now with the other parameters, and in the user's words
    with pytest.raises(UserError, match=r"P \+ C must be at most 1"):
        engine.make_policy("st3", 0.5, {"first_drop": 0.6, "end_keep": 0.6})
    assert engine.make_policy("st3", 1.0).check(L) is None


# ---------------------------------------------------------------------------------------- composition
@pytest.mark.parametrize("cut", ["lazyllm", "fastv"])
def test_a_cut_at_hidivdrops_injection_layer_passes_the_tokens_that_join_there(deep, media, cut):
    """A cut ranks by the layer before's attention, which the visual tokens HiDivDrop injects at L_inj were not in:
    they pass a cut at L_inj, which takes its share of the tokens it scored, and the next layer's cuts rank them.
    Found from outside: ranked as -inf, LazyLLM there pruned 11 of the 12 visual tokens and no text, and FastV
    dropped the first visual tokens by position."""
    engine = load_engine(str(deep["llava"]), device="cpu")
    prompt = engine.prepare(_image_messages(media))
    inject, _ = HiDivDrop.from_speed(1.0).window(len(engine.adapter.layers))
    assert inject >= 1
    member = (LazyLLM(percentiles=(0.2, 0.5), prune_layers=(inject, inject + 1)) if cut == "lazyllm"
              else FastV(ratio=0.25, layer=inject))
    with torch.no_grad():
        _, alone = engine.prefill(prompt, HiDivDrop.from_speed(1.0))
        _, both = engine.prefill(prompt, Pipeline(policies=(HiDivDrop.from_speed(1.0), member)))
    visual = _visual(prompt)
    before, joined = alone.active_per_layer[inject - 1].cpu(), alone.active_per_layer[inject].cpu()
    assert not torch.isin(visual, before).any() and torch.isin(visual, joined).all()  # all of them join at L_inj
    at_inject = both.active_per_layer[inject].cpu()
    assert torch.isin(visual, at_inject).all()  # every token that joined passed the cut
    if cut == "lazyllm":  # floor(k n) of the n tokens it scored, none of them visual, the last one kept
        assert len(at_inject) == len(joined) - math.floor(0.2 * len(before))
        assert at_inject[-1] == len(prompt) - 1
        nxt = both.active_per_layer[inject + 1].cpu()  # a layer later they are ranked, as the rest
        assert len(nxt) == len(at_inject) - math.floor(0.5 * len(at_inject))
    else:  # FastV cuts visual tokens only, and it scored none
        assert torch.equal(at_inject, joined)


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])  # M-RoPE and 1-D RoPE
def test_the_design_pipeline_and_a_hand_built_pipeline_run_end_to_end(deep, media, arch):
    engine = load_engine(str(deep[arch]), device="cpu")
    messages = _image_messages(media)
    result = engine.generate(messages, policy=design_pipeline_with_guards(0.8, 4), max_new_tokens=6)
    counts = result.metrics["active_tokens_per_layer"]
    assert result.policy == "hidivdrop+dash+st3" and "dash" in result.params
    assert counts[-1] < counts[0] and result.token_ids

    fastv, dash = FastV(ratio=0.5), DASH(rho=0.5, keep_first=2, keep_last=2)
    prompt = engine.prepare(messages)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, Pipeline(policies=(fastv, dash)))
    K, l_s = fastv.params()["layer"], dash.params()["start_layer"]
    active = ctx.active_per_layer
    for before, after in zip(active, active[1:]):
        assert torch.isin(after, before).all()
    visual = len(_visual(prompt))
    assert len(active[K]) == len(prompt) - visual // 2  # FastV's drop first ...
    assert len(active[l_s]) == len(active[l_s - 1]) - dash.telemetry["num_halted"]  # ... then DASH on the rest


# ---------------------------------------------------------------------------------------- masking
MASKING_CASES = {
    "dash": lambda: DASH(rho=0.5, keep_first=2, keep_last=2),
    "zipvl": lambda: ZipVL(tau_image=0.85),
    "st3": lambda: ST3(first_drop=0.5, end_keep=0.1),
    "lazyllm": lambda: LazyLLM(percentiles=(0.3, 0.4, 0.5)),
    "fastv": lambda: FastV(ratio=0.6),
    "divprune": lambda: DivPrune(keep=0.4),
    "design pipeline": lambda: design_pipeline_with_guards(0.8, 2),
}


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("name", list(MASKING_CASES))
def test_physical_dropping_equals_masking_for_each_policy(deep, media, arch, name):
    engine = load_engine(str(deep[arch]), device="cpu", attn="eager")
    prompt = engine.prepare(_image_messages(media))
    with torch.no_grad():
        logits, ctx = engine.prefill(prompt, MASKING_CASES[name]())
        reference = masked_reference(engine, prompt, ctx.active_per_layer, ctx.attention_per_layer)
        unpruned, _ = engine.prefill(prompt, NoPruning())
    pruned_something = any(len(a) < len(prompt) for a in ctx.active_per_layer) or any(
        r is not None for r in ctx.attention_per_layer)
    assert pruned_something
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert (logits - unpruned).abs().max() > 1e-4  # what was dropped did matter


def test_docs_slider_tables_are_what_the_code_maps():
    from pathlib import Path

    from glimpse.pruning.slider import table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "slider.md").read_text()
    assert table(28) in doc and table(32) in doc and table(36) in doc  # regenerate with `python -m glimpse.pruning.slider --layers N`
    for depth in (28, 32, 36):  # each table is for the depth asked: DASH's l_s is floor(0.4 L) of it
        assert f"DASH rho=0.80 at layer {math.floor(0.4 * depth)}" in table(depth)


@pytest.mark.parametrize("name", list(MASKING_CASES))
def test_each_policy_gives_the_same_logits_with_sdpa_and_eager(deep, media, name):
    prompt_logits, active = [], []
    for attn in ("sdpa", "eager"):
        engine = load_engine(str(deep["qwen2_vl"]), device="cpu", attn=attn)
        prompt = engine.prepare(_image_messages(media))
        with torch.no_grad():
            logits, ctx = engine.prefill(prompt, MASKING_CASES[name]())
        prompt_logits.append(logits)
        active.append([a.tolist() for a in ctx.active_per_layer])
    assert active[0] == active[1]
    torch.testing.assert_close(prompt_logits[0], prompt_logits[1], atol=1e-4, rtol=0)


def design_pipeline_with_guards(speed: float, guard: int) -> Pipeline:
    """The design card's pipeline with DASH's first/last guards small enough for a tiny prompt."""
    from glimpse.pruning import design_pipeline

    pipeline = design_pipeline(speed)
    for member in pipeline.policies:
        if member.name == "dash":
            member.keep_first = member.keep_last = guard
    return pipeline


def test_the_worked_example_of_a_policy_runs(deep, media, monkeypatch):
    """docs/pruning.md, "Writing a policy": the example file, registered with one line, is made by
    make_policy with a --param override, prunes exactly every other visual token from layer K on, and
    at speed 0 answers exactly as no pruning."""
    import re
    import sys
    import types
    from pathlib import Path

    from glimpse import pruning
    from glimpse.common import UserError

    doc = (Path(__file__).resolve().parents[1] / "docs" / "pruning.md").read_text()
    code = re.search(r"```python\n# pruning/every_other.py\n(.*?)```", doc, re.S).group(1)
    module = types.ModuleType("every_other")
    monkeypatch.setitem(sys.modules, "every_other", module)  # dataclasses look their module up
    exec(compile(code, "docs/pruning.md", "exec"), module.__dict__)
    monkeypatch.setitem(pruning.POLICIES, "every_other", module.EveryOther)

    engine = load_engine(str(deep["llava"]), device="cpu")
    messages = _image_messages(media)
    prompt = engine.prepare(messages)
    policy = make_policy("every_other", 1.0, {"layer": 5})
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    visual = _visual(prompt)
    T = len(prompt)
    assert [len(a) for a in ctx.active_per_layer] == [T] * 5 + [T - len(visual) // 2] * (DEEP_LAYERS - 5)
    assert set(ctx.active_per_layer[5].tolist()) == set(range(T)) - set(visual[1::2].tolist())
    # what it observed is reported apart from what it was told
    pruned = engine.generate(messages, policy=make_policy("every_other", 1.0, {"layer": 5}), max_new_tokens=1)
    assert pruned.metrics["policy_telemetry"] == {"num_dropped": len(visual) // 2}
    assert pruned.params == {"layer": 5, "enabled": True}
    exact = engine.generate(messages, policy=make_policy("every_other", 0.0), max_new_tokens=6)
    assert exact.token_ids == engine.generate(messages, policy="none", max_new_tokens=6).token_ids
    with pytest.raises(UserError, match=f"every_other layer must be in \\[1, {DEEP_LAYERS - 1}\\]"):
        engine.prefill(prompt, make_policy("every_other", 1.0, {"layer": DEEP_LAYERS}))
    with pytest.raises(UserError, match="every_other layer must be a layer number of at least 1"):
        make_policy("every_other", 1.0, {"layer": 0})


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_every_policy_at_full_speed_answers_on_the_new_qwen_generations(checkpoints, media, arch):
    """Qwen2.5-VL and Qwen3-VL: every registered policy at speed 1 answers an image question end to end,
    never computing more prefill than the unpruned model."""
    from glimpse.pruning import NAMES

    engine = load_engine(str(checkpoints[arch]), device="cpu")
    messages = _image_messages(media)
    for name in NAMES:
        result = engine.generate(messages, policy=engine.make_policy(name, 1.0), max_new_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4, name
        assert result.metrics["prefill_flops"] <= result.metrics["prefill_flops_baseline"] * (1 + 1e-9), name
