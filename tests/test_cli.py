"""`glimpse ask` as a user runs it: one JSON object with --json, one clear line on bad input.

Most commands run as a process (``glimpse``); those whose subject is what the command says and returns, not what
only a process shows, run by the same entry point in the test's process (``glimpse_here``)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import signal
import sys
from pathlib import Path

import pytest

METRIC_KEYS = {"ttft_s", "prefill_s", "decode_tokens_per_s", "prompt_tokens", "active_tokens_per_layer",
               "prefill_flops", "prefill_flops_baseline", "kv_bytes", "peak_memory_bytes", "keep_map"}


def glimpse(*args, cache: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("glimpse")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "glimpse.cli"]
    env = dict(os.environ)
    if cache is not None:
        env["GLIMPSE_CACHE"] = str(cache)
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=timeout, env=env)


def glimpse_here(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    """``glimpse *args`` run by its entry point (``glimpse.cli.main``, what the ``glimpse`` script calls) in this
    process: the same code, exit status and output, without the 5 s a new Python spends importing torch and
    transformers. What only a process shows (a closed stdout, a pipe, Ctrl-C, what gets imported) and the README's
    own command are run by ``glimpse``."""
    from glimpse.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if cache is not None:
            env.setenv("GLIMPSE_CACHE", str(cache))
        try:
            status = main(list(args))
        except SystemExit as exit:  # argparse's usage errors
            status = exit.code
    return subprocess.CompletedProcess(["glimpse", *args], status, out.getvalue(), err.getvalue())


def glimpse_here_each(*commands: list[str], cache: Path | None = None) -> list[subprocess.CompletedProcess]:
    return [glimpse_here(*command, cache=cache) for command in commands]


def _assert_clean_error(proc, *fragments):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("glimpse: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_ask_json_reports_the_spec_metrics(checkpoints, media):
    proc = glimpse_here("ask", "--model", str(checkpoints["qwen2_vl"]), "--image", str(media["image"]),
                        "--max-new-tokens", "4", "--json", "What is in this picture?")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert {"text", "policy", "params", "metrics"} <= set(out)
    assert METRIC_KEYS <= set(out["metrics"])
    prompt = out["metrics"]["prompt_tokens"]
    assert prompt["image"] > 0 and prompt["video"] == 0
    assert len(out["metrics"]["keep_map"]["depth"]) == prompt["image"]
    # README: why the answer ended: "length" at --max-new-tokens, "stop" at an end-of-sequence token before it
    assert out["finish_reason"] == ("length" if out["metrics"]["new_tokens"] == 4 else "stop"), out["finish_reason"]


def test_ask_embedded_answers_a_text_question(embedded_cache):
    proc = glimpse_here("ask", "--max-new-tokens", "20", "What is the capital of France?", cache=embedded_cache)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_ask_embedded_about_the_sample_image(embedded_cache):
    """README's first question. Without a trained projector in assets/ the answer is not grounded and says so."""
    from glimpse.pipeline.embedded import EMBEDDED_GROUNDED
    from glimpse.tasks import COLOURS

    sample = Path(__file__).resolve().parents[1] / "assets" / "sample.png"
    proc = glimpse("ask", "--image", str(sample), "--max-new-tokens", "8", "--json", "What colour is the circle?",
                   cache=embedded_cache)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["grounded"] is EMBEDDED_GROUNDED and out["metrics"]["prompt_tokens"]["image"] == 256
    assert out["promise"]["configuration"] == "none" and out["promise"]["calibrated"]  # speed 0: exact
    assert ("not grounded" in proc.stderr) is not EMBEDDED_GROUNDED
    if EMBEDDED_GROUNDED:  # a short answer in the task's vocabulary (held-out colour accuracy: docs/embedded.md)
        assert out["text"].strip().rstrip(".").lower() in COLOURS


def test_caption_asks_the_embedded_model_for_a_description_in_its_own_words(embedded_cache, tmp_path):
    """The README's batch captioning on the embedded model: asked the default instruction of real checkpoints
    ("Describe this image in one or two sentences.") it captioned the sample picture "CAT." (an outside pass). It
    is asked the wording it learnt a description from, and describes the picture's shapes; a rerun over an output
    captioned with the earlier default goes on with it."""
    from glimpse.pipeline.embedded import EMBEDDED_GROUNDED
    from glimpse.tasks import SHAPES

    folder = tmp_path / "pictures"
    folder.mkdir()
    (folder / "sample.png").write_bytes((Path(__file__).resolve().parents[1] / "assets" / "sample.png").read_bytes())
    out = tmp_path / "captions.jsonl"
    proc = glimpse_here("caption", str(folder), "--out", str(out), cache=embedded_cache)
    assert proc.returncode == 0, proc.stderr
    record, = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["prompt"] == "Describe the image."
    if EMBEDDED_GROUNDED:  # (the sample holds a circle, a square and a triangle: README)
        assert sum(shape in record["caption"].lower() for shape in SHAPES) >= 2, record["caption"]
    (folder / "second.png").write_bytes((folder / "sample.png").read_bytes())  # another input
    earlier = {**record, "prompt": "Describe this image in one or two sentences."}
    out.write_text(json.dumps(earlier) + "\n")
    proc = glimpse_here("caption", str(folder), "--out", str(out), cache=embedded_cache)
    assert proc.returncode == 0, proc.stderr
    assert "captioned 1, already done 1" in proc.stderr
    # Another model's captions asked "Describe the image." by --prompt are not that model's default: a rerun without
    # --prompt is refused, as before the embedded model had a wording of its own.
    from glimpse.caption import refuse_other_settings
    from glimpse.common import UserError
    from glimpse.pipeline.profiles import model_key

    rows = [{**record, "model": model_key("/models/llava"), "policy": "auto", "speed": 0.0}]
    with pytest.raises(UserError, match="--prompt 'Describe the image.'"):
        refuse_other_settings(rows, out, "auto", 0.0, None, "start afresh", model="/models/llava")
    refuse_other_settings([{**rows[0], "model": model_key("embedded")}], out, "auto", 0.0, None, "start afresh",
                          model="embedded")


