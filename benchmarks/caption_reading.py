"""Does `glimpse caption` keep the model busy while it reads videos? Times the installed `glimpse caption` over a
folder of 720p clips, with the model's torch given one thread and then every core.

Reading a video (decoding, sampling, resizing the frames) is CPU work. Before 2026-12-05 the captioner read a batch's
inputs one after the other and only then answered them, so the model waited for every batch's reading. Now the next
batch is read, several inputs at a time, while the model answers this one. On a GPU box the model leaves the CPU's
cores free for that; here ``OMP_NUM_THREADS=1`` is the stand-in (the model on one of the two cores). With the model
on every core there is no spare CPU to read on, and the two should take the same time.

    python benchmarks/caption_reading.py --clips 16

Run it once per checkout to compare (the script times whatever `glimpse` the environment has installed). It also
prints the reading alone: every clip's prompt built one after the other (``Preprocessor.prepare``), the time the model
waited in all before. The clips are written once to ``--folder`` (distinct moving patterns: the media cache does not
know one from another) and reused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from flags import check_flags


def write_clip(path: Path, seconds: int, seed: int, width: int = 1280, height: int = 720) -> None:
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8).repeat(16, 0).repeat(16, 1)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "23"}  # x264's default keyframe interval: a camera's file
        for i in range(30 * seconds):
            frame = av.VideoFrame.from_ndarray(np.roll(base, (2 * i, 5 * i), axis=(0, 1)), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def reading_alone(folder: Path) -> float:
    from glimpse.pipeline import Preprocessor
    from glimpse.pipeline.prompt import user_message

    preprocessor = Preprocessor("embedded")
    clips = sorted(folder.glob("*.mp4"))
    preprocessor.prepare(user_message("Describe this video.", [("video", str(clips[0]))]))  # warm-up
    start = time.perf_counter()
    for clip in clips:
        preprocessor.prepare(user_message("Describe this video.", [("video", str(clip))]))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=10, help="length of each clip")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "glimpse-caption-reading")
    args = parser.parse_args()
    check_flags(parser, args, counts=("clips", "seconds", "batch_size", "max_new_tokens"))

    args.folder.mkdir(parents=True, exist_ok=True)
    for k in range(args.clips):
        clip = args.folder / f"clip{k:03d}.mp4"
        if not clip.exists():
            print(f"writing {clip}", file=sys.stderr)
            write_clip(clip, args.seconds, seed=k)
    glimpse = shutil.which("glimpse") or str(Path(sys.executable).with_name("glimpse"))
    print(f"{args.clips} clips of {args.seconds} s at 720p, batches of {args.batch_size}, {args.max_new_tokens} answer "
          f"tokens, {os.cpu_count()} CPUs")
    print(f"reading alone, one clip after the other: {reading_alone(args.folder):.1f} s")
    for threads in ("1", str(os.cpu_count())):
        with tempfile.TemporaryDirectory() as out:
            command = [glimpse, "caption", str(args.folder), "--out", f"{out}/captions.jsonl", "--batch-size",
                       str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens)]
            start = time.perf_counter()
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": threads},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"glimpse caption, model on {threads} thread(s): {time.perf_counter() - start:.1f} s "
                  "(the model's load included)")


if __name__ == "__main__":
    main()
