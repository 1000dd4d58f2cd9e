"""What the engine needs from each architecture, and nothing else.

One small adapter per architecture. An adapter knows:
  * where the decoder lives (embeddings, layers, final norm, rotary embedding, lm_head),
  * how a piece of media becomes encoder inputs and how many placeholder tokens it takes,
  * how the vision encoder + projector turn those inputs into one embedding per placeholder,
  * the (persistent) position of every prompt token, 1-D or Qwen2-VL's 3-D M-RoPE.

Everything here calls the model's own modules and functions (``get_image_features``,
``get_rope_index``, ...), so any checkpoint of a supported architecture works unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from glimpse import vision
from glimpse.common import Modality
from glimpse.pipeline.visual_codes import position_axes, position_code

TEXT, IMAGE, VIDEO = Modality.TEXT, Modality.IMAGE, Modality.VIDEO
MODALITY_NAMES = {m: m.name.lower() for m in Modality}


@dataclass
class MediaInput:
    """One image or video, preprocessed for the encoder.

    ``num_tokens`` placeholder tokens stand for it in the prompt; ``tensors`` are the encoder's
    inputs; ``frames`` are what the user sees in the keep-map (the image, or the sampled frames).
    """

    kind: Modality  # IMAGE or VIDEO
    num_tokens: int
    tensors: dict[str, torch.Tensor]
    frames: list[Image.Image] = field(default_factory=list)
    grid: tuple[int, int, int] | None = None  # (t, h, w) of the visual tokens, for the keep-map
    # Where the grid's t*h*w tokens begin among the item's: after a CLS token (LLaVA's "full" features). They may
    # not be all of them: a LLaVA-NeXT picture's grid is its overview's, and its anyres tiles follow.
    grid_start: int = 0
    # A LLaVA-NeXT picture's anyres tiles: (rows, columns) of their features, after the grid's tokens, over the whole
    # picture (unpadded to its proportions), each row ending in a newline token. The keep map draws them.
    tiles: tuple[int, int] | None = None
    sample_fps: float | None = None  # a video's frames per second as sampled
    timestamps_s: list[float] | None = None  # a video's time per temporal patch, where the prompt writes it
    shortfall: tuple[int, int] | None = None  # a damaged video's frames decoded, of those declared (``SampledVideo``)
    # What this request's answer is told about it, in words naming the file as this request named it (set per
    # request by ``prompt.load_media``: the item itself may be shared through the media cache).
    warning: str | None = None
    # A digest of ``tensors`` (``encoder_cache.item_key``), computed the first time a cache asks for it: the
    # encoder cache and the prefix cache key the same item by it, so its pixels are hashed once.
    key: str | None = field(default=None, repr=False, compare=False)


def patch_times(indices: list[int], source_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch of a sampled video: the mean time of its first and last frame, the
    last frame repeated to fill the final patch (``Qwen3VLProcessor``'s timestamps)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    seconds = [index / source_fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def _size_field(size, name: str):
    """A field of an image processor's ``size`` (a ``SizeDict``, or a plain dict in older transformers), or None."""
    return size.get(name) if isinstance(size, dict) else getattr(size, name, None)  # (None: no size at all)


