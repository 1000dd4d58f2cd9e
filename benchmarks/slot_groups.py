"""Requests of mixed sizes decoding together: KV slot groups (since 2026-12-02) against one batch of slots at a time
(the code before, kept here as the "before" side) and against decoding every request on its own cache.

A batch takes no member that would make its slots hold more than ``WASTE`` (1.5) times what its members need, so
short text questions and long image prompts do not all fit one batch. Before, one batch of slots existed at a time:
the requests outside it attended one by one, and since they looked like newcomers that fit no free slot, the batch
formed again at every step (a copy of every member's entries per step). Now the rest form groups of their own, each
one attention call per layer, and a group forms again only when something changes.

A random LLaVA-1.5 (``--preset``; default the test width, ``llava-tiny``, at LLaVA-1.5-7B's depth of 32 layers)
answers ``--short`` text questions and ``--long`` questions about a random 576-token image together,
``--new-tokens`` greedy tokens each (EOS ignored), unpruned. The sides alternate after a warm-up round. Decode
tokens/s of the whole batch (medians), the tensor operators of one decode step (the fifth, counted by torch's
dispatcher: on a GPU a 7B model's decode step is bound by the host's operator count, as a narrow model's is on a
CPU), the slot batches formed in one answer, and whether every side gives the same tokens.

    python benchmarks/slot_groups.py                               # this CPU (docs/benchmarks.md)
    python benchmarks/slot_groups.py --device cuda --preset llava-1.5-7b
"""

from __future__ import annotations

import argparse
import json
import statistics

from glimpse.bench import device_name
from glimpse.pipeline import engine as engine_module
from glimpse.pipeline.batch_kv import BatchKV
from glimpse.pipeline.engine import Engine
from glimpse.pipeline.random_checkpoint import random_image

from decode_slots import operators_of_one_step, random_llava_engine  # run as a script: benchmarks/ is on the path
from flags import check_flags


def one_batch_serve(groups: list[BatchKV], candidates: list) -> list[BatchKV] | None:
    """The code before: one batch at a time, kept while every candidate is in it or takes a free slot."""
    if not groups:
        return None
    batch = groups[0]
    batch.release(candidates)
    held = {id(r) for r in batch.members}
    served = all(batch.admit(r) for r in candidates if id(r) not in held) and batch.keeps(batch._room())
    return groups if served else None


def one_batch_form(candidates: list) -> list[BatchKV]:
    return [BatchKV.form(candidates)] if candidates else []


SIDES = ("slot groups", "one batch at a time (before)", "per request")


class Side:
    """Decode as ``name`` says for the duration of a ``with``; counts the slot batches formed meanwhile."""

    def __init__(self, engine: Engine, name: str):
        self.engine, self.name, self.formed = engine, name, 0

    def __enter__(self):
        self.saved = engine_module.serve_step, engine_module.form_groups, BatchKV.__init__
        init = BatchKV.__init__

        def counted(batch, requests):
            self.formed += 1
            init(batch, requests)

        BatchKV.__init__ = counted
        if self.name == "one batch at a time (before)":
            engine_module.serve_step, engine_module.form_groups = one_batch_serve, one_batch_form
        self.engine.decode_slots = self.name != "per request"
        return self

    def __exit__(self, *exc):
        engine_module.serve_step, engine_module.form_groups, BatchKV.__init__ = self.saved
        self.engine.decode_slots = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llava-tiny")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--short", type=int, default=8, help="text questions")
    parser.add_argument("--long", type=int, default=8, help="questions about a 576-token image")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "short", "long", "new_tokens", "runs"), device=True)

    engine = random_llava_engine(args.preset, args.layers, args.device)
    image = random_image(576)
    conversations = ([[{"role": "user", "content": "Write one line about the sea."}]] * args.short
                     + [[{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "Describe the image in detail."}]}]]
                     * args.long)

    def run(new_tokens: int):
        return engine.generate_batch(conversations, policy="none", max_new_tokens=new_tokens, ignore_eos=True)

    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    answers, formed, operators = {}, {}, {}
    for round_index in range(1 + args.runs):
        for name in SIDES:
            with Side(engine, name) as side:
                results = run(args.new_tokens)
            if round_index:  # the first round warms up
                rates[name].append(sum(r.metrics["decode_tokens_per_s"] for r in results))
            answers[name], formed[name] = [r.token_ids for r in results], side.formed
    for name in SIDES:
        with Side(engine, name):
            operators[name] = operators_of_one_step(engine, lambda: run(8))
    base = statistics.median(rates["one batch at a time (before)"])
    report = {"device": device_name(engine), "preset": args.preset, "layers": args.layers, "short": args.short,
              "long": args.long, "new_tokens": args.new_tokens, "runs": args.runs,
              "same_tokens": all(answers[name] == answers[SIDES[0]] for name in SIDES),
              "rows": [{"side": name, "decode_tokens_per_s": round(statistics.median(r), 1),
                        "vs_before": round(statistics.median(r) / base, 2), "operators_per_step": operators[name],
                        "batches_formed": formed[name], "all": [round(x, 1) for x in r]}
                       for name, r in rates.items()]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}: {args.preset} at {args.layers} layers, {args.short} text questions beside "
          f"{args.long} questions about a 576-token image, {args.new_tokens} tokens, median of {args.runs}")
    print("| side | decode tokens/s (batch) | vs before | operators per step | slot batches formed |\n"
          "|---|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['side']} | {row['decode_tokens_per_s']} | {row['vs_before']} | {row['operators_per_step']} "
              f"| {row['batches_formed']} |")
    print(f"every side gives the same tokens: {report['same_tokens']}")


if __name__ == "__main__":
    main()
