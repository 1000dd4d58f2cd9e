"""Decode: KV bytes over a long answer and decode speed, each policy against the baseline.

A random Qwen2-VL with the 2B model's text width (default 8 layers), a ~2,000-token image, 256
generated tokens (EOS ignored, so every run decodes the same number), runs alternating baseline and
policies, medians after a warm-up. Writes the KV-bytes-per-step series as an SVG plot. With
``--batch N``, also N copies of the request decoded together (``Engine.generate_batch``), baseline
and policies alternating: decode tokens/s of the whole batch.

    python benchmarks/decode_kv.py --policies st3,zipvl,lazyllm,auto --speed 1.0 --new-tokens 256 --runs 2 \
        --batch 8 --svg docs/kv_over_time.svg
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
from flags import check_flags

COLOURS = ["#444444", "#d62728", "#1f77b4", "#2ca02c", "#9467bd"]


def svg_plot(series: dict[str, list[float]], title: str, path: Path) -> None:
    """A plain line chart (no plotting library): x = decode step, y = KV MiB."""
    width, height, pad = 640, 360, 50
    steps = max(len(s) for s in series.values())
    top = max(max(s) for s in series.values()) * 1.05
    def xy(i, v):
        return pad + i * (width - 2 * pad) / max(steps - 1, 1), height - pad - v * (height - 2 * pad) / top
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">decode step</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">KV cache (MiB)</text>']
    for frac in (0, 0.5, 1):
        value = top * frac
        _, y = xy(0, value)
        parts.append(f'<text x="{pad - 6}" y="{y + 4}" text-anchor="end">{value:.0f}</text>')
        x, _ = xy((steps - 1) * frac, 0)
        parts.append(f'<text x="{x}" y="{height - pad + 16}" text-anchor="middle">{int((steps - 1) * frac) + 1}</text>')
    for k, (name, values) in enumerate(series.items()):
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(values)))
        colour = COLOURS[k % len(COLOURS)]
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        parts.append(f'<text x="{width - pad - 150}" y="{pad + 16 * k}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def batch_rows(engine, messages, names, args) -> list[dict]:
    """Decode tokens/s of ``args.batch`` copies of the request decoded together, per policy."""
    rates: dict[str, list[float]] = {n: [] for n in names}
    kv: dict[str, int] = {}
    for _ in range(args.batch_runs):  # the batch-1 runs before warmed the engine up
        for name in names:
            results = engine.generate_batch([messages] * args.batch, policy=name,
                                            speed=0.0 if name == "none" else args.speed,
                                            max_new_tokens=args.new_tokens, ignore_eos=True)
            rates[name].append(sum(r.metrics["decode_tokens_per_s"] for r in results))
            kv[name] = sum(statistics.mean(r.metrics["kv_bytes_per_step"]) for r in results)
    base = statistics.median(rates["none"])
    return [{"policy": n, "decode_tokens_per_s": statistics.median(rates[n]),
             "decode_speedup": statistics.median(rates[n]) / base, "kv_bytes_mean": kv[n],
             "kv_mean_ratio": kv[n] / kv["none"]} for n in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="st3,zipvl,lazyllm,auto")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--preset", default="qwen2-vl-2b", help="qwen2-vl-2b, qwen2-vl-7b or llava-1.5-7b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--image-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--svg", default=None, help="write the KV-bytes-per-step plot here")
    parser.add_argument("--batch", type=int, default=0, help="also decode this many requests together (0: skip)")
    parser.add_argument("--batch-runs", type=int, default=1)
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "image_tokens", "new_tokens", "runs", "batch_runs"),
                or_none=("warmup", "batch"), device=True)

    with tempfile.TemporaryDirectory() as tmp:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        folder = build_random(Path(tmp) / "model", preset=args.preset, layers=args.layers, dtype=dtype,
                              max_visual_tokens=args.image_tokens)
        engine = load_engine(str(folder), device=args.device, dtype=str(dtype).replace("torch.", ""))
    messages = [{"role": "user", "content": [{"type": "image", "image": random_image(args.image_tokens)},
                                             {"type": "text", "text": "Describe the image in detail."}]}]
    names = ["none", *args.policies.split(",")]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_index in range(args.warmup + args.runs):
        for name in names:
            result = engine.generate(messages, policy=name, speed=0.0 if name == "none" else args.speed,
                                     max_new_tokens=args.new_tokens, ignore_eos=True)
            if round_index >= args.warmup:
                runs[name].append(result.metrics | {"summary": result.summary})
    base = runs["none"]
    report = {"device": device_name(engine), "layers": args.layers, "prompt_tokens": base[0]["prompt_tokens"],
              "new_tokens": args.new_tokens, "speed": args.speed, "runs": args.runs, "rows": []}
    for name in names:
        m = runs[name]
        mean_kv = statistics.mean(m[-1]["kv_bytes_per_step"])
        report["rows"].append({
            "policy": name, "summary": m[-1]["summary"],
            "ttft_s": statistics.median(r["ttft_s"] for r in m),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in m),
            "kv_bytes_after_prefill": m[-1]["kv_bytes_per_step"][0], "kv_bytes_final": m[-1]["kv_bytes"],
            "kv_bytes_mean": mean_kv,
            "kv_mean_ratio": mean_kv / statistics.mean(base[-1]["kv_bytes_per_step"]),
            "decode_speedup": statistics.median(r["decode_tokens_per_s"] for r in m)
            / statistics.median(r["decode_tokens_per_s"] for r in base),
            "ttft_speedup": statistics.median(r["ttft_s"] for r in base) / statistics.median(r["ttft_s"] for r in m),
        })
    if args.batch:
        report["batch"] = {"size": args.batch, "runs": args.batch_runs, "rows": batch_rows(engine, messages, names, args)}
    if args.svg:
        svg_plot({f"{n} at speed {args.speed:g}" if n != "none" else "baseline (none)":
                  [b / 2**20 for b in runs[n][-1]["kv_bytes_per_step"]] for n in names},
                 f"KV cache per decode step, {report['prompt_tokens']['image']}-token image, {args.layers} layers",
                 Path(args.svg))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
