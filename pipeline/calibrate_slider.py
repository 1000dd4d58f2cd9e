"""Label-free calibration of the speed slider: the measured speed/quality frontier of one model.

For every candidate configuration (``pruning.frontier.candidates``), on the calibration prompts:

* agreement with the unpruned model, answer by answer (greedy, ``answer_tokens`` at most, EOS
  honoured): the share of answers that are exactly the unpruned model's (what the slider's floor
  is about), the greedy-token match rate over the unpruned answer's tokens, and the first-token KL
  ``KL(p_unpruned || p_policy)``. No labels: the unpruned model is the reference.
* cost, as ratios to the unpruned model measured side by side: the prefill FLOPs proxy and KV bytes
  (exact, summed over the prompts), and the wall time of the first token plus a typical answer of
  ``typical_answer`` tokens, ``ttft + (typical_answer - 1) / decode tokens/s``, from ``timing_prompts``
  prompts each run unpruned then with the candidate (EOS ignored, ``timing_tokens`` decoded), median
  of the per-prompt ratios (a candidate that prunes but times 0-15% slower than unpruned is timed on as
  many prompts again first: that much is the noise of a shared machine). That is the end-to-end time the
  slider promises never rises.

A candidate whose agreement is already far below the floor after half of the prompts (10 or more) is stopped
there (rejected, no timing). The frontier (``pruning.frontier.pareto_frontier``) is stored as the
model's profile beside its ILVAS profile, atomically. Every finished candidate is appended to a
state file next to it first, so an interrupted calibration, rerun with the same arguments, resumes
where it stopped; ``budget_s`` stops starting new candidates once spent and stores the frontier of
what was measured (rerun to measure the rest; every run measures at least one candidate).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from glimpse.assets import ASSETS
from glimpse.common import UserError
from glimpse.pipeline.metrics import decoder_prefill_s
from glimpse.pipeline.prompt import user_message
from glimpse.pruning.frontier import DEFAULT_FLOOR, Frontier, Member, Point, configuration_name, pareto_frontier
from glimpse.vision import MediaError
from glimpse.vision.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

CALIBRATION_DIR = ASSETS / "calibration"  # the label-free set that ships (training/make_calibration_set.py)
SHIPPED_FRONTIER = ASSETS / "embedded_frontier.json"  # the embedded model's calibrated frontier
# Fewer calibration prompts than this: the command says that one changed answer moves an agreement by 100/n points.
STEADY_PROMPTS = 30
DEFAULT_QUESTIONS = {"image": "Describe the image in one sentence.", "video": "Describe the video in one sentence."}
# A pruning candidate timed 0-15% slower end to end than unpruned is timed again before it is judged (``measure``);
# slower than this it is slower (ZipVL's dequantising: 1.3-1.6x).
RETIME_BELOW = 1.15
# Timed faster end to end than this many times what its prefill FLOPs or its KV bytes save, a candidate was timed
# while the machine slowed its unpruned runs (a loaded machine timed ST3 at 1.8x fewer FLOPs 18.8x faster): timed
# again too.
IMPLAUSIBLE_ABOVE = 1.5
EARLY_STOP_MIN_PROMPTS = 10  # a candidate far below the floor stops half-way only if half-way is this many prompts
EARLY_STOP_BELOW = 0.2  # ... and far below is an agreement this much under the floor, at half-way


def shipped_prompts(video: bool) -> list[list[dict]]:
    """The calibration set that ships with Glimpse, as chat messages (clips only if the model takes video)."""
    prompts = []
    for line in (CALIBRATION_DIR / "prompts.jsonl").read_text().splitlines():
        item = json.loads(line)
        kind = "video" if "video" in item else "image"
        if kind == "video" and not video:
            continue
        prompts.append(_messages(kind, str(CALIBRATION_DIR / item[kind]), item["question"]))
    return prompts


def folder_prompts(images: str | None, videos: str | None, prompts_file: str | None, video: bool | None,
                   limit: int | None = None) -> list[list[dict]]:
    """Prompts from the user's media: every image (and video) in the folders, each asked one of the
    questions of ``prompts_file`` (one per line, in turn), or a request for a one-sentence description."""
    questions = []
    if prompts_file:
        try:
            questions = [q.strip() for q in Path(prompts_file).read_text(encoding="utf-8").splitlines() if q.strip()]
        except UnicodeDecodeError:
            raise UserError(f"{prompts_file} is not UTF-8 text (one question per line)") from None
        if not questions:
            raise UserError(f"{prompts_file} holds no question (one per line)")
    media = []
    for folder, kind, suffixes in ((images, "image", IMAGE_EXTENSIONS), (videos, "video", VIDEO_EXTENSIONS)):
        if folder is None:
            continue
        if not Path(folder).is_dir():
            raise UserError(f"--{kind}s must be a folder, got {folder}")
        if kind == "video" and video is False:  # None: not known yet (the model is not loaded)
            raise UserError("this model takes no video: leave out --videos")
        found = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in suffixes)
        if not found:
            raise UserError(f"no {kind} files ({', '.join(sorted(suffixes))}) in {folder}")
        media += [(kind, str(p)) for p in found]
    if not media:  # text questions alone
        return [[{"role": "user", "content": q}] for q in questions[:limit]]
    media = media[:limit]
    return [_messages(kind, path, questions[i % len(questions)] if questions else DEFAULT_QUESTIONS[kind])
            for i, (kind, path) in enumerate(media)]


def _messages(kind: str, path: str, question: str) -> list[dict]:
    return user_message(question, [(kind, path)])


@dataclass
class Reference:
    """The unpruned model's answer to one prompt."""

    tokens: list[int]
    text: str
    log_p: torch.Tensor  # first-token log-probabilities, float32 on the CPU (kept between runs)
    flops: float
    kv_bytes: int


