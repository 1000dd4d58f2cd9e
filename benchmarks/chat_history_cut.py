"""How long the chat takes to cut a conversation longer than the model's context down to what fits, by halves
(``ui._fitting_prompt``, what the chat does) against one oldest turn at a time (what it did before 2026-11-28),
side by side on the same history and the same engine. Each try builds the whole prompt (templating and
tokenizing every turn kept), as the chat does before it queues a turn.

    python benchmarks/chat_history_cut.py [--model embedded] [--turns 1000] [--give-up-s 120]

The one-at-a-time run stops after ``--give-up-s`` and extrapolates (it grows with the square of the turns).
"""

from __future__ import annotations

import argparse
import time

from glimpse.pipeline import load_engine
from glimpse.pipeline.prompt import ContextOverflow
from glimpse.pipeline.scheduler import Scheduler
from glimpse.ui import _fitting_prompt, _turn_starts, history_to_messages
from flags import check_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--give-up-s", type=float, default=120.0)
    args = parser.parse_args()
    check_flags(parser, args, counts=("turns",), or_none=("give_up_s",))

    engine = load_engine(args.model, device="cpu")
    scheduler = Scheduler(engine, start=False)
    history = []
    for i in range(args.turns):  # Gradio's message format, as the chat's history arrives
        history += [{"role": "user", "content": [{"type": "text", "text": f"question {i}: what colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    turn = [{"role": "user", "content": [{"type": "text", "text": "And now?"}]}]

    def prepare(conversation):
        return scheduler.prepare(history_to_messages(conversation, ()), True)

    start = time.perf_counter()
    prompt, left_out = _fitting_prompt(history, turn, prepare)
    halves = time.perf_counter() - start
    print(f"{args.turns} turns, context {engine.max_length:,}: {left_out} oldest left out, prompt {len(prompt):,} tokens")
    print(f"by halves:       {halves:7.2f} s")

    starts, start, dropped = _turn_starts(history), time.perf_counter(), 0
    while time.perf_counter() - start < args.give_up_s:
        try:
            prepare(history[starts[dropped]:] + turn)
            break
        except ContextOverflow:
            dropped += 1
    one_by_one = time.perf_counter() - start
    estimate = "" if dropped == left_out else f" (gave up at {dropped} of {left_out}: about {one_by_one * left_out / max(dropped, 1):.0f} s in all)"
    print(f"one at a time:   {one_by_one:7.2f} s{estimate}")


if __name__ == "__main__":
    main()