@pytest.mark.parametrize("name,content", [("broken.png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40),
                                          ("empty.jpg", b""), ("notes.xyz", b"hello")])
def test_ask_bad_image_is_one_clear_line(checkpoints, tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), "--image", str(path), "hi")
    _assert_clean_error(proc, name)


def test_ask_json_prints_one_error_object_on_stdout_when_it_fails(checkpoints, tmp_path):
    """A script reading `ask --json`'s one object got nothing to parse on a failure (the error was on stderr only)."""
    (tmp_path / "empty.png").write_bytes(b"")
    asked = ["ask", "--model", str(checkpoints["llava"]), "--image", str(tmp_path / "empty.png")]
    proc, plain, usage, plain_usage = glimpse_here_each([*asked, "--json", "hi"], [*asked, "hi"],
                                                        ["ask", "--speed", "abc", "--json", "hi"],
                                                        ["ask", "--speed", "abc", "hi"])
    _assert_clean_error(proc, "empty.png: the file is empty")
    assert json.loads(proc.stdout) == {"error": "empty.png: the file is empty"}
    assert plain.returncode == 1 and plain.stdout == ""  # without --json, stdout stays the answer's alone
    # argparse's own usage errors too (exit status 2, the usage on stderr as argparse gives it)
    assert usage.returncode == 2 and "usage: glimpse ask" in usage.stderr
    assert json.loads(usage.stdout) == {"error": "argument --speed: invalid float value: 'abc'"}
    assert plain_usage.stdout == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_ask_json_whose_stdout_takes_nothing_says_its_error_once_with_its_exit_status(tmp_path):
    """Found from outside: with stdout on a full disk or a pipe whose reader left, the error object's own write
    failed inside the error handler: two tracebacks, and exit 1 for an argument argparse refuses (2)."""
    missing = ["ask", "--json", "--image", str(tmp_path / "missing.png"), "hi"]
    for argv, status, said in ((["ask", "--json", "--speed", "abc", "hi"], 2, "invalid float value: 'abc'"),
                               (missing, 1, "missing.png: file not found")):
        with open("/dev/full", "w") as full:
            ran = subprocess.run([sys.executable, "-m", "glimpse", *argv], stdout=full, stderr=subprocess.PIPE,
                                 text=True, timeout=300)
        assert ran.returncode == status and said in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
    reader, writer = os.pipe()
    os.close(reader)  # the reader has gone (`glimpse ask --json ... | true`)
    try:
        ran = subprocess.run([sys.executable, "-m", "glimpse", *missing], stdout=writer, stderr=subprocess.PIPE,
                             text=True, timeout=300)
    finally:
        os.close(writer)
    assert ran.returncode == 1 and "missing.png: file not found" in ran.stderr and "Traceback" not in ran.stderr


def test_ask_refuses_a_question_that_is_not_utf8_before_loading_and_its_json_error_is_utf8(checkpoints, tmp_path):
    """``glimpse ask "$(printf 'colour\\xff?')"``: refused only once the model had loaded (minutes for a 7B model); and
    ``--json`` wrote a file name's byte that is not UTF-8 as "\\udcff", which strict readers refuse (an outside
    pass). The question is refused before loading; the name is written "\\xff", as the captions file writes it."""
    question = os.fsdecode(b"colour\xff?")  # as Python hands over such an argument
    proc = glimpse_here("ask", "--model", str(tmp_path / "no model here"), "--json", question)
    _assert_clean_error(proc, "the question: the text is not valid Unicode")
    assert "loading" not in proc.stderr and json.loads(proc.stdout)["error"].startswith("the question")
    missing = tmp_path / os.fsdecode(b"bad\xff.png")
    proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), "--json", "--image", str(missing), "hi")
    assert proc.returncode == 1 and proc.stdout.encode("utf-8")  # (it raised UnicodeEncodeError: a lone surrogate)
    assert json.loads(proc.stdout)["error"].endswith("/bad\\xff.png: file not found")
    assert "/bad\\xff.png: file not found" in proc.stderr

def test_ask_json_is_strict_json_at_any_speed_and_an_abbreviated_flag_still_gets_its_error_object(
        checkpoints, media, capsys):
    """An outside pass: ST3 at speed 1e-320 annealed over 50 / 1e-320 answer tokens, infinite, and ``ask --json``
    printed ``"anneal_tau": Infinity``, which jq and JSON.parse refuse; and ``--js`` (argparse takes it for
    --json) answered in JSON but printed nothing on a usage error."""
    from glimpse.cli import main
    from glimpse.common.jsonable import finite

    def strict(text):
        return json.loads(text, parse_constant=lambda constant: pytest.fail(f"{constant} is not JSON"))

    asked = ["ask", "--model", str(checkpoints["llava"]), "--image", str(media["image"]), "--max-new-tokens", "2"]
    assert main([*asked, "--policy", "st3", "--speed", "1e-320", "--json", "hi"]) == 0
    out = strict(capsys.readouterr().out)
    assert out["speed"] == 1e-320 and out["params"]["anneal_tau"] is None  # 50 / speed is no number: no annealing
    assert strict(json.dumps(finite({"a": [1.5, math.inf], "b": {"c": -math.inf, "d": math.nan}}), allow_nan=False)) \
        == {"a": [1.5, None], "b": {"c": None, "d": None}}
    for flag in ("--j", "--js", "--jso"):  # argparse takes each for --json, the only option of ask starting so
        with pytest.raises(SystemExit) as exit_status:
            main(["ask", "--speed", "abc", flag, "hi"])
        assert exit_status.value.code == 2
        assert strict(capsys.readouterr().out) == {"error": "argument --speed: invalid float value: 'abc'"}


