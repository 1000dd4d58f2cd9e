"""Random-weights checkpoints with real model shapes, for benchmarks and tests (no downloads).

``build_random_qwen2_vl(folder)`` writes a complete Qwen2-VL checkpoint folder — weights, config,
tokenizer, PIL image processor, chat template — that ``pipeline.load_engine(folder)`` loads exactly
like a real one. The decoder has the text shapes of a real Qwen2-VL size (``PRESETS``), so the time
and memory of prefill are those of the real model at that depth; the vision tower keeps the real
width but only ``vision_depth`` layers, since it is not what the benchmarks measure. The weights are
random: answers are noise, speed and memory are not.

``build_random_llava(folder)`` does the same for LLaVA-1.5 (``LLAVA_PRESETS``: llava-hf/llava-1.5-7b-hf's
Llama-2-7B decoder and CLIP ViT-L/14-336 tower width; 576 image tokens per image, fixed by the
336x336 input). ``build_random(folder, preset=...)`` picks the builder of the preset's family.
``REAL_PRESETS`` lists the presets with real model shapes (the others are for tests).

The tokenizer is a small byte-level BPE trained on the fly (``make_tokenizer``), with the special
tokens of the real checkpoint; ``QWEN_TEMPLATE`` is a Qwen2-VL style chat template and
``LLAVA_TEMPLATE`` llava-hf's LLaVA-1.5 one ("USER: <image>\\n... ASSISTANT:"). Both tokenizer and
Qwen template are also used by the tests' tiny checkpoints (tests/tiny_models.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from pathlib import Path

if TYPE_CHECKING:  # torch is imported where weights are built, so the CLI can read the presets without it
    import torch

CORPUS = [
    "What is in this picture? Describe the image in detail. A red circle and a blue square.",
    "The video shows a ball that moves from left to right, then changes colour.",
    "user assistant system You are a helpful assistant. Hello! How are you today?",
    "one two three four five six seven eight nine ten colour shape size count position",
]

QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]

LLAVA_TEMPLATE = (  # llava-hf's LLaVA-1.5 format: "USER: <image>\n{question} ASSISTANT:"
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{% if message['role'] == 'user' %} {% else %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]

# Text shapes of the real checkpoints (config.json of Qwen/Qwen2-VL-2B-Instruct and -7B-Instruct); the
# vision tower has the real width in both (embed_dim 1280, 16 heads, mlp_ratio 4) and projects to the
# text hidden size. "tiny" is for tests: the same structure at a width that builds in a second.
PRESETS: dict[str, dict] = {
    "qwen2-vl-2b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                        num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6,
                        mrope_section=[16, 24, 24], tie_word_embeddings=True, max_position_embeddings=32768,
                        rms_norm_eps=1e-6, vision_embed_dim=1280, vision_num_heads=16, vision_mlp_ratio=4),
    "qwen2-vl-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
                        mrope_section=[16, 24, 24], tie_word_embeddings=False, max_position_embeddings=32768,
                        rms_norm_eps=1e-6, vision_embed_dim=1280, vision_num_heads=16, vision_mlp_ratio=4),
    # Qwen2.5-VL (config.json of Qwen/Qwen2.5-VL-3B-Instruct and -7B-Instruct): the same decoder family, a
    # window-attention vision tower (width 1280, 16 heads, SwiGLU MLP 3420, windows of 112 pixels, full
    # attention in blocks 7, 15, 23, 31) and absolute-time M-RoPE for video.
    "qwen2.5-vl-3b": dict(arch="qwen2_5_vl", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                          num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, rope_theta=1e6,
                          mrope_section=[16, 24, 24], tie_word_embeddings=True, max_position_embeddings=128000,
                          rms_norm_eps=1e-6, vision_embed_dim=1280, vision_num_heads=16, vision_mlp_ratio=3420 / 1280),
    "qwen2.5-vl-7b": dict(arch="qwen2_5_vl", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                          num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, rope_theta=1e6,
                          mrope_section=[16, 24, 24], tie_word_embeddings=False, max_position_embeddings=128000,
                          rms_norm_eps=1e-6, vision_embed_dim=1280, vision_num_heads=16, vision_mlp_ratio=3420 / 1280),
    # Qwen3-VL, dense (config.json of Qwen/Qwen3-VL-4B-Instruct and -8B-Instruct): q/k norms, head_dim 128
    # whatever the width, interleaved M-RoPE; a SigLIP-2 tower with 16-pixel patches (32x32 pixels per LLM
    # token) whose DeepStack blocks feed the first decoder layers.
    "qwen3-vl-4b": dict(arch="qwen3_vl", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        rope_theta=5e6, mrope_section=[24, 20, 20], tie_word_embeddings=True,
                        max_position_embeddings=262144, rms_norm_eps=1e-6, vision_embed_dim=1024,
                        vision_num_heads=16, vision_mlp_ratio=4.0, deepstack=[5, 11, 17]),
    "qwen3-vl-8b": dict(arch="qwen3_vl", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        rope_theta=5e6, mrope_section=[24, 20, 20], tie_word_embeddings=False,
                        max_position_embeddings=262144, rms_norm_eps=1e-6, vision_embed_dim=1152,
                        vision_num_heads=16, vision_mlp_ratio=4304 / 1152, deepstack=[8, 16, 24]),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, mrope_section=[2, 3, 3],
                 tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 vision_embed_dim=32, vision_num_heads=4, vision_mlp_ratio=2),
}

# LLaVA-1.5 (config.json of llava-hf/llava-1.5-7b-hf): a Llama-2-7B decoder (32 heads, no GQA) and a CLIP
# ViT-L/14-336 tower (width 1024, 16 heads, MLP 4096; 336 / 14 = 24x24 = 576 image tokens). "llava-tiny"
# is for tests: the same structure at a width that builds in a second (56 / 14 = 4x4 = 16 image tokens).
LLAVA_PRESETS: dict[str, dict] = {
    "llava-1.5-7b": dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
                         tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         vision_hidden_size=1024, vision_intermediate_size=4096, vision_num_heads=16,
                         vision_patch_size=14, vision_image_size=336, vision_projection_dim=768),
    "llava-tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0,
                       tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       vision_hidden_size=32, vision_intermediate_size=64, vision_num_heads=4,
                       vision_patch_size=14, vision_image_size=56, vision_projection_dim=32),
}
REAL_PRESETS = ["qwen2-vl-2b", "qwen2-vl-7b", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen3-vl-4b", "qwen3-vl-8b",
                "llava-1.5-7b"]

# The real Qwen2-VL image processor's budget: max_pixels 12845056 = 16384 tokens, min_pixels 3136.
DEFAULT_MAX_VISUAL_TOKENS = 16384


def make_tokenizer(special: list[str], eos: str, bos: str | None = None, vocab_size: int = 300):
    """A small byte-level BPE trained on ``CORPUS``, with ``special`` tokens first (ids 0..)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=eos)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: use {', '.join(names)}")
    return names[dtype]


