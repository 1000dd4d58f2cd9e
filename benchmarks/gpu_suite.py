"""Glimpse on a GPU, proven by one command: exactness, engine overhead, every policy at its paper's operating
point, decode speed and HiDivDrop's encoder overlap, with a JSON and a markdown report.

    python benchmarks/gpu_suite.py --out gpu-report            # on a CUDA GPU: real shapes, about 9 min on an H100
    python benchmarks/gpu_suite.py --out smoke --smoke         # anywhere (the test suite runs it on CPU): tiny shapes

Writes DIR/gpu_suite.json (every measurement) and DIR/gpu_suite.md (the tables, for docs/benchmarks.md).
docs/gpu.md says how to run it on a lent GPU. The sections, in the order they run:

1. exactness: the test suite's tiny model of every supported architecture, engine (policy none) against
   transformers' ``generate`` and forward, in float32 and bfloat16, sdpa and (when importable, on CUDA)
   flash-attention 2: greedy tokens identical in float32, first-step logits within bfloat16 tolerance; and
   the engine's decode steps captured as a CUDA graph (``Engine.decode_graphs``) against ``generate`` too; and
   ZipVL's packed KV decoded with the packed-attention kernel (pipeline/packed_attention.py, Triton, since
   2026-12-02) against the packed slots dequantized first: the same tokens, eagerly and as the CUDA graph; and a
   Qwen image's and video's uint8 patches normalized on the device against on the host, bit for bit (since
   2026-12-02); and a decode step that runs out of memory half-way through the model, undone and run again in
   smaller parts: the same answers and KV as with memory to spare (since 2026-12-06).
2. overhead: random weights of Qwen2-VL-7B's shapes (28 decoder layers, the real 32-block vision tower),
   an 8K- and a 16K-token video prompt: the engine's prefill against transformers' own forward, alternating,
   the forward given its inputs on the device and from the host's tensors (the engine's starting point: the
   goal is judged on that ratio). The engine also with its vision encoder run first in the calling thread
   (``parallel_vision`` off). ``benchmarks/prefill_diff.py`` says where a gap comes from.
3. overlap: HiDivDrop with the vision encoder run first against run on its own CUDA stream beside the
   text-only layers (``Engine.parallel_vision``), on the 8K-token video.
4. policies: each policy at its paper's operating point on its paper's shape — DASH, ZipVL, LazyLLM and
   auto on the Qwen2-VL-7B video prompts (LongVA-7B's decoder is Qwen2-7B, the same shapes as this one),
   HiDivDrop, ST3, DivPrune and auto on LLaVA-1.5-7B with a 576-token image — against the baseline, alternating
   (``glimpse bench``'s runner): TTFT and decoder-prefill speedup, FLOPs speedup, realised fraction, own cost
   (the decoder time the FLOPs it saves do not explain), KV bytes, peak memory; beside each paper's headline
   figure.
5. rlt: RLT (leaving a video's repeated tokens out before the encoder) on a still-camera clip of the larger video
   size, alone and under LazyLLM, against the baseline: time to first token split into prompt building, vision
   encoder and decoder prefill.
6. crossover: where pruning starts to pay on this GPU. The uncalibrated ``auto`` (LazyLLM in prefill) at speeds 0.75 and
   1 against no pruning on the Qwen2-VL-7B model's images of 1K, 2K and 4K visual tokens: time to first token and
   to the end of a 16-token answer. Every policy was slower than no pruning on LLaVA-1.5-7B's 617-token image and
   faster on the 8K-token video (2026-11-26 and 27); the sizes between tell a prompt-size guard for the uncalibrated
   default where to stand (since 2026-12-06).
7. decode: tokens/s at batch 1 and 16 on LLaVA-1.5-7B, the engine (none in eager KV slots; ST3, ZipVL's packed KV
   and auto at speed 1 — uncalibrated, LazyLLM pruning in prefill only, which decodes plainly and so in the CUDA
   graph — as the engine runs them by default: ST3 and ZipVL in the CUDA graph too since 2026-12-02, ST3's
   annealing hiding evicted entries in the slots instead of removing them at every step, ZipVL's packed KV in
   packed slots, attended by the packed-attention kernel where Triton is, and beside it dequantized first, as
   before 2026-12-02) against
   transformers' ``generate`` on the same model, and the engine without its KV slots (``Engine.decode_slots``:
   every request attending on its own), and with its slot steps captured as a CUDA graph and replayed
   (``Engine.decode_graphs``, pipeline/decode_graph.py; the engine's default on CUDA since this section measured
   it); ST3's KV after 64 answer tokens against the baseline's. Since 2026-12-02 also what capturing the step
   costs: a capturing, an eager and a replayed decode step of the same requests at batch 1 and 16, and so how many
   replays pay for a capture (a served batch forms new slot groups, and captures again, every few steps).
8. caption: issue 26's pipeline on a GPU, its two stages measured apart (Ray itself is not on the lent machine:
   its wheel is larger than what a call may carry): the model stage, ``CaptionStage`` — what each Ray actor
   runs — over batches of decoded JPEG photos on the LLaVA-1.5-7B engine (images/s for one actor, one GPU),
   and the decode stage, ``decode_input`` on one CPU thread as each Ray task runs it (CPU-seconds per image,
   and per video for the Qwen2-VL-7B videos when an earlier section made them); from the two, the CPUs of
   decoding that keep one GPU actor fed, and which stage bounds a node. Then the local captioner
   (``glimpse caption``) over the same photos, reading included, against the actor's rate.
9. profile: torch.profiler over one prefill (transformers' forward and the engine's) of the smaller video and
   over four decode steps at batch 1 and 16 (KV slots and per request): operator calls, host syncs and the
   heaviest operators on host and device — where the time goes that the sections above only total.

Whatever could not run is listed with the reason; a section that fails is reported and the others go on.
Ratios are measured side by side in this one run (medians after a warm-up); absolute times only mean
something on the GPU named in the report.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import pickle
import platform
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test suite's tiny checkpoints of every architecture

from tiny_models import BUILDERS, RunsOutOfMemory, reference_inputs  # noqa: E402

from glimpse.assets import ASSETS  # noqa: E402
from glimpse.bench import video_plan, generate_decode_rate, run_bench, synthesize_prompts, write_still_scene  # noqa: E402
from glimpse.pipeline import load_engine, packed_attention  # noqa: E402
from glimpse.pipeline.engine import PrefillInterrupted, Sampling  # noqa: E402
from glimpse.pipeline.metrics import synchronize  # noqa: E402
from glimpse.pipeline.prompt import user_message  # noqa: E402
from glimpse.pipeline.random_checkpoint import build_random, random_image  # noqa: E402
from glimpse.pruning import RLT, HiDivDrop, LazyLLM, NoPruning, Pipeline, ZipVL  # noqa: E402

TINY_ARCHS = BUILDERS  # every supported architecture, as the test suite builds it

# Each paper's operating point as a slider speed (docs/pruning.md gives the mapping) and its headline figure.
PAPERS = {
    "dash": (0.8333, "1.74x faster at comparable accuracy (rho 0.667; the slider's rho = 0.8 x speed)"),
    "zipvl": (0.5, "prefill 2.6x faster, GPU memory -50% (tau 0.96 image / 0.975 video, KV 4/2 bits)"),
    "lazyllm": (1.0, "TTFT 2.34x on Llama-2-7B multi-document QA"),
    "hidivdrop": (1.0, "prefill 63.6 ms -> 32.6 ms (1.95x) on LLaVA-1.5-7B"),
    "st3": (1.0, "about 2x faster inference with about 30% of the KV cache, LLaVA-1.5-7B"),
    "divprune": (1.0, "no timing headline used here: keeps 9.8% of LLaVA-1.5-7B's 576 visual tokens in its main "
                      "table; the slider's speed 1 keeps 20%"),
    "auto": (1.0, "no paper: the composed pipeline at full speed (goal: 3x TTFT on a 16K-token video)"),
}
QWEN_POLICIES = ["dash", "zipvl", "lazyllm", "auto"]
LLAVA_POLICIES = ["hidivdrop", "st3", "divprune", "auto"]
# Pruned prefills the profile section profiles beside the unpruned one: the default policy at full speed
# (uncalibrated: LazyLLM in prefill) and ZipVL, whose own cost grew with the prompt (40 ms at 8K, 79 ms at 16K
# on an H200, 2026-11-27).
PROFILED_POLICIES = ("auto@1", "zipvl@0.5")
DECODE_POLICIES = [("none", 0.0), ("st3", 1.0), ("zipvl", 0.5), ("auto", 1.0)]  # auto: uncalibrated LazyLLM, prefill only


@dataclass(frozen=True)
class Shapes:
    qwen_preset: str
    qwen_vision_depth: int
    llava_preset: str
    llava_vision_depth: int
    video_tokens: tuple[int, ...]
    crossover_image_tokens: tuple[int, ...]  # the crossover section's image sizes (Qwen2-VL visual tokens)
    exact_new_tokens: int
    decode_new_tokens: int
    decode_batch: int
    runs: int
    caption_images: int  # the caption section's inputs, captioned in batches of glimpse caption's default (8)


REAL = Shapes("qwen2-vl-7b", 32, "llava-1.5-7b", 24, (8192, 16384), (1024, 2048, 4096), 16, 64, 16, 3, 48)
SMOKE = Shapes("tiny", 1, "llava-tiny", 1, (256, 512), (64, 128), 4, 4, 2, 1, 4)
CROSSOVER_SPEEDS, CROSSOVER_NEW_TOKENS = [0.75, 1.0], 16  # uncalibrated, auto prunes from 0.6 on
CAPTION_BATCH, CAPTION_NEW_TOKENS = 8, 64  # glimpse caption's defaults


class Suite:
    def __init__(self, out: Path, smoke: bool, device: str, budget_s: float, progress):
        self.out, self.smoke, self.budget_s, self.progress = out, smoke, budget_s, progress
        self.shapes = SMOKE if smoke else REAL
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.t0 = time.monotonic()
        self.tmp = tempfile.TemporaryDirectory(prefix="glimpse-gpu-suite-")
        self._engines: dict[str, object] = {}
        self.report = {"device": _device_name(self.device), "torch": torch.__version__, "smoke": smoke,
                       "shapes": asdict(self.shapes), "dtype": str(self.dtype).replace("torch.", ""),
                       "flash_attn": _flash_attn_version(), "sections": {}, "skipped": []}
        import transformers

        self.report["transformers"] = transformers.__version__

    def skip(self, what: str, why: str) -> None:
        self.report["skipped"].append({"what": what, "why": why})
        self.progress(f"skipped: {what} ({why})")

    def run(self, name: str, section) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed > self.budget_s:
            self.skip(name, f"the run's time budget ({self.budget_s:.0f} s) was spent before it")
            return
        self.progress(f"== {name} (at {elapsed:.0f} s)")
        start = time.monotonic()
        try:
            result = section(self)
        except Exception as error:  # one broken section must not cost the others' evidence
            result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            self.progress(f"{name} failed: {result['error']}")
        result["seconds"] = round(time.monotonic() - start, 1)
        self.report["sections"][name] = result
        try:
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        except Exception as error:  # a sticky CUDA error (an illegal address, a device-side assert) raises here too:
            # the section's report is kept, and the sections after it say the device failed rather than never run
            self.progress(f"after {name}: the device is unusable ({type(error).__name__}: {error})")
            result.setdefault("error", f"the device failed after it: {type(error).__name__}: {error}")

    def engine(self, family: str):
        """The random-weights Qwen2-VL-7B-shaped ("qwen") or LLaVA-1.5-7B-shaped ("llava") engine, built once
        (weights initialised on the GPU, saved and loaded like a real checkpoint)."""
        if family not in self._engines:
            self._engines.pop("qwen" if family == "llava" else "llava", None)  # one 7B model in memory at a time
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            s = self.shapes
            preset, depth = (s.qwen_preset, s.qwen_vision_depth) if family == "qwen" else (s.llava_preset,
                                                                                             s.llava_vision_depth)
            folder = Path(self.tmp.name) / family
            kwargs = {"max_visual_tokens": max(s.video_tokens) * 2} if family == "qwen" else {}
            started = time.monotonic()
            build_random(folder, preset=preset, vision_depth=depth, dtype=self.dtype,
                         init_device=self.device if self.cuda else None, **kwargs)
            engine = load_engine(str(folder), device=str(self.device), attn="sdpa", dtype=self.dtype)
            for file in folder.glob("*.safetensors"):
                file.unlink()  # loaded: the disk copy is not needed any more
            self.progress(f"built and loaded {preset} ({time.monotonic() - started:.0f} s)")
            self._engines[family] = engine
        return self._engines[family]

    def video_prompts(self, engine) -> dict[str, list]:
        prompts = {}
        for tokens in self.shapes.video_tokens:
            made = synthesize_prompts(engine, Path(self.tmp.name) / f"video-{tokens}", 0, tokens,
                                      progress=self.progress)
            count = engine.prepare(made["video"]).token_counts()["video"]  # named by what it realised
            prompts[f"video {count / 1024:.0f}K" if count >= 1024 else f"video {count}"] = made["video"]
        return prompts


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _flash_attn_version() -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        import flash_attn

        return flash_attn.__version__
    except Exception as error:  # installed but broken (built for another torch): say so, do not crash
        return f"unusable: {type(error).__name__}: {error}"


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}


def _timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _alternate(fns: dict, runs: int, device) -> dict[str, list[float]]:
    """One warm-up of each, then ``runs`` rounds that time each in turn."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(_timed(fn, device))
    return times


