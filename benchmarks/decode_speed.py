"""Decode speed: the engine against transformers' ``generate`` on the same model and prompt, and the engine's
KV tail growing in place against re-concatenating the whole tail at every step (what the engine did before;
``Growing.GROW = 0`` reproduces it exactly: every append allocates n + 1 entries and copies the n before).

A random Qwen2-VL with the 2B model's text width (default 4 decoder layers), text prompts of 2K and 8K
tokens, N answer tokens (EOS ignored); also the engine with ZipVL's packed KV (speed 0.5), which reads
its 4/2-bit cache back at every step. Decode speed is counted from the first answer token to the last on
every side (the engine's ``decode_tokens_per_s``; for ``generate``, the times its logits processor is
called), so the prefill is out of it; the sides alternate after a warm-up round; medians.

    python benchmarks/decode_speed.py --layers 4 --tokens 2048,8192 --new-tokens 32 --runs 2 [--device cuda --layers 28]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from glimpse.bench import device_name, generate_decode_rate, text_prompt
from glimpse.pipeline import load_engine
from glimpse.pipeline.cache import Growing
from glimpse.pipeline.random_checkpoint import build_random
from flags import check_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2-vl-2b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "new_tokens", "runs"), device=True)

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random(Path(tmp) / "model", preset=args.preset, layers=args.layers, dtype=dtype,
                              init_device=args.device if args.device.startswith("cuda") else None)
        engine = load_engine(str(folder), device=args.device, attn="sdpa", dtype=dtype)
    grow = Growing.GROW
    n = args.new_tokens
    report = {"device": device_name(engine), "layers": args.layers, "new_tokens": n, "runs": args.runs, "rows": []}
    for index, tokens in enumerate(int(t) for t in args.tokens.split(",")):
        messages = text_prompt(engine.tokenizer, tokens)
        prompt = engine.prepare(messages)
        ids = prompt.input_ids[None].to(engine.device)

        def hf():
            return generate_decode_rate(engine.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, n)

        def ours(chunk, policy="none", speed=0.0):
            def run():
                Growing.GROW = chunk
                result = engine.generate(messages, policy=policy, speed=speed, max_new_tokens=n, ignore_eos=True)
                return result.metrics["decode_tokens_per_s"]
            return run

        sides = {"generate": hf, "engine, re-concatenated (before)": ours(0), "engine, in place": ours(grow),
                 # ZipVL's packed KV (4/2 bits at speed 0.5) is read back at every step: this row shows its price
                 "engine, ZipVL packed KV": ours(grow, "zipvl", 0.5)}
        rates = {name: [] for name in sides}
        with torch.inference_mode():
            for round_index in range(args.runs + (1 if index == 0 else 0)):  # one warm-up round, first prompt only
                for name, side in sides.items():
                    rate = side()
                    if index or round_index:
                        rates[name].append(rate)
        Growing.GROW = grow
        median = {name: statistics.median(values) for name, values in rates.items()}
        row = {"prompt_tokens": len(prompt), "tokens_per_s": median, "runs": rates,
               "in_place_over_before": median["engine, in place"] / median["engine, re-concatenated (before)"],
               "in_place_over_generate": median["engine, in place"] / median["generate"]}
        report["rows"].append(row)
        if not args.json:
            print(f"{len(prompt)} prompt tokens: " + ", ".join(f"{k} {v:.2f} tok/s" for k, v in median.items())
                  + f"; in place / before {row['in_place_over_before']:.3f}, in place / generate "
                  f"{row['in_place_over_generate']:.3f}", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
