"""How many decode steps each CUDA graph of the decode step would serve under a chat server's mixed load.

The decode step is captured as a CUDA graph for one set of slot groups and replayed while those groups stay
(pipeline/decode_graph.py); new groups capture again. Whether capturing at once pays, or capturing only after the
groups have lasted a few eager steps, depends on how long the sets last and on what a capture costs against what
a replay saves (the GPU suite's decode section measures that break-even). This counts the first part on any
machine: the embedded model served in-process by the scheduler (``--max-batch`` 8), ``--clients`` clients each
asking ``--requests`` questions one after the other, alternately two about the sample image and two for stories
(``glimpse bench serve --workload mixed``'s mix), the fixed-shape step forced on as on CUDA (off a GPU it runs
eagerly, so nothing is captured: each set of groups it is made for is what a GPU would capture).

    python benchmarks/graph_lifetimes.py
"""

from __future__ import annotations

import argparse
import collections
import threading

from glimpse.assets import ASSETS
from glimpse.bench_serve import QUESTIONS, TOPICS
from glimpse.pipeline import load_engine
from glimpse.pipeline.decode_graph import SlotStep
from glimpse.pipeline.engine import Engine
from glimpse.pipeline.scheduler import Scheduler
from flags import check_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    args = parser.parse_args()
    check_flags(parser, args, counts=("clients", "requests", "max_tokens", "max_batch"))
    engine = load_engine("embedded", device="cpu")
    engine.decode_graphs = True  # the fixed-shape step, as on CUDA
    served = collections.Counter()  # per SlotStep made (a capture on a GPU): the steps it ran
    run = SlotStep.run

    def counted(step, engine, groups):
        served[id(step)] += 1
        return run(step, engine, groups)

    SlotStep.run = counted
    steps = []
    decode_step = Engine.decode_step
    Engine.decode_step = lambda engine, running: (steps.append(len(running)), decode_step(engine, running))[1]
    scheduler = Scheduler(engine, max_batch=args.max_batch, queue_size=args.clients * args.requests)
    image = str(ASSETS / "sample.png")

    def client(c: int) -> None:
        for k in range(args.requests):
            i = c * args.requests + k
            content = (f"Write a story about {TOPICS[i % len(TOPICS)]}." if i // 2 % 2 else
                       [{"type": "image", "image": image}, {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}])
            scheduler.submit([{"role": "user", "content": content}], policy="none",
                             max_new_tokens=args.max_tokens).result(timeout=600)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        scheduler.close()
        SlotStep.run, Engine.decode_step = run, decode_step
    lives = list(served.values())
    print(f"{args.clients} clients x {args.requests} requests, at most {args.max_tokens} tokens, batch {args.max_batch}: "
          f"{len(steps)} decode steps, {sum(lives)} of them as the fixed-shape step, for {len(lives)} sets of slot groups")
    print("steps a set lasted: sets —", ", ".join(f"{k}: {v}" for k, v in sorted(collections.Counter(lives).items())))
    print("\n| capture after k eager steps | captures | replayed steps | steps not replayed (eager or capturing) |\n|---|---|---|---|")
    for k in range(5):
        captures = sum(1 for life in lives if life > k)
        replayed = sum(max(0, life - k - 1) for life in lives)
        print(f"| {k} | {captures} | {replayed} | {sum(lives) - replayed} |")


if __name__ == "__main__":
    main()