# ------------------------------------------------------------------------------------------ sections
def exactness(suite: Suite) -> dict:
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    # float32 must mean float32 (convolutions too: the patch embedding); restored for the later sections
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return _exactness(suite)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _exactness(suite: Suite) -> dict:
    attns = ["sdpa"]
    flash = suite.report["flash_attn"]
    if not suite.cuda:
        suite.skip("exactness with flash-attention 2", "no CUDA device")
    elif flash is None or flash.startswith("unusable"):
        suite.skip("exactness with flash-attention 2", f"flash_attn is {flash or 'not installed'}")
    else:
        attns.append("flash_attention_2")
    dtypes = [torch.float32, torch.bfloat16]
    image = str(ASSETS / "sample.png")
    messages = user_message("Describe the picture.", [("image", image)])
    rows = []
    for arch, build in TINY_ARCHS.items():
        folder = build(Path(suite.tmp.name) / "tiny" / arch)
        for dtype in dtypes:
            for attn in attns:
                if attn == "flash_attention_2" and dtype == torch.float32:
                    continue  # flash-attention runs in half precision only
                rows.append(_exact_row(suite, arch, folder, dtype, attn, messages))
                suite.progress(f"  {arch} {rows[-1]['dtype']} {attn}: tokens identical {rows[-1]['tokens_identical']}, "
                               f"logits max diff {rows[-1]['logits_max_abs_diff']:.2e}")
    # A Qwen-family image's or video's patches stay uint8 until the encoder normalizes them on its device
    # (vision/qwen_video.py): the values it reads there against the host's, which transformers' processors give
    # (tested on CPU).
    from PIL import Image

    pixels_identical = {}
    with torch.inference_mode():
        for arch in ("qwen2_vl", "qwen3_vl"):
            engine = load_engine(str(Path(suite.tmp.name) / "tiny" / arch), device=str(suite.device))
            for item in (engine.adapter.prepare_image(Image.open(image).convert("RGB")),
                         engine.adapter.prepare_video(ASSETS / "sample.mp4")):
                pixels_identical[f"{arch} {item.kind.name.lower()}"] = torch.equal(
                    engine.adapter._pixels([item], item.kind, engine.device).cpu(),
                    engine.adapter._pixels([item], item.kind))
    suite.progress(f"  patches normalized on {suite.device} = on the host: {pixels_identical}")
    interrupts_clean = {arch: _interrupt_is_clean(Path(suite.tmp.name) / "tiny" / arch, suite.device, messages)
                        for arch in TINY_ARCHS}
    suite.progress(f"  a prefill stopped in the vision worker leaves the engine as it was: {interrupts_clean}")
    undone = {arch: _out_of_memory_undone(Path(suite.tmp.name) / "tiny" / arch, suite.device, messages)
              for arch in ("qwen2_vl", "llava")}
    suite.progress(f"  a decode step out of memory half-way, undone and run again in parts, answers as before: {undone}")
    float32 = [r for r in rows if r["dtype"] == "float32"]
    half = [r for r in rows if r["dtype"] != "float32"]
    return {"rows": rows, "pixels_identical": pixels_identical, "interrupts_clean": interrupts_clean,
            "out_of_memory_undone": undone,
            "float32_tokens_identical": all(r["tokens_identical"] for r in float32),
            "float32_graph_tokens_identical": all(r["graph_tokens_identical"] for r in float32),
            "float32_logits_close": all(r["logits_close"] for r in float32),
            "bfloat16_logits_close": all(r["logits_close"] for r in half)}