def test_a_command_that_prints_its_answer_is_refused_when_stdout_is_closed(checkpoints, media):
    """``glimpse ask ... >&-``: Python has no sys.stdout then. The answer was lost after the model's work: an
    internal error (a traceback, exit 2), or with --json exit 0 and nothing printed. Now refused before loading."""
    exe = Path(sys.executable).with_name("glimpse")
    for extra in ([], ["--json"]):
        command = [str(exe), "ask", "--model", str(checkpoints["llava"]), "--image", str(media["image"]), *extra, "hi"]
        proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
                              preexec_fn=lambda: os.close(1))  # closed in the child, after the redirection
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "standard output is closed" in proc.stderr and "loading" not in proc.stderr, proc.stderr


def test_ask_oversized_image_is_refused(checkpoints, tmp_path):
    from PIL import Image

    path = tmp_path / "huge.png"
    Image.new("1", (9000, 9000)).save(path)  # 81 MP: over the 64 MP cap, a few KB on disk
    proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), "--image", str(path), "hi")
    _assert_clean_error(proc, "huge.png")
    # 144 MP: past PIL's warning (89 MP), under its own error (179 MP); only Glimpse's line is said
    Image.new("1", (12000, 12000)).save(path)
    proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), "--image", str(path), "hi")
    _assert_clean_error(proc, "huge.png: image too large (12000x12000 = 144 MP")
    assert "DecompressionBombWarning" not in proc.stderr, proc.stderr


def test_ask_corrupt_video_is_one_clear_line(checkpoints, media, tmp_path):
    path = tmp_path / "cut.mp4"
    path.write_bytes(media["video"].read_bytes()[:300])
    proc = glimpse_here("ask", "--model", str(checkpoints["qwen2_vl"]), "--video", str(path), "hi")
    _assert_clean_error(proc, "cut.mp4")


def test_ask_json_says_when_a_damaged_video_was_answered_from_the_frames_that_decoded(checkpoints, tmp_path):
    """The log said it, the answer did not: a client reading --json could not tell a partial video from a whole one."""
    from conftest import write_damaged_video

    path = write_damaged_video(tmp_path / "damaged.mp4", frames=30)
    proc = glimpse_here("ask", "--model", str(checkpoints["qwen2_vl"]), "--video", str(path), "--max-new-tokens", "2",
                        "--json", "What happens?")
    assert proc.returncode == 0, proc.stderr
    warnings = json.loads(proc.stdout)["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("damaged.mp4: only ")
    assert "of the 30 frames it declares could be decoded" in warnings[0] and str(tmp_path) not in warnings[0]
    # ... and so does the answer in words, once, after it (it said nothing there: an outside pass)
    proc = glimpse_here("ask", "--model", str(checkpoints["qwen2_vl"]), "--video", str(path), "--max-new-tokens", "2",
                        "What happens?")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(f"warning: {warnings[0]}") == 1, proc.stderr


def test_ask_video_on_an_image_only_model(checkpoints, media):
    proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), "--video", str(media["video"]), "hi")
    _assert_clean_error(proc, "video")


def test_ask_unknown_model(tmp_path):
    proc = glimpse_here("ask", "--model", str(tmp_path / "no-such-model"), "hi")
    _assert_clean_error(proc, "no-such-model")


def test_ask_json_reports_policy_parameters_active_tokens_flops_and_keep_map(checkpoints, media):
    from glimpse.pipeline.metrics import prefill_flops

    proc = glimpse_here("ask", "--model", str(checkpoints["llava_next"]), "--image", str(media["image"]),
                        "--policy", "dash", "--speed", "0.5", "--param", "keep_first=4", "--param", "keep_last=2",
                        "--max-new-tokens", "2", "--json", "What is in this picture?")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    params, metrics = out["params"], out["metrics"]
    assert out["policy"] == "dash" and params["rho"] == 0.4 and params["keep_first"] == 4
    assert out["summary"] == f"DASH rho=0.40 at layer {params['start_layer']}"
    counts, T = metrics["active_tokens_per_layer"], sum(metrics["prompt_tokens"].values())
    l_s = params["start_layer"]
    # The paper's rule, recomputed by hand from what was reported.
    kept = T - round(params["rho"] * (T - params["keep_first"] - params["keep_last"]))
    assert counts == [T] * l_s + [kept] * (len(counts) - l_s)
    cfg = json.loads((checkpoints["llava_next"] / "config.json").read_text())["text_config"]
    d, m = cfg["hidden_size"], cfg["intermediate_size"]
    assert metrics["prefill_flops"] == prefill_flops(counts, d, m)
    assert metrics["prefill_flops_baseline"] == prefill_flops([T] * len(counts), d, m)
    depth = metrics["keep_map"]["depth"]
    assert len(depth) == metrics["prompt_tokens"]["image"] and set(depth) <= {l_s, len(counts)}


def test_what_the_machine_refuses_is_one_clear_line_not_a_bug_report(checkpoints, media, tmp_path):
    """Found from outside, each a traceback and "internal error" before: a device this machine cannot use,
    a picture it may not read, a name too long for the file system, sampling values torch cannot take."""
    import torch

    ask = ["ask", "--model", str(checkpoints["llava"])]
    cases = [([*ask, "--device", "banana", "hi"], "unknown device", False),
             ([*ask, "--image", "a" * 5000 + ".png", "hi"], "too long", False)]
    if not torch.cuda.is_available():
        cases.append(([*ask, "--device", "cuda", "hi"], "no CUDA GPU", False))
    for option, value, word in (("--temperature", "nan", "temperature"), ("--top-p", "2", "top_p"),
                                ("--seed", str(2**64), "seed")):
        cases.append(([*ask, "--sample", option, value, "hi"], word, True))  # refused before the model loads
    # Without --sample they did nothing, without a word (the answer is greedy): an outside pass gave -3.
    cases.append(([*ask, "--temperature", "-3", "--seed", "1", "hi"],
                  "--temperature, --seed take effect only when sampling: add --sample", True))
    if os.geteuid() != 0:  # root reads whatever the mode says
        locked = tmp_path / "locked.png"
        locked.write_bytes(media["image"].read_bytes())
        locked.chmod(0)
        cases.append(([*ask, "--image", str(locked), "hi"], "locked.png", False))
    for proc, (_, fragment, before_loading) in zip(glimpse_here_each(*(command for command, *_ in cases)), cases):
        _assert_clean_error(proc, fragment)
        assert not before_loading or "loading" not in proc.stderr