def build_random_qwen2_vl(folder: str | Path, *, preset: str = "qwen2-vl-2b", layers: int | None = None,
                          vision_depth: int = 1, max_visual_tokens: int = DEFAULT_MAX_VISUAL_TOKENS,
                          dtype: str | torch.dtype = "float32", seed: int = 0,
                          init_device: str | torch.device | None = None, **overrides) -> Path:
    """Write a random-weights Qwen2-VL (or Qwen2.5-VL, for its presets) checkpoint with the text shapes of
    ``preset`` into ``folder``.

    ``layers`` overrides the decoder depth; ``vision_depth`` is the vision tower's depth (real width).
    The image processor admits images of up to ``max_visual_tokens`` visual tokens (28x28 pixels each;
    32x32 for Qwen3-VL's 16-pixel patches)
    without shrinking them. Weights are created and saved in ``dtype`` (bfloat16 for GPU runs keeps a
    7B-width model at half the memory of float32). ``init_device`` ("cuda") makes the random
    initialisation of a large model fast; the files are the same. ``overrides`` replace preset keys
    (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``vision_embed_dim``, ...).
    Returns ``folder``.
    """
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if preset not in PRESETS:
        hint = " (a LLaVA preset: use build_random_llava or build_random)" if preset in LLAVA_PRESETS else ""
        raise ValueError(f"unknown preset {preset!r}{hint}; available: {', '.join(PRESETS)}")
    unknown = set(overrides) - set(PRESETS[preset])
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}; known: {sorted(PRESETS[preset])}")
    shape = {**PRESETS[preset], **overrides}
    arch = shape.pop("arch", "qwen2_vl")
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if shape["num_hidden_layers"] < 1 or vision_depth < 1:
        raise ValueError("layers and vision_depth must be at least 1")
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    if sum(shape["mrope_section"]) * 2 != head_dim:
        raise ValueError(f"mrope_section {shape['mrope_section']} must sum to head_dim / 2 = {head_dim // 2}")
    torch_dtype = _dtype(dtype)

    tok = make_tokenizer(QWEN_SPECIAL_TOKENS, eos="<|im_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    eos = ids["<|im_end|>"]
    patch = 16 if arch == "qwen3_vl" else 14
    if arch == "qwen3_vl":
        width = shape["vision_embed_dim"]
        # DeepStack blocks of the real tower that this depth has (at least one, so the path is exercised)
        deepstack = [i for i in shape["deepstack"] if i < vision_depth] or [0]
        vision_config = dict(depth=vision_depth, hidden_size=width, intermediate_size=round(width * shape["vision_mlp_ratio"]),
                             num_heads=shape["vision_num_heads"], out_hidden_size=shape["hidden_size"], patch_size=patch,
                             spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                             deepstack_visual_indexes=deepstack)
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    elif arch == "qwen2_5_vl":
        width = shape["vision_embed_dim"]
        vision_config = dict(depth=vision_depth, hidden_size=width, intermediate_size=round(width * shape["vision_mlp_ratio"]),
                             num_heads=shape["vision_num_heads"], out_hidden_size=shape["hidden_size"], patch_size=patch,
                             spatial_merge_size=2, temporal_patch_size=2, window_size=112, tokens_per_second=2,
                             fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < vision_depth])
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision_config = dict(depth=vision_depth, embed_dim=shape["vision_embed_dim"], hidden_size=shape["hidden_size"],
                             num_heads=shape["vision_num_heads"], mlp_ratio=shape["vision_mlp_ratio"], patch_size=patch,
                             spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    config = config_class(
        text_config=dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
                         num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_key_value_heads"],
                         max_position_embeddings=shape["max_position_embeddings"], rms_norm_eps=shape["rms_norm_eps"],
                         bos_token_id=None, eos_token_id=eos, pad_token_id=ids["<|endoftext|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"],
                                          "mrope_section": list(shape["mrope_section"]),
                                          **({"mrope_interleaved": True} if arch == "qwen3_vl" else {})},
                         **({"head_dim": head_dim} if arch == "qwen3_vl" else {})),
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=shape["tie_word_embeddings"],
    )
    torch.manual_seed(seed)
    with torch.device(init_device or "cpu"):
        model = model_class._from_config(config, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    cell = patch * 2  # pixels per side of one LLM token (patches merged 2x2)
    max_pixels = max(int(max_visual_tokens), 4) * cell * cell
    processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2,
                                         size={"shortest_edge": 2 * cell * 2 * cell, "longest_edge": max_pixels})

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    del model
    if torch.device(init_device or "cpu").type == "cuda":
        torch.cuda.empty_cache()  # give the builder's copy back before the engine loads its own
    tok.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return folder


