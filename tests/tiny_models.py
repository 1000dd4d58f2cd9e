"""Tiny checkpoints of every supported architecture, built from configs (no downloads).

Each builder writes a complete checkpoint folder — weights, config, tokenizer, PIL image processor,
chat template — that ``load_engine(folder)`` loads exactly like a real one. The tokenizer is a
small BPE trained on the fly; the templates follow the real checkpoints' formats.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The small-BPE tokenizer and the Qwen2-VL chat template live in the package, shared with the
# random-weights benchmark checkpoints; re-exported here under their old names.
from glimpse.pipeline.random_checkpoint import CORPUS, QWEN_TEMPLATE, make_tokenizer  # noqa: F401

LLAVA_TEMPLATE = (  # llava-hf's LLaVA-1.5 / NeXT format
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}"
    "{% if message['role'] == 'user' %} {% else %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def _text_config(vocab: int, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2, **extra):
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 32, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                initializer_range=0.2, **extra)


def _save(folder: Path, model, tokenizer, image_processor, template: str, eos_id: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def _build_qwen(folder: Path, seed: int, layers: int, config_class, model_class, vision_config: dict, processor,
                rope: dict = MROPE, **text_extra) -> Path:
    """A tiny checkpoint of the Qwen-VL family: its tokens, an M-RoPE text config, the given tower."""
    tok = make_tokenizer(QWEN_SPECIAL, eos="<|im_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = config_class(
        text_config=_text_config(len(tok), layers=layers, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                                 pad_token_id=ids["<|endoftext|>"], rope_parameters=rope, **text_extra),
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    return _save(folder, model, tok, processor, QWEN_TEMPLATE, ids["<|im_end|>"])


def build_qwen2_vl(folder: Path, seed: int = 0, layers: int = 4) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.2)
    # Small images keep the tests fast: at most 112x112 pixels -> at most 16 visual tokens.
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    return _build_qwen(folder, seed, layers, Qwen2VLConfig, Qwen2VLForConditionalGeneration, vision, processor)


def build_qwen2_5_vl(folder: Path, seed: int = 0, layers: int = 4) -> Path:
    """Qwen2.5-VL: the window-attention encoder (window 56 px = 2x2 merged tokens, one full-attention
    block), absolute-time M-RoPE for video."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                  tokens_per_second=2, initializer_range=0.2)
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    return _build_qwen(folder, seed, layers, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, vision, processor)


def build_qwen3_vl(folder: Path, seed: int = 0, layers: int = 4) -> Path:
    """Qwen3-VL (dense): q/k norms in every attention, DeepStack features from encoder blocks 0 and 1
    added to the first two decoder layers' visual tokens, interleaved M-RoPE, 16-pixel patches."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1], initializer_range=0.2)
    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2,
                                         size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128})
    return _build_qwen(folder, seed, layers, Qwen3VLConfig, Qwen3VLForConditionalGeneration, vision, processor,
                       rope={**MROPE, "mrope_interleaved": True}, head_dim=16)


def _clip_vision(image_size: int) -> dict:
    return dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, image_size=image_size, patch_size=14, projection_dim=32,
                initializer_range=0.2)


def _llava_tokenizer():
    return make_tokenizer(["<unk>", "<s>", "</s>", "<image>", "<video>"], eos="</s>", bos="<s>")


def build_llava(folder: Path, seed: int = 0, layers: int = 4, **config) -> Path:
    """``config``: settings of the ``LlavaConfig`` other than these (``vision_feature_layer=[-2, -1]``, ...)."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration

    tok = _llava_tokenizer()
    settings = dict(image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                    vision_feature_select_strategy="default", tie_word_embeddings=False)
    config = LlavaConfig(vision_config=_clip_vision(56), text_config=dict(model_type="llama", **_text_config(len(tok), layers=layers)),
                         **{**settings, **config})
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    return _save(folder, model, tok, processor, LLAVA_TEMPLATE, tok.eos_token_id)