def _exact_row(suite, arch, folder, dtype, attn, messages) -> dict:
    engine = load_engine(str(folder), device=str(suite.device), attn=attn, dtype=dtype)
    n = suite.shapes.exact_new_tokens
    prompt = engine.prepare(messages)
    inputs = _to(reference_inputs(engine, prompt), engine.device)
    with torch.inference_mode():
        expected = engine.model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
        reference = engine.model(**inputs).logits[0, -1].float()
        logits, _ = engine.prefill(prompt, NoPruning())
    if expected and expected[-1] in engine.eos_token_ids:
        expected = expected[:-1]  # the engine reports the answer without its EOS token
    with _decoding(engine, graphs=False):  # the eager decode step (graphs are on by default on CUDA)
        got = engine.generate(messages, policy="none", max_new_tokens=n).token_ids
    with _decoding(engine, graphs=True):  # the decode steps captured as a CUDA graph (pipeline/decode_graph.py)
        graphed = engine.generate(messages, policy="none", max_new_tokens=n).token_ids
    packed = _packed_kernel_check(engine, messages, n) if attn == "sdpa" else None
    same = sum(1 for _ in zip(got, expected))
    agree = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), same)
    diff = float((logits.float() - reference).abs().max())
    scale = float(reference.abs().max())
    # float32: the same arithmetic up to reduction order; bfloat16 keeps 8 significant bits, so differences
    # in the order of 1% of the logits' range are rounding, not a different computation.
    tolerance = (1e-3 if suite.cuda else 1e-4) if dtype == torch.float32 else 2e-2 * max(scale, 1.0)
    return {"arch": arch, "dtype": str(dtype).replace("torch.", ""), "attn": attn, "new_tokens": len(expected),
            "tokens_identical": got == expected, "graph_tokens_identical": graphed == expected,
            "graph_error": engine.decode_graph_error, "agreeing_prefix": agree, "logits_max_abs_diff": diff,
            "logits_scale": scale, "tolerance": tolerance, "logits_close": diff <= tolerance,
            "first_token_same": bool(logits.argmax() == reference.argmax()), "packed_kv_kernel": packed}


def _interrupt_is_clean(folder: Path, device: torch.device, messages) -> bool:
    """A prefill interrupted once the vision tower's first block has run, the tower in the engine's vision worker
    thread on its own CUDA stream (as a server's request whose client left): it stops before the second block and
    before any decoder layer, and the same question then gets the same tokens as before (tested on CPU, where no side
    stream exists)."""
    engine = load_engine(str(folder), device=str(device))
    engine.parallel_vision = True
    expected = engine.generate(messages, policy="none", max_new_tokens=8).token_ids
    ran = []
    handles = [block.register_forward_hook(lambda module, args, out, i=i: ran.append(i))
               for i, block in enumerate(engine.adapter.vision_blocks())]
    handles += [layer.register_forward_hook(lambda *_: ran.append("decoder")) for layer in engine.adapter.layers]
    try:
        with torch.inference_mode():
            engine.start(messages, "none", 0.0, 8, Sampling(), caches=False, interrupted=lambda: len(ran) >= 1)
        stopped = False
    except PrefillInterrupted:
        stopped = True
    finally:
        for handle in handles:
            handle.remove()
    again = engine.generate(messages, policy="none", max_new_tokens=8).token_ids
    return stopped and ran == [0] and again == expected


def _out_of_memory_undone(folder: Path, device: torch.device, messages) -> dict[str, bool]:
    """Per policy (none; ST3, which hides evicted entries in the KV slots): a decode step of three requests that runs
    out of memory half-way through the model (the middle layer's MLP raises CUDA's ``OutOfMemoryError`` for passes of
    two or three requests) is undone and run again in smaller parts (docs/engine.md). The same answers and the same KV
    after every step as the batch with memory to spare, whose steps ran in KV slots as the CUDA graph (tested on CPU)."""
    engine = load_engine(str(folder), device=str(device))
    conversations = [messages, user_message("Write one line about the sea."),
                     user_message("And one about the hills, at some length.")]
    middle = engine.adapter.layers[len(engine.adapter.layers) // 2].mlp
    same = {}
    for policy, speed in (("none", 0.0), ("st3", 1.0)):
        options = dict(policy=policy, speed=speed, max_new_tokens=8, ignore_eos=True)
        spare = engine.generate_batch(conversations, **options)
        with RunsOutOfMemory(middle, "cuda", lambda rows: 2 <= rows <= 3) as fault:
            short = engine.generate_batch(conversations, **options)
        same[policy] = bool(fault.refused) and all(
            a.token_ids == b.token_ids and a.metrics["kv_bytes_per_step"] == b.metrics["kv_bytes_per_step"]
            for a, b in zip(short, spare))
    return same


def _packed_kernel_check(engine, messages, n) -> dict | None:
    """ZipVL's packed KV decoded in KV slots with the packed-attention kernel (pipeline/packed_attention.py) and
    with the packed slots dequantized first, windows packed every 3 tokens, eagerly and as the CUDA graph: the same
    tokens? None where the kernel does not run (no CUDA, or no Triton)."""
    if not packed_attention.available(engine.device):
        return None
    conversations = [messages, user_message("Write one line about the sea.")]
    policy = lambda: replace(ZipVL.from_speed(0.5), requantize_every=3)  # noqa: E731

    def answered(graphs):
        with _decoding(engine, graphs=graphs), torch.inference_mode():
            return [r.token_ids for r in engine.generate_batch(conversations, policy=policy(), max_new_tokens=n,
                                                               ignore_eos=True)]

    answers = {(True, graphs): answered(graphs) for graphs in (False, True)}
    answers.update({(False, graphs): _without_packed_kernel(lambda g=graphs: answered(g)) for graphs in (False, True)})
    return {"tokens_identical": answers[True, False] == answers[False, False],
            "graph_tokens_identical": answers[True, True] == answers[False, True],
            "kernel_failure": packed_attention.failure}


def overhead(suite: Suite) -> dict:
    engine = suite.engine("qwen")
    rows = []
    for name, messages in suite.video_prompts(engine).items():
        prompt = engine.prepare(messages)
        host_inputs = reference_inputs(engine, prompt)
        inputs = _to(host_inputs, engine.device)
        with torch.inference_mode():
            # The engine's prefill starts from the prompt as ``prepare`` left it, on the host; transformers'
            # forward is timed from its inputs on the device (as the first GPU runs measured it) and from the
            # host (the same starting point: the transfer of the pixels counted on both sides).
            times = _alternate({"transformers": lambda: engine.model(**inputs, logits_to_keep=1, use_cache=True),
                                "transformers, inputs from the host": lambda: engine.model(
                                    **_to(host_inputs, engine.device), logits_to_keep=1, use_cache=True),
                                "engine": lambda: engine.prefill(prompt, NoPruning()),
                                "engine, vision first": lambda: _vision_first(engine, prompt)},
                               suite.shapes.runs, engine.device)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"prompt": name, "prompt_tokens": prompt.token_counts(), "median_s": med,
                     "min_s": {k: min(v) for k, v in times.items()}, "max_s": {k: max(v) for k, v in times.items()},
                     "engine_over_transformers": med["engine"] / med["transformers"],
                     "engine_over_transformers_from_host": med["engine"] / med["transformers, inputs from the host"]})
        suite.progress(f"  {name}: engine / transformers = {rows[-1]['engine_over_transformers']:.3f} "
                       f"(inputs on the device), {rows[-1]['engine_over_transformers_from_host']:.3f} (from the host)")
    vision = engine.model.model.visual
    return {"model": f"random {suite.shapes.qwen_preset}", "attn": engine.attn_implementation,
            "dtype": str(engine.dtype), "vision_dtype": str(next(vision.parameters()).dtype),
            "vision_attn": getattr(vision.config, "_attn_implementation", None), "runs": suite.shapes.runs,
            "rows": rows}


