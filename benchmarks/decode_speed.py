"""Decode speed: the engine against transformers' ``generate`` on the same model and prompt, and the engine's
KV tail growing in place against re-concatenating the whole tail at every step (what the engine did before;
``LayerKV.GROW = 0`` reproduces it exactly: every append allocates n + 1 entries and copies the n before).

A random Qwen2-VL with the 2B model's text width (default 8 decoder layers), text prompts of 2K and 8K
tokens, N answer tokens (EOS ignored); also the engine with ZipVL's packed KV (speed 0.5), which reads
its 4/2-bit cache back at every step. Decode time = time(N + 1 tokens) - time(1 token), so the prefill
cancels on every side; the sides alternate after a warm-up; medians.

    python benchmarks/decode_speed.py --tokens 2048,8192 --new-tokens 64 --runs 3 [--device cuda --layers 28]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from glimpse.bench import device_name, text_prompt
from glimpse.pipeline import load_engine
from glimpse.pipeline.cache import LayerKV
from glimpse.pipeline.metrics import synchronize
from glimpse.pipeline.random_checkpoint import build_random


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2-vl-2b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random(Path(tmp) / "model", preset=args.preset, layers=args.layers, dtype=dtype,
                              init_device=args.device if args.device.startswith("cuda") else None)
        engine = load_engine(str(folder), device=args.device, attn="sdpa", dtype=dtype)
    grow = LayerKV.GROW
    n = args.new_tokens
    report = {"device": device_name(engine), "layers": args.layers, "new_tokens": n, "runs": args.runs, "rows": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        messages = text_prompt(engine.tokenizer, tokens)
        prompt = engine.prepare(messages)
        ids = prompt.input_ids[None].to(engine.device)

        def hf(count):
            return lambda: engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                 max_new_tokens=count, min_new_tokens=count, do_sample=False)

        def ours(count, chunk, policy="none", speed=0.0):
            def run():
                LayerKV.GROW = chunk
                engine.generate(messages, policy=policy, speed=speed, max_new_tokens=count, ignore_eos=True)
            return run

        sides = {"generate": (hf(n + 1), hf(1)), "engine, re-concatenated (before)": (ours(n + 1, 0), ours(1, 0)),
                 "engine, in place": (ours(n + 1, grow), ours(1, grow)),
                 # ZipVL's packed KV (4/2 bits at speed 0.5) is dequantized at every step: this row shows its price
                 "engine, ZipVL packed KV": (ours(n + 1, grow, "zipvl", 0.5), ours(1, grow, "zipvl", 0.5))}
        times = {name: ([], []) for name in sides}
        with torch.inference_mode():
            for round_index in range(args.runs + 1):  # round 0 warms up
                for name, (full, first) in sides.items():
                    for k, fn in enumerate((full, first)):
                        synchronize(engine.device)
                        start = time.perf_counter()
                        fn()
                        synchronize(engine.device)
                        if round_index:
                            times[name][k].append(time.perf_counter() - start)
        LayerKV.GROW = grow
        rates = {name: n / (statistics.median(full) - statistics.median(first)) for name, (full, first) in times.items()}
        row = {"prompt_tokens": len(prompt), "tokens_per_s": rates,
               "in_place_over_before": rates["engine, in place"] / rates["engine, re-concatenated (before)"],
               "in_place_over_generate": rates["engine, in place"] / rates["generate"]}
        report["rows"].append(row)
        if not args.json:
            print(f"{len(prompt)} prompt tokens: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in rates.items())
                  + f"; in place / before {row['in_place_over_before']:.3f}, in place / generate "
                  f"{row['in_place_over_generate']:.3f}", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
