"""The honest slider: `auto` reads a measured speed/quality frontier (pruning/frontier.py), calibrated
label-free per model (`glimpse calibrate slider`, pipeline/calibrate_slider.py)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from glimpse.pipeline import embedded, load_engine
from glimpse.pipeline.calibrate_slider import SHIPPED_FRONTIER, calibrate_slider, folder_prompts, shipped_prompts
from glimpse.pipeline.profiles import checkpoint_identity, profile_path, save_profile
from glimpse.pruning import Frontier, Member, Point, make_policy
from glimpse.pruning.frontier import (DEFAULT_FLOOR, candidates, configuration_name, design_pipeline_members,
                              pareto_frontier, required_agreement, uncalibrated_frontier)

SPEEDS = [i / 20 for i in range(21)]


def _point(name: str, agreement: float, flops: float, e2e: float | None) -> Point:
    return Point((Member.of(name, 0.5),), agreement=agreement, flops_ratio=flops, e2e_ratio=e2e, prompts=40)


# ------------------------------------------------------------------------------------------ frontier
def test_the_frontier_keeps_only_points_no_other_beats_on_both_cost_and_agreement():
    a = _point("fastv", 0.60, 0.30, 0.50)  # cheapest
    b = _point("st3", 0.90, 0.55, 0.70)
    dominated = _point("dash", 0.70, 0.80, 0.80)  # more FLOPs than b and agrees less
    c = _point("lazyllm", 0.97, 0.70, 0.85)
    slower = _point("zipvl", 0.99, 0.95, 1.05)  # slower end to end than the unpruned model: never worth it
    rejected = _point("hidivdrop", 0.20, 0.30, None)  # stopped early, never timed
    assert pareto_frontier([dominated, c, slower, a, rejected, b]) == [a, b, c]


def test_a_cheaper_point_measured_slower_end_to_end_is_dropped_so_higher_speed_is_never_slower():
    dear = _point("st3", 0.95, 0.50, 0.80)
    decode_bound = _point("lazyllm", 0.90, 0.40, 0.90)  # fewer FLOPs, but its decode costs more than that
    within_noise = _point("fastv", 0.85, 0.35, 0.82)  # 2 points slower: timing noise, kept
    cheap = _point("dash", 0.70, 0.20, 0.60)
    assert pareto_frontier([dear, decode_bound, within_noise, cheap]) == [cheap, within_noise, dear]


def test_a_cheaper_point_is_held_to_the_fastest_dearer_one_kept_not_the_slowest():
    """"A point measured more than 3% slower end to end than a dearer one is dropped": than *any* dearer one kept,
    so a cheap point slower than a fast middle one goes even when the dearest is slower still."""
    dear, middle, cheap = _point("dash", 0.97, 0.80, 0.90), _point("st3", 0.90, 0.60, 0.60), \
        _point("fastv", 0.80, 0.40, 0.85)
    assert pareto_frontier([dear, middle, cheap]) == [middle, dear]


def test_of_two_points_alike_on_one_axis_only_the_better_on_the_other_is_on_the_frontier():
    """"No other beats it on both cost and agreement": of equal agreement the cheaper stays, of equal FLOPs (LazyLLM
    with and without decode re-selection prune the prefill alike) the better-agreeing one."""
    cheap, dear = _point("fastv", 0.90, 0.40, 0.70), _point("st3", 0.90, 0.60, 0.60)
    assert pareto_frontier([dear, cheap]) == [cheap]
    worse, better = _point("lazyllm", 0.80, 0.50, 0.70), _point("st3", 0.90, 0.50, 0.70)
    assert pareto_frontier([worse, better]) == [better]


def test_a_point_no_faster_or_no_cheaper_than_the_unpruned_model_is_never_on_the_frontier():
    """Only points faster end to end than the unpruned model, and cheaper, are admitted: RLT on pictures alone prunes
    nothing (agreement 1, FLOPs 1) and a noisy timing can still call it faster; at the top of the frontier, auto
    would run and promise it."""
    as_slow = _point("lazyllm", 0.99, 0.60, 1.0)
    no_saving = _point("rlt", 1.0, 1.0, 0.98)
    good = _point("st3", 0.90, 0.50, 0.80)
    assert pareto_frontier([as_slow, no_saving, good]) == [good]


def test_speed_zero_is_exact_whatever_the_frontier_holds():
    """Agreement on a finite set is never a proof of exactness, even a point of agreement 1.0 measured on no prompts
    (a profile's point without its count reads as 0)."""
    frontier = Frontier([Point((Member.of("lazyllm", 0.25),), 1.0, 0.8, 0.9, prompts=0)], calibrated=True)
    assert frontier.choose(0.0) is None and frontier.promise(0.0)["configuration"] == "none"


def test_calibration_keeps_as_its_frontier_the_pareto_points_of_what_it_measured(monkeypatch, tmp_path):
    """What auto runs is the frontier of the measured points: one measured slower end to end than the unpruned model
    or beaten on both axes is measured, kept in ``measured``, and never run."""
    from glimpse.pipeline import calibrate_slider as module

    points = {"fastv@0.5": _point("fastv", 0.90, 0.50, 1.10), "st3@0.5": _point("st3", 0.80, 0.70, 0.80),
              "lazyllm@0.5": _point("lazyllm", 0.95, 0.60, 0.70)}
    monkeypatch.setattr(module, "measure", lambda engine, members, *args: points[members[0].label])
    monkeypatch.setattr(module, "_references", lambda engine, prompts, *args: (prompts, [None] * len(prompts)))
    engine = SimpleNamespace(model_id="m", checkpoint="c", device=torch.device("cpu"))
    frontier = module.calibrate_slider(engine, [[{"role": "user", "content": "q"}]],
                                       [(Member.of(name.split("@")[0], 0.5),) for name in points],
                                       state_path=tmp_path / "state.jsonl")
    assert sorted(p.name for p in frontier.measured) == sorted(points)
    assert frontier.points == pareto_frontier(frontier.measured) == [points["lazyllm@0.5"]]


def test_auto_along_the_slider_is_exact_at_0_then_never_slower_never_pruning_less_and_keeps_its_promise():
    points = [_point("fastv", 0.55, 0.25, 0.45), _point("st3", 0.86, 0.45, 0.60), _point("lazyllm", 0.93, 0.55, 0.72),
              _point("dash", 0.97, 0.80, 0.90)]
    frontier = Frontier(pareto_frontier(points), floor=DEFAULT_FLOOR, calibrated=True)
    assert frontier.choose(0.0) is None  # exact, whatever was measured
    chosen = [frontier.choose(s) for s in SPEEDS[1:]]
    for speed, point in zip(SPEEDS[1:], chosen):
        if point is not None:
            assert point.agreement_bound >= required_agreement(speed, DEFAULT_FLOOR)
    cost = [1.0] + [p.e2e_ratio if p else 1.0 for p in chosen]
    flops = [1.0] + [p.flops_ratio if p else 1.0 for p in chosen]
    assert all(b <= a for a, b in zip(cost, cost[1:])) and all(b <= a for a, b in zip(flops, flops[1:]))
    # speed 1: the cheapest point whose agreement stays above the floor; the 55% one is never run
    assert frontier.choose(1.0).name == "st3@0.5"
    assert all(p is None or p.name != "fastv@0.5" for p in chosen)
    promise = frontier.promise(1.0)
    assert promise["configuration"] == "st3@0.5" and promise["agreement"] == 0.86
    assert "keeps 86% of answers" in promise["text"] and "2.2x fewer prefill FLOPs" in promise["text"]
    # 0.86 less one standard error over 40 prompts (taken at q = (34.4 + 1/2) / 41: 0.056)
    assert promise["text"].count("at least 80%") == 1


def test_agreement_on_every_prompt_of_a_small_set_is_not_promised_as_certain():
    """A 12-prompt calibration that agreed on all 12 read "at least 100% within one standard error" (the standard
    error of 12/12 is 0 at p = k/n) and was run from speed 0.25 on; on 40 prompts the same configuration kept 87.5%.
    The bound of an unbroken run is below 100%, lower on fewer prompts; a run with disagreements keeps its bound
    within a point of p - sqrt(p (1 - p) / n)."""
    few, many = _point("lazyllm", 1.0, 0.5, 0.9), _point("lazyllm", 1.0, 0.5, 0.9)
    few = Point(few.members, agreement=1.0, flops_ratio=0.5, e2e_ratio=0.9, prompts=12)
    assert few.agreement_bound < many.agreement_bound < 1.0
    frontier = Frontier([few], calibrated=True)
    assert "at least 100%" not in frontier.promise(1.0)["text"]
    for agreement in (0.9, 0.925, 0.95):  # the shipped frontier's points, on 40 prompts
        point = _point("divprune", agreement, 0.5, 0.9)
        wald = agreement - (agreement * (1 - agreement) / 40) ** 0.5
        assert abs(point.agreement_bound - wald) < 0.01


def test_a_frontier_survives_its_json_and_builds_the_same_policy():
    frontier = Frontier(pareto_frontier([Point(design_pipeline_members(1.0), 0.9, 0.3, 0.5, token_match=0.95),
                                         Point((Member.of("lazyllm", 1.0, percentiles=[0.5, 0.6, 0.7]),), 0.97,
                                               0.5, 0.7)]), calibrated=True, source="test")
    again = Frontier.from_json(json.loads(json.dumps(frontier.to_json())))
    assert again.points == frontier.points
    for speed in (0.25, 1.0):
        assert make_policy("auto", speed, frontier=again).params() == make_policy("auto", speed, frontier=frontier).params()
    assert make_policy("auto", 0.25, frontier=again).policies[0].percentiles == (0.5, 0.6, 0.7)


def test_without_a_profile_auto_is_the_labelled_uncalibrated_default():
    frontier = uncalibrated_frontier()
    assert not frontier.calibrated
    for speed in (0.5, 1.0):
        assert frontier.promise(speed)["text"].startswith("uncalibrated")
    assert frontier.promise(0.0)["configuration"] == "none"


def test_the_default_candidates_hold_the_design_pipeline_and_every_policy():
    names = {member.policy for members in candidates() for member in members}
    from glimpse.pruning import PRUNING_NAMES

    assert names == set(PRUNING_NAMES)  # a registered policy is measured, or auto could never pick it
    assert design_pipeline_members(0.5) in candidates()
    assert len({tuple(c) for c in candidates()}) == len(candidates())  # no candidate measured twice


# ------------------------------------------------------------------------------------------ calibration
@pytest.fixture(scope="module")
def engine(deep_checkpoints):
    return load_engine(str(deep_checkpoints["qwen2_vl"]), device="cpu")


def test_calibration_can_choose_or_reject_the_design_pipeline_by_what_it_measured(engine, media, tmp_path):
    image = str(media["image"])
    prompts = [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
               for question in ("What is in the picture?", "What colours are there?", "Describe it.", "Is it dark?")]
    design = design_pipeline_members(1.0)
    mild = (Member.of("lazyllm", 0.25),)
    # floor 0: nothing stops early, so both are measured on every prompt and timed
    frontier = calibrate_slider(engine, prompts, [design, mild], state_path=tmp_path / "state.jsonl", floor=0.0,
                                answer_tokens=6, timing_prompts=1, timing_tokens=4)
    measured = {p.name: p for p in frontier.measured}
    design_point = measured["+".join(m.label for m in design)]
    assert 0.0 <= design_point.agreement <= 1.0 and design_point.prompts == len(prompts)
    assert design_point.flops_ratio < measured["lazyllm@0.25"].flops_ratio < 1.0
    assert design_point.e2e_ratio is not None and design_point.e2e_ratio > 0
    # FLOPs as the policy's over the unpruned model's, summed over the prompts
    flops = [sum(engine.generate(p, policy=policy, max_new_tokens=6).metrics["prefill_flops"] for p in prompts)
             for policy in (engine.configuration(mild), "none")]
    assert measured["lazyllm@0.25"].flops_ratio == pytest.approx(flops[0] / flops[1])
    # The same measurements, read against a floor above what the design pipeline kept: never chosen.
    misses = Frontier(frontier.points, floor=min(1.0, design_point.agreement_bound + 0.01), calibrated=True)
    assert all(misses.choose(s) != design_point for s in SPEEDS)
    # ... and against a floor it meets: chosen at speed 1, being the cheapest, if it made the frontier
    # (a shared machine may time it slower end to end than the unpruned model, which keeps it off).
    meets = Frontier(frontier.points, floor=design_point.agreement_bound, calibrated=True)
    assert (meets.choose(1.0) == design_point) == (design_point in frontier.points)


class _Interrupt(Exception):
    pass


def test_an_interrupted_calibration_resumes_without_measuring_again(engine, media, tmp_path):
    prompts = folder_prompts(str(media["image"].parent), None, None, video=True)
    todo = [(Member.of("fastv", 0.5),), (Member.of("st3", 0.5),), (Member.of("lazyllm", 0.5),)]
    state = tmp_path / "state.jsonl"
    lines = []

    def stop_after_first(line):
        lines.append(line)
        if line.startswith("[1/3]"):
            raise _Interrupt  # as Ctrl-C would, right after the first candidate was stored

    with pytest.raises(_Interrupt):
        calibrate_slider(engine, prompts, todo, state_path=state, answer_tokens=4, timing_prompts=1,
                         timing_tokens=3, progress=stop_after_first)
    first = json.loads(state.read_text().splitlines()[1])["point"]
    assert first["name"] == "fastv@0.5"
    with state.open("a") as f:  # a kill in the middle of writing the next line
        f.write('{"point": {"name": "st3@0.5", "agr')
    lines.clear()
    frontier = calibrate_slider(engine, prompts, todo, state_path=state, answer_tokens=4, timing_prompts=1,
                                timing_tokens=3, progress=lines.append)
    assert any(line.startswith("resuming: 1 of 3") for line in lines)
    assert [line.split(":")[0] for line in lines if line.startswith("[")] == ["[2/3] st3@0.5", "[3/3] lazyllm@0.5"]
    assert {p.name for p in frontier.measured} == {"fastv@0.5", "st3@0.5", "lazyllm@0.5"}
    assert next(p for p in frontier.measured if p.name == "fastv@0.5").to_json() == first
    # other settings: the old measurements are not mixed in
    calibrate_slider(engine, prompts, todo[:1], state_path=state, answer_tokens=5, timing_prompts=1,
                     timing_tokens=3, progress=lines.append)
    assert any("holds a calibration with other settings (answer_tokens): starting afresh" in line for line in lines)
    kept = state.with_name(state.name + ".previous")  # the old measurements are moved aside, not lost
    assert json.loads(kept.read_text().splitlines()[1])["point"] == first
    # retrained weights under the same model name (another checkpoint identity): measured afresh, never
    # resumed from the old weights' points
    lines.clear()
    calibrate_slider(engine, prompts, todo[:1], state_path=state, answer_tokens=5, timing_prompts=1,
                     timing_tokens=3, progress=lines.append)
    assert any(line.startswith("resuming") for line in lines)  # same weights: resumed
    identity, engine.checkpoint = engine.checkpoint, engine.checkpoint + "-retrained"
    try:
        lines.clear()
        calibrate_slider(engine, prompts, todo[:1], state_path=state, answer_tokens=5, timing_prompts=1,
                         timing_tokens=3, progress=lines.append)
    finally:
        engine.checkpoint = identity
    assert any("holds a calibration of other weights: starting afresh" in line for line in lines)
    assert not any(line.startswith("resuming") for line in lines)


def test_a_lower_floor_measures_again_the_candidates_a_higher_floor_stopped_half_way(engine, media, tmp_path,
                                                                                    monkeypatch):
    """A candidate far below the floor stops half-way, untimed, and a rerun reuses what was measured. A rerun with a
    lower floor reused those rejections too (an outside pass): never timed, the lower floor could never pick them. It
    measures again the ones it would not have stopped, and only those."""
    from glimpse.pipeline import calibrate_slider as module

    prompts = folder_prompts(str(media["image"].parent), None, None, video=True)
    measured = []

    def agreeing_45_percent(engine, members, prompts, references, floor, *args):  # as measure() would, by its floor
        measured.append(floor)
        if 0.45 < floor - module.EARLY_STOP_BELOW:
            return Point(members, agreement=0.45, flops_ratio=0.5, prompts=10)  # stopped half-way: no e2e_ratio
        return Point(members, agreement=0.45, flops_ratio=0.5, e2e_ratio=0.7, prompts=20)

    monkeypatch.setattr(module, "measure", agreeing_45_percent)
    state, candidate = tmp_path / "state.jsonl", [(Member.of("fastv", 0.5),)]
    for floor in (0.75, 0.75, 0.7, 0.6, 0.6, 0.75):
        frontier = calibrate_slider(engine, prompts, candidate, state_path=state, floor=floor, answer_tokens=4,
                                    timing_prompts=1, timing_tokens=3)
    assert measured == [0.75, 0.6]  # 0.7 would have stopped it too (0.45 < 0.5); once timed, it is kept
    assert frontier.measured[0].e2e_ratio == 0.7


def test_measurements_are_never_lost_and_a_resume_does_not_answer_the_prompts_unpruned_again(engine, media,
                                                                                              tmp_path):
    """Found from outside: two reruns with other settings moved the first's state aside under one name, the second
    over the first (67 measured candidates lost), and before the new prompts were known to be readable; and every
    resume answered all prompts unpruned again, so a 2-minute budget measured about one candidate per rerun."""
    from glimpse.common import UserError

    prompts = folder_prompts(str(media["image"].parent), None, None, video=True)
    state, lines = tmp_path / "state.jsonl", []

    def run(prompts, answer_tokens):
        lines.clear()
        return calibrate_slider(engine, prompts, [(Member.of("fastv", 0.5),)], state_path=state,
                                answer_tokens=answer_tokens, timing_prompts=1, timing_tokens=3, progress=lines.append)

    first = run(prompts, 4)
    measured = state.read_text()
    again = run(prompts, 4)
    assert any("kept from the last run" in line for line in lines) and any(line.startswith("resuming") for line in lines)
    assert again.measured == first.measured
    unreadable = [[{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "gone.png")},
                                                {"type": "text", "text": "What is it?"}]}]]
    with pytest.raises(UserError, match="none of the calibration prompts"):
        run(unreadable, 5)
    assert state.read_text() == measured  # nothing moved for a calibration that could not start
    run(prompts, 5)
    run(prompts, 6)
    assert state.with_name(state.name + ".previous").read_text() == measured
    moved = state.with_name(state.name + ".previous-2").read_text().splitlines()
    assert json.loads(moved[0])["settings"]["answer_tokens"] == 5 and len(moved) == 2


