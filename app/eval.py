"""`glimpse eval`: answer quality of each pruning policy against the unpruned model, same inputs.

Three tasks:

* ``agreement`` (any model): on a fixed set of prompts — a synthesized image, a synthesized video
  when the model takes video, and text questions — each policy at each speed is compared with the
  unpruned model (policy ``none``):
  - greedy-token match rate: the share of the unpruned answer's positions where the pruned answer
    (greedy, ``new_tokens`` long, EOS ignored) has the same token;
  - first-token KL: ``KL(p_none || p_policy)`` of the next-token distributions after prefill.
  Speed 0 is exact for every policy, so its match rate is 1 and its KL 0 (the smoke test checks).
* ``passkey`` (text, real weights): long-context pass-key retrieval with the embedded model's
  SmolLM2-135M-Instruct. A five-digit key sits at a random depth of filler text of about 512, 1024
  or 2048 tokens; the answer counts as correct when the key's digits appear in it. Policies that
  prune text: DASH, ZipVL, LazyLLM and FastV's text adaptation (``text=True``).

* ``visual`` (the embedded model, or any model that reads the shapes): the held-out split of the generated
  visual task set (``app/tasks.py``; seed 1 unless ``--seed`` says otherwise, never the training
  seed 0): ``--samples`` questions per category — colour, shape, count, position, size, exists, word on
  images; motion, appear, change on clips — each image written as a PNG and each clip as an .mp4 and asked
  through the ordinary chat path. Accuracy per category, plus the measured visual-token reduction (the
  share of visual token-layers the policy removed from prefill) and the prefill FLOPs-proxy speedup.

All report, per policy and speed, the TTFT speedup of the same runs (summed baseline TTFT over
summed policy TTFT: single runs, for the plot's x axis; ``glimpse bench`` is the timing tool). One untimed answer
of each kind of prompt (text, image, video) runs first: a process's first run of a kind pays one-time costs
(kernels, buffers and the vision encoder's first call) that made the timed baseline after it look slow — DASH
read "24x" on a 64-token prompt it cannot prune, and policies at speed 0, which run exactly as the baseline,
"1.5x".
Output: a table, ``--json``, and ``--plot FILE.png`` (TTFT speedup on x, quality on y, one curve per
policy over the speeds).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch

from glimpse.bench import FILLER, device_name, synthesize_prompts
from glimpse.common import UserError
from glimpse.pipeline.calibrate_slider import normalised
from glimpse.pipeline.prompt import user_message
from glimpse import tasks, vision

TEXT_QUESTIONS = ["Explain in a few sentences why the sky is blue.",
                  "Write a short story about a lighthouse keeper and a storm."]


def policy_for(engine, name: str, speed: float, text_task: bool, overrides: dict | None = None):
    """The pruned policies' configuration: ``overrides`` (``--param``) on top; the unpruned reference never gets them."""
    if name == "none":
        return engine.make_policy(name, speed)
    params = dict(overrides or {})
    if text_task and name == "fastv":
        params.setdefault("text", True)  # FastV prunes only visual tokens; on text, its text adaptation (DASH's appendix)
    return engine.make_policy(name, speed, params or None)


# ------------------------------------------------------------------------------------ agreement
def agreement_prompts(engine, folder: Path, image_tokens: int = 256, video_tokens: int = 512) -> dict[str, list]:
    prompts = synthesize_prompts(engine, folder, image_tokens, video_tokens if engine.adapter.supports_video else 0)
    for i, question in enumerate(TEXT_QUESTIONS):
        prompts[f"text{i + 1}"] = [{"role": "user", "content": question}]
    return prompts


WARM_UP_TOKENS = 2
# How often the visual task says how far through a configuration's questions it is: a 200-question run of the
# documented command said nothing for 36 minutes on a busy 2-core machine (an outside pass), only a line at the end
# of each configuration.
PROGRESS_EVERY_S = 30.0


def warm_up(engine, conversations) -> None:
    """One untimed answer of the first conversation of each kind (text only, with an image, with a video), so that
    no timed run pays the first-use costs."""
    seen = set()
    for messages in conversations:
        kinds = frozenset(item.get("type") for message in messages if isinstance(message["content"], list)
                          for item in message["content"]) - {"text"}
        if kinds not in seen:
            seen.add(kinds)
            engine.generate(messages, policy="none", max_new_tokens=WARM_UP_TOKENS)