def policies(suite: Suite) -> dict:
    rows = []

    def bench(engine, prompts, names):
        for name in names:
            speed, headline = PAPERS[name]
            report = run_bench(engine, prompts, [name], [speed], runs=suite.shapes.runs, warmup=1,
                               progress=lambda line: None, model=engine.model_id)
            for row in report["rows"]:
                row.pop("active_tokens_per_layer", None)
                rows.append({**row, "paper": headline, "model": shape})
                suite.progress(f"  {shape} {row['prompt']} {name}@{speed:g}: TTFT x{row['ttft_speedup']:.2f}, "
                               f"FLOPs x{row['flops_speedup']:.2f}, realised {row['realised_fraction'] or 0:.2f}")

    shape = suite.shapes.qwen_preset
    engine = suite.engine("qwen")
    bench(engine, suite.video_prompts(engine), QWEN_POLICIES)
    shape = suite.shapes.llava_preset
    engine = suite.engine("llava")
    messages = user_message("Describe the image in detail.", [("image", random_image(576))])
    bench(engine, {f"image {engine.prepare(messages).token_counts()['image']}": messages}, LLAVA_POLICIES)
    return {"runs": suite.shapes.runs, "rows": rows}


def decode(suite: Suite) -> dict:
    engine = suite.engine("llava")
    messages = user_message("Describe the image in detail.", [("image", random_image(576))])
    prompt = engine.prepare(messages)
    n = suite.shapes.decode_new_tokens
    rows = []
    for batch in (1, suite.shapes.decode_batch):
        inputs = _to(reference_inputs(engine, prompt), engine.device)
        inputs = {k: v.expand(batch, *v.shape[1:]).contiguous() if k != "pixel_values" else v.repeat(batch, 1, 1, 1)
                  for k, v in inputs.items()}

        def ours(policy, speed, slots=True, graphs=None):
            """The engine's decode rate (a batch counts every request) and its KV after the answer; ``slots``
            False: every request attends over its own cache on its own (the engine before pipeline/batch_kv.py);
            ``graphs``: the slot steps captured as a CUDA graph (pipeline/decode_graph.py), or not; None: as the
            engine does by default (on CUDA: for the steps in which no policy works inside the step, ST3's too)."""
            with _decoding(engine, slots=slots, graphs=graphs):
                results = engine.generate_batch([messages] * batch, policy=policy, speed=speed, max_new_tokens=n,
                                                ignore_eos=True)
            return (sum(r.metrics["decode_tokens_per_s"] for r in results),
                    sum(r.metrics["kv_bytes"] for r in results))

        # Every side counts from the first answer token to the last, so the prefill is out of it.
        sides = {"generate": lambda: (generate_decode_rate(engine.model, inputs, n), None)}
        sides.update({policy: (lambda p=policy, s=speed: ours(p, s)) for policy, speed in DECODE_POLICIES})
        sides["none"] = lambda: ours("none", 0.0, graphs=False)  # the eager slot step; the graph is its own row
        sides["none, per request"] = lambda: ours("none", 0.0, slots=False)
        sides["none, CUDA graph"] = lambda: ours("none", 0.0, graphs=True)
        if packed_attention.available(engine.device):  # ZipVL's packed slots dequantized first, not the kernel's
            sides["zipvl, dequantized first"] = lambda: _without_packed_kernel(lambda: ours("zipvl", 0.5))
        # (Until 2026-11-27 the eager steps of none and ST3 also ran with SDPA's cuDNN backend left out: on an
        # H200 that was 1.49x faster for none at batch 16 and slower for ST3, docs/benchmarks.md, fourth run.)
        measured = {name: [] for name in sides}
        with torch.inference_mode():
            for round_index in range(suite.shapes.runs + 1):  # round 0 warms up
                for name, side in sides.items():
                    result = side()
                    if round_index:
                        measured[name].append(result)
        rate = {name: statistics.median(r for r, _ in runs) for name, runs in measured.items()}
        kv = {name: runs[-1][1] for name, runs in measured.items() if runs[-1][1] is not None}
        for name in rate:
            rows.append({"batch": batch, "decoder": name, "new_tokens": n, "decode_tokens_per_s": rate[name],
                         "vs_generate": rate[name] / rate["generate"],
                         "kv_bytes": kv.get(name), "kv_vs_baseline": kv[name] / kv["none"] if name in kv else None})
            suite.progress(f"  batch {batch} {name}: {rate[name]:.1f} tokens/s ({rows[-1]['vs_generate']:.2f}x generate)")
    # Off CUDA the same steps run, the "capture" and "replay" ones as the fixed-shape step run eagerly: not a measurement.
    with torch.inference_mode():
        capture = [_graph_capture_cost(engine, messages, batch, repeats=3 + 2 * suite.shapes.runs)
                   for batch in (1, suite.shapes.decode_batch)]
    for c in capture:
        suite.progress(f"  batch {c['batch']} capture: " + (c["error"] if "error" in c else
                       f"{c['capture_step_s'] * 1000:.1f} ms against {c['eager_step_s'] * 1000:.1f} eager and "
                       f"{c['replay_step_s'] * 1000:.1f} replayed; replays to pay for a capture: {_replays(c)}"))
    if engine.decode_graph_error:  # the "CUDA graph" rows then ran the fixed-shape step eagerly
        suite.skip("decode as a CUDA graph", f"capture failed: {engine.decode_graph_error}")
    if packed_attention.failure:  # the "zipvl" rows then dequantized first: said here too, not only in exactness
        suite.skip("ZipVL's packed-attention kernel in decode", f"it failed: {packed_attention.failure}")
    return {"model": f"random {suite.shapes.llava_preset}", "prompt_tokens": prompt.token_counts(),
            "runs": suite.shapes.runs, "rows": rows, "capture": capture}


def _replays(capture: dict) -> str:
    replays = capture["break_even_replays"]
    return "never (a replay is no faster)" if replays is None else f"{replays:.1f}"


def _graph_capture_cost(engine, messages, batch: int, repeats: int) -> dict:
    """What capturing the decode step as a CUDA graph costs against what each replay saves, at ``batch``: a served
    batch forms new slot groups (and captures again) every few steps (docs/benchmarks.md, slot groups), so whether to
    capture at once or after some eager steps depends on this break-even. Three kinds of decode step of the same
    requests, interleaved, each timed whole (``Engine.decode_step``: the host's work, the device's, the sampling):
    one that captures (its step forgotten first, so it captures again), one eager (the plain slot step, graphs off),
    one replayed; medians."""
    with _decoding(engine, graphs=True):
        requests = [engine.start(messages, "none", 0.0, 4 + 3 * repeats, Sampling(), ignore_eos=True)
                    for _ in range(batch)]
        engine.decode_step(requests)  # the prompts' last tokens
        engine.decode_step(requests)  # the slot groups form, and the step is captured
        if engine.decode_graph_error or not engine.slot_groups or engine.slot_groups[0].fixed_step is None:
            return {"batch": batch, "error": engine.decode_graph_error or "no fixed-shape step to capture"}

        def step(kind: str) -> float:
            engine.decode_graphs = kind != "eager"
            if kind == "capture":
                engine.slot_groups[0].fixed_step = None  # the next step makes and captures it again
            synchronize(engine.device)
            start = time.perf_counter()
            engine.decode_step(requests)
            synchronize(engine.device)
            return time.perf_counter() - start

        seconds = {"capture": [], "eager": [], "replay": []}
        for _ in range(repeats):
            for kind in seconds:  # a replay after each capture: the graph just captured
                seconds[kind].append(step(kind))
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    saved = median["eager"] - median["replay"]
    return {"batch": batch, "capture_step_s": median["capture"], "eager_step_s": median["eager"],
            "replay_step_s": median["replay"], "repeats": repeats,
            # Replays it takes to win back the capture's cost over the eager step it replaces.
            "break_even_replays": (median["capture"] - median["eager"]) / saved if saved > 0 else None}  # None: never


