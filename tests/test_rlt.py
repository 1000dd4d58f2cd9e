"""RLT (pruning/rlt.py): a video's repeated tokens are left out before the vision encoder, and then they are
in no layer, no cache and no cached encoder output of another request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glimpse.pipeline import load_engine
from glimpse.pipeline.adapters import TEXT, VIDEO
from glimpse.pruning import HiDivDrop, NoPruning, Pipeline, RLT, make_policy
from glimpse.pruning.rlt import repeated_tokens
from tiny_models import masked_reference


@pytest.fixture(scope="module")
def moving_square(media) -> Path:
    return media["moving_square"]


def _video_messages(path: Path, question: str = "What moves in this video?") -> list:
    return [{"role": "user", "content": [{"type": "video", "video": str(path)}, {"type": "text", "text": question}]}]


def test_a_token_repeats_until_its_change_from_the_last_kept_one_reaches_tau():
    steps = torch.arange(5, dtype=torch.float32)[:, None, None]  # tokens of 4 patches of 8 values, 5 steps
    still = torch.zeros(5, 4, 8)
    drifting = steps.expand(5, 4, 8) * 0.06  # 0.06 a step: below tau=0.1 from one step to the next
    changing = steps.expand(5, 4, 8) * 1.0
    one_patch_moves = torch.zeros(5, 4, 8)
    one_patch_moves[:, 3] = steps[:, 0] * 0.2  # 0.2 in one patch: 0.05 averaged over the token's four
    pixels = torch.stack([still, drifting, changing, one_patch_moves], dim=1)  # (t, n=4, p=4, f=8)
    repeats = repeated_tokens(pixels, tau=0.1)
    assert not repeats[0].any()  # the first step is kept whole
    assert repeats[1:, 0].all()  # a still token repeats the first one
    assert not repeats[1:, 2].any()  # a token that changes a lot every step is kept every step
    # The drift is measured from the last token kept at its place, not from the step just before (which would
    # drop it every time): 0.06 (repeat), 0.12 (kept), 0.06 from the kept one (repeat), 0.12 (kept).
    assert repeats[1:, 1].tolist() == [True, False, True, False]
    assert not repeats[1:, 3].any()  # one changed patch keeps its token
    assert not repeated_tokens(pixels, tau=0.0).any()  # tau 0: off


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])  # per step; windows; interpolated positions
def test_the_qwen_encoder_computes_only_the_kept_tokens_and_each_step_on_its_own(checkpoints, moving_square, arch):
    engine = load_engine(str(checkpoints[arch]), device="cpu")
    adapter = engine.adapter
    item = engine.prepare(_video_messages(moving_square)).media[0]
    t, h, w = item.grid
    assert t >= 3
    patches_in = []
    hook = adapter.model.model.visual.patch_embed.register_forward_hook(
        lambda module, args, out: patches_in.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            full = adapter.encode([item], VIDEO).reshape(t, h * w, -1)
            every = torch.ones(t * h * w, dtype=torch.bool)
            torch.testing.assert_close(adapter.encode_kept([item], VIDEO, every).reshape(t, h * w, -1), full)
            # Step 1 left out whole, half of step 2's tokens left out.
            keep = torch.ones(t, h * w, dtype=torch.bool)
            keep[1] = False
            keep[2, ::2] = False
            kept = adapter.encode_kept([item], VIDEO, keep.flatten())
    finally:
        hook.remove()
    assert patches_in[-1] == int(keep.sum()) * adapter.merge_size**2  # the encoder never saw the others
    assert kept.shape[0] == int(keep.sum())
    rows = torch.full((t, h * w), -1)
    rows[keep] = torch.arange(kept.shape[0])
    # Every step attends only within itself: the untouched steps come out as from the whole video ...
    for step in [0, *range(3, t)]:
        torch.testing.assert_close(kept[rows[step]], full[step], atol=1e-5, rtol=1e-5)
    # ... and the kept half of step 2 saw only its own step's kept patches, so it differs from the whole video's.
    assert (kept[rows[2, 1::2]] - full[2, 1::2]).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "longva"])  # the encoder leaves tokens out; drops them after it
def test_the_tokens_rlt_skips_are_in_no_layer_and_the_rest_is_exactly_masking_them(checkpoints, moving_square, arch):
    engine = load_engine(str(checkpoints[arch]), device="cpu", attn="eager")
    prompt = engine.prepare(_video_messages(moving_square))
    policy = RLT(tau=0.05)
    with torch.no_grad():
        logits, ctx = engine.prefill(prompt, policy)
        unpruned, _ = engine.prefill(prompt, NoPruning())
        reference = masked_reference(engine, prompt, ctx.active_per_layer, ctx.attention_per_layer, ctx.encoded)
    skipped = (~ctx.encoded).nonzero().squeeze(1)
    assert 0 < skipped.numel() == policy.telemetry["not_encoded"]
    assert (prompt.modality[skipped.cpu()] == VIDEO).all()
    first_step = next(tokens for item, tokens in prompt.media_rows())[: int(prompt.media[0].num_tokens // prompt.media[0].grid[0])]
    assert not torch.isin(first_step, skipped).any()
    for layer, active in enumerate(ctx.active_per_layer):
        assert not torch.isin(active, skipped).any(), layer
        assert not torch.isin(ctx.cache.tokens(layer), skipped).any(), layer
    # Everything else is the model run on the kept tokens: the logits of the decoder with the skipped ones masked out
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    assert (logits - unpruned).abs().max() > 1e-4


def test_rlt_at_speed_zero_is_the_unpruned_model_on_a_video(checkpoints, moving_square):
    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    messages = _video_messages(moving_square)
    exact = engine.generate(messages, policy="none", max_new_tokens=8)
    result = engine.generate(messages, policy="rlt", speed=0.0, max_new_tokens=8)
    assert result.token_ids == exact.token_ids
    assert result.metrics["prefill_flops"] == result.metrics["prefill_flops_baseline"]
    pruned = engine.generate(messages, policy="rlt", speed=1.0, max_new_tokens=8)
    assert pruned.metrics["prefill_flops"] < pruned.metrics["prefill_flops_baseline"]


def test_a_late_injecting_policy_does_not_bring_back_a_token_the_encoder_skipped(deep_checkpoints, moving_square):
    engine = load_engine(str(deep_checkpoints["qwen2_vl"]), device="cpu")
    prompt = engine.prepare(_video_messages(moving_square))
    hidivdrop = HiDivDrop.from_speed(0.5)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, Pipeline(policies=(RLT(tau=0.05), hidivdrop)))
    skipped = (~ctx.encoded).nonzero().squeeze(1)
    injected_at = hidivdrop.params()["inject_layer"]
    assert skipped.numel() and injected_at > 0
    visual = prompt.modality.to(ctx.active_per_layer[0].device) == VIDEO
    assert visual[ctx.active_per_layer[injected_at]].any()  # vision did join there ...
    for active in ctx.active_per_layer:
        assert not torch.isin(active, skipped).any()  # ... without the skipped tokens


def test_the_encoder_cache_never_hands_a_full_video_the_features_of_a_pruned_one(checkpoints, moving_square):
    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    messages = _video_messages(moving_square)
    fresh = {name: engine.generate(messages, policy=name, speed=1.0, max_new_tokens=6).token_ids for name in ("none", "rlt")}
    engine.encoder_cache.max_bytes = 64 << 20
    for name in ("rlt", "none", "rlt", "none"):
        assert engine.generate(messages, policy=name, speed=1.0, max_new_tokens=6).token_ids == fresh[name], name
    assert engine.encoder_cache.hits == 2 and engine.encoder_cache.misses == 2


def test_rlt_prunes_more_of_a_still_video_as_speed_rises_and_never_an_image(checkpoints, moving_square, media):
    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    skipped = []
    for speed in (0.0, 0.25, 0.5, 1.0):
        result = engine.generate(_video_messages(moving_square), policy=make_policy("rlt", speed), max_new_tokens=1)
        skipped.append(result.metrics["policy_telemetry"]["not_encoded"])
    assert skipped[0] == 0 and all(b >= a for a, b in zip(skipped, skipped[1:])) and skipped[-1] > 0
    image = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])}, {"type": "text", "text": "?"}]}]
    result = engine.generate(image, policy="rlt", speed=1.0, max_new_tokens=1)
    assert result.metrics["prefill_flops"] == result.metrics["prefill_flops_baseline"]


def test_the_pixels_rlt_compares_are_each_tokens_own_cell(checkpoints, moving_square):
    """LLaVA-family videos: token i of a frame is the i-th pooled cell, row by row (the order the projector's
    features come in): each token's pixels average to that cell's colour as the adapter's own pooling gives it."""
    engine = load_engine(str(checkpoints["longva"]), device="cpu")
    adapter = engine.adapter
    item = engine.prepare(_video_messages(moving_square)).media[0]
    cells = adapter.token_pixels(item)  # (frames, tokens, patches, C*P*P)
    frames, tokens = cells.shape[:2]
    assert frames * tokens == item.num_tokens
    pixels = item.tensors["pixel_values_videos"].reshape(frames, *item.tensors["pixel_values_videos"].shape[-3:])
    colours = adapter.cell_colours(pixels, adapter.config.spatial_pool_stride)  # (frames, tokens, 3)
    means = cells.reshape(frames, tokens, cells.shape[2], 3, -1).mean(dim=(2, 4))
    torch.testing.assert_close(means, colours, atol=1e-5, rtol=1e-5)


