"""The slider's LazyLLM (``auto`` on every uncalibrated model) decoding in a batch's KV slots, against the same
policy decoding request by request as it did before 2026-11-28 (its decode callbacks, which do nothing without the
paper's re-selection, kept it out of the slots and the CUDA graph). Both sides run in one process, alternately,
on the embedded model: one question about ``assets/sample.png`` per request, 32 greedy tokens each (``ignore_eos``),
tokens/s over the whole ``generate_batch`` call (prefill included), the median of the rounds after a warm-up round;
and whether the tokens are the same.

    python benchmarks/lazyllm_slots.py [--batches 1,4,8] [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from glimpse.pipeline import load_engine
from glimpse.pruning import LazyLLM, Policy
from flags import check_flags

QUESTIONS = ["Write a short story about a fox.", "Describe the sea.", "What is a cat?", "Tell me a joke about bread.",
             "Explain rain.", "Name three colours.", "Write a poem about trees.", "What is music?"]
IMAGE = str(Path(__file__).resolve().parent.parent / "assets" / "sample.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,8", help="batch sizes, comma-separated (1 to 8)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of both sides (the median is reported)")
    args = parser.parse_args()
    check_flags(parser, args, counts=("new_tokens", "rounds"))
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes whole numbers, comma-separated; got {args.batches!r}")
    if not all(1 <= b <= len(QUESTIONS) for b in batches):
        parser.error(f"--batches must be in [1, {len(QUESTIONS)}], got {args.batches}")
    engine = load_engine("embedded", device="cpu")
    conversations = [[{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": q}]}]
                     for q in QUESTIONS]
    slots = LazyLLM.implements
    per_request = lambda self, callback: Policy.implements(self, callback)  # noqa: E731 — the behaviour before
    print("| batch | KV slots (tokens/s) | per request (tokens/s) | ratio | same tokens |")
    print("|---|---|---|---|---|")
    for batch in batches:
        rates, tokens = {"slots": [], "per request": []}, {}
        for round_ in range(args.rounds + 1):  # round 0 warms up (first-call allocations), not counted
            for name, implements in (("slots", slots), ("per request", per_request)):
                LazyLLM.implements = implements
                try:
                    start = time.perf_counter()
                    results = engine.generate_batch(conversations[:batch], policy="lazyllm", speed=1.0,
                                                    max_new_tokens=args.new_tokens, ignore_eos=True)
                    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
                finally:
                    LazyLLM.implements = slots
                if round_:
                    rates[name].append(rate)
                tokens[name] = [r.token_ids for r in results]
        slot_rate, request_rate = statistics.median(rates["slots"]), statistics.median(rates["per request"])
        print(f"| {batch} | {slot_rate:.1f} | {request_rate:.1f} | {slot_rate / request_rate:.2f}x "
              f"| {tokens['slots'] == tokens['per request']} |", flush=True)


if __name__ == "__main__":
    main()