def overlap(suite: Suite) -> dict:
    if not suite.cuda:
        suite.skip("HiDivDrop's encoder on its own CUDA stream", "no CUDA device: on CPU the encoder runs in a "
                   "thread beside the layers, which the CPU benchmarks measure (docs/benchmarks.md)")
    engine = suite.engine("qwen")
    name, messages = next(iter(suite.video_prompts(engine).items()))
    prompt = engine.prepare(messages)
    policy = HiDivDrop.from_speed(1.0)

    def run(parallel):
        def go():
            engine.parallel_vision = parallel
            return engine.generate(messages, policy=policy, max_new_tokens=1)
        return go

    with torch.inference_mode():
        times = _alternate({"sequential": run(False), "parallel": run(True)}, suite.shapes.runs, engine.device)
    engine.parallel_vision = True
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"prompt": name, "prompt_tokens": prompt.token_counts(), "policy": "hidivdrop@1",
            "median_ttft_s": med, "sequential_over_parallel": med["sequential"] / med["parallel"],
            "stream": "CUDA side stream" if suite.cuda else "thread (CPU)"}


# overlap runs beside overhead (both on the Qwen-shaped model) so that each 7B model is built once.
# Host work that stalls the GPU: each of these waits for the device (or is the copy a wait is for).
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def _profiled(fn, device) -> dict:
    """``fn`` under torch.profiler: operator calls, host time, device waits and the heaviest operators."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        fn()
        synchronize(device)
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    ops = [e for e in averages if e.key.startswith("aten::")]
    device_time = [(getattr(e, "self_device_time_total", 0) or 0, e) for e in averages]

    def top(pairs):
        return [{"op": e.key, "calls": e.count, "ms": round(t / 1000, 3)} for t, e in sorted(
            pairs, key=lambda p: -p[0])[:10] if t > 0]

    return {"wall_s": wall, "aten_calls": sum(e.count for e in ops),
            "syncs": {name: e.count for e in averages for name in SYNCS if e.key == name},
            "top_host": top([(e.self_cpu_time_total, e) for e in ops]),
            "top_device": top(device_time) if device.type == "cuda" else []}


def _vision_first(engine, prompt, policy=None):
    """The engine's prefill with the vision encoder run first, in the calling thread (``parallel_vision``);
    ``policy`` (a name@speed string) or none."""
    engine.parallel_vision = False
    try:
        if policy is None:
            return engine.prefill(prompt, NoPruning())
        name, speed = policy.split("@")
        return engine.prefill(prompt, engine.make_policy(name, float(speed)))
    finally:
        engine.parallel_vision = True


def _without_packed_kernel(run):
    """``run()`` with ZipVL's packed slots dequantized before attention, as a CPU does (pipeline/batch_kv.py)."""
    packed_attention.enabled = False
    try:
        return run()
    finally:
        packed_attention.enabled = packed_attention.failure is None


@contextmanager
def _decoding(engine, *, slots: bool = True, graphs: bool | None = None):
    """Decode in KV slots or per request, with or without the CUDA graph (None: the engine's default), for one
    measurement; afterwards the defaults again, and the slots of the measured requests let go. A capture that
    failed keeps the graphs off (``Engine.decode_graph_error``)."""
    default = engine.decode_graphs
    engine.decode_slots, engine.decode_graphs = slots, default if graphs is None else graphs
    try:
        yield
    finally:
        engine.decode_slots, engine.slot_groups = True, []
        engine.decode_graphs = default and engine.decode_graph_error is None


def profile(suite: Suite) -> dict:
    """Where the time goes that the other sections only total: torch.profiler over (1) one prefill of the
    smaller video by transformers' forward and by the engine (the engine's overhead), unpruned and under
    ``PROFILED_POLICIES`` (what pruning's own work costs), (2) four decode steps of
    the LLaVA engine at batch 1 and at the decode batch, in KV slots, as a CUDA graph and per request (the host
    work that keeps decode behind ``generate``). Operator calls, host syncs and the ten heaviest operators on host
    and device."""
    rows = []
    engine = suite.engine("qwen")
    name, messages = next(iter(suite.video_prompts(engine).items()))
    prompt = engine.prepare(messages)
    inputs = _to(reference_inputs(engine, prompt), engine.device)
    with torch.inference_mode():
        # The profiler sees the calling thread's operators: the engine's encoder runs in it here (vision
        # first), as it does in transformers' forward; the wall time of the default (its own thread) beside it.
        sides = {"transformers forward": lambda: engine.model(**inputs, logits_to_keep=1, use_cache=True),
                 "engine prefill, vision first": lambda: _vision_first(engine, prompt),
                 "engine prefill, vision in its thread (wall time only)": lambda: engine.prefill(prompt, NoPruning()),
                 # What a pruning policy's prefill adds (the policies section's "own cost": 11-20 ms for auto's
                 # LazyLLM at 8K-16K tokens on an H200, 2026-11-27), to read beside the unpruned rows above.
                 **{f"engine prefill, {policy}, vision first": partial(_vision_first, engine, prompt, policy)
                    for policy in PROFILED_POLICIES}}
        for fn in sides.values():  # warm-up
            fn()
        for side, fn in sides.items():
            rows.append({"what": f"{side}, {name}", **_profiled(fn, engine.device)})
    engine = suite.engine("llava")
    messages = user_message("Describe the image in detail.", [("image", random_image(576))])
    with torch.inference_mode():
        for batch in (1, suite.shapes.decode_batch):
            for mode in ("KV slots", "CUDA graph", "per request"):
                with _decoding(engine, slots=mode != "per request", graphs=mode == "CUDA graph"):
                    requests = [engine.start(messages, "none", 0.0, 64, Sampling(), ignore_eos=True)
                                for _ in range(batch)]
                    for _ in range(2):  # warm-up (the slots form here, and the graph is captured)
                        engine.decode_step(requests)

                    def steps():
                        for _ in range(4):
                            engine.decode_step(requests)

                    rows.append({"what": f"4 decode steps, batch {batch}, {mode}", **_profiled(steps, engine.device)})
            suite.progress(f"  profiled decode at batch {batch}")
    for row in rows:
        suite.progress(f"  {row['what']}: {row['wall_s']:.3f} s, {row['aten_calls']} aten calls, syncs {row['syncs']}")
    return {"rows": rows}