def test_ask_piped_into_head_ends_quietly(checkpoints):
    # The answer streams token by token: once head has its byte and exits, the next write meets a closed pipe.
    import shlex

    command = [str(Path(sys.executable).with_name("glimpse")), "ask", "--model", str(checkpoints["llava"]),
               "--max-new-tokens", "200", "Write a long story about the sea."]
    done = subprocess.run(shlex.join(command) + " | head -c 1", shell=True, capture_output=True, timeout=300)
    err = done.stderr.decode(errors="replace")
    assert "Traceback" not in err and "internal error" not in err, err


def test_ask_rejects_an_unknown_policy_parameter_before_loading(checkpoints, media):
    proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), "--policy", "dash", "--param", "rhoo=1", "hi")
    assert proc.returncode == 1
    assert "dash has no parameter rhoo" in proc.stderr and "loading" not in proc.stderr


def test_ask_refuses_a_value_out_of_range_before_loading_and_a_layer_past_the_last_before_decoding(checkpoints):
    model = str(checkpoints["llava"])
    stride, percentiles, layer, evaluated = glimpse_here_each(
        ["ask", "--model", model, "--policy", "st3", "--param", "stride=0", "hi"],
        ["ask", "--model", model, "--policy", "lazyllm", "--param", "percentiles=(0.3,0.4,0.5)", "hi"],
        ["ask", "--model", model, "--image", "missing.png", "--policy", "dash", "--param", "start_layer=1000", "hi"],
        ["eval", "visual", "--model", model, "--policies", "fastv", "--speeds", "1", "--param", "layer=1000"])
    assert stride.returncode == 1 and "ST3 stride must be >= 1" in stride.stderr and "loading" not in stride.stderr
    assert percentiles.returncode == 1 and "write a list as JSON" in percentiles.stderr
    assert "loading" not in percentiles.stderr
    assert layer.returncode == 1 and "-layer model, got 1000" in layer.stderr and "Traceback" not in layer.stderr
    assert "missing.png" not in layer.stderr  # refused before the picture is looked at
    assert "loading" not in layer.stderr  # and before the model loads: a local checkpoint's config gives its depth
    assert evaluated.returncode == 1 and "-layer model, got 1000" in evaluated.stderr
    assert "loading" not in evaluated.stderr


def test_ask_refuses_media_its_first_bytes_and_header_refuse_before_loading_and_takes_several_videos(
        checkpoints, media, tmp_path):
    """An empty file, a folder, a picture given as a video (PyAV reads it as a one-frame clip, and the answer said
    the shapes moved) and the reverse: refused before the model loads, which can take minutes. Several --video
    are all asked about (only the last one was)."""
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "folder.mp4").mkdir()
    cases = [(["--video", str(tmp_path / "empty.mp4")], "empty.mp4: the file is empty"),
             (["--video", str(tmp_path / "folder.mp4")], "folder.mp4: a folder"),
             (["--video", str(media["image"])], f"{media['image'].name}: this is an image, not a video"),
             (["--image", str(media["video"])], f"{media['video'].name}: this is a video, not an image")]
    ask = ["ask", "--model", str(checkpoints["qwen2_vl"])]
    video = ["--video", str(media["video"])]
    *refused, one, two = glimpse_here_each(*([*ask, *flags, "What moves?"] for flags, _ in cases),
                                           [*ask, *video, "--json", "--max-new-tokens", "2", "What moves?"],
                                           [*ask, *video, *video, "--json", "--max-new-tokens", "2", "What moves?"])
    for proc, (_, message) in zip(refused, cases):
        assert proc.returncode == 1 and message in proc.stderr and "loading" not in proc.stderr, proc.stderr
    assert one.returncode == two.returncode == 0, two.stderr
    tokens = [json.loads(p.stdout)["metrics"]["prompt_tokens"]["video"] for p in (one, two)]
    assert tokens[1] == 2 * tokens[0] > 0


def test_auto_s_member_overrides_are_checked_against_the_members_this_model_s_slider_picks(embedded_cache):
    """Before loading, auto's overrides were checked against the uncalibrated default (LazyLLM): the documented
    divprune.keep was refused on the embedded model, whose shipped frontier runs DivPrune at speed 1, and an
    override of a member it does not run passed the early check only to fail after the load."""
    from glimpse import pruning
    from glimpse.pipeline.calibrate_slider import SHIPPED_FRONTIER

    shipped = pruning.Frontier.from_json(json.loads(SHIPPED_FRONTIER.read_text()))
    members = [m.policy for m in shipped.choose(1.0).members]
    absent = next(name for name in ("lazyllm", "divprune", "dash") if name not in members)
    sample = Path(__file__).resolve().parents[1] / "assets" / "sample.png"
    proc = glimpse_here("ask", "--image", str(sample), "--speed", "1", "--param", f"{absent}.keep=0.3", "hi",
                        cache=embedded_cache)
    assert proc.returncode == 1 and f"its members at speed 1: {', '.join(members)}" in proc.stderr
    assert "loading" not in proc.stderr
    if "divprune" in members:  # the example docs/slider.md and --help give
        proc = glimpse_here("ask", "--image", str(sample), "--speed", "1", "--param", "divprune.keep=0.3", "--json",
                            "--max-new-tokens", "2", "What colour is the circle?", cache=embedded_cache)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["params"]["divprune"]["keep"] == 0.3


