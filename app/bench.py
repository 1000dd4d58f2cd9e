"""`glimpse bench`: speed and memory of each pruning policy against the unpruned baseline, in one run.

How it measures (SPEC, "How results are measured"): one process, one loaded model, the same prompt
for every configuration. Per prompt, ``warmup`` untimed rounds run the baseline and every candidate
once each; then ``runs`` timed rounds run, for each candidate (policy, speed) in turn, the baseline
(``policy="none"``) immediately followed by that candidate::

    round r:  none, dash@0.5, none, dash@0.8, none, zipvl@0.5, ...

so every candidate run has its own baseline run right before it, and slow drift of the machine
(thermal state, other load) hits both sides of a pair alike. A candidate's ratios use the median of
its own ``runs`` candidate runs against the median of the ``runs`` baseline runs paired with them.

Each run is ``engine.generate(messages, policy=name, speed=s, max_new_tokens=1, do_sample=False)``,
i.e. one request up to its first token, read through ``result.metrics``:

- TTFT speedup: median baseline ``ttft_s`` / median candidate ``ttft_s`` (request to first token:
  media loading and preprocessing, vision encoder, decoder prefill).
- decoder-prefill speedup: the same for ``prefill_s - vision_encoder_s``, the part pruning acts on
  (``vision_encoder_s`` counts as 0 when the engine does not report it).
- FLOPs speedup: ``prefill_flops_baseline / prefill_flops`` (the SPEC's proxy, decoder layers only).
- realised fraction: decoder-prefill speedup / FLOPs speedup (1.0 = the whole proxy saving realised).
- own cost: the candidate's decoder prefill minus the baseline's divided by the FLOPs speedup, in seconds: the
  time the FLOPs it saves do not explain (its scoring, cuts, gathers, host waits). On a GPU it is what decides
  whether pruning pays on a short prompt, where a few tens of milliseconds are the whole decoder prefill; there
  it also counts that a layer over a few hundred tokens is not proportionally faster than over more.
- KV ratio: candidate ``kv_bytes`` / baseline ``kv_bytes``.
- peak memory: on CUDA the peak allocated during the request (weights included), as a ratio, plus the
  ratio of the request's own working memory (peak minus what was allocated before the request); on
  CPU the process's peak resident set during the request (reset per request, on Linux): the whole process's,
  weights and caches included, so reported but never turned into a ratio.

Absolute times are only a claim on a GPU, with the device named (the report names it).
"""

from __future__ import annotations

import gc
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glimpse.common import UserError
from glimpse.pipeline.metrics import decoder_prefill_s
from glimpse.pipeline.prompt import user_message
from glimpse.pruning.base import check_speed

BASELINE = "none"
DEFAULT_SPEEDS = [0.5, 0.8]
ORDER = ("per prompt: warm-up rounds (baseline then each candidate, untimed), then timed rounds in which "
         "every candidate run directly follows its own baseline run: none, c1, none, c2, ...; ratios use "
         "the median of a candidate's runs over the median of the baseline runs paired with them")
# Filler sentences for long text prompts (the pass-key task hides its key in them too).
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DEFAULT_QUESTIONS = {"image": "Describe the image in detail.", "video": "Describe the video in detail."}


class BenchError(UserError):
    """A benchmark request that cannot run (unknown policy, bad speed, nothing to measure)."""


# ---------------------------------------------------------------------------------------- policies
def available_policies() -> list[str]:
    from glimpse.pruning import NAMES

    return list(NAMES)


def check_policies(policies: list[str], speeds: list[float]) -> None:
    """Fail early, before any model is loaded, on a policy the registry does not know or a bad speed."""
    from glimpse.pruning import make_policy

    if not policies:
        raise BenchError("no policies to benchmark")
    if not speeds:
        raise BenchError("no speeds to benchmark")
    for speed in speeds:
        try:
            check_speed(speed)
        except (UserError, TypeError):
            raise BenchError(f"speed must be a number in [0, 1], got {speed!r}") from None
    for name in policies:
        for speed in speeds:
            try:
                make_policy(name, speed)
            except UserError as error:
                if name not in available_policies():
                    raise BenchError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None
                raise BenchError(f"policy {name!r} at speed {speed}: {error}") from None


