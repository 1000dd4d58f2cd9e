"""`glimpse bench` and the random-weights checkpoint builder, on tiny checkpoints (seconds each)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from glimpse import pruning
from glimpse import bench
from glimpse.cli import main
from glimpse.pipeline import load_engine
from glimpse.pipeline.random_checkpoint import (LLAVA_PRESETS, PRESETS, REAL_PRESETS, build_random, build_random_qwen2_vl,
                                       random_image)

SPEEDS = [0.5, 0.8]
# "none" as a candidate always works; DASH too once it is registered.
CANDIDATES = ["none"] + (["dash"] if "dash" in pruning.POLICIES else [])
# What runs: the baseline as a candidate once, at speed 0 (its row is the noise floor); each policy at each speed.
RUNS = [("none", 0.0)] + [(c, s) for c in CANDIDATES if c != "none" for s in SPEEDS]


@pytest.fixture(scope="module")
def engine(checkpoints):
    return load_engine(str(checkpoints["qwen2_vl"]))


@pytest.fixture(scope="module")
def prompts(media):
    return bench.media_prompts([str(media["image"])], str(media["video"]))


@pytest.fixture(scope="module")
def report(engine, prompts):
    lines = []
    out = bench.run_bench(engine, prompts, CANDIDATES, SPEEDS, runs=2, warmup=1, progress=lines.append)
    out["_progress"] = lines
    return out


def test_one_row_per_prompt_policy_speed(report, prompts):
    keys = [(r["prompt"], r["policy"], r["speed"]) for r in report["rows"]]
    assert keys == [(p, c, s) for p in prompts for c, s in RUNS]
    assert report["runs"] == 2 and report["warmup"] == 1
    assert report["device"].startswith("CPU (") and report["dtype"] == "float32" and report["attn"] == "sdpa"
    for name, info in report["prompts"].items():
        assert info["prompt_tokens"][name] > 0  # the image prompt has image tokens, the video prompt video tokens
        assert info["baseline"]["runs"] == 2 * len(RUNS)
    json.dumps(report)  # JSON-ready as it is


def test_ratios_follow_from_the_rows_own_numbers(report):
    for row in report["rows"]:
        assert row["runs"] == 2
        assert row["flops_speedup"] == pytest.approx(row["prefill_flops_baseline"] / row["prefill_flops"])
        assert row["ttft_speedup"] == pytest.approx(row["baseline_ttft_s"] / row["ttft_s"])
        assert row["e2e_speedup"] == pytest.approx(row["baseline_e2e_s"] / row["e2e_s"])
        assert row["decoder_prefill_speedup"] == pytest.approx(
            row["baseline_decoder_prefill_s"] / row["decoder_prefill_s"])
        assert row["realised_fraction"] == pytest.approx(row["decoder_prefill_speedup"] / row["flops_speedup"])
        # The decoder time the saved FLOPs do not explain.
        assert row["own_cost_s"] == pytest.approx(
            row["decoder_prefill_s"] - row["baseline_decoder_prefill_s"] / row["flops_speedup"])
        assert row["kv_ratio"] == pytest.approx(row["kv_bytes"] / row["baseline_kv_bytes"])
        assert row["peak_memory_ratio"] is None  # CPU: the whole process's peak RSS, no ratio
        assert row["peak_memory_bytes"] > 0
        assert len(row["active_tokens_per_layer"]) == 4
        if row["policy"] == "none":
            assert row["flops_speedup"] == 1.0 and row["kv_ratio"] == 1.0
            assert row["prefill_flops"] == row["prefill_flops_baseline"]


def test_decoder_prefill_excludes_the_vision_encoder(report):
    for record in report["log"]:
        assert record["decoder_prefill_s"] == pytest.approx(record["prefill_s"] - record["vision_encoder_s"])
        assert 0 < record["decoder_prefill_s"] <= record["prefill_s"]


def test_runs_alternate_with_the_baseline(report, prompts):
    log = report["log"]
    n = len(RUNS)
    assert len(log) == len(prompts) * (1 * (1 + n) + 2 * 2 * n)
    for name in prompts:
        runs = [r for r in log if r["prompt"] == name]
        warm, timed = runs[: 1 + n], runs[1 + n:]
        assert all(r["phase"] == "warmup" for r in warm) and all(r["phase"] == "timed" for r in timed)
        assert warm[0]["role"] == "baseline"
        # timed: baseline, candidate, baseline, candidate, ... each candidate right after its own baseline
        assert [r["role"] for r in timed] == ["baseline", "candidate"] * (2 * n)
        for base, cand in zip(timed[::2], timed[1::2]):
            assert base["policy"] == "none" and base["round"] == cand["round"]
        order = [(r["policy"], r["speed"]) for r in timed[1::2]]
        assert order == RUNS * 2
    assert any("[1/" in line and "none (baseline)" in line and "warm-up" in line for line in report["_progress"])


def test_unknown_policy_is_a_clear_error(engine, prompts):
    with pytest.raises(bench.BenchError) as error:
        bench.run_bench(engine, prompts, ["none", "no-such-policy"], [0.5], runs=1, warmup=0)
    message = str(error.value)
    assert "no-such-policy" in message and "available" in message and "none" in message
    with pytest.raises(bench.BenchError, match="speed"):
        bench.run_bench(engine, prompts, ["none"], [1.5], runs=1, warmup=0)


def test_cli_unknown_policy_is_one_line(checkpoints, capsys):
    code = main(["bench", "--model", str(checkpoints["qwen2_vl"]), "--policies", "none,no-such-policy"])
    assert code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("glimpse: error:")]
    assert len(lines) == 1 and "no-such-policy" in lines[0] and "available: " in lines[0]
    assert "loading" not in err  # refused before loading anything


def test_cli_bench_json(checkpoints, media, tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    code = main(["bench", "--model", str(checkpoints["qwen2_vl"]), "--image", str(media["image"]),
                 "--policies", ",".join(CANDIDATES), "--speeds", "0.5", "--runs", "1", "--warmup", "0",
                 "--json", "--out", str(out_file)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)  # stdout is exactly one JSON object
    assert [(r["prompt"], r["policy"]) for r in report["rows"]] == [("image", c) for c in CANDIDATES]
    assert report["runs"] == 1 and report["warmup"] == 0
    assert json.loads(out_file.read_text()) == report
    assert "[1/" in captured.err  # progress on stderr


def test_ctrl_c_or_sigterm_keeps_a_report_of_the_runs_done(checkpoints, media, tmp_path, capsys, monkeypatch, stop):
    """Found from outside: Ctrl-C in a long bench ended cleanly but dropped every finished run and wrote no --out.
    Now the report holds the candidates with a timed pair by then, says it is partial, and the exit code is 130
    (143 for SIGTERM, as every other command's: it was 130 for both)."""
    measure, calls = bench._measure, []
    stop_now, status = stop

    def interrupted_at_the_fifth_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # round 1: none, dash, none, fastv; round 2: none -> Ctrl-C
            stop_now()
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench, "_measure", interrupted_at_the_fifth_run)
    out_file = tmp_path / "bench.json"
    code = main(["bench", "--model", str(checkpoints["qwen2_vl"]), "--image", str(media["image"]),
                 "--policies", "dash,fastv", "--speeds", "0.5", "--runs", "2", "--warmup", "0", "--video-tokens", "0",
                 "--out", str(out_file)])
    captured = capsys.readouterr()
    assert code == status, captured.err
    report = json.loads(out_file.read_text())
    assert report["interrupted"] is True and len(report["log"]) == 4
    assert [(r["policy"], r["runs"]) for r in report["rows"]] == [("dash", 1), ("fastv", 1)]
    assert "Interrupted (Ctrl-C or SIGTERM) after 4 runs" in captured.out and "interrupted: 2 rows" in captured.err


