"""Promises of the architecture adapters and the model loader that the engine tests do not hold on their own: each
against transformers' own model, processor or cache, or the documented numbers (found by a mutation pass)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from glimpse.pipeline import load_engine
from glimpse.pipeline.adapters import VIDEO
from tiny_models import build_llava, reference_inputs, transformers_model

MAX_NEW = 10


def _image(media):
    return [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def _generate_both(engine, folder, messages, attn="sdpa"):
    result = engine.generate(messages, policy="none", max_new_tokens=MAX_NEW)
    prompt = engine.prepare(messages)
    with torch.no_grad():
        expected = transformers_model(folder, attn).generate(**reference_inputs(engine, prompt),
                                                             max_new_tokens=MAX_NEW, do_sample=False)
    expected = [t for t in expected[0, len(prompt):].tolist() if t not in engine.eos_token_ids]
    return result.token_ids, expected


def test_a_llava_checkpoint_with_the_full_feature_strategy_answers_as_transformers_does(media, tmp_path):
    """LLaVA-1.5 with ``vision_feature_select_strategy: "full"`` keeps the CLS token: one placeholder more per
    picture than "default", and transformers' own answer."""
    folder = build_llava(tmp_path / "full", vision_feature_select_strategy="full")
    engine = load_engine(str(folder), device="cpu", attn="sdpa")
    got, expected = _generate_both(engine, folder, _image(media))
    assert got == expected


def test_a_llava_checkpoint_taking_video_with_the_full_strategy_is_refused_at_load(tmp_path):
    """docs/models.md: a frame's features are pooled as a grid, which the CLS token of "full" is not part of:
    refused as the model loads, not failing every video request."""
    from glimpse.pipeline.loading import ModelLoadError

    folder = build_llava(tmp_path / "full-video", vision_feature_select_strategy="full", video_token_id=4,
                         video_frames=4, spatial_pool_stride=2)
    with pytest.raises(ModelLoadError, match="'full' is not supported with video"):
        load_engine(str(folder), device="cpu")


def test_a_llava_video_frame_is_its_vision_layer_2x2_average_pooled_then_projected(media, tmp_path):
    """A LLaVA checkpoint with a video token (the embedded model's layout): each frame encoded like a picture from
    the config's ``vision_feature_layer`` without CLS, its grid average-pooled by ``spatial_pool_stride`` before the
    projector (LLaVA-NeXT-Video's pooling: transformers' own ``LlavaNextVideoPooler``)."""
    from transformers.models.llava_next_video.modeling_llava_next_video import LlavaNextVideoPooler

    folder = build_llava(tmp_path / "video", vision_feature_layer=-2, video_token_id=4, video_frames=4,
                         spatial_pool_stride=2)
    engine = load_engine(str(folder), device="cpu")
    item = engine.adapter.prepare_video(media["video"])
    reference = transformers_model(folder)
    pooler = LlavaNextVideoPooler(SimpleNamespace(spatial_pool_mode="average", spatial_pool_stride=2,
                                                  vision_config=reference.config.vision_config))
    with torch.no_grad():
        ours = engine.adapter.encode([item], VIDEO)
        pixels = item.tensors["pixel_values_videos"]
        states = reference.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        theirs = reference.model.multi_modal_projector(pooler(states)).flatten(0, 1)
    assert item.num_tokens == len(theirs)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_longva_samples_16_frames_uniformly_each_pooled_2x2(checkpoints, media):
    """docs/models.md: LongVA takes 16 uniformly sampled frames, each 2x2 average-pooled."""
    from glimpse import vision

    engine = load_engine(str(checkpoints["longva"]), device="cpu")
    item = engine.adapter.prepare_video(media["video"])
    vc = engine.adapter.config.vision_config
    side = vc.image_size // vc.patch_size // 2
    assert len(item.frames) == 16 and item.num_tokens == 16 * side * side
    expected = vision.sample_video_uniform(media["video"], num_frames=16).frames
    assert all(np.array_equal(f, np.asarray(g)) for f, g in zip(expected, item.frames))


