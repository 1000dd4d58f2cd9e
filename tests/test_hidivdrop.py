"""HiDivDrop: late injection beside a parallel vision encoder, concave pyramid, early exit, ILVAS."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from glimpse.cli import main as glimpse
from glimpse.pipeline import load_engine
from glimpse.pipeline.adapters import TEXT
from glimpse.pipeline.calibrate import ilvas, local_maxima
from glimpse.pruning import HiDivDrop, NoPruning, Pipeline, Policy
from conftest import DEEP_LAYERS
from tiny_models import masked_reference

LAYERS = DEEP_LAYERS


@pytest.fixture(scope="module")
def deep(deep_checkpoints) -> dict:
    return deep_checkpoints


def _messages(media):
    return [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                         {"type": "text", "text": "What is in this picture? Describe it."}]}]


class TextOnly(Policy):
    name = "text-only"

    def select(self, layer_idx, active, ctx):
        return active[ctx.modality[active] == TEXT]


def _layer_inputs(engine, prompt, policy, layer_idx):
    """The hidden states (original index -> row) that enter ``layer_idx``'s attention."""
    seen = {}
    norm = engine.adapter.layers[layer_idx].input_layernorm
    hook = norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0][0].clone()))
    try:
        with torch.no_grad():
            _, ctx = engine.prefill(prompt, policy)
    finally:
        hook.remove()
    return seen["h"], ctx


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])  # 1-D positions and M-RoPE
def test_text_before_injection_never_sees_vision_and_vision_enters_with_its_embeddings(deep, media, arch):
    engine = load_engine(str(deep[arch]), device="cpu", attn="eager")
    prompt = engine.prepare(_messages(media))
    policy = HiDivDrop(inject_layer=4, exit_layer=10, filter_layers=(5, 7), keep=(0.5, 0.25))
    entering, ctx = _layer_inputs(engine, prompt, policy, 4)
    text_only, _ = _layer_inputs(engine, prompt, TextOnly(), 4)

    text = (prompt.modality == TEXT).nonzero().squeeze(1)
    visual = (prompt.modality != TEXT).nonzero().squeeze(1)
    active = ctx.active_per_layer[4]
    rows_text = torch.isin(active, text).nonzero().squeeze(1)
    rows_visual = torch.isin(active, visual).nonzero().squeeze(1)
    # Text states after layers 0-3 equal a run in which no vision token exists at all.
    torch.testing.assert_close(entering[rows_text], text_only, atol=0, rtol=0)
    # Vision tokens join at layer 4 with the projector's output, untouched by layers 0-3.
    with torch.no_grad():
        embeddings = engine.embed_prompt(prompt)[0]
    torch.testing.assert_close(entering[rows_visual], embeddings[visual], atol=0, rtol=0)
    for layer in range(4):  # layers below the injection hold no vision KV
        assert not (ctx.cache.layers[layer].modality != TEXT).any()
        assert ctx.active_per_layer[layer].tolist() == text.tolist()
    # Their positions are the persistent ones: the pruned run equals the masked full-length model.
    with torch.no_grad():
        logits, ctx = engine.prefill(prompt, policy)
        reference = masked_reference(engine, prompt, ctx.active_per_layer, ctx.attention_per_layer)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_keep_counts_follow_the_schedule_and_nothing_visual_survives_the_exit(deep, media):
    engine = load_engine(str(deep["qwen2_vl"]), device="cpu")
    prompt = engine.prepare(_messages(media))
    visual = (prompt.modality != TEXT).nonzero().squeeze(1)
    V = len(visual)
    policy = HiDivDrop(inject_layer=3, exit_layer=10, filter_layers=(4, 6, 8), keep=(0.5, 0.25, 0.125))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
    counts = [int(torch.isin(a, visual).sum()) for a in ctx.active_per_layer]
    half, quarter, eighth = round(0.5 * V), round(0.25 * V), round(0.125 * V)
    assert counts == [0] * 3 + [V] * 2 + [half] * 2 + [quarter] * 2 + [eighth] + [0] * 2
    assert policy.params()["keep_counts"] == [half, quarter, eighth]
    for layer in range(10, LAYERS):
        assert not (ctx.cache.layers[layer].modality != TEXT).any()
    # Each filtering layer keeps the vision tokens its last token attended to most (nested sets).
    for a, b in zip(ctx.active_per_layer[3:10], ctx.active_per_layer[4:10]):
        assert torch.isin(b, a).all()