PINPOINTS = [[56, 112], [112, 56], [112, 112]]


def build_llava_next(folder: Path, seed: int = 0, image_size: int = 56, pinpoints: list = PINPOINTS) -> Path:
    """``image_size`` and ``pinpoints``: the tower's input and anyres' tilings (336 and llava-v1.6's for its real image
    processor in front of the tiny model: benchmarks/image_fit.py)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = _llava_tokenizer()
    config = LlavaNextConfig(vision_config=_clip_vision(image_size),
                             text_config=dict(model_type="llama", **_text_config(len(tok))),
                             image_token_id=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
                             vision_feature_layer=-2, vision_feature_select_strategy="default",
                             tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    processor = LlavaNextImageProcessorPil(size={"shortest_edge": image_size},
                                           crop_size={"height": image_size, "width": image_size},
                                           image_grid_pinpoints=pinpoints)
    return _save(folder, model, tok, processor, LLAVA_TEMPLATE, tok.eos_token_id)


def build_longva(folder: Path, seed: int = 0) -> Path:
    """LongVA's layout: LLaVA-NeXT(-Video) with a Qwen2 language model."""
    from transformers import LlavaNextVideoConfig, LlavaNextVideoForConditionalGeneration
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
    tok = make_tokenizer(special, eos="<|im_end|>")
    config = LlavaNextVideoConfig(
        vision_config=_clip_vision(56), text_config=dict(model_type="qwen2", **_text_config(len(tok))),
        image_token_id=tok.convert_tokens_to_ids("<image>"), video_token_id=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2, vision_feature_select_strategy="default",
        spatial_pool_mode="average", spatial_pool_stride=2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaNextVideoForConditionalGeneration(config).eval()
    processor = LlavaNextImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
                                           image_grid_pinpoints=PINPOINTS)
    template = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>\n").replace(
        "<|vision_start|><|video_pad|><|vision_end|>", "<video>\n")
    return _save(folder, model, tok, processor, template, tok.convert_tokens_to_ids("<|im_end|>"))


BUILDERS = {"qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl, "qwen3_vl": build_qwen3_vl, "llava": build_llava, "llava_next": build_llava_next,
            "longva": build_longva}


def transformers_model(folder: Path, attn: str = "sdpa"):
    """The checkpoint as transformers alone loads it: the reference the engine is held to. Not ``engine.model``,
    which the engine has changed on a CPU (its float32 linears are ``CpuLinear``s) and whose attention it chooses."""
    import transformers

    from glimpse.pipeline.adapters import ADAPTERS

    config = transformers.AutoConfig.from_pretrained(folder)
    model_class = getattr(transformers, ADAPTERS[config.model_type].model_class)
    return model_class.from_pretrained(folder, attn_implementation=attn, dtype=torch.float32).eval()