def test_divprune_under_rlt_keeps_its_share_of_each_frames_encoded_tokens(deep_checkpoints, moving_square):
    from glimpse.pruning import DivPrune
    from glimpse.pruning.divprune import kept_count

    engine = load_engine(str(deep_checkpoints["qwen2_vl"]), device="cpu")
    prompt = engine.prepare(_video_messages(moving_square))
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, Pipeline(policies=(RLT(tau=0.05), DivPrune(keep=0.5))))
    item, tokens = prompt.media_rows()[0]
    encoded = ctx.encoded.cpu()
    layer0 = ctx.active_per_layer[0].cpu()
    for step in tokens.reshape(item.grid[0], -1):
        reaching = step[encoded[step]]
        kept = step[torch.isin(step, layer0)]
        assert torch.isin(kept, reaching).all()  # never a token the encoder skipped ...
        assert kept.numel() == (kept_count(0.5, reaching.numel()) if reaching.numel() else 0)  # ... half of the rest


def test_a_policy_that_skips_every_visual_token_runs_no_encoder(checkpoints, moving_square):
    """A composition may leave nothing of a video to encode: the request then answers from the text, with no
    encoder call on an empty input."""
    from dataclasses import dataclass

    from glimpse.pruning import Policy

    @dataclass
    class SkipAllVisual(Policy):
        name = "skip_all_visual"

        def skip_encoding(self, ctx):
            return (ctx.prompt.modality != TEXT).nonzero().squeeze(1)

    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    calls = []
    hook = engine.adapter.model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    try:
        result = engine.generate(_video_messages(moving_square), policy=SkipAllVisual(), max_new_tokens=3)
    finally:
        hook.remove()
    assert not calls and result.token_ids and result.metrics["active_tokens_per_layer"][0] == result.metrics["prompt_tokens"]["text"]


def test_rlt_parameters_past_their_edges_are_a_clear_error_or_an_answer_on_a_video(checkpoints, moving_square):
    """What a client may send as ``params`` (the API, the chat's overrides box): a negative, non-finite or
    mistyped tau is refused as the user's mistake; a huge one leaves out all but the first step, and answers."""
    from glimpse.common import UserError

    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    messages = _video_messages(moving_square)
    for bad in (-1.0, float("nan"), float("inf"), "abc", [0.1]):
        with pytest.raises(UserError):
            engine.generate(messages, policy=make_policy("rlt", 1.0, {"tau": bad}), max_new_tokens=1)
    result = engine.generate(messages, policy=make_policy("rlt", 1.0, {"tau": 1e300}), max_new_tokens=2)
    item = engine.prepare(messages).media[0]
    assert result.token_ids
    assert result.metrics["policy_telemetry"]["not_encoded"] == item.num_tokens - item.num_tokens // item.grid[0]
