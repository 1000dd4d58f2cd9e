"""Qwen2-VL video inputs without torchvision: `pixel_values_videos` and `video_grid_thw`.

transformers' `Qwen2VLVideoProcessor` imports torchvision, which cannot be installed next to the CPU torch,
so Glimpse reproduces its output here with torch alone: optional resize (smart_resize size, antialiased
bicubic on uint8 as torchvision does on CPU), rescale by 1/255 and normalize (fused as transformers does), pad
the frame count to a multiple of `temporal_patch_size` by repeating the last frame, then cut
`temporal_patch_size x patch_size x patch_size` patches ordered so that each `merge_size x merge_size`
block of patches is contiguous (the vision tower merges those blocks into one LLM token).

What "equal to Qwen2VLVideoProcessor" means, and how it is checked: for frames that already have the
target size (sides multiples of patch_size * merge_size within the pixel budget, or `resize=False`), the
output layout and values are those of the processor's rescale/normalize/patchify. That processor cannot
run here, so the tests compare against transformers' torchvision-free `Qwen2VLImageProcessorPil`, which
shares the patch layout: one image equals a video of that frame shown twice (T=2), since the image
processor fills the temporal patch by repeating the image. Values agree to float32 rounding (~1e-6; the
image processor rescales and normalizes in two steps, the video processor in one). With resizing, sizes
agree exactly; pixels follow torchvision's CPU uint8 resize, which differs from the PIL processor's resize
by at most a couple of grey levels.

The engine uses the two halves apart: `qwen2vl_video_patches` (the bytes in patch order) when the prompt is
built, `normalize_video_patches` where the encoder runs (`Qwen2VLAdapter._pixels`). A Qwen image's patches, from its PIL
image processor without rescaling and normalizing, are kept as bytes the same way (`normalize_image_patches`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from glimpse.vision.sampling import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, resize_frames_bicubic, smart_resize


# CLIP's normalization, used by Qwen2-VL (same values as transformers.image_utils.OPENAI_CLIP_MEAN/STD).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESCALE_FACTOR = 1 / 255


def qwen2vl_video_inputs(
    frames: np.ndarray,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    image_mean: Sequence[float] = OPENAI_CLIP_MEAN,
    image_std: Sequence[float] = OPENAI_CLIP_STD,
    resize: bool = True,
    min_pixels: float = VIDEO_MIN_PIXELS,
    max_pixels: float = VIDEO_MAX_PIXELS,
) -> dict[str, torch.Tensor]:
    """Turn uint8 RGB frames (T, H, W, 3) into Qwen2-VL's video inputs, as its processor gives them.

    Returns `pixel_values_videos`, float32 (grid_t * grid_h * grid_w, 3 * temporal_patch_size *
    patch_size**2), and `video_grid_thw`, int64 (1, 3). `min_pixels`/`max_pixels` default to
    Qwen2VLVideoProcessor's size (128 and 768 tokens' worth of pixels per frame); frames from
    `sample_video_qwen` already have their final size, so resizing them again changes nothing.
    `qwen2vl_video_patches` then `normalize_video_patches`: the engine runs the two apart, the second where the
    encoder runs.
    """
    out = qwen2vl_video_patches(frames, patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                                merge_size=merge_size, resize=resize, min_pixels=min_pixels, max_pixels=max_pixels)
    out["pixel_values_videos"] = normalize_video_patches(out["pixel_values_videos"], image_mean, image_std)
    return out


def qwen2vl_video_patches(
    frames: np.ndarray,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    resize: bool = True,
    min_pixels: float = VIDEO_MIN_PIXELS,
    max_pixels: float = VIDEO_MAX_PIXELS,
) -> dict[str, torch.Tensor]:
    """`qwen2vl_video_inputs` before rescaling and normalizing: `pixel_values_videos` as the frames' uint8 bytes
    in the patch order, and `video_grid_thw`.

    Why the engine keeps a video's patches as bytes until the encoder (`normalize_video_patches` there): a
    quarter of the bytes to write on the host, to hash for the encoder and prefix caches, to keep in the media
    cache, to send to a GPU and between the Ray captioner's stages (a 16K-token Qwen2-VL video: 78 MB of
    uint8 against 312 MB of float32), for the same float32 values where they are normalized.
    """
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames must be a non-empty uint8 array (T, H, W, 3), got {frames.dtype} {frames.shape}")
    factor = patch_size * merge_size
    if resize:
        height, width = smart_resize(frames.shape[1], frames.shape[2], factor, min_pixels, max_pixels)
        frames = resize_frames_bicubic(frames, height, width)
    num_frames, height, width, channels = frames.shape
    if height % factor or width % factor:
        raise ValueError(f"frame size {height}x{width} must be a multiple of {factor} when resize=False")

    video = torch.from_numpy(np.ascontiguousarray(frames))  # (T, H, W, C), uint8
    # Two frames make one temporal patch: an odd count repeats the last frame.
    if pad := -num_frames % temporal_patch_size:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        num_frames += pad

    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    blocks = video.reshape(grid_t, temporal_patch_size, grid_h // merge_size, merge_size, patch_size,
                           grid_w // merge_size, merge_size, patch_size, channels)
    # -> (t, block row, block col, row in block, col in block, channel, frame in pair, pixel row, pixel col):
    # tokens in raster order of merge blocks, each patch flattened channel-major like a Conv3d kernel.
    layout = blocks.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
    patches = torch.empty(layout.shape, dtype=torch.uint8).copy_(layout)
    pixel_values_videos = patches.reshape(
        grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size
    )
    video_grid_thw = torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.long)
    return {"pixel_values_videos": pixel_values_videos, "video_grid_thw": video_grid_thw}


def normalize_video_patches(patches: torch.Tensor, image_mean: Sequence[float] = OPENAI_CLIP_MEAN,
                            image_std: Sequence[float] = OPENAI_CLIP_STD) -> torch.Tensor:
    """uint8 patches of `qwen2vl_video_patches` (rows of channel-major values) -> float32 on the same device,
    rescaled and normalized in one step, (x - mean / s) / (std / s) with s = 1/255, as transformers fuses them.
    A subtraction and a division per value, as the processor's own: on a CPU the processor's values bit for bit
    (tested); on a GPU the same two IEEE operations, whose values the GPU suite's exactness section compares with
    the host's."""
    if patches.dtype != torch.uint8:  # float values are normalized already (and would be changed in place below)
        raise ValueError(f"patches must be uint8 bytes from qwen2vl_video_patches, got {patches.dtype}")
    rows, channels = patches.shape[0], len(image_mean)
    values = patches.to(torch.float32).reshape(rows, channels, -1)
    mean = torch.tensor(image_mean) * (1.0 / RESCALE_FACTOR)
    std = torch.tensor(image_std) * (1.0 / RESCALE_FACTOR)
    values.sub_(mean.to(patches.device)[:, None]).div_(std.to(patches.device)[:, None])
    return values.reshape(patches.shape)