def test_a_qwen2_sliding_window_with_no_sliding_layer_does_not_limit_the_context(checkpoints, media, tmp_path):
    """Qwen2's ``use_sliding_window`` slides only the layers from ``max_window_layers`` on: with it at the depth,
    no layer slides (every ``layer_types`` entry is "full_attention"), so the window limits nothing and a prompt
    longer than it is answered as transformers answers it."""
    messages = _image(media)
    length = len(load_engine(str(checkpoints["qwen2_vl"]), device="cpu").prepare(messages))
    folder = shutil.copytree(checkpoints["qwen2_vl"], tmp_path / "no-sliding-layer")
    config = json.loads((folder / "config.json").read_text())
    depth = config["text_config"]["num_hidden_layers"]
    config["text_config"].update(use_sliding_window=True, max_window_layers=depth, sliding_window=length - 2)
    config["text_config"].pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(config))
    engine = load_engine(str(folder), device="cpu")
    assert set(engine.adapter.text_config.layer_types) == {"full_attention"}
    assert engine.max_length == config["text_config"]["max_position_embeddings"]
    got, expected = _generate_both(engine, folder, messages)
    assert got == expected


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_the_kv_budget_counts_one_tokens_keys_and_values_as_transformers_cache_holds_them(checkpoints, media, arch):
    """The server's KV budget unit is one token's keys and values over all layers: grouped-query attention keeps
    ``num_key_value_heads`` heads of them, as transformers' own cache does (the tiny models have 2 of 4)."""
    engine = load_engine(str(checkpoints[arch]), device="cpu")
    prompt = engine.prepare(_image(media))
    with torch.no_grad():
        model = transformers_model(checkpoints[arch])
        cache = model(**reference_inputs(engine, prompt), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert engine.kv_bytes_per_token() * len(prompt) == held


def test_qwen3_vl_deepstack_features_of_the_kept_tokens_are_the_whole_encoder_s_layer_by_layer(checkpoints, media):
    """RLT's encoder run on the kept tokens (``encode_with_layers(keep=...)``) gives Qwen3-VL's DeepStack features
    for decoder layers 0, 1, ... in that order: keeping every token, they are the whole encoder's, layer by layer."""
    engine = load_engine(str(checkpoints["qwen3_vl"]), device="cpu")
    item = engine.adapter.prepare_video(media["video"])
    every = torch.ones(item.num_tokens, dtype=torch.bool)
    with torch.no_grad():
        features, layers = engine.adapter.encode_with_layers([item], VIDEO)
        kept, kept_layers = engine.adapter.encode_with_layers([item], VIDEO, keep=every)
    assert len(layers) == len(kept_layers) == len(engine.model.config.vision_config.deepstack_visual_indexes)
    torch.testing.assert_close(kept, features, atol=1e-5, rtol=1e-5)
    for whole, only_kept in zip(layers, kept_layers):
        torch.testing.assert_close(only_kept, whole, atol=1e-5, rtol=1e-5)


def test_the_attention_and_dtype_asked_for_are_the_ones_the_model_runs(checkpoints):
    """README/docs/models.md: attention ``auto`` is sdpa without flash-attention on CUDA (so on a CPU), ``eager`` on
    request, for the language model and the vision tower; dtype ``auto`` is float32 on a CPU, else the one named."""
    for attn, expected in (("auto", "sdpa"), ("eager", "eager"), ("sdpa", "sdpa")):
        engine = load_engine(str(checkpoints["llava"]), device="cpu", attn=attn)
        assert engine.attn_implementation == expected, attn
        assert engine.model.config.vision_config._attn_implementation == expected, attn
    for dtype, expected in (("auto", torch.float32), ("float32", torch.float32), ("float16", torch.float16),
                            ("bfloat16", torch.bfloat16)):
        engine = load_engine(str(checkpoints["llava"]), device="cpu", dtype=dtype)
        assert engine.model.dtype == expected and engine.dtype == expected, dtype


def test_an_unknown_attention_backend_is_refused_before_the_model_loads(checkpoints, tmp_path):
    from glimpse.pipeline.loading import ModelLoadError

    folder = shutil.copytree(checkpoints["llava"], tmp_path / "llava")
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"")  # refused before these are read
    with pytest.raises(ModelLoadError, match="unknown attention backend 'flash'"):
        load_engine(str(folder), device="cpu", attn="flash")


