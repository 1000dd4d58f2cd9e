"""What the encoder cache gains on a chat's follow-up question: the second turn of a conversation about one
picture (the picture is sent again with the history), answered with the cache off and on, alternately, in one
run on the same engine; the median time to first token of each, and whether the tokens are the same.

    python benchmarks/encoder_cache.py [--model embedded] [--image assets/sample.png] [--runs 7] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from flags import check_flags

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--image", default=str(REPO / "assets" / "sample.png"))
    parser.add_argument("--runs", type=int, default=7, help="answers per measurement (the median is reported)")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    args = parser.parse_args()
    check_flags(parser, args, counts=("runs", "rounds"))

    from glimpse.pipeline import load_engine

    engine = load_engine(args.model)
    chat = [{"role": "user", "content": [{"type": "image", "image": args.image},
                                         {"type": "text", "text": "What colour is the circle?"}]},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "How many shapes are there?"}]

    def follow_up() -> tuple[float, float, list[int]]:
        results = [engine.generate(chat, policy="none", max_new_tokens=2) for _ in range(args.runs)]
        return (statistics.median(r.metrics["ttft_s"] for r in results),
                statistics.median(r.metrics["vision_encoder_s"] for r in results), results[-1].token_ids)

    engine.generate(chat, policy="none", max_new_tokens=2)  # warm-up
    print(f"{args.model} on {engine.device}, {Path(args.image).name}, the median of {args.runs} follow-up answers\n")
    print("| round | TTFT, cache off | encoder, off | TTFT, cache on | encoder, on | speedup | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for round_ in range(1, args.rounds + 1):
        engine.encoder_cache.max_bytes = 0
        off = follow_up()
        engine.encoder_cache.max_bytes = 256 * 2**20  # glimpse serve's default
        # The answer that fills it, not measured: in a chat the picture's encoding is cached by the turn that first
        # showed it, so every follow-up is a hit (measured from here, --runs 1 timed the miss as "cache on").
        engine.generate(chat, policy="none", max_new_tokens=2)
        on = follow_up()
        print(f"| {round_} | {off[0]:.3f} s | {off[1]:.3f} s | {on[0]:.3f} s | {on[1]:.4f} s | {off[0] / on[0]:.2f}x "
              f"| {'yes' if off[2] == on[2] else 'NO'} |")


if __name__ == "__main__":
    main()
