"""The Ray path's overhead: the same small images captioned by the local captioner and by `--ray` with one
actor, alternately, in one run (the same model, prompts and options), then by two actors.

    python benchmarks/caption_ray.py --images 200 [--rounds 3] [--model embedded] [--batch-size 8] [--max-new-tokens 16]

The order: Ray with one actor on a fresh local cluster (the first job on a fresh cluster also starts Ray Data's
own helper actors, which a Ray user's running cluster has), then ``--rounds`` rounds of the local captioner and
Ray with one actor on the cluster that is now running, then two actors. Alternating puts each Ray run beside a
local run of the same minutes: on this shared machine the speed drifts by 10-40% over an hour, as much as the
overhead being measured, so the overhead reported is the median of the rounds' ratios, with their spread.

Times are wall clock from the first input to the last caption (model loading excluded for the local
captioner; for Ray, the actors start and load their model inside the timed span, as a real run pays it). The
time to the first captions separates the fixed start-up from the throughput.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from flags import check_flags


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
    parser.add_argument("--rounds", type=int, default=3, help="local / one-actor pairs, alternating")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    check_flags(parser, args, counts=("images", "rounds", "batch_size", "max_new_tokens"))

    import ray

    from glimpse.caption import caption_inputs, collect_inputs
    from glimpse.caption_ray import caption_on_ray, local_cpus
    from glimpse.pipeline import load_engine

    work = Path(tempfile.mkdtemp(prefix="glimpse-ray-bench-"))
    options = dict(policy="auto", speed=0.0, prompt=None, max_new_tokens=args.max_new_tokens,
                   batch_size=args.batch_size)
    rows = []  # (path, wall s, s to the first captions)
    runs = 0

    def local() -> float:
        nonlocal runs
        runs += 1
        engine = load_engine(args.model, device="cpu")
        first = []
        start = time.perf_counter()
        caption_inputs(engine, inputs, out=work / f"local{runs}.jsonl", fmt="jsonl", overwrite=False,
                       # the first call (0 done) comes before any batch: the first captions are the next one
                       progress=lambda done, *_: first or not done or first.append(time.perf_counter() - start),
                       **options)
        seconds = time.perf_counter() - start
        rows.append(("local captioner", seconds, first[0]))
        return seconds

    def on_ray(actors: int, name: str) -> float:
        nonlocal runs
        runs += 1
        report = caption_on_ray([str(work / "in")], out=work / f"ray{runs}", model=args.model, actors=actors,
                                gpus_per_actor=0.0, address=None, device="cpu", **options)
        assert report.captioned == args.images, report.failed[:3]
        rows.append((name, report.seconds, report.first_rows_s))
        return report.seconds

    try:
        make_images(work / "in", args.images)
        inputs = collect_inputs([str(work / "in")])
        t = time.perf_counter()
        load_engine(args.model, device="cpu")
        load_s = time.perf_counter() - t
        ratios = []
        ray.init(num_cpus=local_cpus(), include_dashboard=False, log_to_driver=False)
        try:
            fresh = on_ray(1, "Ray, 1 actor (fresh local cluster)")
            local_s = local()
            fresh_ratio = fresh / local_s
            for round_number in range(1, args.rounds + 1):
                if round_number > 1:
                    local_s = local()
                ratios.append(on_ray(1, f"Ray, 1 actor (running cluster), round {round_number}") / local_s)
            two = on_ray(2, "Ray, 2 actors (running cluster)")
        finally:
            ray.shutdown()
        print(f"{args.images} images, {args.model}, batch {args.batch_size}, {args.max_new_tokens} new tokens at most; "
              f"one model load: {load_s:.1f} s\n")
        print("| path, in the order run | wall s | inputs/s | first captions after |\n|---|---|---|---|")
        for name, seconds, first in rows:
            print(f"| {name} | {seconds:.1f} | {args.images / seconds:.2f} | {first:.1f} s |")
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else f"{ratios[0]:.2f}x"
        print(f"\nRay with one actor against the local run just before it: median {statistics.median(ratios):.2f}x the "
              f"time over {len(ratios)} rounds ({spread}); on the fresh cluster {fresh_ratio:.2f}x (against the "
              f"local run after it); two actors {two / local_s:.2f}x (against the last local run)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