def test_each_filtering_layer_keeps_the_vision_tokens_the_last_token_attended_to_most(deep, media):
    """Concave pyramid pruning: after filtering layer f, the top share of the vision tokens by the last prompt
    token's attention in f (mean over heads) stays. That attention is taken here from the model's own eager
    layers run at full length with the pruned run's masks: text alone below the injection, vision from it on."""
    engine = load_engine(str(deep["llava"]), device="cpu", attn="eager")
    prompt = engine.prepare(_messages(media))
    visual = (prompt.modality != TEXT).nonzero().squeeze(1)
    policy = HiDivDrop(inject_layer=3, exit_layer=10, filter_layers=(4, 6, 8), keep=(0.5, 0.25, 0.125))
    weights: dict = {}
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
        masked_reference(engine, prompt, ctx.active_per_layer, ctx.attention_per_layer, weights=weights)
    for f, share in ((4, 0.5), (6, 0.25), (8, 0.125)):
        before = visual[torch.isin(visual, ctx.active_per_layer[f])]  # the vision tokens filtering layer f ranks
        attention = weights[f][0, :, -1].mean(dim=0)[before]
        kept = before[attention.argsort(descending=True)[: round(share * len(visual))]]
        assert set(visual[torch.isin(visual, ctx.active_per_layer[f + 1])].tolist()) == set(kept.tolist()), f


def test_the_papers_filtering_layers_scale_with_depth_and_count_from_the_injection_layer_on():
    """F = {10, 14, 16, 18} of 32 layers, scaled to the depth: round(f L / 32), at least 1 (the spec). A filtering
    layer counts where the vision tokens are, from L_inj on, while its cut at f + 1 lies before L_exit."""
    from types import SimpleNamespace

    modality = torch.tensor([1] * 100 + [0] * 10)
    for L in (12, 20, 28, 32, 40):
        policy = HiDivDrop.from_speed(1.0)
        policy.plan(SimpleNamespace(num_layers=L, modality=modality))
        inject, exit_ = policy.resolved["inject_layer"], policy.resolved["exit_layer"]
        scaled = {max(1, round(f * L / 32)) for f in (10, 14, 16, 18)}
        assert policy.resolved["filter_layers"] == sorted(f for f in scaled if inject <= f and f + 1 < exit_), L
    policy = HiDivDrop(inject_layer=4, exit_layer=10, filter_layers=(4, 7), keep=(0.5, 0.25))
    policy.plan(SimpleNamespace(num_layers=12, modality=modality))  # f = L_inj ranks the tokens that joined there
    assert policy.resolved["filter_layers"] == [4, 7] and policy.resolved["keep_counts"] == [50, 25]


def test_vision_encoder_in_parallel_is_bit_identical_to_running_it_first(deep, media):
    engine = load_engine(str(deep["llava"]), device="cpu")
    prompt = engine.prepare(_messages(media))
    outputs = {}
    for parallel in (False, True):
        engine.parallel_vision = parallel
        with torch.no_grad():
            logits, ctx = engine.prefill(prompt, HiDivDrop.from_speed(0.8))
        outputs[parallel] = (logits, ctx.hidden, ctx.vision_encoder_s, ctx.vision_wait_s)
    assert torch.equal(outputs[True][0], outputs[False][0])
    assert torch.equal(outputs[True][1], outputs[False][1])
    assert outputs[False][3] == outputs[False][2]  # sequential: the loop waited for all of it