def first_token_distribution(engine, messages, policy) -> torch.Tensor:
    with torch.inference_mode():
        logits, _ = engine.prefill(engine.prepare(messages), policy)
    return torch.log_softmax(logits.float(), dim=-1)


def run_agreement(engine, prompts: dict[str, list], policies: list[str], speeds: list[float],
                  new_tokens: int = 32, progress=lambda line: None) -> dict:
    # EOS ignored: every answer is new_tokens long, so positions are comparable.
    rows, interrupted = [], False
    try:
        warm_up(engine, prompts.values())
        baseline = {}
        for kind, messages in prompts.items():
            result = engine.generate(messages, policy="none", max_new_tokens=new_tokens, ignore_eos=True)
            baseline[kind] = (result, first_token_distribution(engine, messages, engine.make_policy("none")))
        for name in policies:
            for speed in speeds:
                matches, kls, base_ttft, ttft = [], [], 0.0, 0.0
                for kind, messages in prompts.items():
                    reference, log_p = baseline[kind]
                    text_task = kind.startswith("text")
                    result = engine.generate(messages, policy=policy_for(engine, name, speed, text_task),
                                             max_new_tokens=new_tokens, ignore_eos=True)
                    same = sum(a == b for a, b in zip(reference.token_ids, result.token_ids))
                    matches.append(same / len(reference.token_ids))
                    log_q = first_token_distribution(engine, messages, policy_for(engine, name, speed, text_task))
                    kls.append(float((log_p.exp() * (log_p - log_q)).sum().clamp(min=0.0)))
                    base_ttft += reference.metrics["ttft_s"]
                    ttft += result.metrics["ttft_s"]
                rows.append({"policy": name, "speed": speed, "match_rate": sum(matches) / len(matches),
                             "first_token_kl": sum(kls) / len(kls), "ttft_speedup": base_ttft / ttft,
                             "per_prompt": dict(zip(prompts, matches))})
                progress(f"{name} @ {speed:g}: match {rows[-1]['match_rate']:.3f}, "
                         f"KL {rows[-1]['first_token_kl']:.4f}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the rows finished by then are the report, said to be partial
        interrupted = True
    return {"task": "agreement", "device": device_name(engine), "prompts": list(prompts), "new_tokens": new_tokens,
            "rows": rows, "interrupted": interrupted}


# ------------------------------------------------------------------------------------ pass-key
def passkey_prompt(tokenizer, target_tokens: int, key: int, depth: float) -> list[dict]:
    """A pass-key retrieval question about ``target_tokens`` tokens long, the key at ``depth`` in [0, 1]."""
    intro = "There is an important pass key hidden inside a lot of irrelevant text. Find it and remember it.\n"
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key? Answer with the number only."
    per_filler = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    fixed = len(tokenizer(intro + needle + question, add_special_tokens=False).input_ids)
    repeats = max(1, (target_tokens - fixed) // per_filler)
    before = round(repeats * depth)
    text = intro + FILLER * before + needle + FILLER * (repeats - before) + question
    return [{"role": "user", "content": text}]


def passkey_cases(tokenizer, lengths: list[int], samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for i in range(samples):
            key, depth = rng.randint(10000, 99999), (i + 0.5) / samples  # depths spread evenly
            cases.append({"length": length, "key": key, "depth": depth,
                          "messages": passkey_prompt(tokenizer, length, key, depth)})
    return cases


def run_passkey(engine, lengths: list[int], samples: int, policies: list[str], speeds: list[float], seed: int = 0,
                new_tokens: int = 12, progress=lambda line: None, overrides: dict | None = None) -> dict:
    cases = passkey_cases(engine.tokenizer, lengths, samples, seed)
    configs = [("none", 0.0)] + [(name, speed) for name in policies for speed in speeds]
    warm_up(engine, [case["messages"] for case in cases])
    rows, base_ttft, interrupted = [], {}, False
    try:
        for name, speed in configs:
            for length in lengths:
                correct, ttft = 0, 0.0
                for case in (c for c in cases if c["length"] == length):
                    result = engine.generate(case["messages"], policy=policy_for(engine, name, speed, True, overrides),
                                             max_new_tokens=new_tokens)
                    correct += str(case["key"]) in result.text
                    ttft += result.metrics["ttft_s"]
                if name == "none":
                    base_ttft[length] = ttft
                rows.append({"policy": name, "speed": speed, "length": length, "accuracy": correct / samples,
                             "ttft_speedup": base_ttft[length] / ttft})
                progress(f"{name} @ {speed:g}, {length} tokens: accuracy {correct}/{samples}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the rows finished by then are the report, said to be partial
        interrupted = True
    return {"task": "passkey", "device": device_name(engine), "lengths": lengths, "samples": samples, "seed": seed,
            "rows": rows, "params": overrides or {}, "interrupted": interrupted}


# ------------------------------------------------------------------------------------ visual task
def visual_cases(folder: Path, samples: int, seed: int, video: bool, categories: tuple[str, ...] | None = None,
                 styled: float = 0.0) -> list[dict]:
    """`samples` held-out questions of each category (default: every image category, and every clip category when
    the model takes video), the media written into `folder`, as chat messages; a `styled` share of the scenes and
    clips drawn with a look of other pictures (`tasks.stylise`)."""
    if categories is None:
        categories = tasks.IMAGE_CATEGORIES + (tasks.VIDEO_CATEGORIES if video else ())
    cases = []
    for i, (item, qa) in enumerate(tasks.heldout_set(seed, samples, categories, styled)):
        if item.is_video:
            media = ("video", str(tasks.write_clip(item.frames, folder / f"{i:04d}.mp4")))
        else:
            item.frames[0].save(folder / f"{i:04d}.png")
            media = ("image", str(folder / f"{i:04d}.png"))
        cases.append({"qa": qa, "messages": user_message(qa.question, [media]), "video": item.is_video})
    return cases


def visual_reduction(metrics: dict) -> float:
    """The share of visual token-layers that prefill did not compute (0 unpruned, 1 nothing computed)."""
    depth, layers = metrics["keep_map"]["depth"], metrics["keep_map"]["num_layers"]
    return 1.0 - sum(depth) / (len(depth) * layers) if depth else 0.0


UNCATEGORISED = "uncategorised"  # the category of a question file's line that names none


def read_questions(path: str | Path, video: bool = True) -> list[dict]:
    """Cases from a question file of the user's: JSON lines of {"image": PATH} or {"video": PATH}, "question",
    "answer" and optionally "category" (else "uncategorised"; not "all", the overall score's column: a line without
    one made a second "all" column, an outside pass); a path relative to the file's folder. Right is judged as on
    the generated set (`tasks.is_correct`: the reply's first words are the answer's). Every line and every file it
    names is checked before a model runs — each image decoded whole, each video's container read — and the error
    names every line that cannot be asked, so that one fix of the file serves, and no evaluation stops half way
    on a truncated picture."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--questions {path}: cannot read it ({error})") from None
    cases, problems = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            cases.append(_question_case(line, path.parent, video))
        except UserError as error:
            problems.append(f"line {number}: {error}")
    if problems:
        shown = problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more lines"]
                                               if len(problems) > MAX_PROBLEMS_SHOWN else [])
        raise UserError(f"--questions {path}, " + ("\n  ".join(shown) if len(problems) == 1 else
                                                    f"{len(problems)} lines cannot be asked:\n  " + "\n  ".join(shown)))
    if not cases:
        raise UserError(f"--questions {path}: no questions in it")
    return cases


MAX_PROBLEMS_SHOWN = 10  # of a question file's bad lines, in its error


def _question_case(line: str, folder: Path, video: bool) -> dict:
    """One line of a question file as a case; a `UserError` saying what is wrong with it."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"not JSON ({error.msg})") from None
    if not isinstance(entry, dict):
        raise UserError("a line is a JSON object")
    kinds = [k for k in ("image", "video") if k in entry]
    texts = {k: entry.get(k) for k in ("question", "answer")}
    if len(kinds) != 1 or not all(isinstance(v, str) and v.strip() for v in texts.values()):
        raise UserError('a line has one of "image" or "video" (a path), and "question" and "answer" (text)')
    kind = kinds[0]
    if kind == "video" and not video:
        raise UserError("this model takes no video")
    media = entry[kind]
    if not isinstance(media, str) or not media:
        raise UserError(f'"{kind}" is a path')
    category = entry.get("category", UNCATEGORISED)
    if not isinstance(category, str) or not category:
        raise UserError('"category" is a name')
    if category == "all":
        raise UserError('"category" "all" names the score over every question: name the category otherwise')
    media_path = Path(media) if Path(media).is_absolute() else folder / media
    if not media_path.is_file():
        raise UserError(f"{media_path} is not a file")
    if kind == "image":
        vision.load_image(media_path)  # decoded whole: a truncated picture is refused here, not mid-evaluation
    else:
        vision.check_media(media_path, kind)  # its container and stream; frames are read when it is asked
    return {"qa": tasks.QA(category, texts["question"], texts["answer"]),
            "messages": user_message(texts["question"], [(kind, str(media_path))]), "video": kind == "video"}


def run_visual(engine, samples: int, policies: list[str], speeds: list[float], seed: int = tasks.HELDOUT_SEED,
               new_tokens: int = 8, progress=lambda line: None, categories: tuple[str, ...] | None = None,
               overrides: dict | None = None, styled: float = 0.0, questions: str | Path | None = None) -> dict:
    """Accuracy of each configuration on the generated held-out set of `seed` (`samples` per category, a `styled`
    share drawn with other looks), or on a question file of the user's (`questions`, `read_questions`)."""
    with tempfile.TemporaryDirectory(prefix="glimpse-visual-") as tmp:
        if questions is not None:
            cases = read_questions(questions, engine.adapter.supports_video)
        else:
            cases = visual_cases(Path(tmp), samples, seed, engine.adapter.supports_video, categories, styled)
        categories = list(dict.fromkeys(c["qa"].category for c in cases))
        asked = {c: sum(case["qa"].category == c for case in cases) for c in categories}
        configs = [("none", 0.0)] + [(name, speed) for name in policies for speed in speeds]
        warm_up(engine, [case["messages"] for case in cases])
        rows, base_ttft, interrupted = [], 0.0, False
        try:
            for name, speed in configs:
                ttft = flops = flops_base = 0.0
                reductions, answers, right = [], [], []
                params = overrides if name != "none" else None
                promise = engine.promise(name, speed, params)  # what auto picked at this speed, calibrated or not
                configuration = promise["configuration"]
                said_at = time.monotonic()
                for number, case in enumerate(cases):
                    if number and time.monotonic() - said_at >= PROGRESS_EVERY_S:
                        progress(f"{name} @ {speed:g}: {number} of {len(cases)} questions asked")
                        said_at = time.monotonic()
                    result = engine.generate(case["messages"], policy=policy_for(engine, name, speed, False, overrides),
                                             max_new_tokens=new_tokens)
                    right.append(tasks.is_correct(result.text, case["qa"]))
                    answers.append(result.text)
                    metrics = result.metrics
                    ttft += metrics["ttft_s"]
                    flops += metrics["prefill_flops"]
                    flops_base += metrics["prefill_flops_baseline"]
                    reductions.append(visual_reduction(metrics))
                if name == "none":
                    base_ttft = ttft
                    reference = answers
                accuracy = {c: sum(r for r, case in zip(right, cases) if case["qa"].category == c) / asked[c]
                            for c in categories}
                by_kind = {kind: [r for r, case in zip(right, cases) if case["video"] == kind]
                           for kind in (False, True)}
                agreement = sum(_same_answer(a, b) for a, b in zip(answers, reference)) / len(cases)
                rows.append({"policy": name, "speed": speed, "accuracy": sum(right) / len(cases),
                             "agreement": agreement, "configuration": configuration,
                             "calibrated": promise["calibrated"],
                             "image_accuracy": sum(by_kind[False]) / len(by_kind[False]) if by_kind[False] else None,
                             "video_accuracy": sum(by_kind[True]) / len(by_kind[True]) if by_kind[True] else None,
                             "per_category": accuracy, "visual_reduction": sum(reductions) / len(reductions),
                             "flops_speedup": flops_base / flops, "ttft_speedup": base_ttft / ttft,
                             "answers": answers})
                progress(f"{name} @ {speed:g}: accuracy {rows[-1]['accuracy']:.0%}, "
                         f"visual tokens removed {rows[-1]['visual_reduction']:.0%}")
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the rows finished by then are the report, said to be partial
            interrupted = True
        listed = [{"category": c["qa"].category, "question": c["qa"].question, "answer": c["qa"].answer}
                  for c in cases]
    source = {"questions": str(questions)} if questions is not None else {"seed": seed, "samples": samples,
                                                                          "styled": styled}
    return {"task": "visual", "device": device_name(engine), **source, "asked": asked,
            "categories": categories, "questions": listed, "rows": rows, "params": overrides or {},
            "interrupted": interrupted}


def _label(row: dict) -> str:
    """A table's policy cell: auto names the configuration it ran."""
    if row["policy"] == "auto" and row.get("configuration"):
        return f"auto ({row['configuration']}{'' if row.get('calibrated') else ', uncalibrated'})"
    return row["policy"]


def _same_answer(a: str, b: str) -> bool:
    """The label-free agreement calibration measures: the same answer as the unpruned model's."""
    return normalised(a) == normalised(b)


# ------------------------------------------------------------------------------------ output
def format_table(report: dict) -> str:
    if report["task"] == "visual":
        cats = report["categories"]
        lines = ["| policy | speed | visual tokens removed | FLOPs speedup | TTFT speedup | same answer as none | all | "
                 + " | ".join(cats) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(cats)]
        lines += [f"| {_label(r)} | {r['speed']:g} | {r['visual_reduction']:.0%} | {r['flops_speedup']:.2f}x | "
                  f"{r['ttft_speedup']:.2f}x | {r['agreement']:.0%} | {r['accuracy']:.0%} | "
                  + " | ".join(f"{r['per_category'][c]:.0%}" for c in cats) + " |" for r in report["rows"]]
    elif report["task"] == "agreement":
        lines = ["| policy | speed | greedy match | first-token KL | TTFT speedup |", "|---|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['speed']:g} | {r['match_rate']:.3f} | {r['first_token_kl']:.4f} | "
                  f"{r['ttft_speedup']:.2f}x |" for r in report["rows"]]
    else:
        lines = ["| policy | speed | " + " | ".join(f"{n} tokens" for n in report["lengths"]) + " |",
                 "|---|---|" + "---|" * len(report["lengths"])]
        keys = []
        for r in report["rows"]:
            if (r["policy"], r["speed"]) not in keys:
                keys.append((r["policy"], r["speed"]))
        for name, speed in keys:
            cells = [f"{r['accuracy']:.0%} ({r['ttft_speedup']:.2f}x)" for r in report["rows"]
                     if (r["policy"], r["speed"]) == (name, speed)]
            lines.append(f"| {name} | {speed:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> None:
    """TTFT speedup on x, match rate (agreement) or accuracy (pass-key: mean over lengths; visual: all
    categories) on y; the unpruned model is the single point "none" at 1x, the level to keep."""
    from glimpse.plot import line_plot

    quality = "match_rate" if report["task"] == "agreement" else "accuracy"
    points: dict[tuple[str, float], list[dict]] = {}
    for r in report["rows"]:
        points.setdefault((r["policy"], r["speed"]), []).append(r)
    series: dict[str, list[tuple[float, float]]] = {}
    for (name, _), rs in points.items():
        series.setdefault(name, []).append((sum(r["ttft_speedup"] for r in rs) / len(rs),
                                            sum(r[quality] for r in rs) / len(rs)))
    line_plot(series, path, title=f"glimpse eval {report['task']}", xlabel="TTFT speedup",
              ylabel=quality.replace("_", " "))


def agreement_with_synthesized_media(engine, policies, speeds, new_tokens, image_tokens, video_tokens, progress):
    with tempfile.TemporaryDirectory(prefix="glimpse-eval-") as tmp:
        prompts = agreement_prompts(engine, Path(tmp), image_tokens, video_tokens)
        return run_agreement(engine, prompts, policies, speeds, new_tokens, progress)
