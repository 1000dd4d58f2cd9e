"""Decode-time policies in a batch's KV slots, each against the code before it, side by side: ST3's annealing hiding
evicted entries in the slots (masked by rank, freed when the batch forms again; since 2026-12-02) against removing
them from every layer of every request at every step; ZipVL's 4/2-bit KV in packed slots (since 2026-12-02) against
decoding each request on its own cache (``Engine.decode_slots = False``, what it did before).

A random LLaVA-1.5 (``--preset``; default the test width, ``llava-tiny``, at LLaVA-1.5-7B's depth of 32 layers, with
its 576-token image) answers ``--batch`` copies of one question about a random image together, ``--new-tokens``
greedy tokens each (EOS ignored); ST3 at speed 1 (the paper's tau = 50), ZipVL at speed 0.5 (the paper's 4/2 bits).
The sides alternate after a warm-up round. Decode tokens/s of the whole batch, medians; the tensor operators of one
decode step (the fifth), counted by torch's dispatcher: on a GPU a 7B model's decode step is bound by the host's
operator count, as a narrow model's is on a CPU (with ZipVL less so there: dequantizing the whole cache at every
step is real work on a CPU). And whether each policy's two sides give the same tokens and KV bytes. On CUDA the
"before" sides take the fixed-shape step where the engine now allows it, where before they decoded eagerly.

    python benchmarks/decode_slots.py                               # this CPU (docs/benchmarks.md)
    python benchmarks/decode_slots.py --device cuda --preset llava-1.5-7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from glimpse.bench import OperatorCount, device_name
from glimpse.pipeline import load_engine
from glimpse.pipeline.cache import LayerKV
from glimpse.pipeline.engine import Engine
from glimpse.pipeline.random_checkpoint import build_random_llava, random_image
from flags import check_flags


hides_now = LayerKV.keep_top_visual


def removed_at_once(layer: LayerKV, count: int) -> None:
    """``keep_top_visual`` as it was before 2026-12-02: the entries leave storage at once, in a slot too."""
    kept_before = layer.rank_limit
    hides_now(layer, count)
    if layer.rank_limit < kept_before:
        layer.tail_entries()  # any read removes the hidden entries from storage


def operators_of_one_step(engine, run) -> int:
    """The tensor operators of the fifth decode step of ``run()``."""
    step, seen, counted = Engine.decode_step, [], []

    def spy(self, running):
        seen.append(1)
        if len(seen) != 5:
            return step(self, running)
        with OperatorCount() as operators:
            step(self, running)
        counted.append(operators.count)

    Engine.decode_step = spy
    try:
        run()
    finally:
        Engine.decode_step = step
    return counted[0]


def random_llava_engine(preset: str, layers: int, device: str) -> Engine:
    """A random LLaVA-1.5 of ``preset``'s shapes at ``layers`` layers, with a 576-token image (bfloat16 on CUDA); on
    a CPU one thread, so that a step's time follows its operator count, not how they spread over cores."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    overrides = {"vision_image_size": 336} if preset == "llava-tiny" else {}  # 576 image tokens
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random_llava(Path(tmp) / "model", preset=preset, layers=layers, dtype=dtype, **overrides)
        engine = load_engine(str(folder), device=device, dtype=str(dtype).replace("torch.", ""))
    if device == "cpu":
        torch.set_num_threads(1)
    return engine


# side -> (policy, speed, evictions removed at once, KV slots)
SIDES = {"none": ("none", 0.0, False, True),
         "st3 (hidden in slots)": ("st3", 1.0, False, True),
         "st3 (removed at every step)": ("st3", 1.0, True, True),
         "zipvl (packed slots)": ("zipvl", 0.5, False, True),
         "zipvl (per request)": ("zipvl", 0.5, False, False)}
PAIRS = [("st3 (hidden in slots)", "st3 (removed at every step)"), ("zipvl (packed slots)", "zipvl (per request)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llava-tiny")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "batch", "new_tokens", "runs"), device=True)

    engine = random_llava_engine(args.preset, args.layers, args.device)
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(576)},
                                             {"type": "text", "text": "Describe the image in detail."}]}]

    def run(name: str, new_tokens: int):
        policy, speed, at_once, slots = SIDES[name]
        LayerKV.keep_top_visual = removed_at_once if at_once else hides_now
        engine.decode_slots = slots
        try:
            return engine.generate_batch([messages] * args.batch, policy=policy, speed=speed,
                                         max_new_tokens=new_tokens, ignore_eos=True)
        finally:
            LayerKV.keep_top_visual, engine.decode_slots = hides_now, True

    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    answers: dict[str, tuple] = {}
    for round_index in range(1 + args.runs):
        for name in SIDES:
            results = run(name, args.new_tokens)
            if round_index:  # the first round warms up
                rates[name].append(sum(r.metrics["decode_tokens_per_s"] for r in results))
            answers[name] = (tuple(tuple(r.token_ids) for r in results), results[0].metrics["kv_bytes"])
    operators = {name: operators_of_one_step(engine, lambda n=name: run(n, 8)) for name in SIDES}
    base = statistics.median(rates["none"])
    report = {"device": device_name(engine), "preset": args.preset, "layers": args.layers, "batch": args.batch,
              "new_tokens": args.new_tokens, "runs": args.runs,
              "same_tokens_and_kv": {now: answers[now] == answers[before] for now, before in PAIRS},
              "rows": [{"side": name, "decode_tokens_per_s": round(statistics.median(r), 1),
                        "vs_none": round(statistics.median(r) / base, 2), "operators_per_step": operators[name],
                        "all": [round(x, 1) for x in r]} for name, r in rates.items()]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}: {args.preset} at {args.layers} layers, 576-token image, batch {args.batch}, "
          f"{args.new_tokens} tokens, median of {args.runs}")
    print("| side | decode tokens/s (batch) | vs none | operators per step |\n|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['side']} | {row['decode_tokens_per_s']} | {row['vs_none']} | {row['operators_per_step']} |")
    for now, same in report["same_tokens_and_kv"].items():
        print(f"{now} and the code before it give the same tokens and KV bytes: {same}")


if __name__ == "__main__":
    main()
