"""The slider's LazyLLM (``auto`` on every uncalibrated model) decoding in a batch's KV slots, against the same
policy decoding request by request as it did before 2026-11-28 (its decode callbacks, which do nothing without the
paper's re-selection, kept it out of the slots and the CUDA graph). Both sides run in one process, alternately,
on the embedded model: one question about ``assets/sample.png`` per request, 32 greedy tokens each (``ignore_eos``),
tokens/s over the whole ``generate_batch`` call (prefill included), best of two rounds; and whether the tokens are
the same.

    python benchmarks/lazyllm_slots.py
"""

from __future__ import annotations

import time
from pathlib import Path

from glimpse.pipeline import load_engine
from glimpse.pruning import LazyLLM, Policy

QUESTIONS = ["Write a short story about a fox.", "Describe the sea.", "What is a cat?", "Tell me a joke about bread.",
             "Explain rain.", "Name three colours.", "Write a poem about trees.", "What is music?"]
IMAGE = str(Path(__file__).resolve().parent.parent / "assets" / "sample.png")


def main() -> None:
    engine = load_engine("embedded", device="cpu")
    conversations = [[{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": q}]}]
                     for q in QUESTIONS]
    slots = LazyLLM.implements
    per_request = lambda self, callback: Policy.implements(self, callback)  # noqa: E731 — the behaviour before
    print("| batch | KV slots (tokens/s) | per request (tokens/s) | ratio | same tokens |")
    print("|---|---|---|---|---|")
    for batch in (1, 4, 8):
        best, tokens = {}, {}
        for _ in range(2):
            for name, implements in (("slots", slots), ("per request", per_request)):
                LazyLLM.implements = implements
                start = time.perf_counter()
                results = engine.generate_batch(conversations[:batch], policy="lazyllm", speed=1.0, max_new_tokens=32,
                                                ignore_eos=True)
                rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
                best[name] = max(best.get(name, 0.0), rate)
                tokens[name] = [r.token_ids for r in results]
        LazyLLM.implements = slots
        print(f"| {batch} | {best['slots']:.1f} | {best['per request']:.1f} | {best['slots'] / best['per request']:.2f}x "
              f"| {tokens['slots'] == tokens['per request']} |", flush=True)


if __name__ == "__main__":
    main()
