"""The slider's calibration, as docs/slider.md and docs/benchmarks.md show it.

Reads a slider profile (``glimpse calibrate slider --out FILE``; default: the embedded model's
shipped frontier) and prints every measured candidate, the frontier, and what ``auto`` runs at each
speed; with ``--eval`` (the JSON of ``glimpse eval visual --json`` with ``auto`` in it) it also puts
the agreement calibration predicted beside the agreement and accuracy measured on held-out questions.

    python benchmarks/slider_report.py --plot docs/slider_frontier.png
    python benchmarks/slider_report.py --eval eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glimpse.plot import line_plot
from glimpse.pipeline.calibrate_slider import SHIPPED_FRONTIER
from glimpse.pruning import Frontier

SPEEDS = (0.0, 0.25, 0.5, 0.75, 1.0)


def candidates_table(frontier: Frontier) -> str:
    on = {p.name for p in frontier.points}
    lines = ["| configuration | agreement | token match | first-token KL | FLOPs speedup | end-to-end speedup "
             "| decode speedup | KV ratio | on the frontier |", "|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(frontier.measured, key=lambda p: p.flops_ratio, reverse=True):
        e2e = f"{1 / p.e2e_ratio:.2f}x" if p.e2e_ratio is not None else f"rejected ({p.prompts} prompts)"
        decode = f"{p.decode_speedup:.2f}x" if p.decode_speedup is not None else "-"
        lines.append(f"| `{p.name}` | {p.agreement:.0%} | {p.token_match:.2f} | {p.first_token_kl:.3f} | "
                     f"{1 / p.flops_ratio:.2f}x | {e2e} | {decode} | {p.kv_ratio:.2f} | "
                     f"{'yes' if p.name in on else ''} |")
    return "\n".join(lines)


def speeds_table(frontier: Frontier) -> str:
    lines = ["| speed | agreement required (of the bound) | auto runs | its agreement (bound) | FLOPs speedup "
             "| end-to-end speedup |", "|---|---|---|---|---|---|"]
    for speed in SPEEDS:
        promise, point = frontier.promise(speed), frontier.choose(speed)
        need = 1 - speed * (1 - frontier.floor)
        bound = f" ({point.agreement_bound:.0%})" if point else ""
        lines.append(f"| {speed:g} | {need:.3f} | `{promise['configuration']}` | {promise['agreement']:.0%}{bound} | "
                     f"{promise['flops_speedup']:.2f}x | {promise['e2e_speedup']:.2f}x |")
    return "\n".join(lines)


def predicted_vs_measured(frontier: Frontier, report: dict) -> str:
    """Per row of an eval report: the agreement calibration measured for that configuration (if it
    did), the same-answer rate and the accuracy measured on the report's held-out questions."""
    measured = {p.name: p for p in frontier.measured}
    base = next(r for r in report["rows"] if r["policy"] == "none")
    prompts = max((p.prompts for p in frontier.measured), default=0)  # the set's size (rejected ones stop at half)
    lines = [f"| policy | speed | configuration | calibration agreement ({prompts} prompts) | held-out same answer "
             f"({len(report['questions'])} questions) | held-out accuracy | share of unpruned accuracy | FLOPs speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        name = r.get("configuration") or r["policy"]
        point = measured.get(name)
        predicted = f"{point.agreement:.0%}" if point else ("100% (exact)" if name == "none" else "not measured")
        lines.append(f"| {r['policy']} | {r['speed']:g} | `{name}` | {predicted} | {r['agreement']:.0%} | "
                     f"{r['accuracy']:.0%} | {r['accuracy'] / base['accuracy']:.0%} | {r['flops_speedup']:.2f}x |")
    return "\n".join(lines)


def plot(frontier: Frontier, path: str) -> None:
    """Agreement against prefill-FLOPs speedup: every measured candidate by its first policy, and the frontier."""
    series: dict[str, list[tuple[float, float]]] = {}
    for p in frontier.measured:
        family = p.members[0].policy if len(p.members) == 1 else "compositions"
        series.setdefault(family, []).append((1 / p.flops_ratio, p.agreement))
    series["frontier"] = [(1 / p.flops_ratio, p.agreement) for p in frontier.points]
    line_plot(series, path, title="glimpse calibrate slider: agreement with the unpruned model",
              xlabel="prefill FLOPs speedup", ylabel="same answer", xmin=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=str(SHIPPED_FRONTIER))
    parser.add_argument("--eval", default=None, help="a `glimpse eval visual --json` report")
    parser.add_argument("--plot", default=None, metavar="FILE.png")
    args = parser.parse_args()
    frontier = Frontier.from_json(json.loads(Path(args.profile).read_text()))
    print(f"source: {frontier.source}; floor {frontier.floor}\n")
    print(candidates_table(frontier) + "\n")
    print(speeds_table(frontier) + "\n")
    if args.eval:
        print(predicted_vs_measured(frontier, json.loads(Path(args.eval).read_text())))
    if args.plot:
        plot(frontier, args.plot)


if __name__ == "__main__":
    main()
