"""benchmarks/gpu_suite.py, the one command a lent GPU runs, in its CPU smoke mode: every section runs at
tiny shapes, the report says what it could not run and why, and the exactness it reports is real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_suite_runs_every_section_at_tiny_shapes_and_reports_them(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), "--smoke", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "gpu_suite.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["exactness", "overhead", "overlap", "policies", "rlt", "crossover", "decode", "caption",
                              "profile"]
    assert not [name for name, s in sections.items() if "error" in s]

    exact = sections["exactness"]["rows"]
    assert {r["arch"] for r in exact} == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "longva"}
    assert {r["dtype"] for r in exact} == {"float32", "bfloat16"}
    # On CPU in float32 the engine is transformers' generate, token for token.
    assert sections["exactness"]["float32_tokens_identical"] and sections["exactness"]["float32_logits_close"]
    assert sections["exactness"]["float32_graph_tokens_identical"]  # the fixed-shape step, run eagerly on a CPU
    interrupts = sections["exactness"]["interrupts_clean"]  # the vision worker's stop, on a CPU without a side stream
    assert set(interrupts) == {r["arch"] for r in exact} and all(interrupts.values()), interrupts
    undone = sections["exactness"]["out_of_memory_undone"]  # CUDA's OutOfMemoryError, raised on the CPU
    assert undone == {arch: {"none": True, "st3": True} for arch in ("qwen2_vl", "llava")}, undone

    policies = {(r["policy"], r["model"]) for r in sections["policies"]["rows"]}
    assert policies == {("dash", "tiny"), ("zipvl", "tiny"), ("lazyllm", "tiny"), ("auto", "tiny"),
                        ("hidivdrop", "llava-tiny"), ("st3", "llava-tiny"), ("divprune", "llava-tiny"),
                        ("auto", "llava-tiny")}
    for row in sections["policies"]["rows"]:
        assert row["flops_speedup"] > 1.0 and row["paper"]  # each pruned something, beside its paper's figure
    # RLT on the still-camera clip: the same tokens left out alone and under LazyLLM, none by the baseline.
    rlt = {r["config"]: r for r in sections["rlt"]["rows"]}
    assert rlt["none"]["left_out"] == 0 < rlt["rlt@1"]["left_out"] == rlt["rlt@1 + lazyllm@1"]["left_out"] < 1
    # Where pruning starts to pay: the uncalibrated auto at two speeds on each image size, each pruning more (by the
    # FLOPs proxy) at the higher speed and on every size, timed to the first token and to the end of the answer.
    crossover = sections["crossover"]["rows"]
    assert [(r["prompt"].split()[0], r["speed"]) for r in crossover] == [("image", s) for _ in (64, 128)
                                                                          for s in (0.75, 1.0)]
    assert len({r["prompt"] for r in crossover}) == 2
    for lower, higher in zip(crossover[::2], crossover[1::2]):
        assert 1.0 < lower["flops_speedup"] < higher["flops_speedup"] and higher["e2e_speedup"] > 0
    decoders = {(r["batch"], r["decoder"]) for r in sections["decode"]["rows"]}
    assert decoders == {(b, d) for b in (1, 2)
                        for d in ("generate", "none", "st3", "zipvl", "auto", "none, per request", "none, CUDA graph")}
    # The Ray captioner's two stages apart: the actor's images/s and the decode stage's CPU time per input, for
    # photos and for the video an earlier section made (with Qwen2-VL's processor: LLaVA-1.5 takes no video).
    captioning = sections["caption"]
    assert captioning["images"] == 4 and captioning["actor_images_per_s"] > 0 and captioning["answer_tokens_per_image"] >= 1
    assert captioning["decode_cpu_s_per_image"] > 0 and captioning["decode_cpu_s_per_video"] > 0
    assert captioning["cpus_to_feed_one_actor"] == captioning["actor_images_per_s"] * captioning["decode_cpu_s_per_image"]
    assert captioning["local_images_per_s"] > 0  # glimpse caption over the same photos, reading included
    # The profile counts operators, not time: in KV slots a decode step of two requests runs fewer operators than
    # attending request by request (the host work a GPU step is bound by), and reads values no more often (each
    # request's next token; the per-request path's extra reads were the visual-KV recount, gone since 2026-11-27).
    profiled = {r["what"]: r for r in sections["profile"]["rows"]}
    slots, alone = profiled["4 decode steps, batch 2, KV slots"], profiled["4 decode steps, batch 2, per request"]
    assert slots["aten_calls"] < alone["aten_calls"]
    assert sum(slots["syncs"].values()) <= sum(alone["syncs"].values())
    # A pruned prefill is profiled beside the unpruned one: fewer tokens, but the policy's own work (scoring,
    # cutting, gathering the kept rows) runs operators the unpruned prefill does not.
    pruned = next(r for what, r in profiled.items() if what.startswith("engine prefill, auto@1, vision first"))
    unpruned = next(r for what, r in profiled.items() if what.startswith("engine prefill, vision first"))
    assert pruned["aten_calls"] > unpruned["aten_calls"]

    skipped = " ".join(s["what"] + ": " + s["why"] for s in report["skipped"])
    assert "flash-attention 2: no CUDA device" in skipped and "CUDA stream" in skipped
    markdown = (out / "gpu_suite.md").read_text()
    for name in sections:
        assert f"### {name}" in markdown
    assert "SMOKE RUN" in markdown and "### not run" in markdown
    # Issue 27's goals at the top, each judged from the numbers below it.
    goals = markdown.split("### issue 27's goals, from this run")[1].split("###")[0]
    assert "first-step logits within tolerance: **met**" in goals  # float32 on a CPU: identical, as asserted above
    # ... and each of the section's other checks on a line of its own (the line above was its only verdict)
    for check in ("the decode steps as a CUDA graph: the same float32 tokens: **met**",
                  "patches normalized on the device = on the host: **met** (4/4)",
                  "a prefill stopped in the vision worker leaves the engine as it was: **met** (6/6)",
                  "undone and run again in parts, answers as before: **met** (4/4)",
                  "the same float32 tokens as dequantized first: not measured"):  # no CUDA, no Triton interpreter
        assert check in goals, (check, goals)
    st3 = next(r for r in sections["decode"]["rows"] if r["batch"] == 2 and r["decoder"] == "st3")
    assert f"batch 2: **{'met' if st3['kv_vs_baseline'] <= 0.3 else 'not met'}** ({st3['kv_vs_baseline']:.2f})" in goals
    auto = next(r for r in sections["policies"]["rows"] if r["policy"] == "auto" and r["prompt"] == "video 495")
    ceiling = auto["baseline_ttft_s"] / (auto["baseline_ttft_s"] - auto["baseline_decoder_prefill_s"])
    assert f"({auto['ttft_speedup']:.2f}x; with the decoder's prefill free" in goals and f"allow {ceiling:.2f}x)" in goals
    # The overhead goal is judged with both sides starting from the host's tensors (the engine's starting point),
    # the ratio against transformers given its inputs on the device beside it.
    overhead = sections["overhead"]["rows"]
    from_host = max(r["engine_over_transformers_from_host"] for r in overhead)
    assert f"both from the host's tensors: **{'met' if from_host <= 1.03 else 'not met'}**" in goals
    assert all(f"{r['engine_over_transformers']:.3f}" in goals for r in overhead)


def test_the_prefill_diff_names_where_the_engine_s_extra_operators_come_from():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prefill_diff.py"), "--smoke", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    engine_side = proc.stdout.split("== the engine, more often than transformers")[1].split("==")[0]
    # Its own bookkeeping (the cache's token records) is named with the frames that called it.
    assert "add_records" in engine_side and "engine.py:" in engine_side
    assert "== operators whose time differs most" in proc.stdout