def normalised(text: str) -> str:
    """An answer as compared: case, surrounding space and trailing punctuation do not count."""
    return " ".join(text.lower().split()).rstrip(".!?,;:")


def calibrate_slider(engine, prompts: list[list[dict]], candidates: list[tuple[Member, ...]], *, state_path: Path,
                     floor: float = DEFAULT_FLOOR, answer_tokens: int = 16, timing_prompts: int = 3,
                     timing_tokens: int = 16, typical_answer: int = 64, budget_s: float | None = None,
                     progress: Callable[[str], None] = lambda line: None) -> Frontier:
    start = time.perf_counter()
    # What the measurements depend on (the floor only decides which far-off candidates stop early and how the
    # frontier is read, so a new floor reuses them, but for those it would not stop: below). The weights' identity
    # as well as the model's name (profiles.checkpoint_identity): retrained weights under the same name must not
    # resume from the old weights' measurements.
    settings = {"model": engine.model_id, "checkpoint": engine.checkpoint,
                "answer_tokens": answer_tokens,
                "timing_prompts": timing_prompts, "timing_tokens": timing_tokens, "typical_answer": typical_answer,
                "retime_below": RETIME_BELOW,
                "prompts": hashlib.sha256(json.dumps(prompts, sort_keys=True, default=str).encode()).hexdigest()}
    done = _read_state(state_path, settings)
    usable, references = _references(engine, prompts, answer_tokens, settings, state_path, progress)
    if len(usable) < len(prompts) and len(usable) < STEADY_PROMPTS:  # the count warned about before the skips
        progress(f"{len(prompts) - len(usable)} of {len(prompts)} calibration prompts skipped: {len(usable)} left, so "
                 f"one answer that changes moves a candidate's agreement by {100 / len(usable):.0f} points")
    if done is None:  # a new calibration: only now that its prompts are known to be usable
        done = _start_state(state_path, settings, progress)

    # A candidate stopped half-way under a higher floor is measured again if this floor would not have stopped it
    # (a rerun with --floor 0.4 reused the rejections of 0.75: they were never timed, and the lower floor could never
    # pick them; an outside pass).
    done = {name: point for name, point in done.items() if not _stopped_above(point, floor)}
    todo = [c for c in candidates if configuration_name(c) not in done]
    measured: list[Point] = [done[configuration_name(c)] for c in candidates if configuration_name(c) in done]
    if measured:
        progress(f"resuming: {len(measured)} of {len(candidates)} candidates already measured ({state_path})")
    unmeasured = 0  # left for a rerun by the budget (not those this model cannot run: a rerun skips them again)
    cannot_run = 0
    for done_now, members in enumerate(todo):
        number = len(candidates) - len(todo) + done_now + 1
        # Every run measures at least one candidate, so a rerun always makes progress.
        if done_now and budget_s is not None and time.perf_counter() - start > budget_s:
            unmeasured = len(todo) - done_now
            progress(f"budget spent: {unmeasured} candidates not measured; rerun the same command to measure them")
            break
        name = configuration_name(members)
        t0 = time.perf_counter()
        try:
            point = measure(engine, members, usable, references, floor, answer_tokens, timing_prompts, timing_tokens,
                            typical_answer)
        except KeyboardInterrupt:  # Ctrl-C: what is kept, and how to go on (it said only "interrupted")
            progress(f"interrupted: {len(measured)} of {len(candidates)} candidates measured are kept in {state_path}; "
                     "rerun the same command to measure the rest (the profile is written when a run ends: until "
                     "then auto runs what it ran before)")
            raise
        except UserError as error:  # a configuration this model cannot run (e.g. too shallow for its layers)
            progress(f"[{number}/{len(candidates)}] {name}: skipped, {error}")
            cannot_run += 1
            continue
        measured.append(point)
        with state_path.open("a") as state:
            state.write(json.dumps({"point": point.to_json()}) + "\n")
        verdict = (f"e2e {1 / point.e2e_ratio:.2f}x" if point.e2e_ratio is not None
                   else f"rejected after {point.prompts} prompts")
        progress(f"[{number}/{len(candidates)}] {name}: agreement {point.agreement:.0%}, "
                 f"FLOPs {1 / point.flops_ratio:.2f}x, {verdict} ({time.perf_counter() - t0:.0f} s)")

    device = engine.device.type if engine.device.type != "cuda" else torch.cuda.get_device_name(engine.device)
    # "66 of 71 measured" on a complete run read as unfinished: the candidates this model cannot run are said apart.
    runnable = len(candidates) - cannot_run
    source = (f"calibrated on {len(usable)} prompts, {device}, {time.strftime('%Y-%m-%d')}, "
              f"{len(measured)} of {runnable} candidates measured"
              + (f" ({cannot_run} more that this model cannot run)" if cannot_run else ""))
    return Frontier(pareto_frontier(measured), floor=floor, calibrated=True, source=source,
                    answer_tokens=typical_answer, measured=measured, unmeasured=unmeasured)