class Adapter:
    """Base class: the decoder parts are the same for every transformers VLM we support."""

    name = "base"
    model_class = ""  # the transformers class that loads this architecture's checkpoints
    supports_video = False

    def __init__(self, model, tokenizer, image_processor):
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.config = model.config
        self.text_model = model.model.language_model
        self.layers = self.text_model.layers
        self.norm = self.text_model.norm
        self.rotary_emb = self.text_model.rotary_emb
        self.embed_tokens = self.text_model.embed_tokens
        self.lm_head = model.lm_head
        self.text_config = self.config.text_config

    @classmethod
    def unservable(cls, config) -> str | None:
        """Why a checkpoint of this architecture with ``config`` cannot be served (None: it can), said before its
        weights load: such configs were accepted, and every image request then failed as an internal error (an
        outside pass). A placeholder token the text model has no embedding row for is one."""
        vocab = getattr(config.text_config, "vocab_size", None)
        for name in ("image_token_id", "video_token_id"):
            token = getattr(config, name, None)
            if vocab is not None and token is not None and not 0 <= token < vocab:
                return f"its {name} {token} is outside the text model's vocabulary (vocab_size {vocab})"
        return None

    # -- decoder shapes (what the KV budget and the FLOPs proxy count) --------------------------
    @property
    def kv_heads_and_dim(self) -> tuple[int, int]:
        """(key/value heads, head dimension) of every decoder layer: one token's keys and values per layer."""
        tc = self.text_config
        heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        return heads, getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads

    @property
    def attention_window(self) -> int | None:
        """How far back a decoder layer's attention reaches, where the text model limits it (a sliding window:
        Mistral's ``sliding_window``, 4096 in v0.1; Qwen2's with ``use_sliding_window``), in tokens of the sequence;
        None: the whole sequence. The engine attends to the whole sequence, so it serves such a model within one
        window (``max_length``), where the window cuts nothing and the answer is transformers' own: beyond it,
        transformers' sliding layers see less than the engine's would, and the tokens differ (an outside pass)."""
        window = getattr(self.text_config, "sliding_window", None)
        layer_types = getattr(self.text_config, "layer_types", None)
        if not window or (layer_types is not None and "sliding_attention" not in layer_types):
            return None
        return int(window)

    @property
    def max_length(self) -> int | None:
        """The longest sequence served, in tokens: the positions the model knows, within one attention window."""
        limits = [n for n in (getattr(self.text_config, "max_position_embeddings", None), self.attention_window) if n]
        return min(limits) if limits else None

    @property
    def hidden_and_ffn(self) -> tuple[int, int]:
        """(hidden size, FFN inner size) of a decoder layer, as the FLOPs proxy counts it (``metrics.layer_flops``)."""
        return self.text_config.hidden_size, self.text_config.intermediate_size

    @property
    def image_fit(self) -> vision.ImageFit | None:
        """What this model's image processor does to a picture's size: ``vision.load_image`` resizes a larger
        picture to it as it decodes (docs/models.md). None where it is not known: the processor gets the picture."""
        return None

    @functools.cached_property
    def prompt_signature(self) -> str:
        """What a prompt built for this model depends on, in a few characters: the architecture (its media tensors'
        layout), the tokenizer's size and placeholder ids (the token ids), the image processor's settings (the
        pixels) and the model's own that decide placeholder counts (``prompt_settings``). A ``Prompt`` carries it, and an engine refuses one made for another model, where its ids and tensors
        mean something else. Two checkpoints that share all of these (Qwen2-VL-2B and -7B) take each other's prompts."""
        parts = [type(self).__name__, len(self.tokenizer), self.image_token_id, self.video_token_id,
                 self.image_processor.to_json_string(), self.prompt_settings()]
        return f"{self.name}:{hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]}"

    def prompt_settings(self) -> list:
        """The model's settings, beyond its processor's, that decide how many placeholders an image or video gets
        (none where the processor alone decides, as for the Qwen family)."""
        return []

    # -- tokens -------------------------------------------------------------------------------
    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def video_token_id(self) -> int | None:
        return getattr(self.config, "video_token_id", None)

    # Modalities whose placeholders ``expand_text`` writes out in full (one token per feature) before
    # tokenization, rather than the prompt builder repeating the one placeholder token.
    expands_in_text: frozenset = frozenset()

    def placeholder(self, kind: Modality) -> str:
        """The text a chat template writes for one image/video item, when it writes nothing itself."""
        return self.placeholder_token(kind)

    def placeholder_token(self, kind: Modality) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.image_token_id if kind == IMAGE else self.video_token_id)

    def expand_text(self, text: str, media: list["MediaInput"]) -> str:
        """The rendered chat text with the placeholders of ``expands_in_text`` modalities written out."""
        return text

    # -- media --------------------------------------------------------------------------------
    def prepare_image(self, image: Image.Image) -> MediaInput:
        raise NotImplementedError

    def prepare_video(self, path) -> MediaInput:
        raise vision.MediaError(f"{path}: this model ({self.name}) does not take video")

    def encode(self, media: list[MediaInput], kind: Modality) -> torch.Tensor:
        """Vision encoder + projector: one row per placeholder token of ``kind``, in prompt order."""
        raise NotImplementedError

    def vision_blocks(self) -> torch.nn.ModuleList | None:
        """The vision tower's transformer blocks, in order: before each one the engine asks whether the prefill should
        stop (a client that left during a long video's encoder, on a CPU minutes of work). None: the encoder runs as
        one call that cannot be stopped."""
        return None

    def encode_with_layers(self, media: list[MediaInput], kind: Modality, keep: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``encode``, plus what the architecture adds to the visual tokens after decoder layers 0, 1, ...
        (Qwen3-VL's DeepStack features, one row per placeholder each); none for most. ``keep`` (one bool per
        placeholder of ``kind``): only those rows, from ``encode_kept``."""
        return (self.encode(media, kind) if keep is None else self.encode_kept(media, kind, keep)), []

    def encode_kept(self, media: list[MediaInput], kind: Modality, keep: torch.Tensor) -> torch.Tensor:
        """``encode``'s rows for the placeholders ``keep`` marks. Here the encoder computes every token and
        the others are dropped after it (the decoder still saves them); an architecture whose encoder can
        leave tokens out overrides this (Qwen2-VL)."""
        features = self.encode(media, kind)
        return features[keep.to(features.device)]

    def processor_tensors(self, item: MediaInput) -> dict[str, torch.Tensor]:
        """The item's tensors as the checkpoint's own processor gives them to transformers' forward (they may be
        kept in a more compact form until the encoder: a Qwen-family image's or video's patches, as bytes)."""
        return item.tensors

    @property
    def token_cell(self) -> int | None:
        """The side in pixels of the square one visual token covers, where a picture's token count follows its size
        (the Qwen family: patch x merge, 28 or 32); None where the count does not (a fixed resize, anyres tiles)."""
        return None

    def token_pixels(self, item: MediaInput) -> torch.Tensor | None:
        """(t, n, p, f) for a video: the processed pixels the encoder reads for each of its ``n`` visual tokens
        per temporal step, as the token's ``p`` encoder patches of ``f`` values each, the tokens in placeholder
        order (step by step). What RLT compares (pruning/rlt.py); None where the architecture cannot say."""
        return None

    # -- positions ----------------------------------------------------------------------------
    def positions(self, input_ids: torch.Tensor, modality: torch.Tensor, media: list[MediaInput]) -> torch.Tensor:
        """Persistent positions of the prompt tokens: (P, T) with P=1 (1-D RoPE) or 3 (M-RoPE)."""
        return torch.arange(input_ids.shape[-1], device=input_ids.device)[None]

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for (P, T) positions, shaped (1, T, head_dim) for every architecture."""
        return self.rotary_emb(hidden, positions)