def test_a_qwen_pictures_token_grid_is_its_processor_s_rows_by_columns(checkpoints, tmp_path):
    """The keep map draws a Qwen picture's tokens over its (t, h, w) grid: a wide picture's grid is the processor's
    ``image_grid_thw`` merged, rows then columns (wider than tall), not its transpose."""
    from PIL import Image

    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    picture = Image.new("RGB", (112, 56), (200, 30, 30))
    item = engine.adapter.prepare_image(picture)
    t, h, w = (int(x) for x in item.tensors["image_grid_thw"][0])
    m = engine.model.config.vision_config.spatial_merge_size
    assert item.grid == (t, h // m, w // m) and item.grid[2] > item.grid[1]


def test_auto_attention_is_flash_attention_only_on_cuda_in_half_precision(monkeypatch):
    """docs/models.md: ``auto`` is flash_attention_2 where flash-attn is installed on CUDA and the weights are
    bfloat16 or float16 (flash-attention computes in half precision only), else sdpa."""
    import importlib.util

    from glimpse.pipeline.loading import resolve_attn

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_attn("auto", cuda, torch.bfloat16) == "flash_attention_2"
    assert resolve_attn("auto", cuda, torch.float16) == "flash_attention_2"
    assert resolve_attn("auto", cuda, torch.float32) == resolve_attn("auto", cpu, torch.bfloat16) == "sdpa"


def test_the_batch_preprocessor_refuses_a_prompt_past_the_context_as_the_engine_does(checkpoints, media, tmp_path):
    """The Ray captioner's CPU tasks build prompts with ``Preprocessor`` and the actors take them as they are: a
    prompt past the model's context is refused there, as ``engine.prepare`` refuses it."""
    from glimpse.pipeline import Preprocessor
    from glimpse.pipeline.prompt import ContextOverflow

    folder = shutil.copytree(checkpoints["llava"], tmp_path / "short")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 24  # fewer than a picture's 16 tokens and the question
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ContextOverflow):
        load_engine(str(folder), device="cpu").prepare(_image(media))
    with pytest.raises(ContextOverflow):
        Preprocessor(str(folder)).prepare(_image(media))


def test_a_chat_template_that_writes_only_blanks_is_refused_at_load(checkpoints, tmp_path):
    from glimpse.pipeline.loading import ModelLoadError

    folder = shutil.copytree(checkpoints["llava"], tmp_path / "blank")
    (folder / "chat_template.jinja").write_text("{{ '  \\n ' }}")
    with pytest.raises(ModelLoadError, match="writes nothing"):
        load_engine(str(folder), device="cpu")


def test_a_checkpoint_with_both_chat_template_files_is_prompted_as_transformers_processor_prompts_it(
        checkpoints, tmp_path):
    """transformers' processor takes the legacy chat_template.json whenever a checkpoint has one, beside a
    chat_template.jinja too: the prompt Glimpse builds is the one the processor's template renders."""
    from transformers import AutoProcessor

    folder = shutil.copytree(checkpoints["llava"], tmp_path / "both")
    jinja = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "LEGACY " + jinja}))
    assert AutoProcessor.from_pretrained(folder).chat_template.startswith("LEGACY ")  # (transformers' own choice)
    engine = load_engine(str(folder), device="cpu")
    said = [{"role": "user", "content": "Say hi."}]
    assert engine.prepare(said).text.lstrip().startswith("LEGACY")