def test_cli_bench_synthesizes_media_and_prints_a_table(checkpoints, capsys):
    # The tiny checkpoint's image processor caps images at 16 tokens; videos follow qwen-vl-utils' budget.
    code = main(["bench", "--model", str(checkpoints["qwen2_vl"]), "--image-tokens", "12", "--video-tokens", "400",
                 "--policies", "none", "--speeds", "0.5", "--runs", "1", "--warmup", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    table = [line for line in captured.out.splitlines() if line.startswith("| image") or line.startswith("| video")]
    assert len(table) == 2
    assert "Prompt image: " in captured.out and "image 12" in captured.out
    video = int(captured.out.split("Prompt video: ")[1].split("video ")[1].split(")")[0])
    assert abs(video - 400) <= 40
    # --warmup 0 is a smoke test: the report says its first ratios read too high (a cold first baseline)
    assert "No warm-up round (--warmup 0)" in captured.out


def test_cli_bench_option_errors(checkpoints, capsys):
    assert main(["bench", "--model", str(checkpoints["qwen2_vl"]), "--layers", "2"]) == 1
    assert main(["bench", "--speeds", "fast", "--policies", "none"]) == 1
    assert main(["bench", "--image-tokens", "0", "--video-tokens", "0", "--policies", "none"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("glimpse: error:")]
    assert len(lines) == 3
    # Found from outside: 1.71 TiB of pixels asked for, or a run's results lost to a bad --plot after it.
    for extra, said in ((["--image-tokens", "99999999"], "at most 262,144"), (["--plot", "chart.txt"], "a chart is")):
        assert main(["bench", "--random-model", "qwen2-vl-2b", "--layers", "1", *extra]) == 1
        err = capsys.readouterr().err
        assert said in err and "building" not in err, (extra, err)
    # One mode's options given to the other are refused before anything runs, not ignored (found from outside),
    # also when the value typed is the default.
    for argv, said in ((["bench", "--clients", "8", "--policies", "none"],
                        "--clients is an option of `glimpse bench serve`"),
                       (["bench", "serve", "--runs=3", "--speeds", "0.5"],
                        "--speeds, --runs are options of `glimpse bench policies`")):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert said in err and "building" not in err and "starting" not in err, (argv, err)


def test_random_checkpoint_loads_and_gives_the_requested_tokens(tmp_path):
    folder = build_random_qwen2_vl(tmp_path / "model", preset="tiny", layers=2, max_visual_tokens=200,
                                   dtype="bfloat16")
    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2 and config["vision_config"]["depth"] == 1
    assert config["text_config"]["dtype"] == "bfloat16"
    engine = load_engine(str(folder), dtype="bfloat16")
    assert engine.dtype.is_floating_point and str(engine.dtype) == "torch.bfloat16"
    for tokens in (30, 150):
        messages = bench._messages("image", random_image(tokens), "What is in this picture?")
        got = engine.prepare(messages).token_counts()["image"]
        assert abs(got - tokens) <= 0.1 * tokens
    prompts = bench.synthesize_prompts(engine, tmp_path / "media", 100, 600)
    assert abs(engine.prepare(prompts["video"]).token_counts()["video"] - 600) <= 60
    result = engine.generate(prompts["image"], policy="none", max_new_tokens=2)
    assert result.metrics["prompt_tokens"]["image"] == pytest.approx(100, rel=0.1)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])  # 28- and 32-pixel tokens
def test_synthesized_media_give_the_asked_token_counts_on_every_qwen_model(checkpoints, tmp_path, arch):
    """Found from outside: the synthesized picture was sized in 28-pixel cells for every Qwen model, so a Qwen3-VL
    (32-pixel tokens) benchmark measured 23% fewer image tokens than asked, and the note blamed its processor."""
    engine = load_engine(str(checkpoints[arch]), device="cpu")
    processor = engine.adapter.image_processor
    cell = processor.patch_size * processor.merge_size
    processor.size = {"shortest_edge": 4 * cell * cell, "longest_edge": 4096 * cell * cell}  # a real checkpoint's room
    notes = []
    prompts = bench.synthesize_prompts(engine, tmp_path / "media", 1024, 600, progress=notes.append)
    assert engine.prepare(prompts["image"]).token_counts()["image"] == pytest.approx(1024, rel=0.1)
    assert engine.prepare(prompts["video"]).token_counts()["video"] == pytest.approx(600, rel=0.1)
    assert not notes


def test_presets_have_the_real_text_shapes():
    from glimpse import cli

    assert cli.REAL_PRESETS == REAL_PRESETS
    two, seven = PRESETS["qwen2-vl-2b"], PRESETS["qwen2-vl-7b"]
    assert (two["hidden_size"], two["intermediate_size"], two["num_hidden_layers"], two["num_attention_heads"],
            two["num_key_value_heads"], two["vocab_size"], two["tie_word_embeddings"]) == (
        1536, 8960, 28, 12, 2, 151936, True)
    assert (seven["hidden_size"], seven["intermediate_size"], seven["num_hidden_layers"],
            seven["num_attention_heads"], seven["num_key_value_heads"], seven["vocab_size"],
            seven["tie_word_embeddings"]) == (3584, 18944, 28, 28, 4, 152064, False)
    for preset in PRESETS.values():
        head_dim = preset.get("head_dim") or preset["hidden_size"] // preset["num_attention_heads"]  # Qwen3: explicit
        assert sum(preset["mrope_section"]) * 2 == head_dim
    assert two["rope_theta"] == seven["rope_theta"] == 1e6 and not math.isnan(two["rms_norm_eps"])


def test_random_llava_checkpoint_loads_and_gives_a_fixed_image_token_count(tmp_path):
    folder = build_random(tmp_path / "model", preset="llava-tiny", layers=2)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["text_config"]["num_hidden_layers"] == 2 and config["vision_config"]["num_hidden_layers"] == 1
    assert (config["vision_feature_layer"], config["vision_feature_select_strategy"]) == (-2, "default")
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    assert processor["size"] == {"shortest_edge": 56} and processor["crop_size"] == {"height": 56, "width": 56}
    assert processor["image_mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    engine = load_engine(str(folder))
    assert engine.adapter.name == "llava" and not engine.adapter.supports_video
    expected = (56 // 14) ** 2  # (image_size / patch) ** 2, whatever the image's size
    for tokens, aspect in ((30, 1.0), (300, 2.0)):
        messages = bench._messages("image", random_image(tokens, aspect=aspect), "What is in this picture?")
        prompt = engine.prepare(messages)
        assert prompt.token_counts()["image"] == expected
    text = engine.tokenizer.decode(prompt.input_ids)
    assert text.startswith("USER: <image>") and text.endswith("What is in this picture? ASSISTANT:")
    result = engine.generate(messages, policy="none", max_new_tokens=2)
    assert result.metrics["prompt_tokens"]["image"] == expected
    with pytest.raises(ValueError, match="LLaVA preset"):
        build_random_qwen2_vl(tmp_path / "wrong", preset="llava-tiny")


def test_llava_preset_has_the_real_shapes():
    import torch
    from transformers import LlavaForConditionalGeneration

    from glimpse.pipeline.random_checkpoint import llava_config

    assert "llava-1.5-7b" in REAL_PRESETS and not set(LLAVA_PRESETS) & set(PRESETS)
    seven = LLAVA_PRESETS["llava-1.5-7b"]
    assert (seven["vocab_size"], seven["hidden_size"], seven["intermediate_size"], seven["num_hidden_layers"],
            seven["num_attention_heads"], seven["num_key_value_heads"], seven["tie_word_embeddings"]) == (
        32064, 4096, 11008, 32, 32, 32, False)
    assert (seven["vision_hidden_size"], seven["vision_intermediate_size"], seven["vision_num_heads"],
            seven["vision_image_size"] // seven["vision_patch_size"]) == (1024, 4096, 16, 24)
    config = llava_config("llava-1.5-7b", vision_depth=24)  # the real depths: shapes on the meta device, no weights
    assert config.image_seq_length == 576 and config.projector_hidden_act == "gelu"
    with torch.device("meta"):
        model = LlavaForConditionalGeneration._from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 7_063_427_072  # llava-hf/llava-1.5-7b-hf's count


def test_cli_bench_random_llava(monkeypatch, capsys):
    """--random-model llava-1.5-7b, built at the tiny preset's width: 576 -> 16 fixed image tokens, no video."""
    import argparse

    from glimpse.cli import build_parser
    from glimpse.pipeline import random_checkpoint

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench_parser = commands.choices["bench"]
    assert "llava-1.5-7b" in next(a for a in bench_parser._actions if a.dest == "random_model").choices
    monkeypatch.setitem(random_checkpoint.LLAVA_PRESETS, "llava-1.5-7b", LLAVA_PRESETS["llava-tiny"])
    code = main(["bench", "--random-model", "llava-1.5-7b", "--layers", "1", "--image-tokens", "100",
                 "--policies", "none", "--speeds", "0.5", "--runs", "1", "--warmup", "0", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert set(report["prompts"]) == {"image"} and report["prompts"]["image"]["prompt_tokens"]["image"] == 16
    assert "random-weights llava-1.5-7b" in report["model"]
    assert "gives every image 16 visual tokens" in captured.err and "takes no video" in captured.err


def test_tiny_models_keeps_its_public_names():
    import tiny_models

    assert {"QWEN_TEMPLATE", "make_tokenizer", "BUILDERS", "reference_inputs"} <= set(dir(tiny_models))
    assert tiny_models.QWEN_TEMPLATE.startswith("{% for message in messages %}")


def test_cli_bench_decode_text_prompt_spread_and_plot(checkpoints, tmp_path, capsys):
    """A CI-sized smoke run: decode tokens/s with --new-tokens, a long text prompt, min/max around
    every median, the plot; and the FLOPs proxy never rises with the speed for any policy."""
    from PIL import Image

    plot = tmp_path / "bench.png"
    code = main(["bench", "--model", str(checkpoints["qwen2_vl"]), "--image-tokens", "12", "--video-tokens", "0",
                 "--text-tokens", "200", "--policies", "dash,lazyllm,fastv", "--speeds", "0,0.5,1", "--runs", "2",
                 "--warmup", "0", "--new-tokens", "4", "--json", "--plot", str(plot)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert set(report["prompts"]) == {"image", "text"} and report["new_tokens"] == 4
    assert report["prompts"]["text"]["prompt_tokens"]["text"] >= 150
    for row in report["rows"]:
        low, high = row["ttft_range_s"]
        assert low <= row["ttft_s"] <= high
        assert row["decode_tokens_per_s"] > 0 and row["baseline_decode_tokens_per_s"] > 0
        assert row["decode_speedup"] == pytest.approx(row["decode_tokens_per_s"] / row["baseline_decode_tokens_per_s"])
        assert row["e2e_speedup"] == pytest.approx(row["baseline_e2e_s"] / row["e2e_s"])
        if row["speed"] == 0:
            assert row["flops_speedup"] == 1.0  # exact at speed 0
    for record in report["log"]:  # the whole answer takes at least its first token and 3 decode steps
        assert record["e2e_s"] > record["ttft_s"] + 3 / record["decode_tokens_per_s"] * 0.99
    for prompt in report["prompts"]:
        for policy in ("dash", "lazyllm", "fastv"):
            flops = [r["prefill_flops"] for r in report["rows"] if (r["prompt"], r["policy"]) == (prompt, policy)]
            assert flops == sorted(flops, reverse=True)  # speeds 0, 0.5, 1: never more FLOPs
    assert Image.open(plot).size == (720, 440)


def test_random_qwen2_5_vl_checkpoint_is_a_qwen2_5_vl_that_glimpse_loads(tmp_path, media):
    """The Qwen2.5-VL presets build Qwen2_5_VLForConditionalGeneration (window-attention tower, absolute-time
    M-RoPE); at a test width it loads through load_engine with the Qwen2.5-VL adapter and answers an image and
    a video exactly as transformers' forward scores them."""
    from glimpse.pipeline.adapters import Qwen25VLAdapter
    from tiny_models import reference_inputs

    assert {"qwen2.5-vl-3b", "qwen2.5-vl-7b"} <= set(REAL_PRESETS)
    seven = PRESETS["qwen2.5-vl-7b"]
    assert (seven["hidden_size"], seven["intermediate_size"], seven["num_hidden_layers"], seven["num_attention_heads"],
            seven["num_key_value_heads"], seven["vocab_size"]) == (3584, 18944, 28, 28, 4, 152064)
    folder = build_random(tmp_path / "model", preset="qwen2.5-vl-7b", layers=2, vision_depth=2, hidden_size=64,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                          mrope_section=[2, 3, 3], vision_embed_dim=32, vision_num_heads=4, max_visual_tokens=16)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["vision_config"]["window_size"] == 112 and config["vision_config"]["out_hidden_size"] == 64
    engine = load_engine(str(folder), device="cpu")
    assert isinstance(engine.adapter, Qwen25VLAdapter)
    for item in ({"type": "image", "image": str(media["image"])}, {"type": "video", "video": str(media["video"])}):
        prompt = engine.prepare([{"role": "user", "content": [item, {"type": "text", "text": "What is it?"}]}])
        with torch.no_grad():
            logits, _ = engine.prefill(prompt, pruning.NoPruning())
            expected = engine.model(**reference_inputs(engine, prompt)).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_random_qwen3_vl_checkpoint_is_a_qwen3_vl_that_glimpse_loads(tmp_path, media):
    """The Qwen3-VL presets build Qwen3VLForConditionalGeneration (head_dim 128 whatever the width, interleaved
    M-RoPE, 16-pixel patches, DeepStack); at a test width it loads with the Qwen3-VL adapter and prefills an
    image exactly as transformers' forward scores it."""
    from glimpse.pipeline.adapters import Qwen3VLAdapter
    from tiny_models import reference_inputs

    assert {"qwen3-vl-4b", "qwen3-vl-8b"} <= set(REAL_PRESETS)
    eight = PRESETS["qwen3-vl-8b"]
    assert (eight["hidden_size"], eight["num_hidden_layers"], eight["num_attention_heads"], eight["num_key_value_heads"],
            eight["head_dim"]) == (4096, 36, 32, 8, 128)
    folder = build_random(tmp_path / "model", preset="qwen3-vl-8b", layers=2, vision_depth=2, hidden_size=64,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          vocab_size=512, mrope_section=[2, 3, 3], vision_embed_dim=32, vision_num_heads=4,
                          max_visual_tokens=16)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["vision_config"]["patch_size"] == 16 and config["vision_config"]["deepstack_visual_indexes"] == [0]
    engine = load_engine(str(folder), device="cpu")
    assert isinstance(engine.adapter, Qwen3VLAdapter)
    prompt = engine.prepare([{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                          {"type": "text", "text": "What is it?"}]}])
    with torch.no_grad():
        logits, _ = engine.prefill(prompt, pruning.NoPruning())
        expected = engine.model(**reference_inputs(engine, prompt)).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_a_benchmark_of_your_own_files_checks_them_before_building_the_model_and_never_writes_over_them(
        tmp_path, media, capsys):
    """Found from outside: a missing or corrupt --image was said after the model was built (29 s of a random 2B model,
    minutes for a 7B one); --plot or --out naming the benchmark's own picture replaced it after the run; and
    --video-tokens 500 beside --image measured no video without a word."""
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    picture = tmp_path / "photo.png"
    picture.write_bytes(media["image"].read_bytes())
    absent = str(tmp_path / "no-model")  # never reached: each is refused first
    for extra, said in ((["--image", str(tmp_path / "missing.png")], "missing.png"),
                        (["--image", str(corrupt)], "corrupt.png"),
                        (["--video", str(picture)], "photo.png"),
                        (["--image", str(picture), "--plot", str(tmp_path / "." / "photo.png")],
                         "is one of the benchmark's own inputs"),
                        (["--image", str(picture), "--out", str(picture)], "--out"),
                        (["--image", str(picture), "--video-tokens", "500"], "--video-tokens sizes the synthesized")):
        assert main(["bench", "--model", absent, *extra]) == 1, extra
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, (extra, err)
    assert picture.read_bytes() == media["image"].read_bytes()


def test_every_benchmark_script_answers_help_and_refuses_bad_flags_before_any_work():
    """What docs/benchmarks.md tells a user to run answers ``--help`` and refuses a bad flag in a usage line (exit 2)
    before it builds or loads anything. Found from outside: lazyllm_slots.py had no flags, so ``--help`` started
    the whole benchmark; ``--runs 0`` ended in a StatisticsError after the model was built; ``--device cuda`` on a
    machine without one in torch's words; dash_diagnosis ran no variant for a name that matched none. One process
    runs them all (each script as ``__main__``), so torch is imported once."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(p.name for p in folder.glob("*.py") if p.name != "flags.py")
    cuda = "--device cuda: this machine has no CUDA GPU" if not torch.cuda.is_available() else None
    cases = [(name, ["--help"], 0, "usage:") for name in scripts] + [
        ("decode_slots.py", ["--runs", "0"], 2, "--runs must be at least 1, got 0"),
        ("lazyllm_slots.py", ["--batches", "9"], 2, "--batches must be in [1, 8]"),
        ("dash_diagnosis.py", ["--variants", "none,random_0.25"], 2, "--variants 'random_0.25': no variant starts so"),
        ("zipvl_prefill.py", ["--tokens", "8000", "0"], 2, "--tokens must be at least 1, got [8000, 0]"),
    ] + ([("decode_kv.py", ["--device", "cuda"], 2, cuda), ("prefill_diff.py", ["--device", "cuda"], 2, cuda)]
         if cuda else [])
    program = f"""
import contextlib, io, runpy, sys
sys.path.insert(0, {str(folder)!r})
for name, argv, code, said in {cases!r}:
    sys.argv, out = [name, *argv], io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path({str(folder)!r} + "/" + name, run_name="__main__")
        got = None
    except SystemExit as stop:
        got = stop.code
    print(repr((name, argv, got == code and said in out.getvalue(), got, out.getvalue()[-300:])))
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import ast

    outcomes = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("(")]
    assert len(outcomes) == len(cases)
    assert [o[:2] for o in outcomes if not o[2]] == [], [o for o in outcomes if not o[2]]


class _ScriptedEngine:
    """An engine whose runs report the numbers a test gives, per policy and in call order (the first call of each
    policy is its warm-up), so that what ``run_bench`` makes of them can be checked exactly."""

    def __init__(self, script):
        self.script, self.calls = script, {}
        self.device, self.dtype, self.attn_implementation = torch.device("cpu"), torch.float32, "sdpa"
        self.model_id = "m"
        self.adapter = type("Adapter", (), {"layers": [None] * 4})()

    def prepare(self, messages):
        return type("Prompt", (), {"token_counts": lambda self: {"text": 10}})()

    def generate(self, messages, policy, speed, max_new_tokens, do_sample, ignore_eos):
        k = self.calls[policy] = self.calls.get(policy, -1) + 1
        metrics = {key: values[k] for key, values in self.script[policy].items()}
        metrics.update(vision_encoder_s=0.1, vision_wait_s=0.1,  # the decoder prefill is prefill_s - 0.1
                        peak_memory_bytes=1, active_tokens_per_layer=[10] * 4)
        return type("Result", (), {"metrics": metrics, "params": {}})()


def test_a_rows_ratios_are_the_median_of_its_timed_runs_over_the_median_of_the_baseline_runs_paired_with_them():
    """SPEC, "How results are measured": alternating baseline and policy, the median of several runs after a warm-up.
    Warm-up runs (first of each) read 100 and must not count; the medians (2, 0.5) are not the means."""
    script = {"none": {"ttft_s": [100, 1, 2, 10], "prefill_s": [100, 0.9, 1.7, 8.1],
                       "decode_tokens_per_s": [1, 10, 10, 40],
                       "prefill_flops": [1000] * 4, "prefill_flops_baseline": [1000] * 4, "kv_bytes": [100] * 4},
              "dash": {"ttft_s": [100, 0.5, 0.5, 0.6], "prefill_s": [100, 0.3, 0.3, 0.4],
                       "decode_tokens_per_s": [1, 20, 20, 21],
                       "prefill_flops": [400] * 4, "prefill_flops_baseline": [1000] * 4, "kv_bytes": [50] * 4}}
    report = bench.run_bench(_ScriptedEngine(script), {"p": [{"role": "user", "content": "hi"}]}, ["dash"], [0.5],
                             runs=3, warmup=1, new_tokens=4)
    (row,) = report["rows"]
    assert row["baseline_ttft_s"] == 2 and row["ttft_s"] == 0.5 and row["ttft_speedup"] == pytest.approx(4.0)
    assert row["baseline_decoder_prefill_s"] == pytest.approx(1.6)
    assert row["decoder_prefill_speedup"] == pytest.approx(8.0)
    assert row["flops_speedup"] == pytest.approx(2.5)  # baseline FLOPs / the policy's
    assert row["realised_fraction"] == pytest.approx(8.0 / 2.5)  # measured speedup / FLOPs-proxy speedup
    assert row["kv_ratio"] == pytest.approx(0.5)  # policy / baseline
    assert row["decode_speedup"] == pytest.approx(2.0)  # tokens/s, policy / baseline
    assert row["ttft_range_s"] == [0.5, 0.6] and row["baseline_ttft_range_s"] == [1, 10]  # the spread of the timed runs


def test_a_memory_meter_reads_the_peak_since_it_was_made_not_the_processs_lifetime_peak():
    """MemoryMeter: making one resets the peak (on Linux, /proc/self/clear_refs), so a request's peak is its own."""
    import numpy as np

    from glimpse.pipeline.metrics import MemoryMeter

    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("no /proc/self/clear_refs here: the meter reads the lifetime peak, as documented")
    meter = MemoryMeter(torch.device("cpu"))
    big = np.ones(400 * 2**20 // 8)  # 400 MiB, touched
    high = meter.peak()
    del big
    assert MemoryMeter(torch.device("cpu")).peak() < high - 200 * 2**20
