"""Shared fixtures: tiny checkpoints of each architecture, a sample image and a sample video."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import BUILDERS  # noqa: E402

ARCHS = list(BUILDERS)
VIDEO_ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "longva"]
DEEP_LAYERS = 12


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def deep_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """12-layer tiny Qwen2-VL and LLaVA: deep enough for multi-stage schedules (ST3, LazyLLM, HiDivDrop)."""
    from tiny_models import build_llava, build_qwen2_vl

    root = tmp_path_factory.mktemp("deep")
    return {"qwen2_vl": build_qwen2_vl(root / "qwen2_vl", layers=DEEP_LAYERS),
            "llava": build_llava(root / "llava", layers=DEEP_LAYERS)}


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media")
    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(90, 120, 3) * 255).astype("uint8"))
    image.save(root / "image.png")
    write_video(root / "clip.mp4", frames=20, fps=10, size=(64, 48))
    return {"image": root / "image.png", "video": root / "clip.mp4",
            "moving_square": write_moving_square(root / "square.mp4")}


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> Path:
    """A cache folder holding the embedded model, converted once per test session."""
    from glimpse.pipeline.embedded import embedded_checkpoint

    root = tmp_path_factory.mktemp("glimpse-cache")
    embedded_checkpoint(root, progress=lambda line: None)
    return root


def write_moving_square(path: Path) -> Path:
    """A still, textured scene in which one white square moves right, 6 s at 8 fps: most of its tokens repeat
    over time, the square's do not (RLT). Written losslessly, so the still part is the same in every frame."""
    from glimpse.tasks import write_clip

    rng = np.random.RandomState(0)
    scene = (rng.rand(112, 224, 3) * 255).astype(np.uint8)
    frames = []
    for i in range(48):  # Qwen2-VL samples 12 frames: 6 temporal steps
        frame = scene.copy()
        frame[28:56, 8 + 4 * i:36 + 4 * i] = 255
        frames.append(frame)
    return write_clip(frames, path, 8, crf=0)


def refuse_listing(monkeypatch, locked: Path) -> None:
    """``locked`` cannot be listed, as for a user without read permission on it (the tests may run as root,
    whom permissions do not stop): os.walk lists folders with os.scandir."""
    import os

    real = os.scandir

    def scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


def write_video(path: Path, frames: int, fps: int, size: tuple[int, int]) -> Path:
    """A small H.264/MPEG-4 clip whose frame i is a solid colour that encodes i."""
    import av

    with av.open(str(path), "w") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            array = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            array[..., 0] = (i * 12) % 256
            array[: size[1] // 2, :, 1] = 200
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