def _references(engine, prompts, answer_tokens: int, settings: dict, state_path: Path, progress):
    """The prompts that could be read and the unpruned model's answers to them: computed once and kept beside the
    state file, so that a resumed calibration spends its budget on candidates, not on answering them again."""
    path = state_path.with_name(state_path.name + ".references.pt")
    try:
        kept = torch.load(path, weights_only=True) if path.exists() else None
    except Exception:  # noqa: BLE001 — a file cut short by a kill, or not ours: computed again
        kept = None
    if kept is not None and kept.get("settings") == settings:
        progress(f"unpruned answers to {len(kept['usable'])} calibration prompts: kept from the last run ({path})")
        return ([prompts[i] for i in kept["usable"]],
                [Reference(r["tokens"], r["text"], r["log_p"], r["flops"], r["kv_bytes"]) for r in kept["references"]])
    progress(f"unpruned answers to {len(prompts)} calibration prompts ...")
    references, usable, start = [], [], time.perf_counter()
    for number, messages in enumerate(prompts, start=1):
        try:
            result = engine.generate(messages, policy="none", max_new_tokens=answer_tokens)
        except MediaError as error:  # one unreadable file does not spoil a calibration
            progress(f"  skipped prompt {number}: {error}")
            continue
        usable.append(number - 1)
        log_p = torch.log_softmax(result.first_logits.float().cpu(), -1)
        references.append(Reference(result.token_ids, result.text, log_p, result.metrics["prefill_flops"],
                                    result.metrics["kv_bytes"]))
        if number % 10 == 0 and number < len(prompts):
            progress(f"  {number} of {len(prompts)} ({time.perf_counter() - start:.0f} s)")
    if not usable:
        raise UserError("none of the calibration prompts could be read")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"settings": settings, "usable": usable,
                "references": [{"tokens": r.tokens, "text": r.text, "log_p": r.log_p, "flops": r.flops,
                                "kv_bytes": r.kv_bytes} for r in references]}, tmp)
    tmp.replace(path)
    return [prompts[i] for i in usable], references