def test_an_encoder_failure_in_the_worker_reaches_the_request(deep, media, monkeypatch):
    engine = load_engine(str(deep["llava"]), device="cpu")
    prompt = engine.prepare(_messages(media))

    def broken(media, kind):
        raise RuntimeError("encoder exploded")

    monkeypatch.setattr(engine.adapter, "encode", broken)
    with pytest.raises(RuntimeError, match="encoder exploded"):
        engine.prefill(prompt, HiDivDrop.from_speed(0.8))


def test_the_encoder_runs_in_one_worker_thread_for_the_engines_life(deep, media, monkeypatch):
    """Every request's encoder runs in the same worker (a new thread or CUDA stream per request would set up its
    own library handles on a GPU), never in the caller's thread, and a failure in it does not stop the next one."""
    engine = load_engine(str(deep["llava"]), device="cpu")
    engine.parallel_vision = True  # the GPU's default; on a CPU the encoder runs first, in the caller's thread
    prompt = engine.prepare(_messages(media))
    threads = []
    encode = engine.adapter.encode

    def watched(media, kind):
        threads.append(threading.get_ident())
        if len(threads) == 2:
            raise RuntimeError("encoder exploded")
        return encode(media, kind)

    monkeypatch.setattr(engine.adapter, "encode", watched)
    with torch.no_grad():
        first, _ = engine.prefill(prompt, HiDivDrop.from_speed(0.8))
        with pytest.raises(RuntimeError, match="encoder exploded"):
            engine.prefill(prompt, HiDivDrop.from_speed(0.8))
        third, _ = engine.prefill(prompt, HiDivDrop.from_speed(0.8))
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()
    assert torch.equal(first, third)


def test_only_the_cuts_made_are_reported_shares_go_in_layer_order_and_a_resampled_schedule_keeps_its_ends():
    """docs/pruning.md: a filtering layer f whose cut at f + 1 would fall at or past L_exit makes no cut and is not
    reported; the i-th share goes with the i-th filtering layer in layer order (steep first, whatever order they
    were given in); a profile with more or fewer layers than shares resamples the schedule, same first and last."""
    from types import SimpleNamespace

    from glimpse.pruning.hidivdrop import KEEP_AT_FULL_SPEED, resample

    modality = torch.tensor([1] * 96 + [0] * 10)
    policy = HiDivDrop(inject_layer=3, exit_layer=9, filter_layers=(4, 8), keep=(0.5, 0.25))
    policy.plan(SimpleNamespace(num_layers=12, modality=modality))
    assert policy.resolved["filter_layers"] == [4] and policy.resolved["keep_counts"] == [48]  # 8 + 1 is L_exit
    policy = HiDivDrop(inject_layer=3, exit_layer=10, filter_layers=(8, 4, 6), keep=(0.5, 0.25, 0.125))
    policy.plan(SimpleNamespace(num_layers=12, modality=modality))
    assert policy.resolved["filter_layers"] == [4, 6, 8] and policy.resolved["keep_counts"] == [48, 24, 12]
    for n in (2, 3, 5, 7):
        shares = resample(KEEP_AT_FULL_SPEED, n)
        assert len(shares) == n and (shares[0], shares[-1]) == (KEEP_AT_FULL_SPEED[0], KEEP_AT_FULL_SPEED[-1]), n
        assert all(b <= a for a, b in zip(shares, shares[1:])), n


def test_speed_moves_injection_later_exit_earlier_and_the_schedule_steeper():
    from types import SimpleNamespace

    resolved = []
    for speed in (0.0, 0.25, 0.5, 0.75, 1.0):
        policy = HiDivDrop.from_speed(speed)
        policy.plan(SimpleNamespace(num_layers=32, modality=torch.tensor([1] * 576 + [0] * 40)))
        resolved.append((policy.resolved["inject_layer"], policy.resolved["exit_layer"], policy.keep))
    assert resolved[0] == (0, 32, (1.0, 1.0, 1.0, 1.0))  # speed 0: exact
    assert resolved[-1][:2] == (9, 25)  # the paper's window on 32 layers
    for (i0, e0, k0), (i1, e1, k1) in zip(resolved, resolved[1:]):
        assert i1 >= i0 and e1 <= e0 and all(b <= a for a, b in zip(k0, k1))
    keep = resolved[-1][2]
    drops = [1.0 - keep[0]] + [a - b for a, b in zip(keep, keep[1:])]
    assert all(b <= a for a, b in zip(drops, drops[1:]))  # concave: steep first, then gentle