def caption(suite: Suite) -> dict:
    """The Ray captioner's model stage (one actor on this GPU) and decode stage (one CPU task) measured apart:
    the two rates docs/scale.md's arithmetic takes (``r`` and ``d``)."""
    from PIL import Image

    from glimpse.caption import caption_inputs
    from glimpse.caption_ray import CaptionStage, decode_input

    engine = suite.engine("llava")
    model = str(Path(suite.tmp.name) / "llava")  # the checkpoint's folder: config, tokenizer, image processor
    folder = Path(suite.tmp.name) / "photos"
    folder.mkdir(exist_ok=True)
    rng = torch.Generator().manual_seed(0)
    images = []
    for i in range(suite.shapes.caption_images):  # 640x480 JPEGs, a typical photo dataset's files
        pixels = torch.randint(0, 256, (480, 640, 3), dtype=torch.uint8, generator=rng).numpy()
        images.append(folder / f"photo-{i:03d}.jpg")
        Image.fromarray(pixels).save(images[-1], quality=90)
    # The largest of the Qwen2-VL videos an earlier section made (overhead, policies), the file it used.
    videos = sorted(Path(suite.tmp.name).glob("video-*"), key=lambda f: int(f.name.removeprefix("video-")))[-1:]
    videos = [max(videos[0].glob("bench-video-*.mp4"))] if videos and (Path(suite.tmp.name) / "qwen").is_dir() else []

    def decode_stage(keys, model=model):
        """CPU-seconds per input of ``decode_input`` in one thread (Ray runs each decode task with one CPU)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            decode_input({"key": str(keys[0])}, model=model, prompt=None)  # warm-up: the Preprocessor is built once
            start = time.process_time()
            rows = [decode_input({"key": str(k)}, model=model, prompt=None) for k in keys]
            seconds = (time.process_time() - start) / len(keys)
        finally:
            torch.set_num_threads(threads)
        errors = [r["error"] for r in rows if r["error"]]
        if errors:
            raise RuntimeError(f"the decode stage failed: {errors[0]}")
        return seconds, rows

    d_image, rows = decode_stage(images)
    stage = CaptionStage(model, "auto", 0.0, CAPTION_NEW_TOKENS, str(suite.device))
    stage.engine = engine  # loaded already (an actor loads it in its first batch)
    batches = [rows[i:i + CAPTION_BATCH] for i in range(0, len(rows), CAPTION_BATCH)]

    def columns(batch):
        return {"key": [r["key"] for r in batch], "prompt_bytes": [r["prompt_bytes"] for r in batch],
                "instruction": [r["instruction"] for r in batch], "error": [r["error"] for r in batch]}

    with torch.inference_mode():
        stage(columns(batches[0]))  # warm-up
        synchronize(engine.device)
        start = time.perf_counter()
        out = [stage(columns(batch)) for batch in batches]
        synchronize(engine.device)
        seconds = time.perf_counter() - start
    failed = [e for o in out for e in o["error"] if e]
    if failed:
        raise RuntimeError(f"the model stage failed: {failed[0]}")
    r = len(rows) / seconds
    answer_tokens = sum(t for o in out for t in o["answer_tokens"])
    result = {"model": f"random {suite.shapes.llava_preset}", "images": len(rows), "batch": CAPTION_BATCH,
              "max_new_tokens": CAPTION_NEW_TOKENS, "answer_tokens_per_image": answer_tokens / len(rows),
              "actor_images_per_s": r, "actor_answer_tokens_per_s": answer_tokens / seconds,
              "decode_cpu_s_per_image": d_image, "decode_images_per_s_per_cpu": 1 / d_image,
              # docs/scale.md: N actors stay fed while the decode stage has at least N * r * d CPUs
              "cpus_to_feed_one_actor": r * d_image}
    suite.progress(f"  one actor: {r:.2f} images/s ({answer_tokens / seconds:.0f} answer tokens/s); decode: "
                   f"{d_image * 1000:.1f} CPU-ms per image: {r * d_image:.2f} CPUs keep one actor fed")
    # The local captioner (`glimpse caption`) over the same photos, reading included: it reads the next batch beside
    # the model, so its rate is the actor's where reading keeps up (since 2026-12-05; before, the GPU waited for each
    # batch to be read).
    start = time.perf_counter()
    report = caption_inputs(engine, images, out=Path(suite.tmp.name) / "captions.jsonl", fmt="jsonl", overwrite=True,
                            policy="auto", speed=0.0, prompt=None, max_new_tokens=CAPTION_NEW_TOKENS,
                            batch_size=CAPTION_BATCH)
    local = len(images) / (time.perf_counter() - start)
    if report.failed:
        raise RuntimeError(f"the local captioner failed: {report.failed[0]}")
    result.update({"local_images_per_s": local, "local_vs_actor": local / r})
    suite.progress(f"  glimpse caption, reading included: {local:.2f} images/s ({local / r:.2f}x the actor's)")
    if videos:
        d_video, (row,) = decode_stage(videos, model=str(Path(suite.tmp.name) / "qwen"))
        tokens = pickle.loads(row["prompt_bytes"]).token_counts()["video"]
        result.update({"decode_cpu_s_per_video": d_video,
                       "video": f"{tokens} visual tokens, {suite.shapes.qwen_preset}'s processor"})
        suite.progress(f"  decode: {d_video:.2f} CPU-s per {tokens}-token video")
    else:
        suite.skip("the decode stage's time per video", "no section before this one made the Qwen2-VL videos")
    return result


def rlt(suite: Suite) -> dict:
    """RLT (pruning/rlt.py) before the encoder on a still-camera clip of the largest video size: the other
    sections' clips are new noise in every frame, where nothing repeats. The baseline, RLT alone and RLT under
    LazyLLM (the uncalibrated ``auto``) at speed 1, alternating; each configuration's last time to first token
    split into prompt building, vision encoder and decoder prefill (``_ttft_split``)."""
    engine = suite.engine("qwen")
    tokens = max(suite.shapes.video_tokens)
    frames, rows, cols = video_plan(tokens)
    path = write_still_scene(Path(suite.tmp.name) / "still-scene.mp4", frames, (cols * 28, rows * 28))
    messages = user_message("What happens in this video?", [("video", str(path))])
    configs = {"none": lambda: NoPruning(), "rlt@1": lambda: RLT.from_speed(1.0),
               "rlt@1 + lazyllm@1": lambda: Pipeline(policies=(RLT.from_speed(1.0), LazyLLM.from_speed(1.0)))}
    last = {}

    def run(name):
        def go():
            last[name] = engine.generate(messages, policy=configs[name](), max_new_tokens=1).metrics
        return go

    with torch.inference_mode():
        times = _alternate({name: run(name) for name in configs}, suite.shapes.runs, engine.device)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = []
    for name, metrics in last.items():
        observed = metrics.get("policy_telemetry", {})
        observed = observed.get("rlt", observed)
        out.append({"config": name, "median_s": med[name], "ttft_speedup": med["none"] / med[name],
                    "left_out": observed.get("not_encoded", 0) / max(metrics["prompt_tokens"]["video"], 1),
                    "ttft_s": metrics["ttft_s"], "prefill_s": metrics["prefill_s"],
                    "decoder_prefill_s": metrics["prefill_s"] - metrics["vision_encoder_s"]})
        suite.progress(f"  still scene {name}: first token x{out[-1]['ttft_speedup']:.2f}, "
                       f"{out[-1]['left_out']:.0%} of the video tokens left out")
    return {"prompt_tokens": last["none"]["prompt_tokens"], "runs": suite.shapes.runs, "rows": out}


def crossover(suite: Suite) -> dict:
    """The uncalibrated ``auto`` against no pruning on Qwen2-VL-7B images of a few sizes (``glimpse bench``'s runner,
    alternating): from which prompt size pruning pays on this GPU, to the first token and to the end of an answer."""
    engine = suite.engine("qwen")
    prompts = {}
    for tokens in suite.shapes.crossover_image_tokens:
        messages = user_message("Describe the image in detail.", [("image", random_image(tokens))])
        prompts[f"image {engine.prepare(messages).token_counts()['image']}"] = messages
    report = run_bench(engine, prompts, ["auto"], CROSSOVER_SPEEDS, runs=suite.shapes.runs, warmup=1,
                       progress=lambda line: None, model=engine.model_id, new_tokens=CROSSOVER_NEW_TOKENS)
    rows = []
    for row in report["rows"]:
        if row["policy"] == "none":
            continue
        row.pop("active_tokens_per_layer", None)
        rows.append(row)
        suite.progress(f"  {row['prompt']} auto@{row['speed']:g}: TTFT x{row['ttft_speedup']:.2f}, "
                       f"end to end x{row['e2e_speedup']:.2f}, FLOPs x{row['flops_speedup']:.2f}")
    return {"model": suite.shapes.qwen_preset, "runs": suite.shapes.runs, "new_tokens": CROSSOVER_NEW_TOKENS,
            "rows": rows}


SECTIONS = {"exactness": exactness, "overhead": overhead, "overlap": overlap, "policies": policies, "rlt": rlt,
            "crossover": crossover, "decode": decode, "caption": caption, "profile": profile}


# -------------------------------------------------------------------------------------------- report
def _f(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(headers: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + [
        "| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _ttft_split(row: dict, prefix: str = "") -> str:
    """Where a time to first token goes: building the prompt (before the prefill) and the vision encoder, which no
    pruning inside the decoder shortens, beside the decoder's prefill (``row``'s ``{prefix}ttft_s``,
    ``{prefix}prefill_s`` and ``{prefix}decoder_prefill_s``)."""
    ttft, prefill, decoder = row[f"{prefix}ttft_s"], row[f"{prefix}prefill_s"], row[f"{prefix}decoder_prefill_s"]
    return f"{ttft:.3f} = {ttft - prefill:.3f} + {prefill - decoder:.3f} + {decoder:.3f}"


def _ttft_parts(row: dict) -> str:
    """The baseline's and the policy's ``_ttft_split``."""
    return f"baseline {_ttft_split(row, 'baseline_')}; policy {_ttft_split(row)}"


def goals(report: dict) -> list[str]:
    """Issue 27's goals, each met or not by this run's numbers (or not measured: the section did not run)."""
    sections = {name: s for name, s in report["sections"].items() if "error" not in s}
    verdict = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731
    lines = []
    if "exactness" in sections:
        rows = sections["exactness"]["rows"]
        exact = all(r["tokens_identical"] for r in rows if r["dtype"] == "float32")
        close = all(r["logits_max_abs_diff"] <= r["tolerance"] for r in rows)
        lines.append(f"- greedy tokens identical in float32, first-step logits within tolerance: {verdict(exact and close)} "
                     f"({sum(r['tokens_identical'] for r in rows)}/{len(rows)} rows identical)")
        # The section's other checks, each its own line (the verdict above read "met" whatever they said).
        section = sections["exactness"]
        float32 = [r for r in rows if r["dtype"] == "float32"]
        packed = [r["packed_kv_kernel"] for r in float32 if r.get("packed_kv_kernel")]
        others = [("the decode steps as a CUDA graph: the same float32 tokens",
                   [r["graph_tokens_identical"] for r in float32 if "graph_tokens_identical" in r]),
                  ("ZipVL's packed KV attended by the kernel: the same float32 tokens as dequantized first",
                   [c["tokens_identical"] and c["graph_tokens_identical"] and not c["kernel_failure"] for c in packed]),
                  ("image and video patches normalized on the device = on the host",
                   list(section.get("pixels_identical", {}).values())),
                  ("a prefill stopped in the vision worker leaves the engine as it was",
                   list(section.get("interrupts_clean", {}).values())),
                  ("a decode step out of memory half-way, undone and run again in parts, answers as before",
                   [same for by_policy in section.get("out_of_memory_undone", {}).values()
                    for same in by_policy.values()])]
        for what, passed in others:
            lines.append(f"- {what}: " + (f"{verdict(all(passed))} ({sum(passed)}/{len(passed)})" if passed
                                          else "not measured"))
    if "overhead" in sections:
        rows = sections["overhead"]["rows"]
        ratios = [r.get("engine_over_transformers_from_host") for r in rows]
        on_device = ", ".join(f"{r['engine_over_transformers']:.3f}" for r in rows)
        if None in ratios:  # a report from before the like-for-like side
            lines.append(f"- engine overhead at speed 0 within 3% of transformers' forward: "
                         f"{verdict(max(r['engine_over_transformers'] for r in rows) <= 1.03)} ({on_device})")
        else:
            lines.append(f"- engine overhead at speed 0 within 3% of transformers' forward, both from the host's "
                         f"tensors: {verdict(max(ratios) <= 1.03)} ({', '.join(f'{x:.3f}' for x in ratios)}; against "
                         f"transformers given its inputs on the device: {on_device})")
    if "policies" in sections:
        rows = [r for r in sections["policies"]["rows"] if r["prompt"].startswith("video")]
        if rows:
            longest = max(rows, key=lambda r: int(r["prompt"].split()[1].rstrip("K")))["prompt"]
            at = [r for r in rows if r["prompt"] == longest]
            realised = {f"{r['policy']}": r["realised_fraction"] or 0.0 for r in at}
            lines.append(f"- realised fraction at least 0.9 for every policy on the {longest} prompt: "
                         f"{verdict(min(realised.values()) >= 0.9)} ("
                         + ", ".join(f"{k} {v:.2f}" for k, v in realised.items()) + ")")
            auto = next((r for r in at if r["policy"] == "auto"), None)
            if auto:
                # What pruning inside the decoder could reach at best: the baseline's TTFT with its decoder free.
                ceiling = auto["baseline_ttft_s"] / (auto["baseline_ttft_s"] - auto["baseline_decoder_prefill_s"])
                lines.append(f"- `auto` at least 3x faster TTFT on the {longest} prompt: "
                             f"{verdict(auto['ttft_speedup'] >= 3)} ({auto['ttft_speedup']:.2f}x; with the decoder's "
                             f"prefill free, prompt building and the vision encoder alone would allow {ceiling:.2f}x)")
    if "rlt" in sections and "rows" in sections["rlt"]:
        best = max(sections["rlt"]["rows"], key=lambda r: r["ttft_speedup"])
        lines.append(f"- with RLT before the encoder, on a still-camera clip ({sections['rlt']['prompt_tokens']['video']}"
                     f" video tokens; not `auto`: RLT is not in its uncalibrated default): {best['config']} "
                     f"{best['ttft_speedup']:.2f}x TTFT, {best['left_out']:.0%} of the video tokens left out")
    if "decode" in sections:
        rows = sections["decode"]["rows"]
        one = {r["decoder"]: r["vs_generate"] for r in rows if r["batch"] == 1}
        default = "none" if report["device"].startswith("CPU") else "none, CUDA graph"  # the engine's own choice
        if default in one:
            lines.append(f"- decode at batch 1 at least as fast as `generate` (1.5x hoped): {verdict(one[default] >= 1)}"
                         f" ({default}: {one[default]:.2f}x)")
        big = max(r["batch"] for r in rows)
        st3 = next((r for r in rows if r["batch"] == big and r["decoder"] == "st3"), None)
        if st3 and st3["kv_vs_baseline"] is not None:
            lines.append(f"- ST3's KV at most 30% of the baseline's after the answer, batch {big}: "
                         f"{verdict(st3['kv_vs_baseline'] <= 0.3)} ({st3['kv_vs_baseline']:.2f})")
    return lines or ["- nothing measured"]


def _packed_cell(check: dict | None) -> str:
    if check is None:
        return "not run (no CUDA or no Triton)"
    if check["kernel_failure"]:
        return f"kernel failed: {check['kernel_failure']}"
    return f"{check['tokens_identical']} (graph: {check['graph_tokens_identical']})"


def markdown(report: dict) -> str:
    lines = [f"Device: {report['device']}; torch {report['torch']}, transformers {report['transformers']}; "
             f"{report['dtype']}; flash-attn {report['flash_attn'] or 'not installed'}"
             + ("; SMOKE RUN (tiny shapes: not a measurement)" if report["smoke"] else ""), ""]
    lines += ["### issue 27's goals, from this run", ""] + goals(report) + [""]
    sections = report["sections"]
    for name, section in sections.items():
        lines.append(f"### {name} ({section.get('seconds', 0):.0f} s)")
        lines.append("")
        if "error" in section:
            lines += [f"Failed: `{section['error']}`", ""]
            continue
        if name == "exactness":
            # Without CUDA there is no graph: the column is the fixed-shape step the graph would capture, run eagerly.
            graph = "with the CUDA graph" if not report["device"].startswith("CPU") else "fixed-shape step (no CUDA)"
            lines += _table(["arch", "dtype", "attention", "tokens identical", graph,
                             "agreeing prefix", "logits max diff", "tolerance", "ZipVL: kernel = dequantized first"],
                            [[r["arch"], r["dtype"], r["attn"], r["tokens_identical"],
                              f"capture failed: {r['graph_error']}" if r.get("graph_error")
                              else r.get("graph_tokens_identical"),
                              f"{r['agreeing_prefix']}/{r['new_tokens']}", f"{r['logits_max_abs_diff']:.2e}",
                              f"{r['tolerance']:.1e}", _packed_cell(r.get("packed_kv_kernel"))]
                             for r in section["rows"]])
            if "pixels_identical" in section:
                lines += ["", "Qwen patches normalized where the encoder runs, against on the host (bit for bit): "
                          + ", ".join(f"{what} {same}" for what, same in section["pixels_identical"].items())]
            if "interrupts_clean" in section:
                lines += ["", "A prefill stopped after the vision tower's first block, in the vision worker: stopped "
                          "there, and the engine answers as before: "
                          + ", ".join(f"{arch} {clean}" for arch, clean in section["interrupts_clean"].items())]
            if "out_of_memory_undone" in section:
                lines += ["", "A decode step of three requests out of memory half-way through the model, undone and "
                          "run again in parts: the same answers and KV as with memory to spare: "
                          + ", ".join(f"{arch} {policy} {same}" for arch, by_policy in
                                      section["out_of_memory_undone"].items() for policy, same in by_policy.items())]
        elif name == "overhead":
            lines += [f"{section['model']}, {section['attn']}, {section['dtype']} (vision encoder: "
                      f"{section.get('vision_dtype')}, {section.get('vision_attn')}), median of {section['runs']}", ""]
            lines += _table(["prompt", "tokens", "transformers forward, inputs on the device (s)",
                             "transformers forward, inputs from the host (s)", "engine prefill (s)",
                             "engine / transformers (on the device)", "engine / transformers (from the host)",
                             "engine, vision first (s)"],
                            [[r["prompt"], sum(r["prompt_tokens"].values()), f"{r['median_s']['transformers']:.3f}",
                              _f(r["median_s"].get("transformers, inputs from the host"), 3),
                              f"{r['median_s']['engine']:.3f}", f"{r['engine_over_transformers']:.3f}",
                              _f(r.get("engine_over_transformers_from_host"), 3),
                              _f(r["median_s"].get("engine, vision first"), 3)]
                             for r in section["rows"]])
        elif name == "policies":
            lines += _table(["model", "prompt", "policy@speed", "TTFT speedup", "decoder-prefill speedup",
                             "FLOPs speedup", "realised", "own cost (ms)", "KV ratio", "peak memory ratio",
                             "TTFT (s) = prompt building + vision encoder + decoder", "paper's headline"],
                            [[r["model"], r["prompt"], f"{r['policy']}@{r['speed']:g}", _f(r["ttft_speedup"]),
                              _f(r["decoder_prefill_speedup"]), _f(r["flops_speedup"]), _f(r["realised_fraction"]),
                              _f(None if r.get("own_cost_s") is None else r["own_cost_s"] * 1000, 1),
                              _f(r["kv_ratio"]), _f(r["peak_memory_ratio"]), _ttft_parts(r), r["paper"]]
                             for r in section["rows"]])
        elif name == "decode":
            lines += [f"{section['model']}, prompt {section['prompt_tokens']}, median of {section['runs']}"
                      + ("; no CUDA: the 'CUDA graph' row is the fixed-shape step run eagerly"
                         if report["device"].startswith("CPU") else ""), ""]
            lines += _table(["batch", "decoder", "tokens/s", "vs generate", "KV after the answer / baseline"],
                            [[r["batch"], r["decoder"], f"{r['decode_tokens_per_s']:.1f}", f"{r['vs_generate']:.2f}",
                              _f(r["kv_vs_baseline"])] for r in section["rows"]])
            if section.get("capture"):
                lines += ["", "The CUDA graph's capture against what a replay saves (whole decode steps, medians"
                          + ("; no CUDA: no graph, the capturing and replayed steps are the fixed-shape step run eagerly"
                             if report["device"].startswith("CPU") else "") + "):", ""]
                lines += _table(["batch", "capturing step (ms)", "eager step (ms)", "replayed step (ms)",
                                 "replays to pay for a capture"],
                                [[c["batch"], "-", "-", "-", c["error"]] if "error" in c else
                                 [c["batch"], f"{c['capture_step_s'] * 1000:.1f}", f"{c['eager_step_s'] * 1000:.1f}",
                                  f"{c['replay_step_s'] * 1000:.1f}", _replays(c)]
                                 for c in section["capture"]])
        elif name == "profile":
            lines += _table(["what", "wall (s)", "aten calls", "host syncs", "heaviest on host (ms)",
                             "heaviest on device (ms)"],
                            [[r["what"], f"{r['wall_s']:.3f}", r["aten_calls"],
                              ", ".join(f"{k} {v}" for k, v in r["syncs"].items()) or "-",
                              "; ".join(f"{t['op']} x{t['calls']} {t['ms']}" for t in r["top_host"][:4]),
                              "; ".join(f"{t['op'][:40]} x{t['calls']} {t['ms']}" for t in r["top_device"][:4]) or "-"]
                             for r in section["rows"]])
        elif name == "caption":
            lines += [f"{section['model']}: {section['images']} JPEG photos (640x480), batches of {section['batch']}, "
                      f"at most {section['max_new_tokens']} answer tokens ({section['answer_tokens_per_image']:.0f} "
                      "on average)", ""]
            lines += _table(["one actor (images/s)", "answer tokens/s", "decode (CPU-ms per image)",
                             "CPUs of decoding that keep one actor fed", "decode (CPU-s per video)",
                             "glimpse caption, reading included (images/s)"],
                            [[f"{section['actor_images_per_s']:.2f}", f"{section['actor_answer_tokens_per_s']:.0f}",
                              f"{section['decode_cpu_s_per_image'] * 1000:.1f}", f"{section['cpus_to_feed_one_actor']:.2f}",
                              _f(section.get("decode_cpu_s_per_video")) + (f" ({section['video']})" if "video"
                                                                           in section else ""),
                              f"{section['local_images_per_s']:.2f} ({section['local_vs_actor']:.2f}x the actor)"]])
        elif name == "rlt":
            lines += [f"A still-camera clip ({section['prompt_tokens']['video']} video tokens), median of {section['runs']}", ""]
            lines += _table(["configuration", "video tokens left out", "TTFT (s)", "TTFT speedup",
                             "last run's TTFT (s) = prompt building + vision encoder + decoder"],
                            [[r["config"], f"{r['left_out']:.0%}", f"{r['median_s']:.3f}", _f(r["ttft_speedup"]),
                              _ttft_split(r)] for r in section["rows"]])
        elif name == "crossover":
            lines += [f"{section['model']}, uncalibrated auto against no pruning, median of {section['runs']}; end to "
                      f"end: the first token and {section['new_tokens'] - 1} more", ""]
            lines += _table(["prompt", "auto@speed", "TTFT base -> auto (s)", "TTFT speedup", "end-to-end speedup",
                             "decoder-prefill speedup", "FLOPs speedup", "own cost (ms)"],
                            [[r["prompt"], f"auto@{r['speed']:g}", f"{r['baseline_ttft_s']:.3f} -> {r['ttft_s']:.3f}",
                              _f(r["ttft_speedup"]), _f(r["e2e_speedup"]), _f(r["decoder_prefill_speedup"]),
                              _f(r["flops_speedup"]),
                              _f(None if r.get("own_cost_s") is None else r["own_cost_s"] * 1000, 1)]
                             for r in section["rows"]])
        elif name == "overlap":
            med = section["median_ttft_s"]
            lines += [f"{section['policy']} on {section['prompt']} ({section['stream']}): TTFT sequential "
                      f"{med['sequential']:.3f} s, parallel {med['parallel']:.3f} s, sequential / parallel "
                      f"{section['sequential_over_parallel']:.3f}"]
        lines.append("")
    lines.append("### not run")
    lines.append("")
    lines += [f"- {s['what']}: {s['why']}" for s in report["skipped"]] or ["- nothing"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks that every section runs")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no new section after this many seconds (default 480: done within 9 minutes)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed runs of each side (after one warm-up); default 3 (1 with --smoke)")
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; available: {', '.join(SECTIONS)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if not device.startswith("cuda") and not args.smoke:
        print("note: no CUDA device; the real shapes (7B models) on a CPU take hours — use --smoke for a check",
              file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    suite = Suite(out, args.smoke, device, args.budget_s, progress)
    if args.runs is not None:
        suite.shapes = replace(suite.shapes, runs=args.runs)
        suite.report["shapes"] = asdict(suite.shapes)
    with suite.tmp:
        for name in args.sections.split(","):
            suite.run(name, SECTIONS[name])
            # written after every section, so a run stopped by its time limit still leaves its evidence
            (out / "gpu_suite.json").write_text(json.dumps(suite.report, indent=1, default=str))
            (out / "gpu_suite.md").write_text(markdown(suite.report))
    progress(f"wrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.md'} ({time.monotonic() - suite.t0:.0f} s)")
    return 1 if any("error" in s for s in suite.report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
