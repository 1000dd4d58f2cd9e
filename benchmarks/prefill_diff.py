"""Which operators the engine's prefill runs beyond transformers' own forward, and where they come from.

The GPU suite's overhead section says how much slower the engine's prefill is than transformers' forward on
the same prompt; this says why. One prefill of a video prompt each way (the engine with its vision encoder in
the calling thread), twice:

1. under a dispatch mode that records every copy, join, index write and host read with the three innermost
   frames of Glimpse or transformers that called it, the devices of its tensors and the bytes it wrote;
   printed: what the engine does more often than transformers, largest first, then the reverse;
2. under torch.profiler: the operators (and on CUDA the kernels and memory copies) whose device time differs
   most between the two.

It found, on one H200 (2026-11-27; docs/benchmarks.md), a host value written through a tensor index at every
decoder layer (on a GPU a copy from pageable memory, which synchronizes) and a host copy of the prompt's
pixels before their transfer.

    python benchmarks/prefill_diff.py                 # CUDA: random Qwen2-VL-7B, an 8K-token video (~1 minute)
    python benchmarks/prefill_diff.py --smoke         # anywhere: the tiny model (seconds)
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_suite  # noqa: E402  (its random 7B engine, its videos, its prefill sides)
from flags import check_flags  # noqa: E402  (beside this script)

RECORDED = {"copy_", "_to_copy", "cat", "_local_scalar_dense", "nonzero", "index_put_", "index", "index_select",
            "clone", "masked_scatter", "contiguous"}


class Recorder(TorchDispatchMode):
    """Per (operator, devices, callers): how many calls and how many bytes they produced."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in RECORDED:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and Path(f.filename).name not in ("prefill_diff.py", "gpu_suite.py")]
            callers = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
            result = out if torch.is_tensor(out) else next((t for t in out if torch.is_tensor(t)), None) \
                if isinstance(out, (list, tuple)) else None
            tensors = [a for a in args if torch.is_tensor(a)] + ([result] if result is not None else [])
            key = (name, ",".join(sorted({str(t.device) for t in tensors})), callers)
            self.calls[key] += 1
            if result is not None:
                self.bytes[key] += result.numel() * result.element_size()
        return out


def _recorded(fn, device) -> Recorder:
    fn()  # warm-up
    gpu_suite.synchronize(device)
    with Recorder() as recorder:
        fn()
    return recorder


def _profiled(fn, device) -> dict[str, tuple[int, float, float]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    gpu_suite.synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        gpu_suite.synchronize(device)
    return {e.key: (e.count, (getattr(e, "self_device_time_total", 0) or 0) / 1000, e.self_cpu_time_total / 1000)
            for e in prof.key_averages() if "/" not in e.key and not e.key.startswith("<")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, on any device")
    parser.add_argument("--tokens", type=int, default=8192, help="the video's visual tokens (default 8192)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    args = parser.parse_args(argv)
    check_flags(parser, args, counts=("tokens", "top"), device=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="glimpse-prefill-diff-") as tmp:
        suite = gpu_suite.Suite(Path(tmp), args.smoke, device, float("inf"), print)
        if not args.smoke:
            suite.shapes = replace(suite.shapes, video_tokens=(args.tokens,))
        engine = suite.engine("qwen")
        name, messages = next(iter(suite.video_prompts(engine).items()))
        prompt = engine.prepare(messages)
        host_inputs = gpu_suite.reference_inputs(engine, prompt)
        sides = {  # both from the host's tensors, as the engine starts
            "transformers": lambda: engine.model(**gpu_suite._to(host_inputs, engine.device), logits_to_keep=1,
                                                 use_cache=True),
            "engine": lambda: gpu_suite._vision_first(engine, prompt)}
        print(f"{name}: {prompt.token_counts()} on {gpu_suite._device_name(engine.device)}")
        with torch.inference_mode():
            recorded = {side: _recorded(fn, engine.device) for side, fn in sides.items()}
            timed = {side: _profiled(fn, engine.device) for side, fn in sides.items()}
    ours, theirs = recorded["engine"], recorded["transformers"]
    for title, a, b in (("the engine, more often than transformers", ours, theirs),
                        ("transformers, more often than the engine", theirs, ours)):
        print(f"\n== {title}: calls (against), MB produced, operator [devices] callers")
        rows = sorted((k for k in a.calls if a.calls[k] > b.calls.get(k, 0)), key=lambda k: -a.bytes[k])
        for key in rows[:args.top]:
            print(f"{a.calls[key]:5d} ({b.calls.get(key, 0):4d}) {a.bytes[key] / 2**20:9.1f}  {key[0]} [{key[1]}] {key[2]}")
    tf, en = timed["transformers"], timed["engine"]
    print("\n== operators whose time differs most: calls, device ms, host ms (transformers / engine)")
    zero = (0, 0.0, 0.0)
    keys = sorted(set(tf) | set(en), key=lambda k: -(abs(en.get(k, zero)[1] - tf.get(k, zero)[1])
                                                     + abs(en.get(k, zero)[2] - tf.get(k, zero)[2])))
    for key in [k for k in keys if tf.get(k) != en.get(k)][:args.top]:
        x, y = tf.get(key, zero), en.get(key, zero)
        print(f"{key[:80]:80s} {x[0]:5d} / {y[0]:5d} | {x[1]:8.2f} / {y[1]:8.2f} | {x[2]:7.2f} / {y[2]:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