def test_the_frontier_a_model_will_run_is_known_before_it_loads(checkpoints, embedded_cache, monkeypatch, tmp_path):
    from glimpse.pipeline import load_engine
    from glimpse.pipeline.loading import expected_frontier
    from glimpse.pipeline.profiles import save_profile

    monkeypatch.setenv("GLIMPSE_CACHE", str(embedded_cache))
    assert expected_frontier("embedded").to_json() == load_engine("embedded", device="cpu").frontier.to_json()
    assert expected_frontier("Qwen/Qwen2-VL-7B-Instruct") is None  # a hub id: known once loaded
    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path))  # the calibration below stays in this test's own cache
    folder = str(checkpoints["llava"])
    engine = load_engine(folder, device="cpu")
    assert expected_frontier(folder).to_json() == engine.frontier.to_json()  # uncalibrated
    profile = {**engine.frontier.to_json(), "checkpoint": engine.checkpoint, "num_layers": len(engine.adapter.layers)}
    save_profile(folder, profile, "slider")
    assert expected_frontier(folder).calibrated and load_engine(folder, device="cpu").frontier.calibrated


def test_ask_refuses_an_empty_question_before_loading(checkpoints):
    for question in ("", "  \n\t"):  # `glimpse ask "$Q"` with Q unset: the model would answer a blank turn
        proc = glimpse_here("ask", "--model", str(checkpoints["llava"]), question)
        assert proc.returncode == 1 and "the question is empty" in proc.stderr and "loading" not in proc.stderr


def test_ask_states_what_the_speed_selects_and_its_measured_promise(embedded_cache, checkpoints, media):
    """The embedded model's shipped frontier: auto at speed 1 runs, and promises, what calibration measured."""
    from glimpse import pruning
    from glimpse.pipeline.calibrate_slider import SHIPPED_FRONTIER

    shipped = pruning.Frontier.from_json(json.loads(SHIPPED_FRONTIER.read_text()))
    sample = Path(__file__).resolve().parents[1] / "assets" / "sample.png"
    proc, uncalibrated = glimpse_here_each(
        ["ask", "--image", str(sample), "--speed", "1", "--max-new-tokens", "4", "--json",
         "What colour is the circle?"],
        ["ask", "--model", str(checkpoints["llava"]), "--image", str(media["image"]), "--speed", "1",
         "--max-new-tokens", "2", "--json", "What is in this picture?"], cache=embedded_cache)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    chosen = shipped.choose(1.0)
    assert out["promise"]["configuration"] == chosen.name and out["promise"]["calibrated"]
    assert out["promise"]["measured_on"] == "this model" and out["promise"]["complete"] is True
    assert out["promise"]["agreement"] == chosen.agreement and chosen.agreement_bound >= shipped.floor
    assert set(out["params"]) == {m.policy for m in chosen.members}  # the configuration it promised is what ran
    flops = out["metrics"]["prefill_flops_baseline"] / out["metrics"]["prefill_flops"]
    assert flops > 1.0
    assert f"keeps {chosen.agreement:.0%} of answers" in proc.stderr  # said before the answer, in the terminal too
    # a model nobody calibrated: auto is the labelled uncalibrated default
    out = json.loads(uncalibrated.stdout)
    assert out["promise"]["calibrated"] is False and out["promise"]["text"].startswith("uncalibrated")
    # its numbers are another model's: the JSON says whose, as the text does (found from outside)
    assert out["promise"]["measured_on"] == "the embedded model" and "complete" not in out["promise"]


def test_ctrl_c_while_the_command_loads_its_libraries_ends_with_one_line(monkeypatch, capsys):
    """The entry point imports the CLI (torch, transformers: seconds) under a guard: Ctrl-C then printed a
    KeyboardInterrupt traceback from deep inside an import."""
    from glimpse import launcher

    class InterruptedImport:
        def find_spec(self, name, path=None, target=None):
            if name == "glimpse.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "glimpse.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [InterruptedImport(), *sys.meta_path])
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert launcher.main() == 130
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # the command's handler, put in by main(): not this test process's
    assert capsys.readouterr().err == "glimpse: interrupted\n"


def test_a_local_checkpoint_s_depth_is_read_from_its_config_before_loading(checkpoints, tmp_path):
    from glimpse.pipeline import load_engine
    from glimpse.pipeline.loading import checkpoint_depth

    for name in ("llava", "qwen2_vl"):  # text_config.num_hidden_layers: what the engine counts once loaded
        engine = load_engine(str(checkpoints[name]), device="cpu")
        assert checkpoint_depth(str(checkpoints[name])) == len(engine.adapter.layers)
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "config.json").write_text('{"num_hidden_layers": 7}')
    assert checkpoint_depth(str(tmp_path / "flat")) == 7
    for text in ("not json", "[]", '{"num_hidden_layers": "7"}', '{"num_hidden_layers": true}', "{}"):
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "config.json").write_text(text)
        assert checkpoint_depth(str(tmp_path / "bad")) is None  # the engine checks once the model is loaded
    assert checkpoint_depth("embedded") is None and checkpoint_depth("Qwen/Qwen2-VL-7B-Instruct") is None


def test_glimpse_version_says_the_installed_version_and_the_name_pip_knows(capsys):
    """`glimpse --version`: the version of the install (pyproject's), and the distribution's name — `pip show
    glimpse` says nothing is installed, since the distribution is glimpse-vl."""
    import tomllib

    from glimpse.cli import main

    declared = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"glimpse {declared['version']} (pip: {declared['name']})"