class Qwen2VLAdapter(Adapter):
    name = "qwen2-vl"
    model_class = "Qwen2VLForConditionalGeneration"
    supports_video = True

    def placeholder(self, kind: int) -> str:
        pad = "<|image_pad|>" if kind == IMAGE else "<|video_pad|>"
        return f"<|vision_start|>{pad}<|vision_end|>"

    @property
    def merge_size(self) -> int:
        return self.config.vision_config.spatial_merge_size

    @property
    def image_fit(self) -> vision.ImageFit | None:
        ip = self.image_processor
        size = getattr(ip, "size", None)
        min_pixels, max_pixels = _size_field(size, "shortest_edge"), _size_field(size, "longest_edge")
        if not (getattr(ip, "do_resize", False) and min_pixels and max_pixels):
            return None
        factor = ip.patch_size * ip.merge_size  # the processor's own smart_resize, with its pixel bounds

        def size_for(width: int, height: int) -> tuple[int, int]:
            fitted = vision.smart_resize(height, width, factor, min_pixels, max_pixels)
            if vision.smart_resize(*fitted, factor, min_pixels, max_pixels) != fitted:
                # The processor would resize the fitted picture again (a thin one: smart_resize's clamp to one factor
                # left it over max_pixels), to another grid than the picture's own: left to the processor alone.
                return width, height
            return fitted[1], fitted[0]

        return vision.ImageFit(size_for, ip.resample)

    def prepare_image(self, image):
        # Resized and cut into patches, but kept as bytes: the encoder rescales and normalizes them on its device
        # (``_pixels``), as a video's (vision/qwen_video.py says why).
        out = self.image_processor(images=[image], do_rescale=False, do_normalize=False, return_tensors="pt")
        pixels = out["pixel_values"].to(torch.uint8)
        sample = slice(None, None, max(1, len(pixels) // 64))  # a processor that resized in floats would show it anywhere
        if not torch.equal(pixels[sample].to(out["pixel_values"].dtype), out["pixel_values"][sample]):
            raise RuntimeError(f"{type(self.image_processor).__name__} resized the image to values that are not bytes")
        grid = out["image_grid_thw"]
        t, h, w = (int(x) for x in grid[0])
        m = self.merge_size
        return MediaInput(IMAGE, t * h * w // m**2, {"pixel_values": pixels, "image_grid_thw": grid},
                          frames=[image], grid=(t, h // m, w // m))

    def sample_video(self, path):
        """Frames sampled and resized as qwen-vl-utils does for this generation."""
        return vision.sample_video_qwen(path)

    def prepare_video(self, path):
        return self._video_input(self.sample_video(path))

    def _video_input(self, sampled) -> MediaInput:
        ip = self.image_processor
        # The patches stay uint8 until the encoder normalizes them where it runs (``_pixels``):
        # vision/qwen_video.py says why.
        tensors = vision.qwen2vl_video_patches(
            sampled.frames, patch_size=ip.patch_size, temporal_patch_size=ip.temporal_patch_size,
            merge_size=ip.merge_size, resize=False,
        )
        t, h, w = (int(x) for x in tensors["video_grid_thw"][0])
        m = self.merge_size
        frames = [Image.fromarray(f) for f in sampled.frames[:: ip.temporal_patch_size]]
        return MediaInput(VIDEO, t * h * w // m**2, tensors, frames=frames, grid=(t, h // m, w // m),
                          sample_fps=sampled.sample_fps, shortfall=sampled.shortfall)

    def encode(self, media, kind):
        return _joined(self._vision_output(media, kind).pooler_output)

    def vision_blocks(self):
        return self.model.model.visual.blocks  # Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike

    @property
    def token_cell(self) -> int:
        return self.image_processor.patch_size * self.image_processor.merge_size

    def token_pixels(self, item):
        if item.kind != VIDEO:
            return None
        t, h, w = item.grid
        pixels = self._pixels([item], VIDEO)  # (patches, C*T*P*P), each token's m*m patches in a row
        return pixels.reshape(t, h * w, self.merge_size**2, -1)

    def processor_tensors(self, item):
        name = "pixel_values" if item.kind == IMAGE else "pixel_values_videos"
        return {**item.tensors, name: self._pixels([item], item.kind)}

    def _pixels(self, items, kind, device=None, rows=None) -> torch.Tensor:
        """The items' patches joined (only ``rows`` of them, a bool mask, if given), on ``device``, and rescaled and
        normalized there: float32, as the checkpoint's image processor (an image) or Qwen2-VL's video processor (a
        video) gives them."""
        patches = [m.tensors["pixel_values" if kind == IMAGE else "pixel_values_videos"] for m in items]
        pixels = _joined(patches, device) if rows is None else _joined(patches)[rows].to(device)
        ip = self.image_processor
        if kind == IMAGE:
            return vision.normalize_image_patches(pixels, ip.rescale_factor, ip.image_mean, ip.image_std)
        return vision.normalize_video_patches(pixels, ip.image_mean, ip.image_std)

    def encode_kept(self, media, kind, keep):
        return self._vision_output_kept(media, kind, keep).pooler_output

    def _vision_output_kept(self, media, kind, keep):
        """The vision tower on the kept tokens' patches only: each temporal step of each item attends among
        its kept patches (the tower's own forward, given the kept patches' positions and one attention
        segment per step), and the merger joins each token's m*m patches as usual."""
        from transformers.vision_utils import get_vision_position_ids

        vm = self.model.model
        items = [m for m in media if m.kind == kind]
        grid_name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
        grid = _joined([m.tensors[grid_name] for m in items])
        keep = keep.cpu()
        patches = keep.repeat_interleave(self.merge_size**2)  # a token is m*m consecutive patches
        step_sizes = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])  # one attention segment per step
        segments = {"position_ids": get_vision_position_ids(grid, self.merge_size)[patches],
                    "cu_seqlens": _kept_segments(step_sizes, patches), **self._kept_extras(grid, keep, patches)}
        device = vm.visual.device
        pixels = self._pixels(items, kind, device, rows=patches).to(vm.visual.dtype)
        return vm.visual(pixels, grid_thw=grid.to(device),
                         **{k: v.to(device) for k, v in segments.items()})

    def _kept_extras(self, grid: torch.Tensor, keep: torch.Tensor, patches: torch.Tensor) -> dict:
        """What else the tower computes over the whole grid, for the kept patches (Qwen2.5-VL's windows,
        Qwen3-VL's position embeddings): nothing here."""
        return {}

    def _vision_output(self, media, kind):
        """The model's own encoder call on the items of ``kind``: its output, one entry per item."""
        vm = self.model.model
        items = [m for m in media if m.kind == kind]
        device = vm.visual.device
        pixels = self._pixels(items, kind, device)
        if kind == IMAGE:
            grid = _joined([m.tensors["image_grid_thw"] for m in items], device)
            return vm.get_image_features(pixels, grid, return_dict=True)
        grid = _joined([m.tensors["video_grid_thw"] for m in items], device)
        return vm.get_video_features(pixels, grid, return_dict=True)

    def positions(self, input_ids, modality, media):
        if not media:
            return super().positions(input_ids, modality, media).expand(3, -1)
        grids = {k: [m.tensors["image_grid_thw" if k == IMAGE else "video_grid_thw"] for m in media if m.kind == k]
                 for k in (IMAGE, VIDEO)}
        position_ids, _ = self.model.model.get_rope_index(
            input_ids[None],
            mm_token_type_ids=modality[None].to(input_ids.device),
            image_grid_thw=torch.cat(grids[IMAGE]).to(input_ids.device) if grids[IMAGE] else None,
            video_grid_thw=torch.cat(grids[VIDEO]).to(input_ids.device) if grids[VIDEO] else None,
            **self._rope_extras(media, input_ids.device),
        )
        return position_ids[:, 0]  # (3, T)

    def _rope_extras(self, media, device) -> dict:
        return {}

    def rotary(self, hidden, positions):
        return self.rotary_emb(hidden, positions[:, None, :])  # (3, 1, T) -> M-RoPE cos/sin


class Qwen25VLAdapter(Qwen2VLAdapter):
    """Qwen2.5-VL: Qwen2-VL's layout and processor, a window-attention encoder (the model's own
    ``get_image_features`` runs it), and M-RoPE whose temporal index is absolute time: a video's
    temporal position advances ``tokens_per_second * second_per_grid_t`` per temporal patch, where
    ``second_per_grid_t = temporal_patch_size / sampled fps`` (as qwen-vl-utils computes it)."""

    name = "qwen2.5-vl"
    model_class = "Qwen2_5_VLForConditionalGeneration"

    def prepare_video(self, path):
        item = super().prepare_video(path)
        seconds = self.image_processor.temporal_patch_size / item.sample_fps
        item.tensors["second_per_grid_ts"] = torch.tensor([seconds], dtype=torch.float32)
        return item

    def _rope_extras(self, media, device) -> dict:
        seconds = [m.tensors["second_per_grid_ts"] for m in media if m.kind == VIDEO]
        return {"second_per_grid_ts": torch.cat(seconds).to(device)} if seconds else {}

    def _kept_extras(self, grid, keep, patches):
        """Its tower attends within windows of the grid in most blocks (within each step in the others), its
        tokens reordered window by window: the kept tokens in that order, and the windows' kept patches."""
        from transformers.vision_utils import get_vision_window_index

        vc = self.config.vision_config
        order, cu_windows = get_vision_window_index(grid, self.merge_size, vc.window_size, vc.patch_size)
        unit = self.merge_size**2
        window_of = torch.repeat_interleave(torch.arange(len(cu_windows) - 1), cu_windows.diff().long() // unit)
        kept_in_order = keep[order]  # window by window
        rank = keep.long().cumsum(0) - 1  # a kept token's place among the kept ones
        return {"window_index": rank[order[kept_in_order]],
                "cu_window_seqlens": _kept_segments(torch.bincount(window_of, minlength=len(cu_windows) - 1),
                                                    kept_in_order) * unit}


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen3-VL, dense (``qwen3_vl_moe`` is not in ``ADAPTERS``: refused): the decoder layer's own forward
    adds q/k norms and the model's rotary embedding interleaves M-RoPE, so only the encoder differs
    here: ``get_image_features`` also returns DeepStack features, which the engine adds to the visual
    tokens after the first decoder layers (only to those still active there).

    Video: frames sampled and resized as qwen-vl-utils does for Qwen3-VL (32-pixel tokens: 16-pixel
    patches merged 2x2), and each temporal patch of the video written into the prompt as its processor
    writes it: ``<t seconds><|vision_start|>`` + that patch's tokens + ``<|vision_end|>``, ``t`` the mean
    time of the patch's two frames, in place of the template's ``<|video_pad|>`` (the template's own
    ``<|vision_start|>``/``<|vision_end|>`` around it stay, as in ``Qwen3VLProcessor``). The model's
    ``get_rope_index`` splits the video grid per temporal patch to match."""

    name = "qwen3-vl"
    model_class = "Qwen3VLForConditionalGeneration"
    expands_in_text = frozenset({VIDEO})

    def sample_video(self, path):
        factor = self.image_processor.patch_size * self.image_processor.merge_size  # 32-pixel tokens
        return vision.sample_video_qwen(path, factor=factor, min_pixels=128 * factor**2,
                                        total_pixels=int(128000 * factor**2 * 0.9))

    def prepare_video(self, path):
        sampled = self.sample_video(path)
        item = self._video_input(sampled)
        item.timestamps_s = patch_times(sampled.indices, sampled.source_fps, self.image_processor.temporal_patch_size)
        return item

    def expand_text(self, text: str, media: list[MediaInput]) -> str:
        pad = self.placeholder_token(VIDEO)
        pieces = text.split(pad)
        videos = [m for m in media if m.kind == VIDEO]
        if len(pieces) - 1 != len(videos):
            return text  # the prompt builder reports the mismatch
        out = pieces[0]
        for item, rest in zip(videos, pieces[1:]):
            per_patch = item.num_tokens // len(item.timestamps_s)
            out += "".join(f"<{seconds:.1f} seconds><|vision_start|>{pad * per_patch}<|vision_end|>"
                           for seconds in item.timestamps_s) + rest
        return out

    def encode_with_layers(self, media, kind, keep=None):
        if keep is not None:  # DeepStack's features of the kept tokens come from the same run
            out = self._vision_output_kept(media, kind, keep)
            return out.pooler_output, list(out.deepstack_features)
        out = self._vision_output(media, kind)
        layers = [_joined(per_item) for per_item in out.deepstack_features]
        return _joined(out.pooler_output), layers

    def _kept_extras(self, grid, keep, patches):
        """Its tower adds position embeddings interpolated over each item's grid: the kept patches' taps."""
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        visual = self.model.model.visual
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=self.merge_size)
        return {"interp_indices": indices[patches], "interp_weights": weights[patches]}


class LlavaAdapter(Adapter):
    """LLaVA-1.5 layout (also the embedded SmolLM2 + DINOv2 model).

    A checkpoint whose config names a ``video_token_id`` (the embedded model does) also takes video:
    ``video_frames`` frames sampled uniformly, each encoded like an image, its feature grid average-pooled by
    ``spatial_pool_stride`` before the projector (LLaVA-NeXT-Video's pooling).
    """

    name = "llava"
    model_class = "LlavaForConditionalGeneration"

    def __init__(self, model, tokenizer, image_processor):
        super().__init__(model, tokenizer, image_processor)
        # The embedded model's 2D position code, added to every visual token (pipeline/embedded.py says why);
        # None for every other checkpoint.
        scale = getattr(self.config, "visual_position_scale", 0.0)
        self.position_axes = position_axes(self.embed_tokens.weight, tokenizer) * scale if scale else None
        # The embedded model's learnt colour input, (hidden, 3): each visual token also gets this map of its
        # cell's mean pixel colour (pipeline/embedded.py says why); None for every other checkpoint.
        colour_map = getattr(self.config, "visual_colour_map", None)
        self.colour_map = torch.tensor(colour_map, dtype=torch.float32) if colour_map else None

    @property
    def supports_video(self) -> bool:
        return self.video_token_id is not None

    @classmethod
    def unservable(cls, config) -> str | None:
        # A video's frames are pooled as a grid of patches, which a "full" layer's CLS token is not part of.
        if getattr(config, "video_token_id", None) is not None and config.vision_feature_select_strategy == "full":
            return "vision_feature_select_strategy 'full' is not supported with video (its CLS token has no place "\
                   "in the pooled grid of a frame's features)"
        return super().unservable(config)

    def prompt_settings(self) -> list:
        # (a "full" checkpoint's prompt on a "default" one gave "encoder gave 17 features for 16 placeholders")
        names = ("vision_feature_select_strategy", "image_grid_pinpoints", "video_frames", "spatial_pool_stride")
        vision_config = self.config.vision_config
        return ([getattr(self.config, name, None) for name in names]
                + [vision_config.image_size, vision_config.patch_size])

    def _feature_kwargs(self):
        return dict(vision_feature_layer=self.config.vision_feature_layer,
                    vision_feature_select_strategy=self.config.vision_feature_select_strategy)

    def _tokens_per_image(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        patch = self.config.vision_config.patch_size
        return pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch

    # The processors whose resizing ``image_fit`` knows: a fixed size (the embedded model's), or the shortest edge
    # (LLaVA-1.5's CLIP), before a centre crop. Others (one that pads to a square first) get the picture as it is.
    FITTED_PROCESSORS = ("CLIPImageProcessorPil", "BitImageProcessorPil")

    @property
    def image_fit(self) -> vision.ImageFit | None:
        ip = self.image_processor
        if type(ip).__name__ not in self.FITTED_PROCESSORS or not getattr(ip, "do_resize", False):
            return None
        fixed = _size_field(ip.size, "height"), _size_field(ip.size, "width")
        shortest = _size_field(ip.size, "shortest_edge")
        if all(fixed):
            return vision.ImageFit(lambda width, height: fixed[::-1], ip.resample)
        if not shortest or _size_field(ip.size, "longest_edge"):
            return None

        def size_for(width: int, height: int) -> tuple[int, int]:  # transformers' get_resize_output_image_size
            longer = int(shortest * max(width, height) / min(width, height))
            return (shortest, longer) if width <= height else (longer, shortest)

        return vision.ImageFit(size_for, ip.resample)

    def prepare_image(self, image):
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        gh, gw = self._tokens_per_image(pixels)
        extra = 1 if self.config.vision_feature_select_strategy == "full" else 0
        return MediaInput(IMAGE, gh * gw + extra, {"pixel_values": pixels}, frames=[self._seen(image)],
                          grid=(1, gh, gw), grid_start=extra)

    def _seen(self, image: Image.Image) -> Image.Image:
        """The part of ``image`` the model sees: LLaVA-1.5's CLIP processor resizes the shortest edge and keeps the
        centre crop of it (the keep map over the whole of a wide picture put tokens over parts no token saw: an
        outside pass). ``LlavaImageProcessor`` with ``do_pad`` (the original LLaVA-1.5's "pad" preprocessing)
        first pads the picture to a square of its mean colour: the whole picture, in that square (it was drawn
        over the centre crop, a part of it: an outside pass)."""
        ip = self.image_processor
        if getattr(ip, "do_pad", False) is True and image.width != image.height:
            side, mean = max(image.size), getattr(ip, "image_mean", None) or (0.0, 0.0, 0.0)
            square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
            square.paste(image.convert("RGB"), ((side - image.width) // 2, (side - image.height) // 2))
            square.info = {key: value for key, value in image.info.items() if key != "source_size"}
            image = square
        shortest = _size_field(getattr(ip, "size", None), "shortest_edge")
        crop_size = getattr(ip, "crop_size", None)
        crop = _size_field(crop_size, "width"), _size_field(crop_size, "height")
        if not (getattr(ip, "do_center_crop", False) and shortest and all(crop)):
            return image
        scale = shortest / min(image.size)  # the resize, then the crop, taken back to the picture's pixels
        width, height = min(image.width, crop[0] / scale), min(image.height, crop[1] / scale)
        left, top = (image.width - width) / 2, (image.height - height) / 2
        seen = image.crop((round(left), round(top), round(left + width), round(top + height)))
        # (a large picture's size before decoding, ``vision.load_image``: its shape, not the crop's)
        seen.info = {key: value for key, value in image.info.items() if key != "source_size"}
        return seen

    def prepare_video(self, path):
        if not self.supports_video:
            return super().prepare_video(path)
        sampled = vision.sample_video_uniform(path, num_frames=self.config.video_frames)
        frames = [Image.fromarray(f) for f in sampled.frames]
        pixels = self.image_processor(images=frames, return_tensors="pt")["pixel_values"]
        stride = self.config.spatial_pool_stride
        gh, gw = (n // stride for n in self._tokens_per_image(pixels))
        return MediaInput(VIDEO, len(frames) * gh * gw, {"pixel_values_videos": pixels},
                          frames=frames, grid=(len(frames), gh, gw), shortfall=sampled.shortfall)

    def vision_features(self, pixel_values: torch.Tensor, pool: int = 1) -> torch.Tensor:
        """The projector's input: the selected vision-tower layer without CLS, (N, tokens, C); ``pool`` > 1
        average-pools each image's feature grid. The projector's training uses exactly this function."""
        vm = self.model.model
        pixels = pixel_values.to(vm.vision_tower.device, vm.vision_tower.dtype)
        states = vm.vision_tower(pixels, output_hidden_states=True).hidden_states
        layer = self.config.vision_feature_layer  # several: joined along the channels, as transformers' LLaVA joins them
        hidden = torch.cat([states[i] for i in layer], dim=-1) if isinstance(layer, (list, tuple)) else states[layer]
        if self.config.vision_feature_select_strategy == "default":
            hidden = hidden[:, 1:]
        if pool > 1:
            gh, gw = self._tokens_per_image(pixels)
            grid = hidden.reshape(len(hidden), gh, gw, -1).permute(0, 3, 1, 2)
            hidden = torch.nn.functional.avg_pool2d(grid, pool).flatten(2).transpose(1, 2)
        return hidden

    def vision_blocks(self):
        tower = self.model.model.vision_tower
        encoder = getattr(getattr(tower, "vision_model", tower), "encoder", None)  # CLIP, SigLIP; DINOv2 (embedded)
        blocks = getattr(encoder, "layers", None) or getattr(encoder, "layer", None)
        return blocks if isinstance(blocks, torch.nn.ModuleList) else None

    def token_pixels(self, item):
        if item.kind != VIDEO:
            return None
        pixels = item.tensors["pixel_values_videos"]
        pixels = pixels.reshape(-1, *pixels.shape[-3:]).float()  # (frames, C, H, W)
        frames, channels, height, width = pixels.shape
        patch, pool = self.config.vision_config.patch_size, self.config.spatial_pool_stride
        gh, gw = height // patch // pool, width // patch // pool  # one token: pool x pool patches
        cells = pixels[:, :, : gh * pool * patch, : gw * pool * patch].reshape(
            frames, channels, gh, pool, patch, gw, pool, patch)
        # -> (frames, gh, gw, pool, pool, C, patch, patch): token by token, row-major, its patches in a row
        cells = cells.permute(0, 2, 5, 3, 6, 1, 4, 7)
        return cells.reshape(frames, gh * gw, pool * pool, channels * patch * patch)

    def cell_colours(self, pixel_values: torch.Tensor, pool: int = 1) -> torch.Tensor:
        """(N, tokens, 3): the mean of the processed pixels under each visual token's cell (a patch, or
        ``pool`` x ``pool`` patches), in the order of `vision_features`. The projector's training uses it too."""
        cell = self.config.vision_config.patch_size * pool
        return torch.nn.functional.avg_pool2d(pixel_values.float(), cell).flatten(2).transpose(1, 2)

    def encode(self, media, kind):
        vm = self.model.model
        if kind == VIDEO:
            pixels = _joined([m.tensors["pixel_values_videos"] for m in media if m.kind == VIDEO])
            features = self.vision_features(pixels, pool=self.config.spatial_pool_stride)
            tokens = vm.multi_modal_projector(features).reshape(-1, self.text_config.hidden_size)
        else:
            pixels = _joined([m.tensors["pixel_values"] for m in media if m.kind == kind],
                             vm.vision_tower.device, vm.vision_tower.dtype)
            out = vm.get_image_features(pixel_values=pixels, return_dict=True, **self._feature_kwargs())
            tokens = torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output], dim=0)
        if self.position_axes is not None:
            code = torch.cat([position_code(self.position_axes, *m.grid) for m in media if m.kind == kind])
            tokens = tokens + code.to(tokens.device, tokens.dtype)
        if self.colour_map is not None:
            pool = self.config.spatial_pool_stride if kind == VIDEO else 1
            colours = self.cell_colours(pixels, pool).reshape(-1, 3)
            tokens = tokens + (colours @ self.colour_map.to(colours.device).T).to(tokens.device, tokens.dtype)
        return tokens


class LlavaNextAdapter(LlavaAdapter):
    """LLaVA-NeXT (anyres images). LongVA is a LLaVA-NeXT-Video checkpoint: see LlavaNextVideoAdapter."""

    name = "llava-next"
    model_class = "LlavaNextForConditionalGeneration"
    FITTED_PROCESSORS = ("LlavaNextImageProcessorPil",)

    @classmethod
    def unservable(cls, config) -> str | None:
        if config.vision_feature_select_strategy == "full":  # (transformers' own LLaVA-NeXT fails on it too)
            return "vision_feature_select_strategy 'full' is not supported by LLaVA-NeXT's anyres features (its " \
                   "CLS token has no place in a tile's grid)"
        return super().unservable(config)

    def __init__(self, model, tokenizer, image_processor):
        super().__init__(model, tokenizer, image_processor)
        from transformers import LlavaNextProcessor

        # Built once: its anyres arithmetic gives the placeholder count of every image.
        self._token_counter = LlavaNextProcessor(
            image_processor=image_processor, tokenizer=tokenizer,
            patch_size=self.config.vision_config.patch_size,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            num_additional_image_tokens=1,  # CLIP-style towers carry a CLS token
        )

    def _count_tokens(self, orig_hw: tuple[int, int], pixel_values: torch.Tensor) -> tuple[int, tuple[int, int]]:
        """A picture's placeholder count, and the (rows, columns) of its tiles' features as the model lays them
        out after the overview's: unpadded to the picture's proportions, each row ending in a newline token."""
        from transformers.image_processing_utils import select_best_resolution

        counter, (height, width) = self._token_counter, pixel_values.shape[-2:]
        n = counter._get_number_of_features(orig_hw[0], orig_hw[1], height, width)
        best = select_best_resolution(list(orig_hw), counter.image_processor.image_grid_pinpoints)
        patch = counter.patch_size
        features, rows = counter._get_unpadded_features(orig_hw[0], orig_hw[1], height // patch, width // patch,
                                                        best[0] // height, best[1] // width)
        count = n - 1 if self.config.vision_feature_select_strategy == "default" else n
        # (A thin picture's tiles may unpad to no row or no column: 7300x100 on LLaVA-v1.6; an outside pass.)
        return count, ((rows, features // rows) if rows and features else None)

    @property
    def image_fit(self) -> vision.ImageFit | None:
        """Anyres resizes a picture twice: into the tiling it picks by the picture's size (proportions kept), and
        squeezed to the tower's input for the overview. A picture over 2 x ``FIT_GAP`` times the first is resized as
        it is decoded to a whole multiple of it, at least ``FIT_GAP`` times each: the processor's tiling of that is
        the whole picture's, to the pixel, and both its resizes start from a picture still 3x their size or more;
        ``prepare_image`` gives the model the whole picture's size, by which it unpads the tiles' features: the same
        tokens (docs/models.md)."""
        from transformers.image_processing_utils import select_best_resolution

        ip = self.image_processor
        pinpoints = getattr(ip, "image_grid_pinpoints", None)
        overview = _size_field(ip.size, "width") or _size_field(ip.size, "shortest_edge"), \
            _size_field(ip.size, "height") or _size_field(ip.size, "shortest_edge")
        if type(ip).__name__ not in self.FITTED_PROCESSORS or not getattr(ip, "do_resize", False) or not (
                pinpoints and all(overview)):
            return None

        def size_for(width: int, height: int) -> tuple[int, int]:
            tiling = select_best_resolution((height, width), pinpoints)
            tiled = _anyres_size(width, height, tiling)
            times = max(math.ceil(vision.FIT_GAP * max(o, t) / t) for o, t in zip(overview, tiled))
            fitted = tiled[0] * times, tiled[1] * times
            if width < 2 * fitted[0] or height < 2 * fitted[1]:
                return width, height  # not worth a resize of its own: the processor's resizes are exact
            # (Always so, over every size up to 9000x9000 with LLaVA-NeXT's and the tests' tilings: checked, not
            # assumed, since the processor's float arithmetic decides it.)
            same = select_best_resolution(fitted[::-1], pinpoints) == tiling and _anyres_size(*fitted, tiling) == tiled
            return fitted if same else (width, height)

        return vision.ImageFit(size_for, ip.resample, jpeg_gap=1.0)  # (the processor reduces it 3x or more itself)

    def prepare_image(self, image):
        out = self.image_processor(images=[image], return_tensors="pt")
        if "source_size" in image.info:  # resized as it was decoded (``image_fit``): the model unpads the tiles'
            out["image_sizes"] = torch.tensor([image.info["source_size"][::-1]])  # features by the whole picture's size
        pixels, sizes = out["pixel_values"], out["image_sizes"]
        n, tiles = self._count_tokens((int(sizes[0][0]), int(sizes[0][1])), pixels)
        patch = self.config.vision_config.patch_size
        side = self.config.vision_config.image_size // patch
        return MediaInput(IMAGE, n, {"pixel_values": pixels, "image_sizes": sizes}, frames=[image], grid=(1, side, side),
                          tiles=tiles)

    def encode(self, media, kind):
        vm = self.model.model
        items = [m for m in media if m.kind == IMAGE]
        # Each picture is processed alone, so their tile counts follow their shapes (a landscape photo 5 tiles, a square
        # one 3): padded with zeros to the most, as LLaVA-NeXT's processor pads a batch; the model reads each picture's
        # own tiles only, by ``image_sizes``. Joined as they were, two such pictures failed (an outside pass).
        tiles = [m.tensors["pixel_values"] for m in items]
        most = max(t.shape[1] for t in tiles)
        tiles = [torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 0, 0, most - t.shape[1])) if t.shape[1] < most else t
                 for t in tiles]
        pixels = _joined(tiles, vm.vision_tower.device, vm.vision_tower.dtype)
        sizes = _joined([m.tensors["image_sizes"] for m in items], vm.vision_tower.device)
        out = vm.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True, **self._feature_kwargs())
        return _joined(out.pooler_output)


class LlavaNextVideoAdapter(LlavaNextAdapter):
    """LLaVA-NeXT-Video layout: LLaVA-NeXT images plus pooled video frames. LongVA loads as this.

    Video frames are sampled uniformly, each is resized (shortest edge) and centre-cropped to the
    tower's input size, encoded, 2x2 average-pooled (``spatial_pool_stride``) and projected —
    transformers' LLaVA-NeXT-Video path, the same UniRes pooling LongVA applies per frame.
    """

    name = "llava-next-video"
    model_class = "LlavaNextVideoForConditionalGeneration"
    supports_video = True
    num_frames = 16

    def placeholder(self, kind):
        return "<image>" if kind == IMAGE else "<video>"

    def prepare_video(self, path):
        sampled = vision.sample_video_uniform(path, num_frames=self.num_frames)
        size = self.config.vision_config.image_size
        frames = [Image.fromarray(f) for f in sampled.frames]
        pixels = torch.stack([_clip_preprocess(f, size, self.image_processor) for f in frames])[None]
        side = size // self.config.vision_config.patch_size // self.config.spatial_pool_stride
        return MediaInput(VIDEO, len(frames) * side * side, {"pixel_values_videos": pixels},
                          frames=frames, grid=(len(frames), side, side), shortfall=sampled.shortfall)

    def encode(self, media, kind):
        if kind == IMAGE:
            return super().encode(media, kind)
        vm = self.model.model
        pixels = _joined([m.tensors["pixel_values_videos"] for m in media if m.kind == VIDEO],
                         vm.vision_tower.device, vm.vision_tower.dtype)
        out = vm.get_video_features(pixel_values_videos=pixels, return_dict=True, **self._feature_kwargs())
        return out.pooler_output.reshape(-1, out.pooler_output.shape[-1])


def _joined(tensors: list[torch.Tensor], device=None, dtype=None) -> torch.Tensor:
    """One tensor per media item joined along the first axis, on ``device`` in ``dtype``: each item is moved first,
    so a prompt's one item is moved as it is, with no copy of its pixels on the host before the transfer (an
    8K-token video's are 156 MB of float32: an H200 profile found that copy in the engine's prefill, where
    transformers' forward, given the processor's tensors, has none), and several are joined where they land."""
    moved = [t.to(device=device, dtype=dtype) for t in tensors]
    return moved[0] if len(moved) == 1 else torch.cat(moved)


def _kept_segments(sizes: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Cumulative lengths (``cu_seqlens``, int32) of the attention segments of ``sizes`` consecutive elements each,
    counting only the ``kept`` ones; a segment with nothing kept is none."""
    segment_of = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    counts = torch.bincount(segment_of[kept], minlength=len(sizes))
    return torch.nn.functional.pad(counts[counts > 0].cumsum(0), (1, 0)).to(torch.int32)


def _anyres_size(width: int, height: int, tiling: tuple[int, int]) -> tuple[int, int]:
    """The (width, height) anyres resizes a picture to inside its ``tiling`` (height, width), proportions kept:
    transformers' ``get_patch_output_size``."""
    tiling_height, tiling_width = tiling
    scale_width, scale_height = tiling_width / width, tiling_height / height
    if scale_width < scale_height:
        return tiling_width, min(math.ceil(height * scale_width), tiling_height)
    return min(math.ceil(width * scale_height), tiling_width), tiling_height


def _clip_preprocess(frame: Image.Image, size: int, image_processor) -> torch.Tensor:
    """Resize the shortest edge to ``size`` (bicubic), centre-crop ``size`` x ``size``, normalise."""
    w, h = frame.size
    longer = int(size * max(w, h) / min(w, h))  # rounded down, as transformers' get_resize_output_image_size (an
    # outside pass: rounded, an 854x480 frame became 598x336, not CLIP's 597x336, up to 193 grey levels off at edges)
    frame = frame.resize((size, longer) if w <= h else (longer, size), Image.BICUBIC)
    w, h = frame.size
    left, top = (w - size) // 2, (h - size) // 2
    frame = frame.crop((left, top, left + size, top + size))
    array = np.asarray(frame, dtype=np.float32) / 255.0
    array = (array - np.array(image_processor.image_mean, dtype=np.float32)) / np.array(
        image_processor.image_std, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


ADAPTERS = {  # model_type -> adapter: the one list of supported architectures
    "qwen2_vl": Qwen2VLAdapter,
    "qwen2_5_vl": Qwen25VLAdapter,
    "qwen3_vl": Qwen3VLAdapter,
    "llava": LlavaAdapter,
    "llava_next": LlavaNextAdapter,
    "llava_next_video": LlavaNextVideoAdapter,
}