# ------------------------------------------------------------------------------------------ device
def device_name(engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    return f"CPU ({torch.get_num_threads()} threads, {_cpu_model()})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"


# --------------------------------------------------------------------------------------- the runs
def run_bench(engine, prompts: dict[str, list], policies: list[str], speeds: list[float], runs: int = 3,
              warmup: int = 1, progress: Callable[[str], None] | None = None, model: str | None = None,
              new_tokens: int = 1, keep_on_interrupt: bool = False) -> dict:
    """Measure every (policy, speed) against the baseline on every prompt; return the report.

    ``prompts`` maps a name ("image", "video", ...) to chat ``messages``. The report is a JSON-ready
    dict: ``device``, ``dtype``, ``attn``, ``runs``, ``warmup``, ``order``, ``prompts`` (token counts
    and baseline medians per prompt), ``rows`` (one per prompt x policy x speed, in that order; ``none``, the
    baseline against itself, once per prompt at speed 0) and
    ``log`` (every run in the order it ran: prompt, policy, speed, role baseline|candidate, phase
    warmup|timed, round, and its measurements). ``keep_on_interrupt``: Ctrl-C returns the report of the runs done
    (``interrupted`` true; rows for the candidates with a timed pair) instead of raising.
    """
    if runs < 1:
        raise BenchError("runs must be at least 1")
    if warmup < 0:
        raise BenchError("warmup must be at least 0")
    if not prompts:
        raise BenchError("no prompts to benchmark")
    if new_tokens < 1:
        raise BenchError("new_tokens must be at least 1")
    check_policies(policies, speeds)
    progress = progress or (lambda line: None)
    # The baseline asked for as a candidate has no speed: it runs once, at 0, against itself (its row is the
    # run-to-run noise of the measurement), not once per speed as identical rows.
    candidates = list(dict.fromkeys((name, 0.0 if name == BASELINE else float(speed))
                                    for name in policies for speed in speeds))
    per_prompt = warmup * (1 + len(candidates)) + runs * 2 * len(candidates)
    total, done = per_prompt * len(prompts), 0
    cuda = engine.device.type == "cuda"

    log, rows, prompt_info = [], [], {}
    vision_timed = True

    def summarise(prompt_name, counts, pairs) -> None:
        """The prompt's rows, from the timed pairs there are (all of them, or those done before a Ctrl-C)."""
        baseline_runs = [b for c in candidates for b, _ in pairs[c]]
        if baseline_runs:
            prompt_info[prompt_name]["baseline"] = _summary(baseline_runs, cuda)
        for name, speed in candidates:
            if pairs[(name, speed)]:
                rows.append(_row(prompt_name, name, speed, counts, pairs[(name, speed)], cuda))

    interrupted, pending = False, None
    try:
        for prompt_name, messages in prompts.items():
            counts = engine.prepare(messages).token_counts()
            prompt_info[prompt_name] = {"prompt_tokens": counts, "total_tokens": sum(counts.values())}
            progress(f"{prompt_name}: {sum(counts.values())} prompt tokens ("
                     + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")

            def one(policy: str, speed: float, role: str, phase: str, round_index: int) -> dict:
                nonlocal done, vision_timed
                done += 1
                label = "none (baseline)" if role == "baseline" else f"{policy}@{speed:g}"
                stage = "warm-up" if phase == "warmup" else f"round {round_index + 1}/{runs}"
                progress(f"[{done}/{total}] {prompt_name} {label} {stage} ...")
                record = _measure(engine, messages, policy, speed, cuda, new_tokens)
                vision_timed = vision_timed and record.pop("vision_timed")
                record.update(prompt=prompt_name, policy=policy, speed=speed, role=role, phase=phase,
                              round=round_index)
                log.append(record)
                return record

            pairs: dict[tuple[str, float], list[tuple[dict, dict]]] = {c: [] for c in candidates}
            pending = (prompt_name, counts, pairs)
            for w in range(warmup):
                one(BASELINE, 0.0, "baseline", "warmup", w)
                for name, speed in candidates:
                    one(name, speed, "candidate", "warmup", w)
            for r in range(runs):
                for name, speed in candidates:
                    base = one(BASELINE, 0.0, "baseline", "timed", r)
                    cand = one(name, speed, "candidate", "timed", r)
                    pairs[(name, speed)].append((base, cand))
            pending = None
            summarise(prompt_name, counts, pairs)
    except KeyboardInterrupt:  # Ctrl-C in `glimpse bench`: a report of what was measured, said to be partial
        if not keep_on_interrupt:  # a caller of its own (the GPU suite) stops as it always did
            raise
        interrupted = True
        if pending is not None:
            summarise(*pending)

    return {
        "device": device_name(engine),
        "device_type": engine.device.type,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "attn": engine.attn_implementation,
        "model": model or engine.model_id,
        "num_layers": len(engine.adapter.layers),
        "policies": list(policies),
        "speeds": [float(s) for s in speeds],
        "runs": runs,
        "warmup": warmup,
        "new_tokens": new_tokens,
        "order": ORDER,
        "vision_encoder_timed": vision_timed,
        "prompts": prompt_info,
        "rows": rows,
        "log": log,
        "interrupted": interrupted,  # Ctrl-C: rows only for what had a timed pair by then
    }


def _measure(engine, messages, policy: str, speed: float, cuda: bool, new_tokens: int = 1) -> dict:
    gc.collect()  # outside the engine's clocks: keeps a collection from landing inside a timed run
    before = torch.cuda.memory_allocated(engine.device) if cuda else None
    # EOS ignored: every run decodes exactly new_tokens, so decode speeds are comparable.
    start = time.perf_counter()
    result = engine.generate(messages, policy=policy, speed=speed, max_new_tokens=new_tokens, do_sample=False,
                             ignore_eos=True)
    e2e_s = time.perf_counter() - start  # as a user waits for the whole answer: prompt building to last token
    m = result.metrics
    vision = m.get("vision_encoder_s")
    vision_s = float(vision) if vision is not None else 0.0
    record = {
        "ttft_s": float(m["ttft_s"]),
        "e2e_s": e2e_s,
        "prefill_s": float(m["prefill_s"]),
        "vision_encoder_s": vision_s,
        "decoder_prefill_s": decoder_prefill_s(m),  # what the layer loop did not spend waiting for the encoder
        "prefill_flops": int(m["prefill_flops"]),
        "prefill_flops_baseline": int(m["prefill_flops_baseline"]),
        "kv_bytes": int(m["kv_bytes"]),
        "peak_memory_bytes": int(m["peak_memory_bytes"]),
        "decode_tokens_per_s": m["decode_tokens_per_s"],
        "active_tokens_per_layer": list(m["active_tokens_per_layer"]),
        "params": result.params,
        "vision_timed": vision is not None,
    }
    if cuda:
        record["request_memory_bytes"] = int(m["peak_memory_bytes"]) - int(before)
    return record


def _median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def _summary(records: list[dict], cuda: bool) -> dict:
    out = {key: _median(records, key) for key in ("ttft_s", "e2e_s", "prefill_s", "vision_encoder_s",
                                                  "decoder_prefill_s", "prefill_flops", "kv_bytes")}
    out["peak_memory_bytes"] = _median(records, "peak_memory_bytes") if cuda else max(
        r["peak_memory_bytes"] for r in records)
    if cuda:
        out["request_memory_bytes"] = _median(records, "request_memory_bytes")
    for key in ("ttft_s", "decoder_prefill_s"):  # the spread behind each median
        out[f"{key}_min"] = min(r[key] for r in records)
        out[f"{key}_max"] = max(r[key] for r in records)
    rates = [r["decode_tokens_per_s"] for r in records if r.get("decode_tokens_per_s")]
    out["decode_tokens_per_s"] = statistics.median(rates) if rates else None
    out["runs"] = len(records)
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _row(prompt: str, policy: str, speed: float, counts: dict, pairs: list[tuple[dict, dict]], cuda: bool) -> dict:
    base = _summary([b for b, _ in pairs], cuda)
    cand = _summary([c for _, c in pairs], cuda)
    cands = [c for _, c in pairs]
    flops_baseline = _median(cands, "prefill_flops_baseline")
    flops = cand["prefill_flops"]
    ttft_speedup = _ratio(base["ttft_s"], cand["ttft_s"])
    prefill_speedup = _ratio(base["decoder_prefill_s"], cand["decoder_prefill_s"])
    flops_speedup = _ratio(flops_baseline, flops)
    row = {
        "prompt": prompt,
        "policy": policy,
        "speed": speed,
        "params": cands[-1]["params"],
        "prompt_tokens": counts,
        "runs": len(pairs),
        "ttft_s": cand["ttft_s"],
        "baseline_ttft_s": base["ttft_s"],
        "ttft_speedup": ttft_speedup,
        "ttft_range_s": [cand["ttft_s_min"], cand["ttft_s_max"]],
        "baseline_ttft_range_s": [base["ttft_s_min"], base["ttft_s_max"]],
        "decoder_prefill_range_s": [cand["decoder_prefill_s_min"], cand["decoder_prefill_s_max"]],
        "e2e_s": cand["e2e_s"],  # the whole answer: prefill plus new_tokens of decode
        "baseline_e2e_s": base["e2e_s"],
        "e2e_speedup": _ratio(base["e2e_s"], cand["e2e_s"]),
        "decode_tokens_per_s": cand["decode_tokens_per_s"],
        "baseline_decode_tokens_per_s": base["decode_tokens_per_s"],
        "decode_speedup": (_ratio(cand["decode_tokens_per_s"], base["decode_tokens_per_s"])
                           if cand["decode_tokens_per_s"] and base["decode_tokens_per_s"] else None),
        "prefill_s": cand["prefill_s"],
        "baseline_prefill_s": base["prefill_s"],
        "vision_encoder_s": cand["vision_encoder_s"],
        "decoder_prefill_s": cand["decoder_prefill_s"],
        "baseline_decoder_prefill_s": base["decoder_prefill_s"],
        "decoder_prefill_speedup": prefill_speedup,
        "prefill_flops": flops,
        "prefill_flops_baseline": flops_baseline,
        "flops_speedup": flops_speedup,
        "realised_fraction": (prefill_speedup / flops_speedup) if prefill_speedup and flops_speedup else None,
        "own_cost_s": (cand["decoder_prefill_s"] - base["decoder_prefill_s"] / flops_speedup) if flops_speedup else None,
        "kv_bytes": cand["kv_bytes"],
        "baseline_kv_bytes": base["kv_bytes"],
        "kv_ratio": _ratio(cand["kv_bytes"], base["kv_bytes"]),
        "peak_memory_bytes": cand["peak_memory_bytes"],
        "baseline_peak_memory_bytes": base["peak_memory_bytes"],
        "peak_memory_ratio": _ratio(cand["peak_memory_bytes"], base["peak_memory_bytes"]) if cuda else None,
        "active_tokens_per_layer": cands[-1]["active_tokens_per_layer"],
    }
    if cuda:
        row["request_memory_bytes"] = cand["request_memory_bytes"]
        row["baseline_request_memory_bytes"] = base["request_memory_bytes"]
        row["request_memory_ratio"] = _ratio(cand["request_memory_bytes"], base["request_memory_bytes"])
    return row


# ----------------------------------------------------------------------------------------- output
def format_markdown(report: dict) -> str:
    """The report as a short header and one markdown table row per prompt x policy x speed."""
    cuda = report.get("device_type") == "cuda"
    lines = [
        f"Device: {report['device']}; {report['dtype']}; attention {report['attn']}; model {report['model']} "
        f"({report['num_layers']} decoder layers)",
        f"Medians of {report['runs']} timed run(s) per configuration after {report['warmup']} warm-up round(s); "
        "each candidate run directly follows its own baseline run (policy none).",
    ]
    if not cuda:
        lines.append("CPU: absolute times are not a claim (shared machine); read the ratios. Peak memory is the "
                     "whole process's peak RSS during the request (weights included), so no ratio is formed.")
    if report.get("interrupted"):
        lines.append(f"Interrupted (Ctrl-C or SIGTERM) after {len(report['log'])} runs: the rows are those with a "
                     "timed pair by then, each from the rounds it had.")
    if report["warmup"] == 0:
        lines.append("No warm-up round (--warmup 0): the first baseline run pays the process's one-time costs, so "
                     "the first candidate's ratios read too high; use --warmup 1 or more for ratios to read.")
    if not report.get("vision_encoder_timed", True):
        lines.append("The engine did not report vision_encoder_s: decoder prefill = the whole prefill.")
    for name, info in report["prompts"].items():
        counts = info["prompt_tokens"]
        lines.append(f"Prompt {name}: {info['total_tokens']} tokens ("
                     + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")")
    lines.append("")
    mem_header = "peak mem ratio | work mem ratio" if cuda else "peak RSS (GiB)"
    decode = report.get("new_tokens", 1) > 1
    lines.append("| prompt | policy | speed | TTFT base -> policy (s) [policy min-max] | TTFT speedup | "
                 "decoder prefill base -> policy (s) | prefill speedup | FLOPs speedup | realised | own cost (ms) | "
                 "KV ratio | "
                 + ("decode tok/s base -> policy | decode speedup | end-to-end speedup | " if decode else "")
                 + f"{mem_header} |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if decode else "")
                 + ("---|---|" if cuda else "---|"))
    for row in report["rows"]:
        mem = (f"{_fmt(row['peak_memory_ratio'])} | {_fmt(row['request_memory_ratio'])}" if cuda
               else f"{row['peak_memory_bytes'] / 2**30:.2f}")
        lines.append(
            f"| {row['prompt']} | {row['policy']} | {row['speed']:g} "
            f"| {row['baseline_ttft_s']:.3f} -> {row['ttft_s']:.3f} [{row['ttft_range_s'][0]:.3f}-"
            f"{row['ttft_range_s'][1]:.3f}] | {_fmt(row['ttft_speedup'])}x "
            f"| {row['baseline_decoder_prefill_s']:.3f} -> {row['decoder_prefill_s']:.3f} "
            f"| {_fmt(row['decoder_prefill_speedup'])}x | {_fmt(row['flops_speedup'])}x "
            f"| {_fmt(row['realised_fraction'])} | {_ms(row['own_cost_s'])} | {_fmt(row['kv_ratio'])} | "
            + (f"{_fmt(row['baseline_decode_tokens_per_s'])} -> {_fmt(row['decode_tokens_per_s'])} | "
               f"{_fmt(row['decode_speedup'])}x | {_fmt(row['e2e_speedup'])}x | " if decode else "") + f"{mem} |")
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> None:
    """TTFT speedup (y) over speed (x), one curve per policy and prompt."""
    from glimpse.plot import line_plot

    series: dict[str, list[tuple[float, float]]] = {}
    several = len(report["prompts"]) > 1
    for row in report["rows"]:
        if row["ttft_speedup"] is not None:
            name = f"{row['policy']} ({row['prompt']})" if several else row["policy"]
            series.setdefault(name, []).append((row["speed"], row["ttft_speedup"]))
    line_plot(series, path, title=f"glimpse bench: {report['model']}, {report['device']}", xlabel="speed",
              ylabel="TTFT speedup")


def generate_decode_rate(model, inputs: dict, new_tokens: int) -> float:
    """Decode tokens/s of transformers' own ``generate`` on ``inputs`` (a batch counts every row), from the
    first answer token to the last, as the engine's ``decode_tokens_per_s`` counts: a logits processor
    notes when each step's logits are ready, so the prefill is out of it. EOS ignored."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            if scores.is_cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    clock = StepClock()
    model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]))
    rows = inputs["input_ids"].shape[0]
    return rows * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def text_prompt(tokenizer, tokens: int) -> list[dict]:
    """A long text-only prompt of about ``tokens`` tokens: filler sentences, then a question."""
    per = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    return [{"role": "user", "content": FILLER * max(1, tokens // per) + "\nSummarise the text above."}]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.1f}"


# ---------------------------------------------------------------------------------- media synthesis
def write_video(path: str | Path, frames: int, fps: int, size: tuple[int, int], seed: int = 0) -> Path:
    """A random video (H.264, or MPEG-4 where libx264 is missing): blocky noise of 28x28-pixel cells,
    different in every frame, ``size`` = (width, height)."""
    import numpy as np

    from glimpse.tasks import write_clip

    width, height = size
    rng = np.random.RandomState(seed)
    cells = [(rng.rand(-(-height // 28), -(-width // 28), 3) * 255).astype(np.uint8) for _ in range(frames)]
    return write_clip([c.repeat(28, 0).repeat(28, 1)[:height, :width] for c in cells], path, fps, crf=None)


def write_still_scene(path: str | Path, frames: int, size: tuple[int, int], seed: int = 0) -> Path:
    """A still camera at 2 fps: a smooth random scene (coarse colour blocks), three shapes moving across it, noise
    of about 2 grey levels on every frame, H.264 at x264's default quality; ``size`` = (width, height). What RLT
    (pruning/rlt.py) is for, where ``write_video``'s clip has nothing that repeats."""
    import numpy as np

    from glimpse.tasks import write_clip

    width, height = size
    rng = np.random.RandomState(seed)
    coarse = rng.rand(height // 16 + 2, width // 16 + 2, 3)
    scene = np.kron(coarse, np.ones((16, 16, 1)))[:height, :width] * 200 + 20
    side = max(1, min(48, height // 4, width // 4))  # each shape's side in pixels
    room_y, room_x = height - side, width - side  # where a shape's corner may go
    shapes = [(rng.randint(0, room_y + 1), rng.randint(0, room_x + 1), rng.uniform(-6, 6), rng.uniform(-6, 6),
               rng.rand(3) * 255) for _ in range(3)]
    out = []
    for i in range(frames):
        frame = scene.copy()
        for top, left, dy, dx, colour in shapes:
            y, x = int(top + dy * i) % (room_y + 1), int(left + dx * i) % (room_x + 1)
            frame[y:y + side, x:x + side] = colour
        frame = frame + rng.normal(0, 2, frame.shape)
        out.append(np.clip(frame, 0, 255).astype(np.uint8))
    return write_clip(out, path, 2, crf=None)


def video_plan(tokens: float) -> tuple[int, int, int]:
    """(frames, rows, cols) at 2 fps whose Qwen2-VL token count is about ``tokens``: frames/2 temporal
    patches of rows x cols tokens, each frame within qwen-vl-utils' per-frame budget (128..768 tokens)."""
    from glimpse.vision import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS

    lo, hi = VIDEO_MIN_PIXELS // 784 + 12, VIDEO_MAX_PIXELS // 784 - 68  # 140..700: margin for rounding
    pairs = 8  # 16 frames at 2 fps
    if tokens / pairs > hi:
        pairs = math.ceil(tokens / hi)
    elif tokens / pairs < lo:
        pairs = max(2, math.floor(tokens / lo))  # 4 frames is the fewest Qwen2-VL samples
    from glimpse.pipeline.random_checkpoint import grid_for_tokens

    rows, cols = grid_for_tokens(tokens / pairs, aspect=4 / 3)
    return 2 * pairs, rows, cols


def synthesize_prompts(engine, folder: str | Path, image_tokens: int, video_tokens: int,
                       questions: dict[str, str] | None = None,
                       progress: Callable[[str], None] | None = None) -> dict[str, list]:
    """Benchmark prompts with made-up media of about the requested visual token counts (0 skips one).

    The image is random noise whose sides are multiples of the model's token cell (``Adapter.token_cell``: one
    Qwen2-VL token per 28x28 pixels, one Qwen3-VL token per 32x32; until 2026-12-07 28 for both, and a Qwen3-VL image
    gave 23% fewer tokens than asked); it goes in as a PIL image, so no file decoding is timed. The video is written to
    ``folder`` (2 fps, 16 frames unless the count needs more or fewer) and sized so that
    frames/2 * rows * cols is the request; the realised count is checked with ``engine.prepare`` and
    the size adjusted until it is within 10% (the Qwen family; other models' counts do not follow the size).
    """
    from glimpse.pipeline.random_checkpoint import random_image

    progress = progress or (lambda line: None)
    questions = {**DEFAULT_QUESTIONS, **(questions or {})}
    cell = engine.adapter.token_cell  # None: token counts do not follow the size
    side = cell or 28  # pixels per token cell of the synthesized media (28: any size, for other models)
    prompts = {}
    if image_tokens > 0:
        image = random_image(image_tokens, cell=side)
        messages = _messages("image", image, questions["image"])
        got = engine.prepare(messages).token_counts()["image"]
        if abs(got - image_tokens) > 0.1 * image_tokens:
            progress(f"note: the synthesized image gives {got} visual tokens (asked for {image_tokens}): "
                     "this model's image processor decides the count")
        prompts["image"] = messages
    if video_tokens > 0:
        if not engine.adapter.supports_video:
            progress(f"note: {engine.adapter.name} takes no video; skipping the video prompt")
        else:
            folder = Path(folder)
            folder.mkdir(parents=True, exist_ok=True)
            target = float(video_tokens)
            for attempt in range(4):
                frames, rows, cols = video_plan(target)
                path = write_video(folder / f"bench-video-{attempt}.mp4", frames, 2, (cols * side, rows * side))
                messages = _messages("video", str(path), questions["video"])
                got = engine.prepare(messages).token_counts()["video"]
                if cell is None or abs(got - video_tokens) <= 0.1 * video_tokens:
                    break
                target *= video_tokens / max(got, 1)  # the sampler shrank or grew it: aim off by as much
            if abs(got - video_tokens) > 0.1 * video_tokens:
                progress(f"note: the synthesized video gives {got} visual tokens (asked for {video_tokens})")
            prompts["video"] = messages
    return prompts


def media_prompts(images: list[str], video: str | None, questions: dict[str, str] | None = None) -> dict[str, list]:
    """Benchmark prompts from the user's own files: one per image, one for the video."""
    questions = {**DEFAULT_QUESTIONS, **(questions or {})}
    prompts = {}
    for i, path in enumerate(images):
        prompts["image" if len(images) == 1 else f"image{i + 1}"] = _messages("image", path, questions["image"])
    if video:
        prompts["video"] = _messages("video", video, questions["video"])
    return prompts


def _messages(kind: str, media, question: str) -> list[dict]:
    return user_message(question, [(kind, media)])


class OperatorCount(TorchDispatchMode):
    """Counts the tensor operators run inside it (``with OperatorCount() as operators: ...; operators.count``): on a
    GPU a decode step of a 7B model is bound by the host's operator count, which a CPU can count."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


__all__ = ["BASELINE", "BenchError", "DEFAULT_SPEEDS", "OperatorCount", "available_policies", "check_policies",
           "device_name", "format_markdown", "media_prompts", "plot", "run_bench", "synthesize_prompts",
           "text_prompt", "write_video"]
