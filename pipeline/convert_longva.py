"""Convert an original LongVA checkpoint (LLaVA-NeXT code base, ``llava_qwen``) to transformers.

    python -m glimpse.pipeline.convert_longva SRC DST [--vision-tower CLIP_FOLDER]

LongVA is the LLaVA-NeXT layout with a Qwen2 language model. The result is a
``llava_next_video`` checkpoint that ``load_engine(DST)`` serves: LLaVA-NeXT's anyres path for
images, 2x2-pooled frames for video (see docs/models.md). If SRC holds no vision-tower weights,
pass the CLIP ViT-L/14-336 folder they come from with --vision-tower.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'video' %}<video>\n{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def rename(key: str) -> str | None:
    """Original LLaVA-NeXT weight name -> transformers LLaVA-NeXT(-Video) name (None: not a weight we keep)."""
    if key.startswith("model.vision_tower.vision_tower."):
        return "model.vision_tower." + key[len("model.vision_tower.vision_tower."):]
    if key.startswith("model.mm_projector.0."):
        return "model.multi_modal_projector.linear_1." + key.rsplit(".", 1)[1]
    if key.startswith("model.mm_projector.2."):
        return "model.multi_modal_projector.linear_2." + key.rsplit(".", 1)[1]
    if key == "model.image_newline" or key.startswith("lm_head."):
        return key
    if key.startswith(("model.embed_tokens.", "model.layers.", "model.norm.")):
        return "model.language_model." + key[len("model."):]
    return None


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    for file in sorted(folder.glob("pytorch_model*.bin")):
        state.update(torch.load(file, map_location="cpu", weights_only=True))
    if not state:
        raise SystemExit(f"{folder}: no *.safetensors or pytorch_model*.bin weights found")
    return state


def convert(src: Path, dst: Path, vision_tower: Path | None = None) -> Path:
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlavaNextVideoConfig,
                              LlavaNextVideoForConditionalGeneration, Qwen2Config)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}: not a checkpoint folder (no config.json)")
    # Written whole or not at all: into a folder beside DST, renamed to DST at the end. An existing DST is refused:
    # given as SRC itself, the original weights were written over (an outside pass), and a folder killed halfway
    # (a template not yet written) loaded as a model with the wrong chat format.
    if dst.exists() and (dst.resolve() == src.resolve() or any(dst.iterdir())):
        raise SystemExit(f"{dst}: exists and is not empty (or is SRC): give a new folder")
    original = json.loads((src / "config.json").read_text())
    state = {new: value for key, value in load_state_dict(src).items() if (new := rename(key))}
    if vision_tower is not None:
        for key, value in load_state_dict(vision_tower).items():
            if key.startswith("vision_model."):
                state["model.vision_tower." + key] = value
    if not any(k.startswith("model.vision_tower.") for k in state):
        raise SystemExit("no vision-tower weights in the checkpoint: pass --vision-tower CLIP_FOLDER "
                         "(openai/clip-vit-large-patch14-336)")

    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    text_fields = {k: v for k, v in original.items() if k in Qwen2Config().to_dict() and not k.startswith("_")}
    text_fields.pop("architectures", None)
    text_fields.pop("model_type", None)
    text_config = Qwen2Config(**text_fields)
    vision_config = CLIPVisionConfig(**{**CLIP_L_336, **original.get("vision_config", {})})
    pinpoints = original.get("image_grid_pinpoints") or [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    config = LlavaNextVideoConfig(
        text_config=text_config.to_dict(), vision_config=vision_config.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints, vision_feature_layer=original.get("mm_vision_select_layer", -2),
        vision_feature_select_strategy="default", spatial_pool_mode="average",
        spatial_pool_stride=original.get("mm_spatial_pool_stride", 2),
        tie_word_embeddings=original.get("tie_word_embeddings", False),
    )
    with torch.device("meta"):
        model = LlavaNextVideoForConditionalGeneration(config)
    embed = state["model.language_model.embed_tokens.weight"]
    if embed.shape[0] < len(tokenizer):  # room for <image>/<video>; their rows are never read
        pad = embed.new_zeros(len(tokenizer) - embed.shape[0], embed.shape[1])
        state["model.language_model.embed_tokens.weight"] = torch.cat([embed, pad])
        if "lm_head.weight" in state:
            state["lm_head.weight"] = torch.cat([state["lm_head.weight"], pad])
        config.text_config.vocab_size = len(tokenizer)
        with torch.device("meta"):
            model = LlavaNextVideoForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise SystemExit(f"weights do not match the LongVA layout: missing {missing[:5]}, unexpected {unexpected[:5]}")

    staging = dst.parent / f".{dst.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # a killed conversion's
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    LlavaNextImageProcessorPil(size={"shortest_edge": vision_config.image_size},
                               crop_size={"height": vision_config.image_size, "width": vision_config.image_size},
                               image_grid_pinpoints=pinpoints, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                               ).save_pretrained(staging)
    (staging / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    if dst.exists():
        dst.rmdir()  # (empty: checked above)
    staging.rename(dst)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="original LongVA checkpoint folder")
    parser.add_argument("dst", type=Path, help="output folder (transformers llava_next_video)")
    parser.add_argument("--vision-tower", type=Path, default=None, help="CLIP ViT-L/14-336 folder, if SRC lacks it")
    args = parser.parse_args()
    print(f"converted into {convert(args.src, args.dst, args.vision_tower)}")


if __name__ == "__main__":
    main()
