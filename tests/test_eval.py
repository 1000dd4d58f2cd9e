"""`glimpse eval`: a CI-sized smoke run of both tasks on tiny models, checking the report's structure
and internal consistency (never a wall-clock threshold)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from glimpse.cli import main
from glimpse.eval import WARM_UP_TOKENS, passkey_prompt, run_agreement, run_passkey
from glimpse.pipeline import load_engine


@pytest.fixture(scope="module")
def qwen(checkpoints):
    return load_engine(str(checkpoints["qwen2_vl"]), device="cpu")


def test_agreement_is_exact_at_speed_0_and_reports_every_policy_and_speed(qwen, media):
    prompts = {"image": [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                      {"type": "text", "text": "Describe it."}]}],
               "text1": [{"role": "user", "content": "Tell me about the sea."}]}
    report = run_agreement(qwen, prompts, ["dash", "st3", "fastv"], [0.0, 1.0], new_tokens=6)
    assert [(r["policy"], r["speed"]) for r in report["rows"]] == [
        ("dash", 0.0), ("dash", 1.0), ("st3", 0.0), ("st3", 1.0), ("fastv", 0.0), ("fastv", 1.0)]
    for row in report["rows"]:
        assert 0.0 <= row["match_rate"] <= 1.0 and row["first_token_kl"] >= 0.0 and row["ttft_speedup"] > 0
        assert set(row["per_prompt"]) == {"image", "text1"}
        if row["speed"] == 0.0:  # speed 0 is exact: the same tokens, the same distribution
            assert row["match_rate"] == 1.0 and row["first_token_kl"] == pytest.approx(0.0, abs=1e-6)
    assert qwen.eos_token_ids  # the engine itself is untouched (EOS is ignored per request)


def test_passkey_prompts_hold_the_key_at_the_requested_length(qwen):
    messages = passkey_prompt(qwen.tokenizer, 300, 12345, 0.5)
    text = messages[0]["content"]
    assert text.count("12345") == 2 and "What is the pass key?" in text
    tokens = len(qwen.tokenizer(text).input_ids)
    assert 0.75 * 300 <= tokens <= 300  # whole filler sentences: within one of the target


def test_passkey_report_is_consistent(qwen):
    report = run_passkey(qwen, [128, 256], samples=2, policies=["dash", "fastv"], speeds=[0.0, 1.0], new_tokens=4)
    configs = {(r["policy"], r["speed"]) for r in report["rows"]}
    assert configs == {("none", 0.0), ("dash", 0.0), ("dash", 1.0), ("fastv", 0.0), ("fastv", 1.0)}
    by = {(r["policy"], r["speed"], r["length"]): r for r in report["rows"]}
    for length in (128, 256):
        assert by[("none", 0.0, length)]["ttft_speedup"] == 1.0
        for name in ("dash", "fastv"):  # speed 0 is exact: the same answers, so the same accuracy
            assert by[(name, 0.0, length)]["accuracy"] == by[("none", 0.0, length)]["accuracy"]
        assert all(r["accuracy"] in (0.0, 0.5, 1.0) for r in report["rows"])


def test_no_timed_run_is_the_first_answer_of_its_kind(qwen, media, monkeypatch):
    """A process's first answer of a kind (text, image) pays one-time costs; each runner answers every kind once,
    untimed, before its timed runs (found from outside: DASH read 24x faster on a 64-token prompt it cannot prune,
    and policies at speed 0, which run exactly as the baseline, 1.5x)."""
    calls, generate = [], qwen.generate

    def recording(messages, **options):
        kind = "image" if isinstance(messages[0]["content"], list) else "text"
        calls.append((kind, options["max_new_tokens"]))
        return generate(messages, **options)

    monkeypatch.setattr(qwen, "generate", recording)
    prompts = {"image": [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                      {"type": "text", "text": "Describe it."}]}],
               "text1": [{"role": "user", "content": "Tell me about the sea."}]}
    run_agreement(qwen, prompts, ["dash"], [0.0], new_tokens=3)
    # one untimed answer per kind, then the timed baseline and candidate of each prompt
    assert calls == [("image", WARM_UP_TOKENS), ("text", WARM_UP_TOKENS)] + [("image", 3), ("text", 3)] * 2
    calls.clear()
    run_passkey(qwen, [128, 256], samples=1, policies=["dash"], speeds=[0.0], new_tokens=3)
    assert calls == [("text", WARM_UP_TOKENS)] + [("text", 3)] * 4


def test_fastvs_text_adaptation_drops_text_tokens_too(qwen):
    messages = [{"role": "user", "content": "A long enough question about many things, one after another."}]
    prompt = qwen.prepare(messages)
    visual_only = qwen.make_policy("fastv", 1.0)
    text_too = qwen.make_policy("fastv", 1.0, {"text": True})
    import torch

    with torch.inference_mode():
        _, ctx_visual = qwen.prefill(prompt, visual_only)
        _, ctx_text = qwen.prefill(prompt, text_too)
    T = len(prompt)
    assert [int(a.shape[0]) for a in ctx_visual.active_per_layer] == [T] * len(ctx_visual.active_per_layer)
    K = text_too.resolved["layer"]
    assert int(ctx_text.active_per_layer[K].shape[0]) == 1  # R = 1: every token but the last is dropped
    assert int(ctx_text.active_per_layer[K][-1]) == T - 1


def test_the_cli_prints_json_and_writes_a_plot(checkpoints, tmp_path, capsys):
    plot = tmp_path / "agreement.png"
    code = main(["eval", "agreement", "--model", str(checkpoints["llava"]), "--policies", "dash,lazyllm",
                 "--speeds", "0,1", "--new-tokens", "4", "--image-tokens", "64", "--json", "--plot", str(plot)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["task"] == "agreement" and len(report["rows"]) == 4
    assert set(report["prompts"]) == {"image", "text1", "text2"}  # LLaVA takes no video
    assert Image.open(plot).size == (720, 440)
    assert main(["eval", "passkey", "--model", str(checkpoints["llava"]), "--policies", "nope"]) == 1
    capsys.readouterr()
    # Found from outside: each ran for minutes and then lost its results to a traceback, or measured nothing.
    absent = str(tmp_path / "no-model")  # never reached: each is refused before loading
    for task, extra, said in (("passkey", ["--plot", str(tmp_path / "p.txt")], "a chart is written as .png"),
                              ("passkey", ["--plot", str(tmp_path)], "a chart is written as"),
                              ("visual", ["--speeds", ",", "--policies", "bogus"], "--speeds needs at least one"),
                              ("passkey", ["--lengths", "0"], "--lengths are prompt lengths"),
                              ("passkey", ["--lengths", "512,10"], "--lengths are prompt lengths in tokens: from 128"),
                              ("agreement", ["--image-tokens", "-1"], "--image-tokens and --video-tokens must be")):
        assert main(["eval", task, "--model", absent, *extra]) == 1
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, (extra, err)
    # the same speed or policy twice is measured once
    code = main(["eval", "agreement", "--model", str(checkpoints["llava"]), "--policies", "dash,dash",
                 "--speeds", "1,1", "--new-tokens", "2", "--image-tokens", "64", "--json"])
    assert code == 0 and len(json.loads(capsys.readouterr().out)["rows"]) == 1


def test_visual_task_report_is_consistent(checkpoints, tmp_path, capsys):
    """The held-out visual task on a tiny LLaVA (images only): speed 0 answers exactly as the unpruned model,
    FastV at speed 1 removes visual token-layers, and the CLI refuses the training seed."""
    plot = tmp_path / "visual.png"
    code = main(["eval", "visual", "--model", str(checkpoints["llava"]), "--policies", "fastv", "--speeds", "0,1",
                 "--samples", "1", "--json", "--plot", str(plot)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    from glimpse import tasks

    assert report["task"] == "visual" and report["seed"] == tasks.HELDOUT_SEED
    assert report["categories"] == list(tasks.IMAGE_CATEGORIES)  # the tiny LLaVA takes no video
    assert [q["category"] for q in report["questions"]] == list(tasks.IMAGE_CATEGORIES)
    rows = {(r["policy"], r["speed"]): r for r in report["rows"]}
    assert set(rows) == {("none", 0.0), ("fastv", 0.0), ("fastv", 1.0)}
    assert rows[("fastv", 0.0)]["answers"] == rows[("none", 0.0)]["answers"]
    assert rows[("fastv", 0.0)]["visual_reduction"] == rows[("none", 0.0)]["visual_reduction"] == 0.0
    assert rows[("fastv", 1.0)]["visual_reduction"] > 0.0 and rows[("fastv", 1.0)]["flops_speedup"] > 1.0
    for r in report["rows"]:
        assert r["accuracy"] == sum(r["per_category"].values()) / len(report["categories"])
    assert Image.open(plot).size == (720, 440)
    assert main(["eval", "visual", "--model", str(checkpoints["llava"]), "--seed", str(tasks.TRAIN_SEED)]) == 1


def test_visual_task_asks_only_the_categories_named(checkpoints, capsys):
    """`--categories` restricts the questions (the goal categories on a fresh draw); an unknown category, or a
    clip category for a model without video, is refused with a message."""
    from glimpse import tasks

    args = ["eval", "visual", "--model", str(checkpoints["llava"]), "--policies", "none", "--samples", "2", "--json"]
    assert main(args + ["--categories", "colour,count", "--seed", "7"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["categories"] == ["colour", "count"] and report["seed"] == 7
    asked = [(q["category"], q["question"]) for q in report["questions"]]
    drawn = [(qa.category, qa.question) for _, qa in tasks.heldout_set(7, 2, ("colour", "count"))]
    assert asked == drawn
    assert main(args + ["--categories", "colour,hue"]) == 1
    assert "--categories" in capsys.readouterr().err
    assert main(args + ["--categories", "motion"]) == 1  # the tiny LLaVA takes no video
    assert "takes no video" in capsys.readouterr().err


def test_visual_task_param_configures_the_pruned_policies_not_the_reference(checkpoints, capsys):
    """`--param` sets a parameter of every policy named (here FastV's cut at layer 2, merging): the run
    differs from FastV's default cut, the unpruned reference is untouched, and the report records the
    parameters; an unknown parameter is refused before the model loads."""
    args = ["eval", "visual", "--model", str(checkpoints["llava"]), "--policies", "fastv", "--speeds", "1",
            "--samples", "1", "--categories", "colour,shape", "--json"]
    assert main(args) == 0
    default = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main(args + ["--param", "layer=2", "--param", "merge=true"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in report["rows"]}
    assert report["params"] == {"layer": 2, "merge": True}
    assert rows["none"]["answers"] == default["none"]["answers"]
    assert rows["fastv"]["flops_speedup"] < default["fastv"]["flops_speedup"]  # a later cut than layer 1 saves less
    assert main(args + ["--param", "nope=1"]) == 1
    assert "nope" in capsys.readouterr().err


def test_visual_task_asks_a_question_file_of_the_users_and_refuses_a_bad_one_before_loading(checkpoints, media,
                                                                                            tmp_path, capsys,
                                                                                            monkeypatch):
    """`--questions FILE.jsonl` asks the user's own questions about their own pictures (paths relative to the file),
    judged as the generated set is; `--styled` draws the generated scenes with other looks, asking the same
    questions. A bad line is refused before the model loads, naming the line."""
    import random

    from glimpse import tasks

    rng = random.Random(3)
    (tmp_path / "pics").mkdir()
    lines = []
    for i in range(3):
        scene = tasks.sample_scene(rng, count=2)
        tasks.render(scene).save(tmp_path / "pics" / f"{i}.png")
        qa = tasks.scene_questions(scene, rng)[i]
        lines.append({"image": f"pics/{i}.png", "question": qa.question, "answer": qa.answer,
                      **({"category": "mine"} if i else {})})
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    base = ["eval", "visual", "--model", str(checkpoints["llava"]), "--policies", "fastv", "--speeds", "1", "--json"]
    from glimpse import eval as evaluation

    monkeypatch.setattr(evaluation, "PROGRESS_EVERY_S", 0.0)  # how far through each configuration, said as it goes
    assert main(base + ["--questions", str(questions)]) == 0
    said = capsys.readouterr()
    report = json.loads(said.out)
    for name in ("none @ 0", "fastv @ 1"):
        assert f"{name}: 1 of 3 questions asked" in said.err and f"{name}: 2 of 3 questions asked" in said.err
    # A line naming no category is scored under a name of its own, not "all", the overall score's (a second "all"
    # column in the table: an outside pass).
    assert report["questions"] == [{"category": line.get("category", "uncategorised"), "question": line["question"],
                                    "answer": line["answer"]} for line in lines]
    assert report["asked"] == {"uncategorised": 1, "mine": 2} and report["categories"] == ["uncategorised", "mine"]
    for row in report["rows"]:
        right = [tasks.is_correct(a, tasks.QA("", "", line["answer"])) for a, line in zip(row["answers"], lines)]
        assert row["accuracy"] == sum(right) / 3 and row["per_category"]["mine"] == sum(right[1:]) / 2
    assert main(base[:-1] + ["--policies", "auto", "--questions", str(questions)]) == 0  # the table, not JSON
    table = capsys.readouterr().out
    assert table.splitlines()[0].endswith("| all | uncategorised | mine |") and "| auto (" in table
    absent = str(tmp_path / "no-model")  # never loaded: every refusal comes first
    video_line = {"video": str(media["video"]), "question": "Which way?", "answer": "Left."}
    for content, said in (('{"image": "pics/9.png", "question": "Q?", "answer": "A."}', "line 1: "),
                          ('{"image": "pics/0.png", "question": "Q?", "answer": "A."}\nnot json', "line 2: not JSON"),
                          ('{"image": "pics/0.png", "question": "", "answer": "A."}', '"question" and "answer"'),
                          ('{"image": "pics/0.png", "video": "pics/0.png", "question": "Q", "answer": "A."}',
                           'one of "image" or "video"'),
                          ('{"image": "pics/0.png", "question": "Q?", "answer": "A.", "category": "all"}',
                           '"category" "all" names the score over every question'),
                          ("", "no questions")):
        questions.write_text(content)
        assert main(["eval", "visual", "--model", absent, "--questions", str(questions)]) == 1
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, (content, err)
    # A truncated or empty picture is refused before the model loads too (not an evaluation stopped half way), and
    # every line that cannot be asked is named at once.
    (tmp_path / "pics" / "cut.png").write_bytes((tmp_path / "pics" / "1.png").read_bytes()[:200])
    (tmp_path / "pics" / "empty.png").write_bytes(b"")
    good = json.dumps(lines[0])
    questions.write_text("\n".join([good, good.replace("0.png", "cut.png"), good, good.replace("0.png", "empty.png"),
                                    good.replace('"image"', '"video"')]))
    assert main(["eval", "visual", "--model", absent, "--questions", str(questions)]) == 1
    err = capsys.readouterr().err
    assert "3 lines cannot be asked" in err and "loading" not in err, err
    assert "line 2: cut.png: the image is corrupt or truncated" in err and "line 4: empty.png" in err, err
    assert "line 5: 0.png: this is an image, not a video" in err and "line 1:" not in err and "line 3:" not in err
    questions.write_text(json.dumps(video_line))
    assert main(base + ["--questions", str(questions)]) == 1  # the tiny LLaVA takes no video
    assert "line 1: this model takes no video" in capsys.readouterr().err
    assert main(["eval", "visual", "--model", absent, "--questions", str(questions), "--seed", "5"]) == 1
    assert "--questions asks the file's questions" in capsys.readouterr().err
    for share in ("-0.1", "1.5"):
        assert main(["eval", "visual", "--model", absent, "--styled", share]) == 1
        assert "--styled is a share" in capsys.readouterr().err
    args = ["eval", "visual", "--model", str(checkpoints["llava"]), "--policies", "none", "--samples", "1",
            "--categories", "colour,count", "--seed", "7", "--json"]
    assert main(args + ["--styled", "1"]) == 0
    styled = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert styled["questions"] == plain["questions"] and styled["styled"] == 1.0 and plain["styled"] == 0.0


def test_options_of_another_task_are_refused_not_ignored(checkpoints, tmp_path, capsys):
    """``glimpse eval agreement --samples 6`` was published as the command behind numbers --samples never changed,
    and ``calibrate hidivdrop --floor 0.3`` took no floor (an outside pass): an option the task does not use is
    refused, naming the tasks that use it, before any model loads."""
    absent = str(tmp_path / "no-model")  # never reached
    for argv, said in ((["eval", "agreement", "--samples", "6"], "--samples is an option of `glimpse eval passkey / "
                                                                   "visual`, not of `glimpse eval agreement`"),
                       (["eval", "passkey", "--new-tokens", "64"],
                        "--new-tokens is an option of `glimpse eval agreement`"),
                       (["eval", "visual", "--new-tokens", "4", "--lengths", "512"],
                        "--new-tokens is an option of `glimpse eval agreement`; --lengths is an option of `glimpse "
                        "eval passkey`, not of `glimpse eval visual`"),
                       (["eval", "visual", "--lengths", "512"], "--lengths is an option of `glimpse eval passkey`"),
                       (["eval", "agreement", "--param", "keep=0.5"], "--param is an option of"),
                       (["calibrate", "hidivdrop", "--images", str(tmp_path), "--floor", "0.3", "--leave-out", "rlt"],
                        "--leave-out, --floor are options of `glimpse calibrate slider`, not of `glimpse calibrate "
                        "hidivdrop`"),
                       (["calibrate", "slider", "--top-k", "5"],
                        "--top-k is an option of `glimpse calibrate hidivdrop`"),
                       (["calibrate", "slider", "--window=4"], "--window is an option of"),  # typed, if the default
                       (["eval", "agreement", "--samp", "10"], "--samples is an option of")):  # abbreviated, too
        assert main([*argv, "--model", absent]) == 1, argv
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, (argv, err)


def test_ctrl_c_or_sigterm_keeps_the_rows_measured_by_then(checkpoints, monkeypatch, capsys, stop):
    """Ctrl-C (or SIGTERM) an hour into an eval printed "interrupted" and nothing of what it had measured (an outside
    pass): the report of the configurations finished by then is printed, said to be partial, exit status 130 (143
    for SIGTERM, as every other command's: it was 130 for both)."""
    from glimpse.pipeline.engine import Engine

    generate, answers = Engine.generate, []
    stop_now, status = stop

    def interrupted_at_the_seventh_answer(self, *args, **kwargs):
        answers.append(1)
        if len(answers) == 7:  # warm-up 1, none 2, dash@0 2, dash@1: the first of its 2 -> Ctrl-C
            stop_now()
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", interrupted_at_the_seventh_answer)
    code = main(["eval", "passkey", "--model", str(checkpoints["qwen2_vl"]), "--policies", "dash", "--speeds", "0,1",
                 "--lengths", "128", "--samples", "2", "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == status and report["interrupted"] is True
    assert [(r["policy"], r["speed"]) for r in report["rows"]] == [("none", 0.0), ("dash", 0.0)]
    assert "interrupted: the 2 rows above" in captured.err


def test_first_token_kl_is_of_the_unpruned_distribution_to_the_pruned_one_and_match_rate_is_per_position(qwen, media):
    """SPEC, "How results are measured": KL of the first-token distribution vs the unpruned model, KL(p_none ||
    p_policy) as the module says, computed here from each answer's own first logits; the greedy-token match rate
    over the unpruned answer's positions."""
    import torch

    messages = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                             {"type": "text", "text": "Describe it."}]}]
    report = run_agreement(qwen, {"image": messages}, ["fastv"], [1.0], new_tokens=4)
    (row,) = report["rows"]
    none = qwen.generate(messages, policy="none", max_new_tokens=4, ignore_eos=True)
    pruned = qwen.generate(messages, policy="fastv", speed=1.0, max_new_tokens=4, ignore_eos=True)
    log_p = torch.log_softmax(none.first_logits.float(), -1)
    log_q = torch.log_softmax(pruned.first_logits.float(), -1)
    forward = float(torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum"))  # sum p (log p - log q)
    backward = float(torch.nn.functional.kl_div(log_p, log_q, log_target=True, reduction="sum"))
    assert forward > 0 and abs(forward - backward) > 1e-3 * forward  # the direction shows on this prompt
    assert row["first_token_kl"] == pytest.approx(forward, rel=1e-3)
    same = sum(a == b for a, b in zip(none.token_ids, pruned.token_ids))
    assert row["match_rate"] == pytest.approx(same / 4)


def test_ttft_speedup_is_the_unpruned_time_over_the_policys(qwen, media, monkeypatch):
    """Each runner's TTFT speedup is baseline / policy: the policy's runs here report a quarter of the unpruned TTFT."""
    generate = qwen.generate

    def scripted(messages, **options):
        result = generate(messages, **options)
        policy = options["policy"]
        unpruned = policy == "none" or getattr(policy, "name", None) == "none"
        result.metrics["ttft_s"] = 1.0 if unpruned else 0.25
        return result

    monkeypatch.setattr(qwen, "generate", scripted)
    prompts = {"text1": [{"role": "user", "content": "Tell me about the sea."}]}
    (row,) = run_agreement(qwen, prompts, ["dash"], [0.5], new_tokens=2)["rows"]
    assert row["ttft_speedup"] == pytest.approx(4.0)
    rows = run_passkey(qwen, [128], samples=1, policies=["dash"], speeds=[0.5], new_tokens=2)["rows"]
    assert [r["ttft_speedup"] for r in rows] == pytest.approx([1.0, 4.0])
