"""What it would cost to make a request's numbers the same alone and batched on a CPU (docs/engine.md, "Linear
layers on a CPU"): oneDNN sums a lone row in another order once a product's input is wider than 1,024, and doubling
that row (multiplying it as a pair, keeping one) would make it sum as a row among others.

Greedy decode at batch 1 on the embedded model, ``--tokens`` tokens (``ignore_eos``), alternating the shipped
``CpuLinear`` and one that doubles a lone row of every packed product wider than 1,024, ``--runs`` times each in one
process; prints each one's decode tokens per second (sorted) and the median ratio.

    python benchmarks/cpu_lone_row.py
"""

from __future__ import annotations

import argparse
import statistics

from flags import check_flags

WIDE = 1024  # the widest input whose lone row oneDNN sums as a row among others (tests/test_cpu_linear.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="timed runs of each, alternating (default 6)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    args = parser.parse_args()
    check_flags(parser, args, counts=("runs", "tokens"))

    import torch

    import glimpse.pipeline.cpu_linear as cpu_linear
    from glimpse.pipeline import load_engine

    engine = load_engine("embedded", device="cpu")
    shipped = cpu_linear.CpuLinear.forward

    def lone_row_doubled(self, x):
        if self.packed is not None and not torch.is_grad_enabled() and self.in_features > WIDE:
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] == 1:
                return shipped(self, rows.expand(2, -1).contiguous())[:1].reshape(*x.shape[:-1], self.out_features)
        return shipped(self, x)

    question = [{"role": "user", "content": "Tell me a long story about the sea."}]
    rates: dict[str, list[float]] = {"shipped": [], "lone row doubled": []}
    engine.generate(question, policy="none", max_new_tokens=8, ignore_eos=True)  # warm-up
    for _ in range(args.runs):
        for name, forward in (("shipped", shipped), ("lone row doubled", lone_row_doubled)):
            cpu_linear.CpuLinear.forward = forward
            result = engine.generate(question, policy="none", max_new_tokens=args.tokens, ignore_eos=True)
            rates[name].append(result.metrics["decode_tokens_per_s"])
    cpu_linear.CpuLinear.forward = shipped
    for name, values in rates.items():
        print(f"{name}: decode {', '.join(f'{v:.1f}' for v in sorted(values))} tokens/s")
    ratio = statistics.median(rates["lone row doubled"]) / statistics.median(rates["shipped"])
    print(f"lone row doubled / shipped (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
