"""ST3's visual-KV annealing in a batch's KV slots: evicted entries hidden (masked out by rank, freed when the
batch forms again; since 2026-12-02) against removed from every layer of every request at every step (before).

A random LLaVA-1.5 (``--preset``; default the test width, ``llava-tiny``, at LLaVA-1.5-7B's depth of 32 layers,
with its 576-token image) answers ``--batch`` copies of one question about a random image together, ``--new-tokens``
greedy tokens each (EOS ignored). Three sides alternate after a warm-up round: no pruning, ST3 at speed 1 (the paper's
tau = 50) as it runs now, and ST3 with every eviction applied at once (``LayerKV.keep_top_visual`` removing the
entries from storage right away, what it did before; on CUDA this side takes the fixed-shape step all the same,
where before its steps ran eagerly while it annealed). Decode tokens/s of the whole batch, medians; and whether the
two ST3 sides give the same tokens and KV bytes. On a narrow model on a CPU a decode step is bound by the host's
operator count, as a 7B model's is on a GPU.

    python benchmarks/st3_slots.py                               # this CPU (docs/benchmarks.md)
    python benchmarks/st3_slots.py --device cuda --preset llava-1.5-7b
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from glimpse.bench import device_name
from glimpse.pipeline import load_engine
from glimpse.pipeline.cache import LayerKV
from glimpse.pipeline.random_checkpoint import build_random_llava, random_image


def removed_at_once(layer: LayerKV, count: int) -> None:
    """``keep_top_visual`` as it was before 2026-12-02: the entries leave storage at once, in a slot too."""
    kept_before = layer.rank_limit
    hides_now(layer, count)
    if layer.rank_limit < kept_before:
        layer.tail_entries()  # any read removes the hidden entries from storage


hides_now = LayerKV.keep_top_visual


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

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    overrides = {"vision_image_size": 336} if args.preset == "llava-tiny" else {}  # 576 image tokens
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random_llava(Path(tmp) / "model", preset=args.preset, layers=args.layers, dtype=dtype,
                                    **overrides)
        engine = load_engine(str(folder), device=args.device, dtype=str(dtype).replace("torch.", ""))
    if args.device == "cpu":
        torch.set_num_threads(1)  # one thread: the step's operator count, not how they spread over cores
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(576)},
                                             {"type": "text", "text": "Describe the image in detail."}]}]
    sides = {"none": ("none", False), "st3 (hidden in slots)": ("st3", False),
             "st3 (removed at every step)": ("st3", True)}
    rates: dict[str, list[float]] = {name: [] for name in sides}
    answers: dict[str, tuple] = {}
    for round_index in range(1 + args.runs):
        for name, (policy, at_once) in sides.items():
            LayerKV.keep_top_visual = removed_at_once if at_once else hides_now
            try:
                results = engine.generate_batch([messages] * args.batch, policy=policy, speed=1.0,
                                                max_new_tokens=args.new_tokens, ignore_eos=True)
            finally:
                LayerKV.keep_top_visual = hides_now
            if round_index:  # the first round warms up
                rates[name].append(sum(r.metrics["decode_tokens_per_s"] for r in results))
            answers[name] = (tuple(tuple(r.token_ids) for r in results), results[0].metrics["kv_bytes"])
    base = statistics.median(rates["none"])
    report = {"device": device_name(engine), "preset": args.preset, "layers": args.layers, "batch": args.batch,
              "new_tokens": args.new_tokens, "runs": args.runs,
              "same_tokens_and_kv": answers["st3 (hidden in slots)"] == answers["st3 (removed at every step)"],
              "rows": [{"side": name, "decode_tokens_per_s": round(statistics.median(r), 1),
                        "vs_none": round(statistics.median(r) / base, 2), "all": [round(x, 1) for x in r]}
                       for name, r in rates.items()]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{report['device']}: {args.preset} at {args.layers} layers, 576-token image, batch {args.batch}, "
          f"{args.new_tokens} tokens, median of {args.runs}")
    print("| side | decode tokens/s (batch) | vs none |\n|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['side']} | {row['decode_tokens_per_s']} | {row['vs_none']} |")
    print(f"the two ST3 sides give the same tokens and KV bytes: {report['same_tokens_and_kv']}")


if __name__ == "__main__":
    main()
