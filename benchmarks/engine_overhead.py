"""Engine overhead: Glimpse's layer-by-layer prefill vs transformers' own forward, same model and prompt.

A random Qwen2-VL with the 2B model's text width (hidden 1536, FFN 8960, 12 heads, 2 KV heads) and
N decoder layers, an image prompt of about 2,000 tokens. Both sides run the vision encoder; the
transformers side computes logits for the last position only (``logits_to_keep=1``), as the engine
does. Runs alternate (transformers, engine, transformers, ...) after a warm-up; we report medians.

    python benchmarks/engine_overhead.py --layers 8 --image-tokens 2000 --runs 5 [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from glimpse.pipeline.random_checkpoint import build_random_qwen2_vl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import reference_inputs  # noqa: E402
from flags import check_flags  # noqa: E402  (beside this script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--image-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "vision_depth", "image_tokens", "runs"), device=True)

    from glimpse.pipeline import load_engine
    from glimpse.pipeline.metrics import synchronize
    from glimpse.pruning import NoPruning

    from glimpse.pipeline.loading import resolve_device, resolve_dtype

    dtype = resolve_dtype(args.dtype, resolve_device(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        # The 2B model's text width, args.layers decoder layers, a shallow vision tower of the real width.
        folder = build_random_qwen2_vl(Path(tmp) / "model", preset="qwen2-vl-2b", layers=args.layers,
                                       vision_depth=args.vision_depth, max_visual_tokens=args.image_tokens,
                                       dtype=dtype)
        engine = load_engine(str(folder), device=args.device, attn=args.attn, dtype=dtype)
    side = int(round((args.image_tokens * 4) ** 0.5)) * 14
    image = Image.fromarray((np.random.RandomState(0).rand(side, side, 3) * 255).astype("uint8"))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Describe the image in detail."}]}]
    prompt = engine.prepare(messages)
    inputs = reference_inputs(engine, prompt)

    def run_transformers():
        # From the host's tensors, as the engine's prefill starts from the prepared prompt's (on a GPU the
        # transfer of the pixels is then counted on both sides; on a CPU nothing moves).
        engine.model(**{k: v.to(engine.device) for k, v in inputs.items()}, logits_to_keep=1, use_cache=True)

    def run_engine():
        engine.prefill(prompt, NoPruning())

    times = {"transformers": [], "engine": []}
    with torch.inference_mode():
        run_transformers(), run_engine()  # warm-up
        for _ in range(args.runs):
            for name, fn in (("transformers", run_transformers), ("engine", run_engine)):
                synchronize(engine.device)
                start = time.perf_counter()
                fn()
                synchronize(engine.device)
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    report = {"device": device, "dtype": str(engine.dtype), "attn": engine.attn_implementation,
              "prompt_tokens": prompt.token_counts(), "layers": args.layers, "runs": args.runs,
              "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
              "max_s": {k: max(v) for k, v in times.items()}, "engine_over_transformers": med["engine"] / med["transformers"]}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{device}, {report['dtype']}, {report['attn']}, prompt {report['prompt_tokens']}, {args.layers} layers")
        for name in times:
            print(f"  {name:13s} median {med[name]:.3f}s  min {report['min_s'][name]:.3f}s  max {report['max_s'][name]:.3f}s")
        print(f"  engine / transformers = {report['engine_over_transformers']:.3f}")


if __name__ == "__main__":
    main()