def test_the_design_pipeline_composes_hidivdrop_dash_and_st3(deep, media):
    from test_pruning import design_pipeline_with_guards

    engine = load_engine(str(deep["qwen2_vl"]), device="cpu")
    result = engine.generate(_messages(media), policy=design_pipeline_with_guards(0.8, 4), max_new_tokens=4)
    assert set(result.params) == {"hidivdrop", "dash", "st3"}
    inject = result.params["hidivdrop"]["inject_layer"]
    assert inject > 0 and result.metrics["keep_map"]["entered"] == [inject] * result.metrics["prompt_tokens"]["image"]
    assert result.metrics["prefill_flops"] < result.metrics["prefill_flops_baseline"]


# ---------------------------------------------------------------------------------------- ILVAS
def test_ilvas_is_the_mean_cosine_of_head_vectors_over_the_top_k_tokens():
    first = torch.tensor([[0.5, 0.1, 0.3, 0.05], [0.4, 0.1, 0.0, 0.2]])  # (heads 2, vision tokens 4)
    assert ilvas(first, first.clone(), top_k=2) == pytest.approx(1.0)
    later = first.clone()
    later[:, 2] = torch.tensor([0.0, 0.3])  # token 2 (in the top 2 at layer l) turns orthogonal
    expected = (1.0 + 0.0) / 2
    assert ilvas(first, later, top_k=2) == pytest.approx(expected)
    assert ilvas(first, later, top_k=1) == pytest.approx(1.0)  # only token 0, unchanged
    # The K tokens are those layer l attends to most (V_K^l), not layer l + n: here layer l + n ranks token 2
    # second, whose head vector turned orthogonal; layer l ranks it last.
    first = torch.tensor([[0.5, 0.3, 0.1], [0.5, 0.3, 0.0]])
    later = torch.tensor([[0.5, 0.3, 0.0], [0.5, 0.3, 0.9]])
    assert ilvas(first, later, top_k=2) == pytest.approx(1.0)


def test_local_maxima_pick_the_peaks_of_the_curve():
    curve = {3: 0.5, 4: 0.7, 5: 0.6, 6: 0.65, 7: 0.9, 8: 0.8, 9: 0.85}
    assert local_maxima(curve, 4) == [4, 7, 9]
    assert local_maxima(curve, 2) == [7, 9]
    # a peak is above its neighbours: a flat stretch is none (a curve of ties has no peak to filter at)
    assert local_maxima({3: 0.5, 4: 0.5, 5: 0.5}, 4) == []