def normalize_image_patches(patches: torch.Tensor, rescale_factor: float = RESCALE_FACTOR,
                            image_mean: Sequence[float] = OPENAI_CLIP_MEAN,
                            image_std: Sequence[float] = OPENAI_CLIP_STD) -> torch.Tensor:
    """uint8 patches of an image, from Qwen2-VL's PIL image processor with ``do_rescale=False, do_normalize=False``
    -> float32 on the same device, as that processor rescales and normalizes them, in two steps: each byte times
    ``rescale_factor`` in float64 then rounded to float32 (NumPy's rescale), then (x - mean) / std in float32. On a
    CPU the processor's values bit for bit (tested); the GPU suite's exactness section compares a GPU's."""
    if patches.dtype != torch.uint8:
        raise ValueError(f"patches must be uint8 bytes, got {patches.dtype}")
    rows, channels = patches.shape[0], len(image_mean)
    if rescale_factor == RESCALE_FACTOR:
        # For every byte b, float32(b * (1/255 in float64)) is b / 255 in float32 (tested over all 256): the same
        # values without a float64 copy, which on a CPU costs several times the division. Divided by a tensor on the
        # patches' device, not by a Python number: a GPU multiplies by a Python number's reciprocal instead, which
        # differs in the last bit for 126 of the 256 bytes (an outside reading of CUDA's division kernel; the GPU
        # suite's exactness section compares the two).
        values = patches.to(torch.float32).div_(torch.tensor(255.0, device=patches.device))
    else:
        values = (patches.to(torch.float64) * rescale_factor).to(torch.float32)
    values = values.reshape(rows, channels, -1)
    mean = torch.tensor(image_mean, dtype=torch.float32, device=patches.device)[:, None]
    std = torch.tensor(image_std, dtype=torch.float32, device=patches.device)[:, None]
    return values.sub_(mean).div_(std).reshape(patches.shape)