def llava_config(preset: str = "llava-1.5-7b", *, layers: int | None = None, vision_depth: int = 1, **overrides):
    """The ``LlavaConfig`` that ``build_random_llava`` writes (arguments as there), without building weights:
    e.g. ``LlavaForConditionalGeneration._from_config(config)`` under ``torch.device("meta")`` checks shapes
    for free. Token ids are those of ``LLAVA_SPECIAL_TOKENS`` (ids 0.. in the builder's tokenizer)."""
    from transformers import LlavaConfig

    if preset not in LLAVA_PRESETS:
        hint = " (a Qwen2-VL preset: use build_random_qwen2_vl or build_random)" if preset in PRESETS else ""
        raise ValueError(f"unknown LLaVA preset {preset!r}{hint}; available: {', '.join(LLAVA_PRESETS)}")
    unknown = set(overrides) - set(LLAVA_PRESETS[preset])
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}; known: {sorted(LLAVA_PRESETS[preset])}")
    shape = {**LLAVA_PRESETS[preset], **overrides}
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if shape["num_hidden_layers"] < 1 or vision_depth < 1:
        raise ValueError("layers and vision_depth must be at least 1")
    if shape["hidden_size"] % shape["num_attention_heads"] or shape["vision_hidden_size"] % shape["vision_num_heads"]:
        raise ValueError("hidden_size and vision_hidden_size must be multiples of their head counts")
    size, patch = shape["vision_image_size"], shape["vision_patch_size"]
    if size % patch:
        raise ValueError(f"vision_image_size {size} must be a multiple of the patch size {patch}")
    ids = {t: i for i, t in enumerate(LLAVA_SPECIAL_TOKENS)}
    return LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                         intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
                         num_attention_heads=shape["num_attention_heads"],
                         num_key_value_heads=shape["num_key_value_heads"],
                         max_position_embeddings=shape["max_position_embeddings"], rms_norm_eps=shape["rms_norm_eps"],
                         bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                         rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
                         tie_word_embeddings=shape["tie_word_embeddings"]),
        vision_config=dict(model_type="clip_vision_model", hidden_size=shape["vision_hidden_size"],
                           intermediate_size=shape["vision_intermediate_size"], num_hidden_layers=vision_depth,
                           num_attention_heads=shape["vision_num_heads"], image_size=size, patch_size=patch,
                           projection_dim=shape["vision_projection_dim"], hidden_act="quick_gelu", layer_norm_eps=1e-5),
        image_token_id=ids["<image>"], image_seq_length=(size // patch) ** 2,
        projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
        pad_token_id=ids["<pad>"], tie_word_embeddings=shape["tie_word_embeddings"],
    )