def measure(engine, members, prompts, references, floor, answer_tokens, timing_prompts, timing_tokens,
            typical_answer) -> Point:
    """One candidate's agreement and cost (see the module docstring)."""
    same = matches = kl = flops = base_flops = kv = base_kv = 0.0
    counted = 0
    # Half-way, once that is enough prompts to tell: on a handful, one different answer is already about 20 points.
    check_at = len(prompts) // 2 if len(prompts) // 2 >= EARLY_STOP_MIN_PROMPTS else None
    for messages, reference in zip(prompts, references):
        result = engine.generate(messages, policy=engine.configuration(members), max_new_tokens=answer_tokens)
        counted += 1
        same += normalised(result.text) == normalised(reference.text)
        matches += sum(a == b for a, b in zip(reference.tokens, result.token_ids)) / max(1, len(reference.tokens))
        log_q = torch.log_softmax(result.first_logits.float().cpu(), -1)
        kl += float((reference.log_p.exp() * (reference.log_p - log_q)).sum().clamp(min=0.0))
        flops, base_flops = flops + result.metrics["prefill_flops"], base_flops + reference.flops
        kv, base_kv = kv + result.metrics["kv_bytes"], base_kv + reference.kv_bytes
        # Far below the floor at half-way (more than EARLY_STOP_BELOW): not worth the other half and the timing.
        if counted == check_at and same / counted < floor - EARLY_STOP_BELOW:
            break
    common = dict(agreement=same / counted, flops_ratio=flops / base_flops, token_match=matches / counted,
                  first_token_kl=kl / counted, kv_ratio=kv / base_kv, prompts=counted)
    if counted < len(prompts):
        return Point(members, e2e_ratio=None, **common)
    ratios = _timed_ratios(engine, members, prompts[:timing_prompts], timing_tokens, typical_answer)
    timed = statistics.median(r[0] for r in ratios)
    saved = max(base_flops / flops, base_kv / max(kv, 1e-9))  # the most it saves of either
    if (flops < base_flops and 1.0 <= timed < RETIME_BELOW) or 1.0 / timed > IMPLAUSIBLE_ABOVE * saved:
        # It prunes, yet timed a little slower end to end than the unpruned model: on a shared machine a
        # few-second run moves by that much (a calibration on 2026-11-26 timed DivPrune keeping 60% 6% slower,
        # decode included). The frontier drops a point slower than unpruned, so be surer first: as many runs
        # again, on the next prompts, and the median of all. Likewise a speed-up its savings cannot explain.
        more = prompts[timing_prompts:2 * timing_prompts] or prompts[:timing_prompts]
        ratios += _timed_ratios(engine, members, more, timing_tokens, typical_answer)
    e2e, prefill, decode = zip(*ratios)
    e2e_ratio, decode_speedup = statistics.median(e2e), statistics.median(decode)
    if 1.0 / e2e_ratio > IMPLAUSIBLE_ABOVE * saved:
        # Timed again and still faster than its savings explain: the machine's load, not the candidate (an outside
        # pass, with one prompt on a loaded machine, stored LazyLLM at 1.17x fewer FLOPs as 4.83x faster end to end
        # and decoding 7.4x faster). Taken as what its savings allow at most, never more.
        e2e_ratio, decode_speedup = 1.0 / saved, min(decode_speedup, saved)
    return Point(members, e2e_ratio=e2e_ratio, prefill_ratio=statistics.median(prefill),
                 decode_speedup=decode_speedup, **common)


