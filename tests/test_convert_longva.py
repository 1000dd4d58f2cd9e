"""The LongVA converter maps an original (LLaVA-NeXT code base) checkpoint onto transformers' layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from glimpse.pipeline import load_engine
from glimpse.pipeline.convert_longva import convert


def _runtime_state(folder) -> dict[str, torch.Tensor]:
    from transformers import LlavaNextVideoForConditionalGeneration

    return LlavaNextVideoForConditionalGeneration.from_pretrained(folder).state_dict()


def _to_original_layout(hf_folder, out):
    """Write the tiny LongVA checkpoint the way the LongVA code base saves one."""
    original_names = {
        "model.vision_tower.": "model.vision_tower.vision_tower.",
        "model.multi_modal_projector.linear_1.": "model.mm_projector.0.",
        "model.multi_modal_projector.linear_2.": "model.mm_projector.2.",
        "model.language_model.": "model.",
    }
    state = _runtime_state(hf_folder)
    renamed = {}
    for key, value in state.items():
        for new, old in original_names.items():
            if key.startswith(new):
                key = old + key[len(new):]
                break
        renamed[key] = value.contiguous()
    out.mkdir()
    save_file(renamed, out / "model.safetensors")
    hf = json.loads((hf_folder / "config.json").read_text())
    config = {**hf["text_config"], "model_type": "llava_qwen", "architectures": ["LlavaQwenForCausalLM"],
              "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2, "mm_spatial_pool_stride": 2,
              "image_grid_pinpoints": hf["image_grid_pinpoints"], "image_aspect_ratio": "anyres",
              # a tiny CLIP tower instead of ViT-L/14-336 (the converter's default)
              "vision_config": {k: hf["vision_config"][k] for k in
                                ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "image_size", "patch_size", "projection_dim", "hidden_act")}}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((hf_folder / name).read_bytes())
    return out


def test_converted_longva_has_the_original_weights_and_serves(checkpoints, media, tmp_path):
    original = _to_original_layout(checkpoints["longva"], tmp_path / "original")
    converted = convert(original, tmp_path / "converted")

    expected = _runtime_state(checkpoints["longva"])
    got = _runtime_state(converted)
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)

    engine = load_engine(str(converted), device="cpu")
    result = engine.generate([{"role": "user", "content": [
        {"type": "image", "image": str(media["image"])}, {"type": "video", "video": str(media["video"])},
        {"type": "text", "text": "Describe both."}]}], max_new_tokens=3)
    counts = result.metrics["prompt_tokens"]
    assert counts["image"] > 0 and counts["video"] > 0
    assert len(result.token_ids) >= 1


def test_the_converter_never_writes_over_its_source_or_a_folder_and_leaves_nothing_half_written(
        checkpoints, tmp_path, monkeypatch):
    """Found from outside: DST given as SRC wrote over the original weights (a 15 GB download for the 7B model), and
    a conversion killed before its chat template was written left a folder that loaded with the wrong chat format.
    SRC, or any folder that is not empty, is refused; the model is written beside DST and renamed at the end."""
    from transformers import LlavaNextVideoForConditionalGeneration

    original = _to_original_layout(checkpoints["longva"], tmp_path / "original")
    before = {p.name: p.read_bytes() for p in original.iterdir()}
    for dst in (original, tmp_path / "original" / ".." / "original"):
        with pytest.raises(SystemExit, match="exists and is not empty"):
            convert(original, dst)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="exists and is not empty"):
        convert(original, tmp_path / "notes")
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        convert(tmp_path / "nothing", tmp_path / "out")
    assert {p.name: p.read_bytes() for p in original.iterdir()} == before

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # killed as the weights are written

    with monkeypatch.context() as patch:
        patch.setattr(LlavaNextVideoForConditionalGeneration, "save_pretrained", killed)
        with pytest.raises(KeyboardInterrupt):
            convert(original, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()  # nothing that could load as a model
    (tmp_path / "converted").mkdir()  # an empty folder is fine, and the half-written one is cleared
    assert (convert(original, tmp_path / "converted") / "chat_template.jinja").is_file()
    assert not list(tmp_path.glob(".converted.partial"))
