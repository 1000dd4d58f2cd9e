"""A client that leaves during a long prefill: how soon the server's model is free for the next request.

Since 2026-12-05 a prefill stops before the next block of its vision tower or its next decoder layer once its client
has left (or the server's shutdown grace has run out); before, it ran to its end and the next request waited for all
of it. This measures both sides in one run on the scheduler ``glimpse serve`` uses: the "before" side turns the
engine's two checks off (``glimpse.pipeline.engine._stop_if_interrupted`` and ``_stop_between``, replaced here and
only here), the code path being otherwise the same.

The model is a random-weights Qwen2-VL of a real size (``--preset``, decoder at full depth; the vision tower at the
real width and ``--vision-depth`` blocks of the real 32, so that a run takes minutes, not a quarter of an hour), asked
about a noise image of about ``--tokens`` visual tokens. Each side: the request is submitted, its client leaves
``--leave-after`` seconds later, a one-word request is submitted at that moment, and the time until that one's answer
is reported. The prefill's own time (encoder included) is measured first, alone.

    python benchmarks/cancel_prefill.py --leave-after 10    # this CPU (docs/serving.md, "Cancellation")
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import glimpse.pipeline.engine as engine_module
from glimpse.bench import device_name
from glimpse.pipeline import load_engine
from glimpse.pipeline.random_checkpoint import build_random, random_image
from glimpse.pipeline.scheduler import Cancelled, Scheduler
from flags import check_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2-vl-2b")
    parser.add_argument("--tokens", type=int, default=3000, help="visual tokens of the image (about)")
    parser.add_argument("--leave-after", type=float, default=1.0, help="seconds into the prefill the client leaves")
    parser.add_argument("--vision-depth", type=int, default=4, help="vision tower blocks (the real towers have 32)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    check_flags(parser, args, counts=("tokens", "vision_depth"), or_none=("leave_after",), device=True)

    folder = Path(tempfile.mkdtemp(prefix="glimpse-cancel-"))
    build_random(folder, preset=args.preset, vision_depth=args.vision_depth)
    engine = load_engine(str(folder), device=args.device)
    image = folder / "noise.png"
    random_image(args.tokens).save(image)
    long = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                         {"type": "text", "text": "Describe it."}]}]
    short = [{"role": "user", "content": "hello"}]
    engine.generate(short, policy="none", max_new_tokens=2)  # warm

    scheduler = Scheduler(engine, max_batch=4)
    try:
        start = time.perf_counter()
        alone = scheduler.submit(long, policy="none", max_new_tokens=1, caches=False)
        metrics = alone.result(timeout=3600).metrics
        print(f"{device_name(engine)}, {args.preset} with {args.vision_depth} vision blocks: a prompt of "
              f"{len(alone.request.prompt):,} tokens; its prefill alone takes {time.perf_counter() - start:.2f} s "
              f"(vision encoder {metrics['vision_encoder_s']:.2f} s)")
        checks = engine_module._stop_if_interrupted, engine_module._stop_between
        for side, interrupts in (("now (interrupted)", True), ("before (runs to its end)", False)):
            engine_module._stop_if_interrupted, engine_module._stop_between = checks if interrupts else (
                lambda ctx: None, lambda blocks, interrupted: contextlib.nullcontext())
            leaving = scheduler.submit(long, policy="none", max_new_tokens=1, caches=False)  # its prompt is built here
            time.sleep(args.leave_after)
            leaving.cancel.set()
            left = time.perf_counter()
            scheduler.submit(short, policy="none", max_new_tokens=1).result(timeout=3600)
            print(f"{side}: the client left {args.leave_after:g} s into the prefill; the next request's answer came "
                  f"{time.perf_counter() - left:.2f} s later")
            try:
                leaving.result(timeout=1)
            except Cancelled:
                pass  # the interrupted side: no answer
        engine_module._stop_if_interrupted, engine_module._stop_between = checks
    finally:
        scheduler.close()


if __name__ == "__main__":
    main()
