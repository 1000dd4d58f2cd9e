"""ZipVL's own work in one prefill layer, against the code before it, side by side: what a layer spends choosing its
important tokens and attending among them, beyond the attention kernel itself.

Why: on a lent H200 ZipVL realised 0.86 of its FLOPs speed-up at 16K tokens (issue 27's goal: 0.9), its "own cost"
79 ms over Qwen2-VL-7B's 28 layers, 2.8 ms a layer, where DASH and LazyLLM spend 7-20 ms in all (docs/benchmarks.md,
fifth run). Per layer ZipVL computes its 128 probe queries' attention over every key (a (heads, 128, n) float32
tensor: 238 MB at 16K tokens), Eq. 6-8 from it, then gathers the important rows' queries, keys and values and
scatters their output back. Since 2026-12-02 the probe attention writes that tensor once (mask and scaling inside
the product, ``pruning/base.py``), not three times, and the rows are gathered token-major and scattered with
``index_copy_`` (``pipeline/engine.py``, ``attend_among``).

Both sides run on the same random queries, keys and values of Qwen2-VL-7B's attention shape (28 query heads, 4
key/value heads, head_dim 128; the queries laid out token-major, as the projections make them) at 8K and 16K
tokens; tau 0.975 (the paper's video value). The attention kernel is left out of both (it is the same call on the
same rows): a stand-in returns the gathered queries. The sides alternate after a warm-up; medians. The script checks
that both sides choose the same rows and give the same output.

    python benchmarks/zipvl_prefill.py                  # this CPU, float32 (docs/benchmarks.md)
    python benchmarks/zipvl_prefill.py --device cuda    # bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from glimpse.bench import device_name
from glimpse.pipeline.engine import LayerView, attend_among
from glimpse.pruning.zipvl import ZipVL, important_count
from flags import check_flags

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128  # Qwen2-VL-7B


def probe_attention_before(queries, keys, rows, scaling):
    """``pruning.base.probe_attention`` as it was before 2026-12-02: product, scaled copy, masked copy, softmax."""
    heads, kv_heads = queries.shape[1], keys.shape[1]
    groups = heads // kv_heads
    q, k = queries[0, :, rows].float(), keys[0].float()
    r, n = q.shape[1], k.shape[1]
    scores = (q.reshape(kv_heads, groups * r, q.shape[-1]) @ k.transpose(1, 2)).reshape(heads, r, n) * scaling
    future = torch.arange(n, device=k.device)[None, :] > rows.to(k.device)[:, None]
    return scores.masked_fill(future[None], float("-inf")).softmax(dim=-1)


def layer_before(policy, query, key, value, kernel):
    """ZipVL's ``attention_rows`` and the engine's sparse attention as they were before 2026-12-02."""
    n = query.shape[2]
    rows = policy.probe_rows(0, n, query.device)
    probs = probe_attention_before(query, key, rows, query.shape[-1] ** -0.5).mean(dim=0)
    p = important_count(probs, policy.tau_video)
    visible = (torch.arange(n, device=rows.device)[None, :] <= rows[:, None]).sum(dim=0)
    importance = probs.sum(dim=0) / visible.clamp(min=1)
    importance[n - 1:].fill_(float("inf"))
    rows = importance.topk(p).indices.sort().values
    out = query.new_zeros(1, n, query.shape[1], query.shape[3])
    out[:, rows] = kernel(query[:, :, rows], key[:, :, rows], value[:, :, rows], None)
    return rows, out


def layer_now(policy, query, key, value, kernel):
    n = query.shape[2]
    ctx = SimpleNamespace(layer=LayerView(0, torch.arange(n), None, query, key, query.shape[-1] ** -0.5))
    policy.telemetry["important_per_layer"].clear()
    rows = policy.attention_rows(0, ctx)
    return rows, attend_among(rows, query, key, value, kernel, None)


def gathered_queries(query, key, value, mask):
    """The stand-in for the attention kernel: its output's shape, (1, rows, heads, head_dim), at no cost."""
    return query.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8318, 16598])  # the GPU suite's video prompts
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tau", type=float, default=0.975)
    parser.add_argument("--out", help="also write the results here as JSON")
    args = parser.parse_args()
    check_flags(parser, args, counts=("tokens", "rounds"), device=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device).manual_seed(0)
    results = []
    for n in args.tokens:
        query = torch.randn(1, n, HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype).transpose(1, 2)
        key, value = (torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=generator, device=device, dtype=dtype)
                      for _ in range(2))
        policy = ZipVL(tau_image=args.tau, tau_video=args.tau)
        policy.resolved, policy.telemetry = {"tau": args.tau}, {"important_per_layer": []}
        sides = {"before": layer_before, "now": layer_now}
        times, chosen = {name: [] for name in sides}, {}
        with torch.inference_mode():
            for round_index in range(args.rounds + 1):  # round 0 warms up
                for name, side in sides.items():
                    sync()
                    start = time.perf_counter()
                    chosen[name] = side(policy, query, key, value, gathered_queries)
                    sync()
                    if round_index:
                        times[name].append(time.perf_counter() - start)
        (rows_before, out_before), (rows_now, out_now) = chosen["before"], chosen["now"]
        same_rows = torch.equal(rows_before, rows_now)
        same_output = same_rows and torch.equal(out_before, out_now)
        ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
        results.append({"tokens": n, "important": int(rows_now.shape[0]), "before_ms": ms["before"],
                        "now_ms": ms["now"], "speedup": ms["before"] / ms["now"], "same_rows": same_rows,
                        "same_output": same_output})
        print(f"{n} tokens ({rows_now.shape[0]} important): before {ms['before']:.1f} ms, now {ms['now']:.1f} ms "
              f"({ms['before'] / ms['now']:.2f}x); same rows {same_rows}, same output {same_output}", flush=True)
    report = {"device": device_name(SimpleNamespace(device=device)), "dtype": str(dtype).removeprefix("torch."), "threads":
              torch.get_num_threads(), "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
              "tau": args.tau, "rounds": args.rounds, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