def test_calibrate_writes_a_profile_the_engine_then_uses(deep, media, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path / "cache"))
    images = tmp_path / "calibration"
    images.mkdir()
    from PIL import Image

    for i, angle in enumerate((0, 90, 180)):
        Image.open(media["image"]).rotate(angle).save(images / f"{i}.png")
    (images / "broken.png").write_bytes(b"not an image")
    model = str(deep["llava"])
    assert glimpse(["calibrate", "hidivdrop", "--model", model, "--images", str(images), "--window", "1"]) == 0
    profile = json.loads(capsys.readouterr().out)
    curve = {int(k): v for k, v in profile["ilvas"].items()}
    assert profile["images"] == 3 and profile["num_layers"] == LAYERS
    assert sorted(curve) == list(range(profile["inject_layer"], profile["exit_layer"] - 1))
    assert profile["filter_layers"] == local_maxima(curve, 4) and profile["filter_layers"]

    engine = load_engine(model, device="cpu")
    policy = engine.make_policy("hidivdrop", 1.0)
    assert policy.filter_layers == tuple(profile["filter_layers"])
    assert engine.make_policy("hidivdrop", 1.0, {"filter_layers": [5]}).filter_layers == (5,)  # overrides win
    # calibration measures a configuration with the same profile applied
    from glimpse.pruning import Member

    assert engine.configuration((Member.of("hidivdrop", 1.0),)).policies[0].filter_layers == policy.filter_layers
    # ... except a layer set a member sets itself, which calibration then measures as written
    assert engine.configuration((Member.of("hidivdrop", 1.0, filter_layers=[2, 4]),)).policies[0].filter_layers == (2, 4)
    # A profile of these weights edited by hand into no layers of the model is ignored, and said, at loading: it
    # failed every command for the model, --policy none included, as "a bug in Glimpse" (an outside pass).
    from glimpse.pipeline.profiles import profile_path

    path = profile_path(model)
    default = HiDivDrop().filter_layers
    for layers in (None, "missing", [], ["5", "9"], [5, LAYERS], [5.0, 9], [True]):
        stored = {k: v for k, v in profile.items() if k != "filter_layers" or layers != "missing"}
        if layers != "missing":
            stored["filter_layers"] = layers
        path.write_text(json.dumps(stored))
        caplog.clear()
        with caplog.at_level("WARNING"):
            damaged = load_engine(model, device="cpu")
        assert f"ignoring the hidivdrop profile {path} (filter_layers" in caplog.text, layers
        assert damaged.make_policy("hidivdrop", 1.0).filter_layers == default, layers
        assert damaged.generate(_messages(media), policy="hidivdrop", speed=1.0, max_new_tokens=2).token_ids


def test_calibrate_refuses_bad_settings_and_outputs_before_loading_and_spares_the_files_beside_its_profile(
        deep, media, tmp_path, monkeypatch, capsys):
    """Found from outside: --top-k 0 saved a profile of NaN whose empty layer list HiDivDrop read as "the paper's
    layers", --window 0 one of 1.0 everywhere, --max-images -1 left out the last image, and an --out that is a folder
    failed after the whole calibration. Each is refused before the model loads. Writing the profile replaced a user's
    notes.tmp beside notes.json: it now goes through a temporary file of its own."""
    images = tmp_path / "calibration"
    images.mkdir()
    from PIL import Image

    for i, angle in enumerate((0, 90, 180)):
        Image.open(media["image"]).rotate(angle).save(images / f"{i}.png")
    absent = str(tmp_path / "no-model")  # never reached: each is refused first
    for extra, said in ((["--top-k", "0"], "--window, --top-k and --max-images must be at least 1"),
                        (["--window", "0"], "at least 1"), (["--top-k", "-3"], "at least 1"),
                        (["--max-images", "-1"], "at least 1"), (["--max-images", "0"], "at least 1"),
                        (["--out", str(images)], "is a folder")):
        assert glimpse(["calibrate", "hidivdrop", "--model", absent, "--images", str(images), *extra]) == 1, extra
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, (extra, err)
    notes = tmp_path / "notes.tmp"
    notes.write_text("mine")
    assert glimpse(["calibrate", "hidivdrop", "--model", str(deep["llava"]), "--images", str(images), "--window", "1",
                    "--max-images", "2", "--out", str(tmp_path / "notes.json")]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert profile["images"] == 2 and json.loads((tmp_path / "notes.json").read_text()) == profile
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "calibration", "notes.json", "notes.tmp"]  # no temporary file left either


def test_speed_zero_is_exact_and_no_pruning_is_unchanged(deep, media):
    engine = load_engine(str(deep["llava"]), device="cpu")
    messages = _messages(media)
    exact = engine.generate(messages, policy=NoPruning(), max_new_tokens=8)
    same = engine.generate(messages, policy=Pipeline(policies=(HiDivDrop.from_speed(0.0),)), max_new_tokens=8)
    assert same.token_ids == exact.token_ids