def test_a_candidate_the_model_cannot_run_is_skipped_with_its_reason_and_the_rest_are_measured(engine, media,
                                                                                                tmp_path):
    prompts = folder_prompts(str(media["image"].parent), None, None, video=True)
    impossible = (Member.of("hidivdrop", 1.0, inject_layer=10, exit_layer=5),)  # injects after it exits
    lines = []
    frontier = calibrate_slider(engine, prompts, [impossible, (Member.of("fastv", 0.5),)],
                                state_path=tmp_path / "state.jsonl", answer_tokens=3, timing_prompts=1,
                                timing_tokens=2, progress=lines.append)
    assert [p.name for p in frontier.measured] == ["fastv@0.5"]
    assert any(line.startswith("[1/2] hidivdrop@1") and "skipped" in line and "L_inj" in line for line in lines)
    assert frontier.unmeasured == 0  # a rerun would skip it again: the calibration is not incomplete for it


def test_a_stored_profile_is_what_auto_runs_and_promises(deep_checkpoints, media, tmp_path, monkeypatch):
    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path))
    model = str(tmp_path / "llava")
    shutil.copytree(deep_checkpoints["llava"], model)  # its weights are rewritten below
    assert not load_engine(model, device="cpu").promise("auto", 1.0)["calibrated"]
    point = Point((Member.of("fastv", 0.5),), agreement=0.9, flops_ratio=0.5, e2e_ratio=0.7, prompts=12)
    frontier = Frontier([point], calibrated=True, source="test calibration")
    checkpoint = checkpoint_identity(model)
    save_profile(model, {**frontier.to_json(), "num_layers": 12, "checkpoint": checkpoint}, policy="slider")
    assert profile_path(model, "slider").exists()
    engine = load_engine(model, device="cpu")
    policy = engine.make_policy("auto", 1.0)
    assert [p.name for p in policy.policies] == ["fastv"] and policy.policies[0].ratio == 0.5
    promise = engine.promise("auto", 1.0)
    assert promise["calibrated"] and promise["configuration"] == "fastv@0.5" and "12 prompts" in promise["text"]
    assert engine.make_policy("auto", 0.0).policies == ()
    # a profile of another depth (another model at the same path) is not used
    save_profile(model, {**frontier.to_json(), "num_layers": 7, "checkpoint": checkpoint}, policy="slider")
    assert not load_engine(model, device="cpu").promise("auto", 1.0)["calibrated"]
    # nor one measured on other weights: the checkpoint fine-tuned and saved over its folder
    save_profile(model, {**frontier.to_json(), "num_layers": 12, "checkpoint": checkpoint}, policy="slider")
    assert load_engine(model, device="cpu").promise("auto", 1.0)["calibrated"]
    weights = next(Path(model).glob("*.safetensors"))
    tensors = load_file(weights)
    tensors = {k: v + 0.01 if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    assert checkpoint_identity(model) != checkpoint
    assert not load_engine(model, device="cpu").promise("auto", 1.0)["calibrated"]
    # a profile from before identities were recorded: not known to be of these weights, not used
    save_profile(model, {**frontier.to_json(), "num_layers": 12}, policy="slider")
    assert not load_engine(model, device="cpu").promise("auto", 1.0)["calibrated"]


def test_the_shipped_calibration_set_and_frontier_are_usable():
    prompts = shipped_prompts(video=True)
    assert len(prompts) >= 40 and {part["type"] for p in prompts for part in p[0]["content"]} == {"image", "video", "text"}
    assert all("video" not in part for p in shipped_prompts(video=False) for part in p[0]["content"])
    shipped = json.loads(SHIPPED_FRONTIER.read_text())
    assert shipped["weights"] == embedded.checkpoint_name()  # measured on the trained files that ship with it
    frontier = Frontier.from_json(shipped)
    assert frontier.calibrated and frontier.points and frontier.choose(0.0) is None
    for point in frontier.points:  # every frontier point was measured, and is faster than the unpruned model
        assert point.e2e_ratio < 1.0 and point.flops_ratio < 1.0 and point in frontier.measured
    assert frontier.choose(1.0).agreement_bound >= frontier.floor


def test_calibrate_slider_from_the_command_line_refuses_bad_input_before_loading(tmp_path, capsys):
    from glimpse.cli import main

    assert main(["calibrate", "slider", "--model", "embedded", "--floor", "1.5"]) == 1
    assert "--floor" in capsys.readouterr().err
    assert main(["calibrate", "slider", "--model", "embedded", "--prompts", str(tmp_path / "missing.txt")]) == 1
    assert "--prompts" in capsys.readouterr().err
    assert main(["calibrate", "hidivdrop", "--model", "embedded"]) == 1
    assert "needs --images" in capsys.readouterr().err
    # Found from outside, each after the model loaded (or after the whole calibration, or never):
    absent = str(tmp_path / "no-model")  # never reached: each is refused first
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"\xff\xfe Qu\xe9 color?\n")
    (tmp_path / "folder").mkdir()
    for extra, said in ((["--budget-minutes", "nan"], "--budget-minutes must be a positive number"),
                        (["--prompts", str(latin)], "is not UTF-8 text"),
                        (["--out", str(tmp_path / "folder")], "is a folder"),
                        (["--out", str(latin / "x" / "slider.json")], f"{latin} is a file, not a folder"),
                        # a folder where no file can be made, although access() says yes to root
                        (["--out", "/proc/slider.json"], "--out /proc/slider.json: cannot write there"),
                        (["--images", str(latin)], "--images must be a folder"),
                        (["--leave-out", "rlt,none"], "--leave-out takes policies of"),
                        (["--leave-out", "auto"], "--leave-out takes policies of")):
        assert main(["calibrate", "slider", "--model", absent, *extra]) == 1
        err = capsys.readouterr().err
        assert said in err and "loading" not in err, (extra, err)