def reference_inputs(engine, prompt) -> dict:
    """The same prompt as keyword arguments for transformers' own forward / generate."""
    from glimpse.pipeline.adapters import IMAGE, VIDEO

    kind = engine.model.config.model_type
    ids = prompt.input_ids[None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    images = [engine.adapter.processor_tensors(m) for m in prompt.media if m.kind == IMAGE]
    videos = [engine.adapter.processor_tensors(m) for m in prompt.media if m.kind == VIDEO]
    if kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        inputs["mm_token_type_ids"] = prompt.modality[None].int()
        if images:
            inputs["pixel_values"] = torch.cat([t["pixel_values"] for t in images])
            inputs["image_grid_thw"] = torch.cat([t["image_grid_thw"] for t in images])
        if videos:
            inputs["pixel_values_videos"] = torch.cat([t["pixel_values_videos"] for t in videos])
            inputs["video_grid_thw"] = torch.cat([t["video_grid_thw"] for t in videos])
            if kind == "qwen2_5_vl":
                inputs["second_per_grid_ts"] = torch.cat([t["second_per_grid_ts"] for t in videos])
    else:
        if images:
            inputs["pixel_values"] = torch.cat([t["pixel_values"] for t in images])
            if "image_sizes" in images[0]:
                inputs["image_sizes"] = torch.cat([t["image_sizes"] for t in images])
        if videos:
            inputs["pixel_values_videos"] = torch.cat([t["pixel_values_videos"] for t in videos])
    return inputs


def masked_reference(engine, prompt, active_per_layer, attention_per_layer, encoded=None,
                     weights: dict | None = None) -> torch.Tensor:
    """Every token through every layer with the layers' own forward (eager), but in each layer only
    the active tokens are keys, inactive tokens keep their hidden state, and where attention was
    restricted (ZipVL) the other tokens' attention output is zeroed while their FFN runs. ``encoded``: the
    visual tokens the encoder computed (``PrefillContext.encoded``), as the pruned run had it. ``weights``, where
    given, receives each layer's attention probabilities (1, heads, T, T) (an engine loaded with eager attention)."""
    adapter = engine.adapter
    hidden = engine.embed_prompt(prompt, encoded)
    # What the architecture adds to the visual tokens after a layer (Qwen3-VL's DeepStack), from
    # transformers' own encoder call: here to the active ones only.
    added = [(rows, layers) for rows, _, layers in engine.encode_media(prompt, encoded=encoded) if layers]
    positions = adapter.positions(prompt.input_ids, prompt.modality, prompt.media)
    cos, sin = adapter.rotary(hidden, positions)
    T = hidden.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    minimum = torch.finfo(hidden.dtype).min
    for layer_idx, (layer, active, rows) in enumerate(zip(adapter.layers, active_per_layer, attention_per_layer)):
        keys = torch.zeros(T, dtype=torch.bool)
        keys[active if rows is None else rows] = True
        allowed = (causal & keys[None, :]) | torch.eye(T, dtype=torch.bool)
        mask = torch.zeros(T, T).masked_fill(~allowed, minimum)[None, None]
        def masked(module, args, out, keys=keys, at=layer_idx):
            if weights is not None:
                weights[at] = out[1]
            return out[0] * keys[None, :, None], out[1]

        hook = layer.self_attn.register_forward_hook(masked)
        try:
            new = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin))
        finally:
            hook.remove()
        is_active = torch.zeros(T, dtype=torch.bool)
        is_active[active] = True
        hidden = torch.where(is_active[None, :, None], new, hidden)
        for rows, layers in added:
            if layer_idx < len(layers):
                hidden[0, rows[is_active[rows]]] += layers[layer_idx][is_active[rows]]
    return adapter.lm_head(adapter.norm(hidden[:, -1:]))[0, -1]


class RunsOutOfMemory:
    """While active, ``module`` fails as an allocation inside it would when memory runs out, on the calls whose
    input has a number of tokens (rows) that ``when`` accepts: a prefill has the prompt's, a decode step one per
    request. "cpu" raises the CPU allocator's own error, for real (2**60 bytes, more than any address space holds,
    whatever the kernel's overcommit setting); "cuda" raises ``torch.OutOfMemoryError`` in the words of CUDA's
    allocator. Keeps a weak reference to each input it refused (``refused``): the tensors of the pass that failed."""

    CUDA_WORDS = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                  "1.06 GiB is free. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.20 GiB is "
                  "reserved by PyTorch but unallocated.")

    def __init__(self, module: torch.nn.Module, kind: str, when):
        self.module, self.kind, self.when = module, kind, when
        self.refused: list = []

    def _hook(self, module, args):
        if self.when(args[0].shape[-2]):
            import weakref

            self.refused.append(weakref.ref(args[0]))
            if self.kind == "cuda":
                raise torch.OutOfMemoryError(self.CUDA_WORDS)
            torch.empty(2**60, dtype=torch.uint8)
            raise AssertionError("2**60 bytes were allocated")

    def __enter__(self) -> "RunsOutOfMemory":
        self.handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
