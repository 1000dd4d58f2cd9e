"""The Ray path's overhead: the same small images captioned by the local captioner and by `--ray` with one
actor (on a fresh local cluster, then on the same cluster again) and with two actors, in one run (the same
model, prompts and options).

    python benchmarks/caption_ray.py --images 200 [--model embedded] [--batch-size 8] [--max-new-tokens 16]

Times are wall clock from the first input to the last caption (model loading excluded for the local
captioner; for Ray, the actors load their model inside the timed span, as a real run pays it, and that
load is reported apart). Inputs/s and the Ray-to-local ratio are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def make_images(folder: Path, count: int) -> list[Path]:
    import random

    from glimpse.tasks import render, sample_scene  # the embedded model's kind of picture

    folder.mkdir(parents=True)
    rng = random.Random(0)
    paths = []
    for i in range(count):
        path = folder / f"scene{i:04d}.png"
        render(sample_scene(rng)).save(path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    import ray

    from glimpse.caption import caption_inputs, collect_inputs
    from glimpse.caption_ray import caption_on_ray, local_cpus
    from glimpse.pipeline import load_engine

    work = Path(tempfile.mkdtemp(prefix="glimpse-ray-bench-"))
    try:
        make_images(work / "in", args.images)
        inputs = collect_inputs([str(work / "in")])
        options = dict(policy="auto", speed=0.0, prompt=None, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size)
        engine = load_engine(args.model, device="cpu")
        start = time.perf_counter()
        caption_inputs(engine, inputs, out=work / "local.jsonl", fmt="jsonl", overwrite=False, **options)
        local_s = time.perf_counter() - start
        del engine
        rows = [("local captioner", local_s)]
        t = time.perf_counter()
        load_engine(args.model, device="cpu")
        load_s = time.perf_counter() - t
        ray.init(num_cpus=local_cpus(), include_dashboard=False, log_to_driver=False)
        try:
            # The first job on a fresh cluster also starts Ray Data's own helper actors; a cluster that is already
            # running (a real Ray user's) has them. So one actor twice: on the fresh cluster, then again.
            runs = [(1, "Ray, 1 actor (fresh local cluster)"), (1, "Ray, 1 actor (cluster already running)"),
                    (2, "Ray, 2 actors (cluster already running)")]
            for number, (actors, name) in enumerate(runs):
                report = caption_on_ray([str(work / "in")], out=work / f"ray{number}", model=args.model,
                                        actors=actors, gpus_per_actor=0.0, address=None, device="cpu", **options)
                assert report.captioned == args.images, report.failed[:3]
                rows.append((name, report.seconds))
        finally:
            ray.shutdown()
        print(f"{args.images} images, {args.model}, batch {args.batch_size}, {args.max_new_tokens} new tokens at most; "
              f"one model load: {load_s:.1f} s\n")
        print("| path | wall s | inputs/s | vs local |\n|---|---|---|---|")
        for name, seconds in rows:
            print(f"| {name} | {seconds:.1f} | {args.images / seconds:.2f} | {seconds / local_s:.2f}x time |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