def build_random_llava(folder: str | Path, *, preset: str = "llava-1.5-7b", layers: int | None = None,
                       vision_depth: int = 1, dtype: str | torch.dtype = "float32", seed: int = 0,
                       init_device: str | torch.device | None = None, **overrides) -> Path:
    """Write a random-weights LLaVA-1.5 checkpoint with the shapes of ``preset`` into ``folder``.

    A ``LlavaForConditionalGeneration`` (Llama decoder, CLIP vision tower, 2-layer GELU projector)
    with llava-hf's settings: ``vision_feature_layer`` -2 and ``vision_feature_select_strategy``
    "default" (CLS dropped), an ``<image>`` token, a PIL ``CLIPImageProcessorPil`` (shortest edge and
    centre crop = the tower's image size, CLIP mean/std) and the "USER: <image>\\n... ASSISTANT:" chat
    template. Every image is ``(image_size / patch) ** 2`` tokens (576 for llava-1.5-7b), whatever its size.

    ``layers`` overrides the decoder depth. ``vision_depth`` is the vision tower's depth (real width);
    the features are its second-to-last hidden state, as in the real model, so with the default
    single layer they are the tower's embeddings (that layer's input) and the layer runs unused — as
    the real tower's 24th does. ``dtype``, ``init_device`` and ``seed`` are as in
    ``build_random_qwen2_vl``; ``overrides`` replace preset keys (``hidden_size``, ``intermediate_size``,
    ``num_attention_heads``, ``vision_hidden_size``, ``vision_image_size``, ...). Returns ``folder``.
    """
    import torch
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration

    config = llava_config(preset, layers=layers, vision_depth=vision_depth, **overrides)
    torch_dtype = _dtype(dtype)
    tok = make_tokenizer(LLAVA_SPECIAL_TOKENS, eos="</s>", bos="<s>")
    tok.pad_token = "<pad>"
    if [tok.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL_TOKENS] != list(range(len(LLAVA_SPECIAL_TOKENS))):
        raise RuntimeError("the tokenizer's special-token ids differ from llava_config's")
    eos, size = tok.eos_token_id, config.vision_config.image_size
    torch.manual_seed(seed)
    with torch.device(init_device or "cpu"):
        model = LlavaForConditionalGeneration._from_config(config, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    del model
    if torch.device(init_device or "cpu").type == "cuda":
        torch.cuda.empty_cache()
    tok.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(LLAVA_TEMPLATE)
    return folder


def preset_family(preset: str) -> str:
    """"qwen2_vl" or "llava": which builder makes ``preset``."""
    if preset in PRESETS:
        return "qwen2_vl"
    if preset in LLAVA_PRESETS:
        return "llava"
    raise ValueError(f"unknown preset {preset!r}; available: {', '.join([*PRESETS, *LLAVA_PRESETS])}")


def build_random(folder: str | Path, *, preset: str = "qwen2-vl-2b", max_visual_tokens: int | None = None,
                 **kwargs) -> Path:
    """``build_random_qwen2_vl`` or ``build_random_llava``, whichever makes ``preset``; ``kwargs`` go to it.
    ``max_visual_tokens`` (the most visual tokens one image may have) bounds Qwen2-VL's processor only: a
    LLaVA-1.5 image is always the same number of tokens, so there it has nothing to bound."""
    if preset_family(preset) == "llava":
        return build_random_llava(folder, preset=preset, **kwargs)
    if max_visual_tokens is not None:
        kwargs["max_visual_tokens"] = max_visual_tokens
    return build_random_qwen2_vl(folder, preset=preset, **kwargs)


def grid_for_tokens(tokens: int, aspect: float = 1.0) -> tuple[int, int]:
    """(rows, cols) of token cells with rows * cols close to ``tokens`` and cols/rows ~ ``aspect``."""
    tokens = max(int(tokens), 1)
    rows = max(1, round(math.sqrt(tokens / aspect)))
    cols = max(1, round(tokens / rows))
    return rows, cols


def random_image(tokens: int, seed: int = 0, aspect: float = 1.0, cell: int = 28):
    """A random-noise RGB PIL image whose Qwen-family token count is about ``tokens``: its sides are
    multiples of ``cell`` pixels, one visual token per cell (Qwen2-VL: 14-pixel patches merged 2x2, 28; Qwen3-VL 32:
    ``Adapter.token_cell``)."""
    import numpy as np
    from PIL import Image

    rows, cols = grid_for_tokens(tokens, aspect)
    array = (np.random.RandomState(seed).rand(rows * cell, cols * cell, 3) * 255).astype("uint8")
    return Image.fromarray(array)


def photo_like(width: int, height: int, seed: int = 0):
    """An RGB PIL picture with a photo's mix of smooth colour and sharp edges: blurred colour noise, rectangles and
    lines (what resizing it is measured on: random noise has no smooth parts, a flat picture no edges)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    picture = Image.fromarray((rng.random((12, 16, 3)) * 255).astype(np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(picture)
    for _ in range(6):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        draw.rectangle([x, y, x + width // 7, y + height // 9], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        draw.line([0, int(rng.integers(0, height)), width, int(rng.integers(0, height))], fill="white",
                  width=max(1, width // 200))
    return picture


__all__ = ["CORPUS", "LLAVA_PRESETS", "LLAVA_TEMPLATE", "PRESETS", "QWEN_TEMPLATE", "REAL_PRESETS", "build_random",
           "build_random_llava", "build_random_qwen2_vl", "grid_for_tokens", "llava_config", "make_tokenizer",
           "photo_like", "preset_family", "random_image"]
