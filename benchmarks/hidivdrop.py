"""HiDivDrop: what late injection with a parallel vision encoder buys, and what it costs in agreement.

1. Speed, on a random Qwen2-VL with the 2B model's text width (default 8 layers) and a ~2,000-token
   image: TTFT and decoder-prefill of the baseline (policy none) and of HiDivDrop at each speed with
   the vision encoder run first (sequential) and beside the text-only layers (parallel), all
   alternating in one process, medians after a warm-up; plus the FLOPs-proxy speedup.
2. Agreement, on the embedded model (real SmolLM2-135M weights, 30 layers; or --model) and the
   sample image (or --image):
   greedy-token match with the unpruned model over 32 new tokens, and the KL divergence of the
   first-token distribution, at each speed.

    python benchmarks/hidivdrop.py --speeds 0.5,0.8 --runs 3            # both parts
    python benchmarks/hidivdrop.py --part speed --device cuda --layers 28 --preset qwen2-vl-7b
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
from glimpse.pipeline.random_checkpoint import build_random, random_image
from glimpse.pruning import HiDivDrop, NoPruning
from flags import check_flags

QUESTIONS = ["What is in this picture?", "Describe the image in detail.", "What colours do you see?"]


def speed_part(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
        folder = build_random(Path(tmp) / "model", preset=args.preset, layers=args.layers,
                              dtype=getattr(torch, dtype), max_visual_tokens=args.image_tokens)
        engine = load_engine(str(folder), device=args.device, attn=args.attn, dtype=dtype)
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(args.image_tokens)},
                                             {"type": "text", "text": "Describe the image in detail."}]}]
    configs = [("none", 0.0, True)] + [("hidivdrop", s, parallel) for s in args.speeds for parallel in (False, True)]

    def run(name, speed, parallel):
        engine.parallel_vision = parallel
        policy = NoPruning() if name == "none" else HiDivDrop.from_speed(speed)
        result = engine.generate(messages, policy=policy, max_new_tokens=1)
        return result.metrics, result.params

    records = {c: [] for c in configs}
    for round_index in range(args.warmup + args.runs):
        for config in configs:
            metrics, params = run(*config)
            if round_index >= args.warmup:
                records[config].append((metrics, params))
    rows = []
    base = records[configs[0]]
    base_ttft = statistics.median(m["ttft_s"] for m, _ in base)
    for config, runs in records.items():
        ttft = statistics.median(m["ttft_s"] for m, _ in runs)
        metrics, params = runs[-1]
        rows.append({"policy": config[0], "speed": config[1], "vision": "parallel" if config[2] else "sequential",
                     "ttft_s": ttft, "ttft_speedup": base_ttft / ttft,
                     "vision_encoder_s": statistics.median(m["vision_encoder_s"] for m, _ in runs),
                     "vision_wait_s": statistics.median(m["vision_wait_s"] for m, _ in runs),
                     "flops_speedup": metrics["prefill_flops_baseline"] / metrics["prefill_flops"],
                     "active_tokens_per_layer": metrics["active_tokens_per_layer"], "params": params})
    return {"device": device_name(engine), "dtype": str(engine.dtype), "layers": len(engine.adapter.layers),
            "prompt_tokens": engine.prepare(messages).token_counts(), "runs": args.runs, "rows": rows}


def agreement_part(args) -> dict:
    engine = load_engine(args.model, device=args.device)
    image = args.image or str(Path(__file__).resolve().parents[1] / "assets" / "sample.png")
    rows = []
    for name in args.agreement_policies:
        for speed in args.speeds:
            rows.append(agreement(engine, image, name, speed))
    return {"model": args.model, "grounded": engine.grounded, "questions": QUESTIONS,
            "new_tokens": 32, "rows": rows}


def agreement(engine, image: str, name: str, speed: float) -> dict:
    """Greedy-token match with the unpruned model over 32 new tokens, and first-token KL."""
    matches, prefixes, kls = [], [], []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
        exact = engine.generate(messages, policy=NoPruning(), max_new_tokens=32)
        pruned = engine.generate(messages, policy=engine.make_policy(name, speed), max_new_tokens=32)
        a, b = exact.token_ids, pruned.token_ids
        n = max(len(a), len(b))
        matches.append(sum(x == y for x, y in zip(a, b)) / n if n else 1.0)
        prefix = 0
        while prefix < min(len(a), len(b)) and a[prefix] == b[prefix]:
            prefix += 1
        prefixes.append(prefix)
        prompt = engine.prepare(messages)
        with torch.inference_mode():
            p, _ = engine.prefill(prompt, NoPruning())
            q, _ = engine.prefill(prompt, engine.make_policy(name, speed))
        kls.append(float(torch.nn.functional.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True,
                                                    reduction="sum")))
    return {"policy": name, "speed": speed, "token_match": statistics.mean(matches), "common_prefix": prefixes,
            "first_token_kl": statistics.mean(kls), "summary": pruned.summary,
            "flops_speedup": pruned.metrics["prefill_flops_baseline"] / pruned.metrics["prefill_flops"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["speed", "agreement", "both"], default="both")
    parser.add_argument("--speeds", default="0.5,0.8")
    parser.add_argument("--preset", default="qwen2-vl-2b", help="qwen2-vl-2b, qwen2-vl-7b or llava-1.5-7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--image-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--model", default="embedded", help="the model of the agreement part")
    parser.add_argument("--image", default=None, help="the image of the agreement part (default assets/sample.png)")
    parser.add_argument("--agreement-policies", default="hidivdrop",
                        help="policies whose agreement to measure (comma-separated; others for context)")
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "image_tokens", "runs"), or_none=("warmup",), device=True)
    args.speeds = [float(s) for s in args.speeds.split(",")]
    args.agreement_policies = args.agreement_policies.split(",")
    report = {}
    if args.part in ("speed", "both"):
        report["speed"] = speed_part(args)
    if args.part in ("agreement", "both"):
        report["agreement"] = agreement_part(args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
