"""Inference on a CPU: what the linear layers of pipeline/cpu_linear.py (packed for oneDNN, or weight on the
left for few rows) and running the vision encoder in the engine's own thread (``Engine.parallel_vision``)
change, on the embedded model.

Each configuration runs in a fresh process, one after the other and then again in the other order: once a
second thread has run torch's OpenMP kernels, every later kernel of the first thread runs slower for the
life of the process, so configurations cannot share one. Each process measures

- greedy decode of text prompts at batch 1, 2, 4 and 8 (``Engine.generate_batch``, ``--tokens`` tokens each,
  ``ignore_eos``): tokens per second over the whole call, best of ``--runs``;
- time to the first token of a question about ``assets/sample.png`` (unpruned, and HiDivDrop at speed 0.5);
- decode at batch 1 again, after the image; the process's peak resident memory.

    python benchmarks/cpu_decode.py                  # the table for docs/benchmarks.md
    python benchmarks/cpu_decode.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from flags import check_flags

ROOT = Path(__file__).resolve().parent.parent
BATCHES = (1, 2, 4, 8)
QUESTIONS = ["Write a short story about a fox.", "Describe the sea.", "What is a cat?", "Tell me a joke about bread.",
             "Explain rain.", "Name three colours.", "Write a poem about trees.", "What is music?"]
CONFIGS = {
    "nn.Linear, encoder in a worker thread (before)": {"linear": "plain", "parallel": True},
    "nn.Linear, encoder first": {"linear": "plain", "parallel": False},
    "weight-left, encoder first": {"linear": "weight-left", "parallel": False},
    "packed, encoder in a worker thread": {"linear": "packed", "parallel": True},
    "packed, encoder first (now)": {"linear": "packed", "parallel": False},
}


def measure(linear: str, parallel: bool, tokens: int, runs: int) -> dict:
    import torch
    from torch import nn

    from glimpse.pipeline import load_engine, loading
    from glimpse.pipeline.cpu_linear import use_cpu_linears

    # What load_engine does to the linear layers, as this configuration asks (so that the peak memory is
    # this configuration's own: nothing packed and dropped).
    loading.use_cpu_linears = lambda model: (0, 0) if linear == "plain" else use_cpu_linears(model, pack=linear == "packed")
    engine = load_engine("embedded", device="cpu")
    engine.parallel_vision = parallel
    assert all(type(m) is nn.Linear for m in engine.model.modules() if isinstance(m, nn.Linear)) == (linear == "plain")
    texts = [[{"role": "user", "content": [{"type": "text", "text": q}]}] for q in QUESTIONS]
    image = [{"role": "user", "content": [{"type": "image", "image": str(ROOT / "assets" / "sample.png")},
                                          {"type": "text", "text": "Describe the picture in detail."}]}]

    def tokens_per_s(batch: int) -> float:
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            engine.generate_batch(texts[:batch], policy="none", max_new_tokens=tokens, ignore_eos=True)
            best = min(best, time.perf_counter() - start)
        return batch * tokens / best

    def ttft(policy: str, speed: float) -> float:
        return min(engine.generate(image, policy=policy, speed=speed, max_new_tokens=1).metrics["ttft_s"]
                   for _ in range(runs))

    tokens_per_s(1)  # warm-up
    result = {"threads": torch.get_num_threads(),
              "decode_tokens_per_s": {str(b): tokens_per_s(b) for b in BATCHES},
              "ttft_s": {"none": ttft("none", 0.0), "hidivdrop@0.5": ttft("hidivdrop", 0.5)}}
    result["decode_after_image_tokens_per_s"] = tokens_per_s(1)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_flags(parser, args, counts=("tokens", "runs"))
    if args.child:
        config = CONFIGS[args.child]
        print(json.dumps(measure(config["linear"], config["parallel"], args.tokens, args.runs)))
        return 0
    rounds: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    for names in (order, order[::-1]):
        for name in names:
            print(f"... {name}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", name, "--tokens", str(args.tokens),
                                  "--runs", str(args.runs)], capture_output=True, text=True, check=True)
            rounds[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    # Best of the two processes per cell: the machine's speed drifts, the best is the least disturbed.
    best = {name: {"decode_tokens_per_s": {b: max(r["decode_tokens_per_s"][b] for r in rs) for b in map(str, BATCHES)},
                   "ttft_s": {k: min(r["ttft_s"][k] for r in rs) for k in rs[0]["ttft_s"]},
                   "decode_after_image_tokens_per_s": max(r["decode_after_image_tokens_per_s"] for r in rs),
                   "peak_rss_mib": max(r["peak_rss_mib"] for r in rs), "threads": rs[0]["threads"]}
            for name, rs in rounds.items()}
    print(f"Decode on a CPU: embedded model, {args.tokens} tokens, torch threads {best[order[0]]['threads']}, "
          "best of two processes\n")
    print("| configuration | " + " | ".join(f"batch {b} tok/s" for b in BATCHES)
          + " | TTFT image (none) | TTFT image (hidivdrop 0.5) | batch 1 after an image | peak RSS |")
    print("|---|" + "---|" * (len(BATCHES) + 4))
    for name, row in best.items():
        cells = [f"{row['decode_tokens_per_s'][str(b)]:.1f}" for b in BATCHES]
        cells += [f"{row['ttft_s']['none']:.3f} s", f"{row['ttft_s']['hidivdrop@0.5']:.3f} s",
                  f"{row['decode_after_image_tokens_per_s']:.1f}", f"{row['peak_rss_mib']:.0f} MiB"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"best": best, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