def test_running_out_of_memory_is_one_clear_line_not_a_bug_report(checkpoints, media, monkeypatch, capsys):
    """A prompt the machine's memory cannot hold was "internal error: this is a bug in Glimpse" with a traceback;
    now one line says what ran out and what needs less (exit 1), and --json prints it as the error."""
    from glimpse import pipeline
    from glimpse.cli import main
    from tiny_models import RunsOutOfMemory

    load = pipeline.load_engine

    def load_short_of_memory(*args, **kwargs):
        engine = load(*args, **kwargs)
        RunsOutOfMemory(engine.adapter.layers[1].mlp, "cpu", lambda rows: rows > 1).__enter__()  # this engine only
        return engine

    monkeypatch.setattr(pipeline, "load_engine", load_short_of_memory)
    ask = ["ask", "--model", str(checkpoints["llava"]), "--image", str(media["image"]), "What is it?"]
    assert main(ask) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("glimpse: error:")]
    assert len(lines) == 1 and lines[0].startswith("glimpse: error: out of CPU memory prefilling this prompt"), err
    assert "Traceback" not in err and "internal error" not in err
    assert main([*ask, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"].startswith("out of CPU memory prefilling this prompt")


def test_what_is_refused_before_loading_is_refused_before_the_model_code_is_imported(tmp_path):
    """A missing file, a file that is not an image, a value out of range, a bad policy parameter, a missing caption
    input, a Ray option out of range: refused without importing the engine or transformers' modeling code, whose
    imports took 5 of the 9 s such a refusal took on a 2-core CPU. Each command's refusal is its usual one line."""
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    script = f"""
import sys
from glimpse.cli import main
commands = [["ask", "--image", "/nonexistent/photo.png", "hi"], ["ask", "--image", {str(not_an_image)!r}, "hi"],
            ["ask", "--speed", "7", "hi"], ["ask", "--sample", "--temperature", "-1", "hi"],
            ["ask", "--policy", "dash", "--param", "rho=7", "hi"], ["caption", "/nonexistent/folder"],
            ["eval", "agreement", "--speeds", "9"], ["caption", {str(tmp_path)!r}, "--ray", "--tries", "0"]]
codes = [main(command) for command in commands]
heavy = [name for name in ("glimpse.pipeline.engine", "transformers.modeling_utils") if name in sys.modules]
print(codes, heavy)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GLIMPSE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[1, 1, 1, 1, 1, 1, 1, 1] []", proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("glimpse: error:")]
    assert "--tries must be at least 1" in errors[7]
    assert len(errors) == 8 and "file not found" in errors[0] and "speed must be in [0, 1]" in errors[2], errors


@pytest.mark.parametrize("policy", ["zipvl", "fastv"])
def test_ask_json_flops_follow_the_documented_proxy_from_the_reported_token_counts(checkpoints, media, policy):
    """docs/pruning.md, "FLOPs proxy": per layer 4nd^2 + 2p^2d + 3ndm, n the tokens the layer computed, p those that
    took part in attention (ZipVL's sparse prefill; n otherwise); the baseline every prompt token in every layer."""
    proc = glimpse_here("ask", "--model", str(checkpoints["qwen2_vl"]), "--image", str(media["image"]), "--policy",
                        policy, "--speed", "1", "--max-new-tokens", "1", "--json", "What is in this picture?")
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(proc.stdout)["metrics"]
    cfg = json.loads((checkpoints["qwen2_vl"] / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    d, m = cfg["hidden_size"], cfg["intermediate_size"]
    active, attending = metrics["active_tokens_per_layer"], metrics["attention_tokens_per_layer"]
    T = sum(metrics["prompt_tokens"].values())
    assert len(active) == len(attending) == cfg["num_hidden_layers"]
    assert all(p <= n <= T for n, p in zip(active, attending))
    if policy == "zipvl":
        assert any(p < n for n, p in zip(active, attending))  # attention made sparse somewhere
    else:
        assert any(n < T for n in active) and attending == active
    assert metrics["prefill_flops"] == sum(4 * n * d * d + 2 * p * p * d + 3 * n * d * m
                                           for n, p in zip(active, attending))
    assert metrics["prefill_flops_baseline"] == len(active) * (4 * T * d * d + 2 * T * T * d + 3 * T * d * m)


# ---- option boundaries and outputs an outside mutation pass found no test holding ----------------------------------

class _Loaded(BaseException):
    """Raised by a stand-in for the model's loading: the command got past every check made before it."""


def _free_port() -> int:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as held:
        return held.getsockname()[1]


def _refused_or_loaded(monkeypatch, capsys, argv):
    """``glimpse *argv`` with the model's loading replaced: (exit status, stderr, whether it reached the loading)."""
    import glimpse.pipeline
    from glimpse.cli import main

    def loading(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(glimpse.pipeline, "load_engine", loading)
    try:
        status, loaded = main(list(argv)), False
    except _Loaded:
        status, loaded = None, True
    return status, capsys.readouterr().err, loaded


@pytest.mark.parametrize("argv,said", [
    (["ask", "--max-new-tokens", "0", "hi"], "--max-new-tokens must be at least 1"),
    (["serve", "--max-batch", "0"], "--max-batch"), (["serve", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["serve", "--queue-size", "-1"], "--queue-size at least 0"),
    (["serve", "--shutdown-grace", "-1"], "--shutdown-grace"), (["serve", "--media-timeout", "0"], "--media-timeout"),
    (["serve", "--port", "-1"], "--port"), (["serve", "--max-upload-mb", "0"], "--max-upload-mb"),
    (["serve", "--prefix-cache-mb", "-1"], "--prefix-cache-mb must be at least 0"),
    (["caption", "/nonexistent/in", "--batch-size", "0"], "--batch-size"),
    (["caption", "/nonexistent/in", "--prompt", "   "], "--prompt is empty"),
    (["caption", "/nonexistent/in", "--format", "txt", "--out", "c.jsonl"], "leave out --out"),
    (["caption", "/nonexistent/in", "--ray", "--actors", "0"], "--actors"),
    (["bench", "--runs", "0"], "--runs must be at least 1"),
    (["bench", "--layers", "0"], "--layers must be at least 1"),
    (["bench", "--new-tokens", "0"], "--new-tokens at least 1"),
    (["bench", "--text-tokens", "300000"], "at most 262,144"),
    (["bench", "serve", "--clients", "4", "--requests", "3"], "--requests at least --clients"),
    (["eval", "passkey", "--lengths", "127"], "from 128"), (["eval", "visual", "--samples", "0"], "--samples"),
    (["eval", "agreement", "--image-tokens", "-1"], "--image-tokens"),
    (["eval", "agreement", "--speeds", ","], "--speeds"),
    (["calibrate", "slider", "--floor", "0"], "--floor must be in (0, 1]"),
    (["calibrate", "slider", "--max-images", "0"], "--max-images must be at least 1"),
    (["calibrate", "hidivdrop", "--images", ".", "--window", "0"], "--window"),
])
def test_a_value_past_an_options_documented_range_is_refused_in_one_line_before_the_model_loads(
        monkeypatch, capsys, tmp_path, argv, said):
    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path))
    status, err, loaded = _refused_or_loaded(monkeypatch, capsys, argv)
    lines = [line for line in err.splitlines() if line.startswith("glimpse: error:")]
    assert status == 1 and not loaded and len(lines) == 1 and said in lines[0], err


@pytest.mark.parametrize("argv", [
    ["serve", "--queue-size", "0"], ["serve", "--shutdown-grace", "0"], ["serve", "--encoder-cache-mb", "0",
     "--media-cache-mb", "0", "--prefix-cache-mb", "0"], ["serve", "--max-upload-mb", "1"],
    ["serve", "--media-timeout", "86400"], ["serve", "--host", "localhost"],
    ["serve", "--host", "0.0.0.0", "--no-api-key"], ["serve", "--host", "0.0.0.0", "--api-key", "k"],
    ["eval", "passkey", "--lengths", "128"], ["eval", "agreement", "--image-tokens", "0", "--video-tokens", "0"],
    ["calibrate", "slider", "--floor", "1"],
])
def test_a_value_at_the_edge_of_an_options_range_goes_on_to_load_the_model(monkeypatch, capsys, tmp_path, argv):
    """The bounds themselves are in range (0 turns a cache off, a queue of 0 admits only the batch; docs/serving.md)."""
    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path))
    if argv[0] == "serve":
        argv = [*argv, "--port", str(_free_port())]
    status, err, loaded = _refused_or_loaded(monkeypatch, capsys, argv)
    assert loaded, err


def test_serve_sizes_each_cache_by_its_own_option(monkeypatch, capsys):
    """--encoder-cache-mb, --media-cache-mb and --prefix-cache-mb each size their own cache (docs/serving.md)."""
    import types

    import glimpse.cli
    import glimpse.pipeline
    from glimpse.cli import main

    caches = {name: types.SimpleNamespace(max_bytes=None) for name in ("encoder_cache", "media_cache", "prefix_cache")}
    monkeypatch.setattr(glimpse.pipeline, "load_engine", lambda *a, **k: types.SimpleNamespace(grounded=True, **caches))

    def built(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(glimpse.cli, "build_server", built)
    with pytest.raises(_Loaded):
        main(["serve", "--port", str(_free_port()), "--encoder-cache-mb", "1", "--media-cache-mb", "2",
              "--prefix-cache-mb", "3"])
    assert [caches[name].max_bytes for name in ("encoder_cache", "media_cache", "prefix_cache")] == \
        [1 * 2**20, 2 * 2**20, 3 * 2**20]
    roots = []
    monkeypatch.setattr(glimpse.cli, "build_server", lambda *a, root_path=None, **k: roots.append(root_path) or built())
    for given in ("/glimpse/", "/glimpse", "/"):  # a path without its trailing slash, as Gradio takes it; / is none
        with pytest.raises(_Loaded):
            main(["serve", "--port", str(_free_port()), "--root-path", given])
    assert roots == ["/glimpse", "/glimpse", None]


def test_ask_prints_the_answer_alone_on_stdout_and_its_numbers_on_stderr(checkpoints):
    """``answer=$(glimpse ask ...)``: stdout is the answer, the line of timings and the notes go to stderr; greedy,
    it is the text --json reports."""
    asked = ["ask", "--model", str(checkpoints["llava"]), "--max-new-tokens", "6", "Say something."]
    plain, as_json = glimpse_here_each(asked, [*asked[:-1], "--json", asked[-1]])
    assert plain.returncode == as_json.returncode == 0, plain.stderr
    assert plain.stdout == json.loads(as_json.stdout)["text"] + "\n"
    assert "TTFT" in plain.stderr


def test_sampling_with_a_seed_repeats_its_answer_and_defaults_to_the_documented_temperature(checkpoints):
    """README: --sample samples with --temperature (default 0.7), --top-p (default 0.9) and --seed: one seed, one
    answer; the defaults are those values."""
    asked = ["ask", "--model", str(checkpoints["llava"]), "--max-new-tokens", "8", "--sample", "--json"]
    texts = {}
    for seed in ("1", "2", "3"):
        runs = glimpse_here_each([*asked, "--seed", seed, "Tell me a story."],
                                 [*asked, "--seed", seed, "Tell me a story."],
                                 [*asked, "--seed", seed, "--temperature", "0.7", "--top-p", "0.9", "Tell me a story."])
        assert all(run.returncode == 0 for run in runs), runs[0].stderr
        texts[seed] = {json.loads(run.stdout)["text"] for run in runs}
        assert len(texts[seed]) == 1, texts  # the same seed, the same answer; the defaults as written out


def test_a_bug_in_glimpse_is_exit_status_2_and_ask_json_still_prints_one_error_object(checkpoints, monkeypatch,
                                                                                        capsys):
    """README: exit status 1 for an error the user can fix, 2 for a command line argparse refuses and for an internal
    error, a bug in Glimpse whose traceback is on stderr; --json prints its error object then too."""
    import glimpse.pipeline
    from glimpse.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(glimpse.pipeline, "load_engine", broken)
    assert main(["ask", "--model", str(checkpoints["llava"]), "--json", "hi"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" in err and "internal error" in err
    assert json.loads(out)["error"].startswith("internal error")


def test_what_the_machine_refuses_past_glimpse_s_own_checks_is_one_line_with_exit_status_1(checkpoints, monkeypatch,
                                                                                           capsys):
    """An OSError no check of Glimpse's words (a file it may not read, a full disk) is the machine's: one line naming
    the file, exit status 1, and ask --json's error object; not an internal error."""
    import glimpse.pipeline
    from glimpse.cli import main

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/models/weights.safetensors")

    monkeypatch.setattr(glimpse.pipeline, "load_engine", unreadable)
    assert main(["ask", "--model", str(checkpoints["llava"]), "--json", "hi"]) == 1
    out, err = capsys.readouterr()
    assert err.strip() .splitlines()[-1] == "glimpse: error: /models/weights.safetensors: Permission denied", err
    assert "Traceback" not in err
    assert json.loads(out) == {"error": "/models/weights.safetensors: Permission denied"}


def test_eval_and_bench_are_refused_too_when_stdout_is_closed(tmp_path):
    """They print their report on stdout (bench without --out): with it closed, the hours of measuring were lost."""
    exe = Path(sys.executable).with_name("glimpse")
    for argv in (["eval", "agreement", "--model", str(tmp_path / "absent")],
                 ["bench", "--model", str(tmp_path / "absent"), "--policies", "none"]):
        proc = subprocess.run([str(exe), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=300, preexec_fn=lambda: os.close(1))
        assert proc.returncode == 1 and "standard output is closed" in proc.stderr, proc.stderr
        assert "loading" not in proc.stderr


# ---- bench serve and eval refuse what cannot work or would be ignored (an outside mutation pass) ------------------

@pytest.mark.parametrize("argv,said", [
    (["bench", "serve", "--policy", "bogus"], "bogus"),  # every request refused, then StatisticsError, exit 2
    (["bench", "serve", "--max-batch", "0"], "--max-batch"),  # the server it starts refused it: RuntimeError, exit 2
    (["bench", "serve", "--queue-size", "-1"], "--queue-size"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--max-batch", "4"], "--max-batch"),  # ignored without a word
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "x"], "--model"),
    (["eval", "visual", "--questions", "q.jsonl", "--samples", "5"], "--samples"),  # ignored without a word
])
def test_bench_serve_and_eval_refuse_what_cannot_work_or_would_be_ignored_before_any_work(
        monkeypatch, capsys, tmp_path, argv, said):
    import glimpse.bench_serve

    def started(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(glimpse.bench_serve, "start_server", started)
    monkeypatch.setattr(glimpse.bench_serve.httpx, "get", started)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.jsonl").write_text(json.dumps({"image": "a.png", "question": "Colour?", "answer": "red"}) + "\n")
    status, err, loaded = _refused_or_loaded(monkeypatch, capsys, argv)
    lines = [line for line in err.splitlines() if line.startswith("glimpse: error:")]
    assert status == 1 and not loaded and len(lines) == 1 and said in lines[0], err


def test_bench_serve_against_a_server_it_cannot_reach_is_one_line_not_a_bug_report(capsys):
    from glimpse.cli import main

    url = f"http://127.0.0.1:{_free_port()}"
    assert main(["bench", "serve", "--url", url, "--clients", "1", "--requests", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err


def test_no_home_folder_and_no_glimpse_cache_is_said_in_one_line(monkeypatch, checkpoints, media):
    """A locked-down pod runs as a user id with no passwd entry and no $HOME (and `env -i` launches have none):
    Glimpse's cache then has nowhere to go, which is said as such, naming GLIMPSE_CACHE, not as "internal error:
    this is a bug in Glimpse" (Path.home()'s RuntimeError; an outside pass)."""
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("GLIMPSE_CACHE", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for model in ("embedded", str(checkpoints["qwen2_vl"])):  # the embedded model's cache, a profile's
        proc = glimpse_here("ask", "--model", model, "--image", str(media["image"]), "--max-new-tokens", "2",
                            "--speed", "0.5", "What is it?")
        _assert_clean_error(proc, "set GLIMPSE_CACHE")


def test_the_api_key_is_taken_as_clients_can_send_it(monkeypatch, capsys):
    """A key file written by `echo` ends in a newline, which no HTTP header carries: the server started, and every
    request got 401. The key is taken without the whitespace around it; one that is then empty (which satisfied the
    non-loopback guard) or holds what a header cannot carry as typed ("clé" sent as UTF-8 never matched) is refused
    before the model loads (an outside pass)."""
    import types

    import glimpse.cli
    import glimpse.pipeline
    from glimpse.cli import main

    caches = {name: types.SimpleNamespace(max_bytes=None) for name in ("encoder_cache", "media_cache", "prefix_cache")}
    monkeypatch.setattr(glimpse.pipeline, "load_engine", lambda *a, **k: types.SimpleNamespace(grounded=True, **caches))
    keys = []

    def built(*args, api_key=None, **kwargs):
        keys.append(api_key)
        raise _Loaded

    monkeypatch.setattr(glimpse.cli, "build_server", built)
    monkeypatch.setenv("GLIMPSE_API_KEY", "s3cret\n")
    with pytest.raises(_Loaded):
        main(["serve", "--host", "0.0.0.0", "--port", str(_free_port())])
    assert keys == ["s3cret"]
    for key, said in ((" \n", "only whitespace"), ("clé", "printable ASCII"), ("a\tb", "printable ASCII")):
        status, err, loaded = _refused_or_loaded(monkeypatch, capsys, ["serve", "--host", "0.0.0.0", "--api-key", key,
                                                                       "--port", str(_free_port())])
        lines = [line for line in err.splitlines() if line.startswith("glimpse: error:")]
        assert status == 1 and not loaded and len(lines) == 1 and said in lines[0], err
        assert not key.strip() or key not in err  # a key is never echoed