def test_calibrate_slider_from_the_command_line_stores_a_profile_within_its_budget_and_resumes(
        deep_checkpoints, media, tmp_path, capsys, monkeypatch):
    from glimpse.cli import main

    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        (images / name).write_bytes(media["image"].read_bytes())
    (images / "notes.txt").write_text("not an image")
    (images / "c_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # a bad file is skipped, not fatal
    out = tmp_path / "slider.json"
    command = ["calibrate", "slider", "--model", str(deep_checkpoints["llava"]), "--images", str(images),
               "--budget-minutes", "0.001", "--out", str(out), "--device", "cpu"]
    assert main(command) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "[1/" in err and "budget spent" in err  # one candidate measured, then the budget stops it
    assert "only 3 calibration prompts: one answer that changes" in err  # 3 images, 3 prompts: said to be few
    assert "no candidate starts after that; the one under way finishes" in err
    # auto reads the cache, not --out: said, and stdout is a summary, not the whole profile
    assert "not --out: it keeps running the frontier it ran before (uncalibrated" in err
    summary = json.loads(captured.out)
    assert summary == {"profile": str(out), "in_use": False, "complete": False, "measured": 1,
                       "unmeasured": summary["unmeasured"], "auto": summary["auto"]} and summary["unmeasured"] > 0
    assert set(summary["auto"]) == {"0", "0.25", "0.5", "0.75", "1"} and summary["auto"]["0"] == "none"
    assert "skipped prompt 3" in err and "c_broken.png" in err
    assert "1 of 3 calibration prompts skipped: 2 left, so one answer that changes moves a candidate's agreement by 50" in err
    profile = json.loads(out.read_text())
    assert profile["num_layers"] == 12 and len(profile["measured"]) == 1 and profile["measured"][0]["prompts"] >= 1
    frontier = Frontier.from_json(profile)
    assert all(p in frontier.measured for p in frontier.points)
    # what is left unmeasured is said at the end, and in every promise the partial frontier makes
    assert f"incomplete: {frontier.unmeasured} of {frontier.unmeasured + 1} candidates not measured" in err
    assert f"calibration incomplete: {frontier.unmeasured} of" in frontier.promise(1.0)["text"]
    assert main(command) == 0  # the same command again: resumes, measures the next one
    err = capsys.readouterr().err
    assert "resuming: 1 of" in err and "[2/" in err
    assert len(json.loads(out.read_text())["measured"]) == 2
    # An --out that holds a complete frontier is not replaced by a run cut short either (found from outside: the
    # maintainer's command with --out assets/embedded_frontier.json and a budget emptied the frontier that ships).
    complete_out = {**json.loads(out.read_text()), "unmeasured": 0, "source": "complete at --out"}
    out.write_text(json.dumps(complete_out))
    assert main(command) == 0
    captured = capsys.readouterr()
    assert json.loads(out.read_text()) == complete_out
    beside_out = out.with_name("slider.incomplete.json")
    assert json.loads(captured.out)["profile"] == str(beside_out)
    assert len(json.loads(beside_out.read_text())["measured"]) == 3 and json.loads(beside_out.read_text())["unmeasured"]
    assert f"{out} holds a complete calibration (complete at --out): this incomplete one does not replace it" in \
        captured.err
    # Into the cache, where auto reads it: a partial frontier of a model with no complete one is what auto runs.
    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path / "cache"))
    assert main(command[:-4] + ["--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "auto now runs this frontier:" in captured.err and json.loads(captured.out)["in_use"] is True
    # A complete calibration in use is not replaced by one cut short (found from outside: a 10-second run with
    # other prompts replaced a complete one); the short one goes beside it, and a complete one replaces it.
    in_use = Path(json.loads(captured.out)["profile"])
    complete = {**json.loads(in_use.read_text()), "unmeasured": 0, "source": "calibrated completely"}
    in_use.write_text(json.dumps(complete))
    assert main(command[:-4] + ["--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert json.loads(in_use.read_text()) == complete
    beside = in_use.with_name(in_use.stem + ".incomplete.json")
    assert json.loads(captured.out)["profile"] == str(beside) and json.loads(beside.read_text())["unmeasured"] > 0
    assert "auto keeps running the complete calibration it ran before (calibrated completely)" in captured.err


class _TimedEngine:
    """Gives the unpruned model's answer to every run, and times the candidate's runs ``slowdowns`` times the
    unpruned run before each (in turn), so that what calibration makes of its timings can be checked exactly."""

    def __init__(self, slowdowns):
        self.slowdowns, self.timed = list(slowdowns), []

    def configuration(self, members):
        return "candidate"

    def generate(self, messages, policy, max_new_tokens, ignore_eos=False):
        pruned = policy != "none"
        slow = 1.0
        if ignore_eos and pruned:  # a timing run of the candidate
            slow = self.slowdowns[len(self.timed) % len(self.slowdowns)]
            self.timed.append(slow)
        metrics = {"prefill_flops": 50.0 if pruned else 100.0, "kv_bytes": 1, "ttft_s": 0.5 * slow,
                   "prefill_s": 0.4 * slow, "decode_tokens_per_s": 20.0 / slow}
        return SimpleNamespace(text="Red.", token_ids=[5, 6], first_logits=torch.zeros(8), metrics=metrics)


@pytest.mark.parametrize("slowdowns,timed", [((1.05,), 6), ((1.06, 1.05, 1.04, 0.95, 0.96, 0.97), 6),
                                             ((1.4,), 3), ((0.9,), 3), ((0.4,), 3), ((0.05,), 6),
                                             ((0.05, 0.05, 0.05, 0.8, 0.8, 0.8), 6), ((0.5, 0.5, 3.0), 3)])
def test_a_pruning_candidate_timed_slightly_slower_than_unpruned_is_timed_again_before_it_is_judged(slowdowns, timed):
    """The frontier drops a candidate timed slower end to end than the unpruned model; a few percent is the noise of
    a shared machine, so a candidate that prunes and times 0-15% slower is timed on as many prompts again and
    judged on the median of all. Clearly slower (ZipVL's dequantising) or faster: timed once — unless faster than
    its savings can explain (here 2x fewer FLOPs: 20x faster is a machine that slowed the unpruned runs, found
    from outside as "st3@0.75 ... 18.79x faster end to end" in a promise); timed that fast again, it is stored as
    what it saves (found from outside too: LazyLLM at 1.17x fewer FLOPs stored as 4.83x faster)."""
    from glimpse.pipeline.calibrate_slider import Reference, measure

    engine = _TimedEngine(slowdowns)
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(8)]
    references = [Reference([5, 6], "Red.", torch.log_softmax(torch.zeros(8), -1), 100.0, 1) for _ in prompts]
    point = measure(engine, (Member.of("divprune", 0.5),), prompts, references, floor=0.75, answer_tokens=4,
                    timing_prompts=3, timing_tokens=4, typical_answer=64)
    assert len(engine.timed) == timed and point.agreement == 1.0 and point.flops_ratio == 0.5
    median = statistics.median(engine.timed)
    if 1 / median <= 1.5 * 2:  # a speed-up its 2x fewer FLOPs can explain, once timed again if need be
        assert point.e2e_ratio == pytest.approx(median)
        # decode tokens/s and prefill time, policy against unpruned, medians of the same runs
        assert point.decode_speedup == pytest.approx(statistics.median(1 / s for s in engine.timed))
        assert point.prefill_ratio == pytest.approx(median)
    else:  # still 20x after the second timing: stored as what it saves, 2x, never more (decode likewise)
        assert point.e2e_ratio == pytest.approx(0.5) and point.decode_speedup <= 2


@pytest.mark.parametrize("count,stopped_at", [(4, None), (18, None), (20, 10), (40, 20)])
def test_a_candidate_far_below_the_floor_stops_half_way_only_when_half_is_enough_prompts(count, stopped_at):
    """Found from outside: on a 2-prompt set every candidate was rejected after 1 prompt (one different answer is
    50 points). Half-way is a verdict only from 10 prompts on; before that every candidate is measured whole."""
    from glimpse.pipeline.calibrate_slider import Reference, measure

    class Disagreeing(_TimedEngine):
        def generate(self, messages, policy, max_new_tokens, ignore_eos=False):
            result = super().generate(messages, policy, max_new_tokens, ignore_eos)
            return SimpleNamespace(**{**vars(result), "text": "Blue." if policy != "none" else result.text})

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(count)]
    references = [Reference([5, 6], "Red.", torch.log_softmax(torch.zeros(8), -1), 100.0, 1) for _ in prompts]
    point = measure(Disagreeing((0.9,)), (Member.of("divprune", 0.5),), prompts, references, floor=0.75,
                    answer_tokens=4, timing_prompts=3, timing_tokens=4, typical_answer=64)
    assert point.agreement == 0.0 and point.prompts == (stopped_at or count)
    assert (point.e2e_ratio is None) == (stopped_at is not None)  # stopped: rejected untimed


def test_a_calibration_cut_short_does_not_replace_the_complete_one_that_ships(monkeypatch):
    """Found from outside: an 8-of-71 calibration of the embedded model replaced its shipped frontier, and speed 1
    became a 1.7x LazyLLM that answered "Green." for a purple circle (the shipped frontier: 3.5x DivPrune, "Purple.").
    A partial calibration is used only where nothing complete is there (another model's uncalibrated default)."""
    from glimpse.pipeline import loading

    shipped = Frontier.from_json(json.loads(SHIPPED_FRONTIER.read_text()), calibrated=True)
    lazy = Point((Member.of("lazyllm", 0.75),), agreement=0.9, flops_ratio=0.6, e2e_ratio=0.9, prompts=40)
    partial = Frontier(points=[lazy], floor=DEFAULT_FLOOR, calibrated=True, source="calibrated here", measured=[lazy],
                       unmeasured=63)
    monkeypatch.setattr(loading, "load_profile", lambda model, kind: {**partial.to_json(), "partial": True})
    monkeypatch.setattr(loading, "profile_matches", lambda profile, checkpoint, layers: True)
    chosen = loading.slider_frontier("embedded", 30, "any")
    assert chosen.to_json() == shipped.to_json() and chosen.choose(1.0).name != "lazyllm@0.75"
    other = loading.slider_frontier("/models/another", 30, "any")  # nothing complete there: the partial one
    assert other.unmeasured == 63 and other.choose(1.0).name == "lazyllm@0.75"
    complete = Frontier(points=[lazy], floor=DEFAULT_FLOOR, calibrated=True, source="calibrated here", measured=[lazy])
    monkeypatch.setattr(loading, "load_profile", lambda model, kind: complete.to_json())
    assert loading.slider_frontier("embedded", 30, "any").choose(1.0).name == "lazyllm@0.75"  # a complete one does


def test_a_named_policy_measured_slower_end_to_end_is_said_to_be_slower():
    """ "lazyllm@0.5: ... 0.97x faster end to end" read as a speed-up."""
    slow = Point((Member.of("lazyllm", 0.5),), agreement=0.9, flops_ratio=0.7, e2e_ratio=1.0 / 0.97, prompts=40)
    frontier = Frontier(points=[], calibrated=True, source="here", measured=[slow])
    assert frontier.promise_for("lazyllm", 0.5)["text"].endswith("1.03x slower end to end (prefill + 64-token answer)")
    even = Point((Member.of("lazyllm", 0.75),), agreement=0.9, flops_ratio=0.6, e2e_ratio=1.002, prompts=40)
    frontier = Frontier(points=[], calibrated=True, source="here", measured=[even])
    assert "as fast end to end" in frontier.promise_for("lazyllm", 0.75)["text"]  # it read "1.00x slower"
    # A candidate stopped far below the floor said "(rejected)", and a user asking for it by name saw it run anyway.
    stopped = Point((Member.of("fastv", 1.0),), agreement=0.35, flops_ratio=0.2, e2e_ratio=None, prompts=20)
    text = Frontier(points=[], calibrated=True, source="here", measured=[stopped]).promise_for("fastv", 1.0)["text"]
    assert "keeps only 35%" in text and "auto never runs it; asked by name, it runs as set" in text
    # No pruning is exact on any model: its promise states the model's calibration as auto's speed 0 does ("calibrated":
    # false beside a source "calibrated on 40 prompts" read as a contradiction, found from outside).
    # A policy the calibration did not measure (RLT came after the shipped frontier) says so beside "complete".
    text = Frontier(points=[], calibrated=True, source="here", measured=[stopped, slow]).promise_for("rlt", 0.5)["text"]
    assert text == "rlt@0.5: not among the 2 candidates calibrated on this model (auto picks measured settings; " \
                   "asked by name, it runs as set)"
    partial = Frontier(points=[], calibrated=True, source="calibrated here", measured=[stopped], unmeasured=3)
    for promise in (partial.promise_for("none", 1.0), partial.promise(0.0)):
        assert promise["configuration"] == "none" and promise["calibrated"] is True
        assert promise["measured_on"] == "this model" and promise["complete"] is False  # 3 candidates not measured


def test_a_damaged_profile_is_ignored_and_said_to_be(tmp_path, monkeypatch, caplog):
    """Found from outside: a slider profile cut short was passed over without a word (the slider quietly went back
    to the shipped frontier)."""
    from glimpse.pipeline.profiles import load_profile, profile_path, save_profile

    monkeypatch.setenv("GLIMPSE_CACHE", str(tmp_path))
    path = save_profile("some/model", {"points": []}, "slider")
    assert path == profile_path("some/model", "slider") and load_profile("some/model", "slider") == {"points": []}
    path.write_text(path.read_text()[:5])  # cut short
    with caplog.at_level("WARNING"):
        assert load_profile("some/model", "slider") is None
        assert load_profile("some/model", "slider") is None  # read again (policy, then promise): said once
    assert caplog.text.count(f"ignoring the slider profile {path} (not a whole JSON profile)") == 1
    path.write_text("[1, 2]")  # JSON, but no profile
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert load_profile("some/model", "slider") is None
    assert "(not a profile)" in caplog.text
    # What `auto` would read: an empty object, a profile of other weights or of a model with other layers, and one
    # without its frontier are passed over, each said once (`{}` was passed over without a word).
    from glimpse.pipeline.loading import local_frontier

    measured = {"checkpoint": "/models/m#abc", "num_layers": 30, "frontier": [], "floor": 0.9}
    point = Point((Member.of("divprune", 1.0),), 0.95, 0.3, 0.9, prompts=40).to_json()
    for stored, said in (({}, "(not a profile)"), ({**measured, "checkpoint": "/models/m#old"}, "on other weights"),
                         ({**measured, "num_layers": 28}, "a model of 28 layers, this one has 30"),
                         ({**measured, "frontier": None}, "(not a whole frontier"),
                         # edited by hand: an e2e_ratio of 0 divided by zero in every promise, a speed of 7 was
                         # promised as divprune@7, a policy Glimpse has not as one (an outside pass)
                         ({**measured, "frontier": [{**point, "e2e_ratio": 0}]}, "not a measurement"),
                         ({**measured, "frontier": [{**point, "agreement": math.nan}]}, "not a measurement"),
                         ({**measured, "frontier": [{**point, "members": [{"policy": "divprune", "speed": 7}]}]},
                          "speed must be in [0, 1]"),
                         ({**measured, "measured": [{**point, "members": [{"policy": "bogus", "speed": 1}]}]},
                          "no policy named bogus"),
                         ({**measured, "floor": math.nan}, "floor nan")):
        save_profile("some/model", stored, "slider")
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert local_frontier("some/model", 30, "/models/m#abc") is None
            assert local_frontier("some/model", 30, "/models/m#abc") is None
        assert caplog.text.count(f"ignoring the slider profile {path}") == 1 and said in caplog.text, stored
    save_profile("some/model", measured, "slider")
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert local_frontier("some/model", 30, "/models/m#abc").points == []  # the weights it was measured on
    assert "ignoring" not in caplog.text
    # The frontier that ships, damaged (a broken install, or a maintainer's --out over it gone wrong): auto runs the
    # uncalibrated default and says why, where it raised from every load of the embedded model.
    from glimpse.pipeline import loading

    shipped = tmp_path / "shipped.json"
    monkeypatch.setattr(loading, "SHIPPED_FRONTIER", shipped)
    for content in ("{", json.dumps({"weights": embedded.checkpoint_name(), "frontier": [{**point, "e2e_ratio": 0}]})):
        shipped.write_text(content)
        caplog.clear()
        with caplog.at_level("WARNING"):
            frontier = loading.slider_frontier("embedded", 30, "/models/m#abc")
        assert not frontier.calibrated and f"ignoring the frontier that ships, {shipped}" in caplog.text


def test_a_second_calibration_of_the_same_profile_is_refused_before_loading(tmp_path, capsys):
    """Found from outside: two at once measured the same candidates into one state file, and the last to finish
    replaced the other's profile."""
    import fcntl

    from glimpse.cli import main

    out = tmp_path / "slider.json"
    with open(tmp_path / "slider.json.lock", "a") as running:  # what the first calibration holds while it runs
        fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["calibrate", "slider", "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert f"another glimpse calibrate slider is writing {out}" in err and "loading" not in err
    # Once it has ended the next one goes on (here to the model, which does not exist).
    assert main(["calibrate", "slider", "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 1
    assert "another glimpse calibrate" not in capsys.readouterr().err


def test_calibrate_slider_leaves_out_the_policies_named_and_says_so_in_every_promise(deep_checkpoints, media,
                                                                                    tmp_path, capsys):
    """`--leave-out P,Q` measures no candidate that runs P or Q, alone or composed (the embedded model's shipped
    frontier leaves out RLT, whose losses on clips 12 calibration clips could not show), and the profile's
    provenance, which every promise carries, says so."""
    from glimpse.cli import main

    images = tmp_path / "images"
    images.mkdir()
    (images / "a.png").write_bytes(media["image"].read_bytes())
    out = tmp_path / "slider.json"
    first = candidates()[0][0].policy  # what an ordinary run measures first
    kept = [c for c in candidates() if not any(m.policy in (first, "rlt") for m in c)]
    assert main(["calibrate", "slider", "--model", str(deep_checkpoints["llava"]), "--images", str(images),
                 "--budget-minutes", "0.001", "--out", str(out), "--device", "cpu", "--leave-out",
                 f"rlt,{first}"]) == 0
    err = capsys.readouterr().err
    assert f"[1/{len(kept)}] {configuration_name(kept[0])}:" in err
    assert f"{len(candidates()) - len(kept)} candidates not measured" in err
    profile = json.loads(out.read_text())
    assert [p["name"] for p in profile["measured"]] == [configuration_name(kept[0])]
    frontier = Frontier.from_json(profile)
    assert f"those running {' or '.join(sorted(('rlt', first)))} left out" in frontier.source
    assert "left out (--leave-out)" in json.dumps(frontier.promise(1.0))


def test_calibration_measures_token_match_kl_and_kv_against_the_unpruned_answer():
    """The module's definitions: greedy-token match rate over the unpruned answer's tokens, the first-token KL
    KL(p_unpruned || p_policy), and KV bytes as policy / unpruned, on an engine whose candidate answers [5, 7] to
    the unpruned [5, 6], with other first logits and half the KV bytes."""
    from glimpse.pipeline.calibrate_slider import Reference, measure

    unpruned_logits, pruned_logits = torch.tensor([3.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])

    class Pruned(_TimedEngine):
        def generate(self, messages, policy, max_new_tokens, ignore_eos=False):
            result = super().generate(messages, policy, max_new_tokens, ignore_eos)
            if policy == "none":
                return result
            return SimpleNamespace(**{**vars(result), "token_ids": [5, 7], "first_logits": pruned_logits,
                                      "metrics": {**result.metrics, "kv_bytes": 1, "ttft_s": 0.25,
                                                  "decode_tokens_per_s": 20.0}})

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    references = [Reference([5, 6], "Red.", torch.log_softmax(unpruned_logits, -1), 100.0, 2) for _ in prompts]
    point = measure(Pruned((0.9,)), (Member.of("divprune", 0.5),), prompts, references, floor=0.75, answer_tokens=4,
                    timing_prompts=3, timing_tokens=4, typical_answer=64)
    log_p, log_q = torch.log_softmax(unpruned_logits, -1), torch.log_softmax(pruned_logits, -1)
    expected_kl = float(torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum"))
    assert point.token_match == pytest.approx(0.5)
    assert point.first_token_kl == pytest.approx(expected_kl)
    assert point.kv_ratio == pytest.approx(0.5)
    # the time to the end of a typical answer: the first token, then typical_answer - 1 decode steps
    assert point.e2e_ratio == pytest.approx((0.25 + 63 / 20) / (0.5 + 63 / 20))