def _stopped_above(point: Point, floor: float) -> bool:
    """Whether ``point`` was stopped half-way (not timed) by a floor higher than ``floor``: its half-way agreement
    would not stop it under ``floor``."""
    return point.e2e_ratio is None and point.agreement >= floor - EARLY_STOP_BELOW


def _timed_ratios(engine, members, prompts, timing_tokens, typical_answer) -> list[tuple[float, float, float]]:
    """Per prompt, the candidate against the unpruned model run just before it: end-to-end time, decoder-prefill
    time and decode tokens/s ratios."""
    ratios = []
    for messages in prompts:
        base = engine.generate(messages, policy="none", max_new_tokens=timing_tokens, ignore_eos=True).metrics
        run = engine.generate(messages, policy=engine.configuration(members), max_new_tokens=timing_tokens,
                              ignore_eos=True).metrics
        ratios.append((_end_to_end(run, typical_answer) / _end_to_end(base, typical_answer),
                       decoder_prefill_s(run) / decoder_prefill_s(base),
                       run["decode_tokens_per_s"] / base["decode_tokens_per_s"]))
    return ratios


def _end_to_end(metrics: dict, answer: int) -> float:
    """Seconds to the end of an ``answer``-token reply: first token, then ``answer - 1`` decode steps."""
    return metrics["ttft_s"] + (answer - 1) / metrics["decode_tokens_per_s"]


def _read_state(path: Path, settings: dict) -> dict[str, Point] | None:
    """Candidates already measured with the same settings and prompts (a resumed calibration); None: no state
    file of these settings (nothing is changed on disk here: the prompts may yet prove unreadable)."""
    if not path.exists():
        return None
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if header != {"settings": settings}:
        return None
    if not text.endswith("\n"):  # a line cut short by a kill: end it, so appends start clean
        with path.open("a") as state:
            state.write("\n")
    done = {}
    for line in lines[1:]:
        try:
            point = Point.from_json(json.loads(line)["point"])
        except (ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError, as Point.check's
            continue  # a line cut short by a kill (or not a measurement): that candidate is measured again
        done[point.name] = point
    return done


def _what_differs(path: Path, settings: dict) -> str:
    """What an old state file was measured with that this run is not: "of other weights", "with other prompts", ...
    (a tester whose weights had changed was told "other settings or prompts")."""
    try:
        old = json.loads(path.read_text(errors="replace").splitlines()[0])["settings"]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        return "with other settings or prompts"
    if old.get("model") != settings["model"]:
        return "of another model"
    if old.get("checkpoint") != settings["checkpoint"]:
        return "of other weights"
    if old.get("prompts") != settings["prompts"]:
        return "with other prompts"
    changed = sorted(key for key in settings if old.get(key) != settings[key])
    return f"with other settings ({', '.join(changed)})" if changed else "with other settings or prompts"


def _start_state(path: Path, settings: dict, progress) -> dict[str, Point]:
    """A new state file for these settings. One of other settings that holds measurements is kept under a name of
    its own (never over an earlier one kept the same way): it may be the only copy of hours of measurements."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and len(path.read_text(errors="replace").splitlines()) > 1:
        kept = next(candidate for n in range(1, 10_000)
                    if not (candidate := path.with_name(f"{path.name}.previous{'' if n == 1 else f'-{n}'}")).exists())
        differs = _what_differs(path, settings)
        path.replace(kept)
        progress(f"{path} holds a calibration {differs}: starting afresh (the old one is {kept})")
    path.write_text(json.dumps({"settings": settings}) + "\n")
    return {}
