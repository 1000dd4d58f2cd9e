"""Why does DASH cost so much accuracy on the embedded model? (docs/pruning.md, "DASH on the embedded model")

    .venv/bin/python benchmarks/dash_diagnosis.py --per-category 4        # ~9 min on a 2-core CPU
    .venv/bin/python benchmarks/dash_diagnosis.py --variants "none,dash_0.25,rho.2 random"

Every variant answers the same held-out image questions (visual_cases, seed 1). Besides accuracy it
reports which tokens each variant halted (text / visual, prompt region) and what share of the halted
visual tokens lie on the foreground (object or word pixels) of the image, against the share among all
visual tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from glimpse.eval import visual_cases
from glimpse.pipeline import load_engine
from glimpse.pruning.base import lowest, without, last_token_attention
from glimpse.pruning.dash import DASH
from glimpse import tasks
from flags import check_flags


# ----------------------------------------------------------------------------- variant policies
@dataclass
class DashVariant(DASH):
    """DASH with a different ranking / eligible set, same count rule and same single-shot cut.

    rank: "low" (DASH), "high" (halt the highest norms), "random", "lastattn" (FastV's signal, lowest
          last-token attention at the same layer), "lowvisual_only" handled by text_guard.
    text_guard: True -> no positional guards; eligible = every visual token (all text protected),
          halt round(rho * n_visual).
    """
    rank: str = "low"
    text_guard: bool = False
    seed: int = 0
    name = "dash_variant"

    def plan(self, ctx):
        super().plan(ctx)
        self.kept = None  # original indices kept from l_s on, chosen by this variant's own score

    def select(self, layer_idx, active, ctx):
        if layer_idx != self.resolved["start_layer"] or self.kept is None:
            return active
        return active[torch.isin(active, self.kept)]

    def score(self, layer_idx, attn_output, ctx):
        l_s = self.resolved["start_layer"]
        if layer_idx != l_s - 1 or self.rho == 0.0:
            return
        active = ctx.layer.active
        n = active.shape[0]
        if self.text_guard:
            elig = ((ctx.modality[active] != 0).nonzero().squeeze(1))
        else:
            first, last = min(self.keep_first, n), max(1, min(self.keep_last, n))
            elig = torch.arange(first, n - last, device=active.device)
        if elig.numel() == 0:
            return
        halt_count = int(round(self.rho * elig.numel()))
        if self.rank == "low":
            s = attn_output[0].float().norm(dim=-1)
        elif self.rank == "high":
            s = -attn_output[0].float().norm(dim=-1)
        elif self.rank == "random":
            g = torch.Generator().manual_seed(self.seed)
            s = torch.rand(n, generator=g).to(active.device)
        elif self.rank == "lastattn":
            s = last_token_attention(ctx)
        else:
            raise ValueError(self.rank)
        halted = elig[lowest(s[elig], halt_count)]
        self.kept = without(active, halted)
        self.telemetry["num_halted"] = halt_count
        self.halted = active[halted].sort().values


@dataclass
class DashFrozenKV(DashVariant):
    """Same halted set as DASH (or a variant), but halted tokens stay in every deeper layer's
    attention as keys/values computed from their frozen hidden state (their own update is discarded).
    Needs the run_layer patch below."""
    name = "dash_frozen_kv"

    def select(self, layer_idx, active, ctx):
        return active  # nobody leaves; freezing is done by the patched run_layer


def patch_engine(engine):
    original = engine.run_layer

    def run_layer(layer, hidden, pe, call):
        out = original(layer, hidden, pe, call)
        policy, ctx, layer_idx = getattr(call, "policy", None), getattr(call, "ctx", None), call.layer_idx
        if isinstance(policy, DashFrozenKV) and policy.kept is not None \
                and layer_idx >= policy.resolved["start_layer"]:
            assert hidden.shape[1] == ctx.hidden.shape[1]  # every token active
            frozen = policy.halted
            out = out.clone()
            out[:, frozen] = hidden[:, frozen]  # no update: the state after layer l_s-1 stays
        return out

    engine.run_layer = run_layer


class Recorder(DASH):
    """No pruning; records ||U_t|| of every token at every layer."""
    name = "recorder"

    def plan(self, ctx):
        super().plan(ctx)
        self.norms = []

    def score(self, layer_idx, attn_output, ctx):
        self.norms.append(attn_output[0].float().norm(dim=-1).cpu())

    def select(self, layer_idx, active, ctx):
        return active


def layer_analysis(engine, cases, prompts, fgs, rho=0.2):
    """Per layer l (score layer; the cut would be l+1): among DASH's eligible tokens, the foreground share
    of the round(rho*eligible) lowest-norm ones, and mean norm of foreground vs background visual tokens."""
    per_layer = {}
    for case, prompt, fg in zip(cases, prompts, fgs):
        rec = Recorder(rho=0.0)
        engine.generate(case["messages"], policy=rec, max_new_tokens=1)
        mod = prompt.modality
        v0 = int((mod != 0).nonzero()[0])
        n = len(mod)
        elig = torch.arange(64, n - 32)
        count = int(round(rho * len(elig)))
        isfg = torch.zeros(n, dtype=torch.bool)
        isfg[v0:v0 + 256] = torch.from_numpy(fg > 0.25)
        isbg = torch.zeros(n, dtype=torch.bool)
        isbg[v0:v0 + 256] = torch.from_numpy(fg == 0)
        for l, norm in enumerate(rec.norms):
            low = elig[lowest(norm[elig], count)]
            per_layer.setdefault(l, []).append((float(isfg[low].float().mean()), float(isfg[elig].float().mean()),
                                                float(norm[isfg].mean()), float(norm[isbg].mean())))
    print("score layer | fg share of DASH-halted (lowest-norm) | fg share of eligible | mean ||U|| fg | mean ||U|| bg")
    for l, rows in per_layer.items():
        a = np.array(rows).mean(axis=0)
        print(f"  {l:2d}  {a[0]:.2f}  {a[1]:.2f}  {a[2]:7.3f}  {a[3]:7.3f}")


# ----------------------------------------------------------------------------- helpers
def foreground_cells(item, grid=16, threshold=40):
    """Per visual token (row-major 16x16), the share of its canvas cell that is not background."""
    img = np.asarray(item.frames[0]).astype(int)
    bg = np.array(item.scene.background)
    fg = (np.abs(img - bg).max(axis=-1) > threshold)
    H = img.shape[0]
    edges = np.linspace(0, H, grid + 1).round().astype(int)
    out = np.zeros(grid * grid)
    for r in range(grid):
        for c in range(grid):
            out[r * grid + c] = fg[edges[r]:edges[r + 1], edges[c]:edges[c + 1]].mean()
    return out


def region(i, mod):
    vis = (mod != 0).nonzero().squeeze(1)
    if mod[i] != 0:
        return "visual"
    return "text-before-image" if i < int(vis[0]) else "text-after-image"


VARIANTS = {
    "none": lambda e: ("none", 0.0),
    "fastv_0.25": lambda e: e.make_policy("fastv", 0.25),
    "dash_0.25 (rho .2)": lambda e: e.make_policy("dash", 0.25),
    "dash_0.5 (rho .4)": lambda e: e.make_policy("dash", 0.5),
    # (a) guards
    "rho.2 no guards (0/1)": lambda e: DASH(rho=0.2, keep_first=0, keep_last=1),
    "rho.2 text-guard (all visual eligible)": lambda e: DashVariant(rho=0.2, text_guard=True),
    # (b) direction
    "rho.2 HIGH norm halted": lambda e: DashVariant(rho=0.2, rank="high"),
    "rho.2 random (same count)": lambda e: DashVariant(rho=0.2, rank="random"),
    "rho.2 last-token-attn @l_s": lambda e: DashVariant(rho=0.2, rank="lastattn"),
    # (c) start layer
    "rho.2 l_s=3": lambda e: DASH(rho=0.2, start_layer=3),
    "rho.2 l_s=6": lambda e: DASH(rho=0.2, start_layer=6),
    "rho.2 l_s=20": lambda e: DASH(rho=0.2, start_layer=20),
    # (d) halted tokens keep serving K/V
    "rho.2 frozen-KV (halted still keys/values)": lambda e: DashFrozenKV(rho=0.2),
    "rho.4 frozen-KV": lambda e: DashFrozenKV(rho=0.4),
    # direction at rho .4
    "rho.4 HIGH norm halted": lambda e: DashVariant(rho=0.4, rank="high"),
    "rho.4 random": lambda e: DashVariant(rho=0.4, rank="random"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--variants", default="all")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--analysis-cases", type=int, default=7, help="questions for the per-layer norm analysis (0: skip)")
    args = ap.parse_args()
    check_flags(ap, args, counts=("per_category", "threads"), or_none=("analysis_cases",))
    patterns = [] if args.variants == "all" else args.variants.split(",")
    # A pattern that names no variant was passed over without a word (the docstring's own example lost one)
    if unknown := [p for p in patterns if not any(v.startswith(p) for v in VARIANTS)]:
        ap.error(f"--variants {', '.join(map(repr, unknown))}: no variant starts so; the variants: "
                 f"{', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    engine = load_engine("embedded")
    patch_engine(engine)
    names = [v for v in VARIANTS if not patterns or any(v.startswith(p) for p in patterns)]
    with tempfile.TemporaryDirectory(prefix="glimpse-dash-") as tmp:
        cases = visual_cases(Path(tmp), args.per_category, seed=1, video=True, categories=tasks.IMAGE_CATEGORIES)
        items = [it for it, _ in tasks.heldout_set(1, args.per_category, tasks.IMAGE_CATEGORIES)]
        assert all(c["qa"].question == qa.question for c, (_, qa) in zip(cases, tasks.heldout_set(
            1, args.per_category, tasks.IMAGE_CATEGORIES)))
        prompts = [engine.prepare(c["messages"]) for c in cases]
        fgs = [foreground_cells(it) for it in items]
        n = len(cases)
        cats = list(dict.fromkeys(c["qa"].category for c in cases))
        print(f"{n} questions, categories {cats}; prompt length {len(prompts[0])} "
              f"(visual {int((prompts[0].modality != 0).sum())})")
        if args.analysis_cases:
            k = args.analysis_cases
            step = max(1, n // k)
            idx = list(range(0, n, step))[:k]
            layer_analysis(engine, [cases[i] for i in idx], [prompts[i] for i in idx], [fgs[i] for i in idx])
        base_correct = None
        rows = []
        for name in names:
            t0 = time.time()
            correct, halted_stats, per_cat = [], [], dict.fromkeys(cats, 0)
            for k, (case, prompt, fg) in enumerate(zip(cases, prompts, fgs)):
                pol = VARIANTS[name](engine)
                if isinstance(pol, tuple):
                    res = engine.generate(case["messages"], policy=pol[0], speed=pol[1], max_new_tokens=8)
                    pol = None
                else:
                    if isinstance(pol, DashVariant):
                        pol.seed = k
                    res = engine.generate(case["messages"], policy=pol, max_new_tokens=8)
                ok = tasks.is_correct(res.text, case["qa"])
                correct.append(ok)
                per_cat[case["qa"].category] += ok
                mod = prompt.modality
                vis = (mod != 0).nonzero().squeeze(1)
                if pol is not None and getattr(pol, "halted", None) is not None:
                    h = pol.halted.cpu()
                    regions = [region(int(i), mod) for i in h]
                    hv = h[mod[h] != 0] - int(vis[0])
                    halted_stats.append((len(h), regions.count("text-before-image"),
                                         regions.count("text-after-image"), int(hv.numel()),
                                         float((fg[hv.numpy()] > 0.25).mean()) if hv.numel() else float("nan"),
                                         float((fg > 0.25).mean())))
                elif pol is not None and pol.name == "fastv":
                    km = res.metrics["keep_map"]
                    dropped = torch.tensor([j for j, d in enumerate(km["depth"]) if d < km["num_layers"]]) + int(vis[0])
                    hv = dropped - int(vis[0])
                    halted_stats.append((len(dropped), 0, 0, len(dropped),
                                         float((fg[hv.numpy()] > 0.25).mean()), float((fg > 0.25).mean())))
            acc = sum(correct) / n
            if base_correct is None and name == "none":
                base_correct = correct
            flips = sum(b and not c for b, c in zip(base_correct or correct, correct))
            hs = np.array(halted_stats) if halted_stats else None
            desc = ""
            if hs is not None and len(hs):
                desc = (f"halted/q {hs[:, 0].mean():.1f} (text<img {hs[:, 1].mean():.1f}, text>img {hs[:, 2].mean():.1f}, "
                        f"visual {hs[:, 3].mean():.1f}); fg share halted {np.nanmean(hs[:, 4]):.2f} "
                        f"vs all visual {hs[:, 5].mean():.2f}")
            pc = " ".join(f"{c[:4]}={per_cat[c]}" for c in cats)
            print(f"{name:44s} acc {acc:5.1%} ({sum(correct)}/{n}) lost-vs-none {flips:2d} | {pc} | {desc} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
            rows.append((name, acc))


if __name__ == "__main__":
    main()
