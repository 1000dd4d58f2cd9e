"""The label-free calibration set that ships with Glimpse (assets/calibration/).

`glimpse calibrate slider` without --images/--videos uses it: 4 images per image category and 4
clips per clip category of the generated shapes task (app/tasks.py), drawn from seed 100 —
neither the training seed 0, the validation seed 2, nor the held-out seeds 1 and 3-7 that the
reported accuracy uses — each with one question. No answers are stored: calibration compares the
pruned model with the unpruned one, so it needs none. ``--per-category 8`` (80 prompts) was tried
on 2026-11-26 to tighten the bound the slider judges on; it did not move speed 0.5 (docs/slider.md).
Since 2026-12-02 half of them (``--styled 0.5``) are drawn with a look of other pictures (`tasks.stylise`:
dark, graded, textured and striped backgrounds, turned, shadowed and outlined shapes, noise, JPEG), so that the
agreement calibration measures is not only that of the plain scenes the model first learnt on: an outside
tester's scenes of other styles lost counting answers under pruning that 40 plain prompts could not show.

    python -m training.make_calibration_set            # rewrites assets/calibration/
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from glimpse import tasks

CALIBRATION_SEED = 100
OUT = Path(__file__).resolve().parent.parent / "assets" / "calibration"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=CALIBRATION_SEED)
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--styled", type=float, default=0.5, help="share of the prompts drawn with other looks")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    # Written into a folder beside the set and swapped in whole: deleting the old media first and writing the
    # questions last left, after a Ctrl-C, 80 questions of missing pictures, and calibrate slider skipped them all
    # (an outside pass). A run stopped between the two renames leaves the old set under ``.old``: put back here.
    staging, previous = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.old")
    if previous.is_dir() and not out.exists():
        previous.rename(out)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(previous, ignore_errors=True)
    staging.mkdir(parents=True)
    lines = []
    for i, (item, qa) in enumerate(tasks.heldout_set(args.seed, args.per_category, styled=args.styled)):
        if item.is_video:
            name = f"{i:03d}.mp4"
            tasks.write_clip(item.frames, staging / name)
            lines.append({"video": name, "question": qa.question})
        else:
            name = f"{i:03d}.png"
            item.frames[0].save(staging / name, optimize=True)
            lines.append({"image": name, "question": qa.question})
    (staging / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if out.is_dir():
        for other in out.iterdir():  # what else the folder holds stays; the old media and questions do not
            if other.is_file() and not re.fullmatch(r"\d{3}\.(png|mp4)|prompts\.jsonl", other.name):
                shutil.copy2(other, staging / other.name)
        out.rename(previous)
    staging.rename(out)
    shutil.rmtree(previous, ignore_errors=True)
    print(f"{len(lines)} prompts -> {out}")


if __name__ == "__main__":
    main()
