"""Frame sampling and resizing, following the conventions the supported models were trained with.

Qwen2-VL: the rules of `qwen-vl-utils` (`vision_process.py`), the reference preprocessing of the Qwen-VL
family, re-implemented here because that package imports torchvision, which cannot be installed next to
the CPU torch. Sizes are multiples of 28 (14-pixel patches merged 2x2) within a pixel budget
(`smart_resize`); videos are sampled at 2 fps, 4..768 frames, an even number because two frames form one
temporal patch (`smart_nframes`); and a video's total pixel budget is shared by its frames, so a densely
sampled video gets smaller frames.

LLaVA-NeXT-Video / LongVA: N frames spread uniformly over the whole clip (`np.linspace(0, total - 1, N,
dtype=int)` as in their demo code), at original size up to 4K UHD; the model's image processor resizes them.

Either way frames are resized as they are decoded: only the resized frames of a clip are ever held together.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from glimpse.vision.media import (DEFAULT_VIDEO_TIMEOUT_S, FrameTransform, MediaError, VideoInfo, _TooFewFramesError,
                                  decode_frames, probe_video)

logger = logging.getLogger(__name__)


IMAGE_FACTOR = 28  # patch_size 14 x spatial merge 2: one LLM token per 28x28 pixels
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200

VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
# Pixel budget of a whole video: 90% of a 128K-token context, as current qwen-vl-utils (and transformers'
# `cap_pixels_per_frame`) use; the first qwen-vl-utils releases used 24576 * 28 * 28.
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
FRAME_FACTOR = 2  # temporal_patch_size: frames are consumed in pairs
UNIFORM_MAX_FRAME_PIXELS = 3840 * 2160  # sample_video_uniform keeps frames at most this large (4K UHD)
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768


def round_by_factor(number: float, factor: int) -> int:
    """The multiple of `factor` closest to `number`."""
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    """The smallest multiple of `factor` that is >= `number`."""
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    """The largest multiple of `factor` that is <= `number`."""
    return math.floor(number / factor) * factor


def smart_resize(
    height: int, width: int, factor: int = IMAGE_FACTOR, min_pixels: float = MIN_PIXELS, max_pixels: float = MAX_PIXELS
) -> tuple[int, int]:
    """The (height, width) Qwen2-VL sees an image at: multiples of `factor`, pixel count within
    [min_pixels, max_pixels], aspect ratio kept as closely as rounding allows.

    Sides are first rounded to the nearest multiple; if that breaks the budget, both sides are scaled by
    the same factor and rounded down (too large) or up (too small). Aspect ratios above 200 raise
    ValueError: such a strip cannot be cut into 28-pixel patches meaningfully.
    """
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
    resized_height = max(factor, round_by_factor(height, factor))
    resized_width = max(factor, round_by_factor(width, factor))
    if resized_height * resized_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        resized_height = max(factor, floor_by_factor(height / scale, factor))
        resized_width = max(factor, floor_by_factor(width / scale, factor))
    elif resized_height * resized_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        resized_height = ceil_by_factor(height * scale, factor)
        resized_width = ceil_by_factor(width * scale, factor)
    return resized_height, resized_width


def smart_nframes(
    total_frames: int,
    video_fps: float,
    fps: float = FPS,
    nframes: int | None = None,
    min_frames: int = FPS_MIN_FRAMES,
    max_frames: int = FPS_MAX_FRAMES,
) -> int:
    """How many frames Qwen2-VL samples from a video: `fps` per second of video, clamped to
    [min_frames, min(max_frames, total_frames)], rounded down to an even number; or `nframes` rounded to
    the nearest even number when given. ValueError if the result is not within [2, total_frames].
    """
    if nframes is not None:
        count = round_by_factor(nframes, FRAME_FACTOR)
    else:
        min_frames = ceil_by_factor(min_frames, FRAME_FACTOR)
        max_frames = floor_by_factor(min(max_frames, total_frames), FRAME_FACTOR)
        wanted = total_frames / video_fps * fps
        count = floor_by_factor(min(max(wanted, min_frames), max_frames, total_frames), FRAME_FACTOR)
    if not FRAME_FACTOR <= count <= total_frames:
        raise ValueError(f"nframes should be in the interval [{FRAME_FACTOR}, {total_frames}], but got {count}")
    return count


def video_frame_max_pixels(
    nframes: int,
    min_pixels: float = VIDEO_MIN_PIXELS,
    total_pixels: float = VIDEO_TOTAL_PIXELS,
    max_pixels: float | None = None,
    factor: int = IMAGE_FACTOR,
) -> float:
    """Per-frame pixel cap for a video of `nframes` frames: the total budget shared by the frame pairs,
    at most 768 tokens' worth of pixels (VIDEO_MAX_PIXELS for 28-pixel tokens; qwen-vl-utils counts
    tokens of `factor` pixels), at least 5% above `min_pixels` (so smart_resize always has room), and no
    more than a caller's own `max_pixels`."""
    frame_max = VIDEO_MAX_PIXELS * factor**2 // IMAGE_FACTOR**2
    cap = max(min(frame_max, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
    return cap if max_pixels is None else min(max_pixels, cap)


def resize_frames_bicubic(frames: np.ndarray, height: int, width: int, chunk: int = 64) -> np.ndarray:
    """Resize uint8 RGB frames (T, H, W, 3) with antialiased bicubic interpolation, in uint8.

    On CPU this is exactly what torchvision's `resize(..., BICUBIC, antialias=True)` runs for uint8 tensors
    (the resize of transformers' Qwen2VLVideoProcessor and qwen-vl-utils): torch's native uint8 kernel,
    written to match PIL's bicubic (within a grey level or two). Chunks bound the temporary memory.
    """
    if frames.shape[1:3] == (height, width):
        return frames
    resized = np.empty((len(frames), height, width, 3), dtype=np.uint8)
    for start in range(0, len(frames), chunk):
        batch = torch.from_numpy(np.ascontiguousarray(frames[start : start + chunk])).permute(0, 3, 1, 2)
        batch = F.interpolate(batch, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        resized[start : start + chunk] = batch.permute(0, 2, 3, 1).numpy()
    return resized


def resize_image_qwen(
    image: Image.Image, min_pixels: float = MIN_PIXELS, max_pixels: float = MAX_PIXELS, factor: int = IMAGE_FACTOR
) -> Image.Image:
    """Resize an image to its `smart_resize` size with PIL bicubic, as qwen-vl-utils' fetch_image does."""
    height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    if (height, width) == (image.height, image.width):
        return image
    return image.resize((width, height), Image.Resampling.BICUBIC)


@dataclass
class SampledVideo:
    """Frames picked from a video and when they were taken."""

    frames: np.ndarray  # uint8 (T, H, W, 3) RGB
    indices: list[int]  # source frame index of each row of `frames`
    timestamps_s: list[float]  # index / source_fps
    sample_fps: float  # effective sampling rate: T / total_frames * source_fps (Qwen2-VL's `fps` input)
    source_fps: float
    # (frames decoded, frames declared) when the file held fewer frames than it declares and these were sampled
    # from the part that decoded: the answer is about that part, and the user is told so with it (not only in a
    # log; ``shortfall_warning``). Counts, not words: a cache of decoded media shares them between requests, and
    # each names the file its own way.
    shortfall: tuple[int, int] | None = None


def shortfall_warning(name: str, decoded: int, declared: int) -> str:
    """What a user is told when a damaged video's frames were sampled from the part that decoded. Control
    characters in the name are escaped: a name holding a line break forged a second line in a log."""
    name = re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", name)
    return (f"{name}: only {decoded} of the {declared} frames it declares could be decoded (a damaged or truncated "
            "file): the answer is about those")


def _shortfall(declared: int, decoded: int) -> tuple[int, int] | None:
    return (decoded, declared) if decoded < declared else None


def _read_sampled(
    path: str | os.PathLike,
    pick_indices: Callable[[int, float], list[int]],
    backend: str | None,
    timeout_s: float,
    transform_for: Callable[[list[int]], FrameTransform] | None = None,
) -> tuple[VideoInfo, int, list[int], np.ndarray, int]:
    """Probe, choose indices with `pick_indices(total_frames, fps)`, decode them, each frame through
    `transform_for(indices)` as it is decoded (so that only the resized frames are kept).

    Returns the probe, the frame count the indices were chosen over, the indices, the frames and how many frames
    were lost in damaged stretches inside the file (`DecodedFrames.lost`).

    Damaged files often declare more frames than they hold; then the indices are chosen again over the
    frames that did decode, so a truncated clip still gives its frames instead of an error.
    """
    info = probe_video(path, backend=backend, timeout_s=timeout_s)
    total_frames = info.num_frames
    for _attempt in range(2):
        indices = pick_indices(total_frames, info.fps)
        transform = transform_for(indices) if transform_for is not None else None
        try:
            decoded = decode_frames(path, indices, backend=backend, timeout_s=timeout_s, transform=transform)
            return info, total_frames, indices, decoded.frames, decoded.lost
        except _TooFewFramesError as error:
            if error.decodable_frames == 0 or error.decodable_frames >= total_frames:
                raise
            # Said, not silent: the answer is about the part that decoded (an outside pass found a faststart file
            # cut after 17 of its 40 frames answered with no word of it). SampledVideo.shortfall carries it further.
            logger.warning("%s", shortfall_warning(Path(str(path)).name, error.decodable_frames, total_frames))
            total_frames = error.decodable_frames
    raise AssertionError("unreachable: the second attempt only asks for frames that decoded")


def sample_video_qwen(
    path: str | os.PathLike,
    fps: float = FPS,
    *,
    nframes: int | None = None,
    min_frames: int = FPS_MIN_FRAMES,
    max_frames: int = FPS_MAX_FRAMES,
    min_pixels: float = VIDEO_MIN_PIXELS,
    max_pixels: float | None = None,
    total_pixels: float = VIDEO_TOTAL_PIXELS,
    resize: bool = True,
    factor: int = IMAGE_FACTOR,
    backend: str | None = None,
    timeout_s: float = DEFAULT_VIDEO_TIMEOUT_S,
) -> SampledVideo:
    """Sample a video for Qwen2-VL exactly as qwen-vl-utils' `fetch_video` does.

    `smart_nframes` frames at indices `round(linspace(0, total - 1, n))`, resized (bicubic, antialiased)
    to `smart_resize` under the per-frame cap of `video_frame_max_pixels`. `resize=False` keeps the
    original size (e.g. to let a processor resize); `factor` is patch_size * merge_size of the model.
    """
    name = Path(path).name

    def pick_indices(total_frames: int, video_fps: float) -> list[int]:
        if total_frames < FRAME_FACTOR:  # (qwen-vl-utils said "nframes should be in the interval [2, 1], but got 0")
            raise MediaError(f"{name}: the video is too short to sample ({total_frames} frame: this model reads a "
                             f"video's frames in pairs; send a still as an image)")
        try:
            count = smart_nframes(total_frames, video_fps, fps, nframes, min_frames, max_frames)
        except ValueError as error:
            message = f"{name}: the video is too short to sample ({total_frames} frames; {error})"
            raise MediaError(message) from error
        # float32 torch.linspace and round-half-to-even, as qwen-vl-utils, so ties pick the same frames
        return torch.linspace(0, total_frames - 1, count).round().long().tolist()

    def resize_each(indices: list[int]) -> FrameTransform:
        # Each frame as it is decoded, to the size the whole clip would get (the cap depends on the frame
        # count): the same pixels as resizing the stack, without holding the full-size stack.
        frame_cap = video_frame_max_pixels(len(indices), min_pixels, total_pixels, max_pixels, factor)

        def resize(frame: np.ndarray) -> np.ndarray:
            try:
                height, width = smart_resize(frame.shape[0], frame.shape[1], factor, min_pixels, frame_cap)
            except ValueError as error:  # aspect ratio above MAX_RATIO
                raise MediaError(f"{name}: the video's frames are too narrow to use ({error})") from error
            return resize_frames_bicubic(frame[None], height, width)[0]
        return resize

    info, total_frames, indices, frames, lost = _read_sampled(path, pick_indices, backend, timeout_s,
                                                        resize_each if resize else None)
    return SampledVideo(
        frames=frames,
        indices=indices,
        timestamps_s=[index / info.fps for index in indices],
        sample_fps=len(indices) / max(total_frames, 1e-6) * info.fps,
        source_fps=info.fps,
        shortfall=_shortfall(info.declared_frames or info.num_frames, total_frames - lost),
    )


def sample_video_uniform(
    path: str | os.PathLike,
    num_frames: int = 8,
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_VIDEO_TIMEOUT_S,
) -> SampledVideo:
    """`num_frames` frames spread uniformly over the whole clip, first and last frame included, at
    original size: the LLaVA-NeXT-Video / LongVA convention (`np.linspace(0, total - 1, N, dtype=int)`).
    Clips shorter than `num_frames` repeat frames, as that convention does. Frames larger than 4K UHD
    (`UNIFORM_MAX_FRAME_PIXELS`) are scaled down to it as they are decoded (the models' processors take
    336-384 pixels a side, and 16 8K frames would hold 1.6 GB)."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")

    def pick_indices(total_frames: int, video_fps: float) -> list[int]:
        return np.linspace(0, total_frames - 1, num_frames, dtype=int).tolist()

    def at_most_4k(frame: np.ndarray) -> np.ndarray:
        height, width = frame.shape[:2]
        if height * width <= UNIFORM_MAX_FRAME_PIXELS:
            return frame
        scale = math.sqrt(UNIFORM_MAX_FRAME_PIXELS / (height * width))
        return resize_frames_bicubic(frame[None], max(1, int(height * scale)), max(1, int(width * scale)))[0]

    info, total_frames, indices, frames, lost = _read_sampled(path, pick_indices, backend, timeout_s,
                                                        lambda indices: at_most_4k)
    return SampledVideo(
        frames=frames,
        indices=indices,
        timestamps_s=[index / info.fps for index in indices],
        sample_fps=len(indices) / total_frames * info.fps,
        source_fps=info.fps,
        shortfall=_shortfall(info.declared_frames or info.num_frames, total_frames - lost),
    )
