"""Write the README's sample inputs: `python -m training.samples` -> assets/sample.png, assets/sample.mp4.

Both are drawn by the task generator (app/tasks.py) with fixed contents, not from a training seed:
a scene with a big red circle, and a clip in which a blue square moves right.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from glimpse import tasks

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def sample_scene() -> tasks.Scene:
    c = tasks.CANVAS
    return tasks.Scene((238, 236, 228), [
        tasks.Thing("circle", "red", "big", "top left", c * 0.26, c * 0.27, 50),
        tasks.Thing("triangle", "green", "small", "top right", c * 0.74, c * 0.22, 26),
        tasks.Thing("square", "blue", "big", "bottom right", c * 0.72, c * 0.75, 46),
    ], word="CAT", word_quadrant="bottom left")


def sample_clip_frames() -> list:
    c = tasks.CANVAS
    square = tasks.Thing("square", "blue", "big", "top left", 0, c * 0.3, 40)
    star = tasks.Thing("star", "yellow", "big", "bottom right", c * 0.7, c * 0.75, 48)
    scene = tasks.Scene((236, 238, 232), [square, star])
    frames = []
    for i in range(tasks.CLIP_FRAMES):
        square.x = c * (0.2 + 0.6 * i / (tasks.CLIP_FRAMES - 1))
        frames.append(tasks.render(scene))
    return frames


def main(argv: list[str] | None = None) -> None:
    # (with no parser, `--help` wrote over the shipped samples: an outside pass)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS, metavar="DIR",
                        help="where to write sample.png and sample.mp4 (default: assets/, the shipped ones)")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    tasks.render(sample_scene()).save(out / "sample.png")
    tasks.write_clip(sample_clip_frames(), out / "sample.mp4")
    print(f"wrote {out / 'sample.png'} and {out / 'sample.mp4'}")


if __name__ == "__main__":
    main()
