"""Batch captioning: ``glimpse caption INPUT... [--out FILE.jsonl | --format txt]``.

Inputs are image and video files, folders (searched recursively for files with an image or video
extension) and list files (``.txt``/``.lst``: one path per line, relative paths taken from the list's
folder, ``#`` comments). Each input gets one caption:

* JSONL (default ``captions.jsonl``): one object per input — ``path``, ``caption``, ``policy``,
  ``speed``, ``params``, ``metrics`` — appended and flushed as soon as its batch is done;
* ``--format txt``: a sidecar ``<name>.txt`` next to each input, written atomically (temp file +
  rename).

Resuming: inputs already captioned (a line with their path in the JSONL, or an existing sidecar)
are skipped unless ``--overwrite``; a JSONL line cut short by a killed run is dropped before
appending. A killed run, rerun, therefore captions every input exactly once.

Inputs are decoded together in batches (``Engine.generate_batch``, each with its own policy state).
An input that cannot be read (corrupt, truncated, empty, unsupported) is logged and skipped; a batch
that fails is retried one input at a time so one bad file never costs its neighbours. A summary
lists the failures at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common import UserError
from pipeline import PromptError
from pipeline.prompt import user_message
from vision.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError

LIST_EXTENSIONS = (".txt", ".lst")
DEFAULT_PROMPT = "Describe this {kind} in one or two sentences."
# Metric keys worth keeping per caption (the keep map and per-step series would dwarf the caption).
KEPT_METRICS = ("ttft_s", "prefill_s", "decode_tokens_per_s", "new_tokens", "prompt_tokens", "kv_bytes",
                "peak_memory_bytes", "batch_size")


@dataclass
class CaptionReport:
    captioned: int = 0
    skipped: int = 0  # already captioned by an earlier run
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


def collect_inputs(items: Iterable[str]) -> list[Path]:
    """Media files from files, folders (recursive) and list files, in a stable order, once each."""
    seen, out = set(), []

    def add(path: Path) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(path)

    for item in items:
        path = Path(item)
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file() and child.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
                    add(child)
        elif path.suffix.lower() in LIST_EXTENSIONS and path.is_file():
            for line in path.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    listed = Path(line)
                    add(listed if listed.is_absolute() else path.parent / listed)
        elif path.exists():
            add(path)
        else:
            raise FileNotFoundError(f"{item}: no such file or folder")
    return out


def kind_of(path: Path) -> str:
    return "video" if path.suffix.lower() in VIDEO_EXTENSIONS else "image"


def sidecar(path: Path) -> Path:
    return path.with_suffix(".txt")


def done_in_jsonl(out: Path) -> set[str]:
    """Paths already captioned in ``out``; a last line cut short by a kill is removed from the file."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):  # the run was killed mid-line: drop the partial line
        data = data[: data.rfind(b"\n") + 1]
        with open(out, "r+b") as f:
            f.truncate(len(data))
    done = set()
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            done.add(json.loads(line)["path"])
        except (ValueError, KeyError, TypeError):
            continue  # not one of ours: leave it alone, it never matches a path
    return done


def write_sidecar(path: Path, caption: str) -> None:
    target = sidecar(path)
    tmp = target.with_name(f".{target.name}.partial")
    tmp.write_text(caption + "\n")
    os.replace(tmp, target)  # atomic: a kill never leaves half a caption


def caption_inputs(engine, inputs: list[Path], *, out: Path | None, fmt: str, overwrite: bool, policy: str,
                   speed: float, prompt: str | None, max_new_tokens: int, batch_size: int,
                   progress: Callable[[int, int, int], None] | None = None,
                   log: Callable[[str], None] = lambda message: None) -> CaptionReport:
    """Caption ``inputs``; ``progress(done, total, failed)`` after every batch."""
    report = CaptionReport()
    sidecars = {}
    if fmt == "txt":
        for path in inputs:
            clash = sidecars.setdefault(sidecar(path).resolve(), path)
            if clash != path:
                raise UserError(f"{clash} and {path} would share the caption file {sidecar(path)}")
    if fmt == "jsonl" and overwrite and out.exists():
        out.unlink()
    done = done_in_jsonl(out) if fmt == "jsonl" else set()
    pending = []
    for path in inputs:
        finished = sidecar(path).exists() if fmt == "txt" else str(path) in done
        if finished and not overwrite:
            report.skipped += 1
        else:
            pending.append(path)

    sink = open(out, "a", encoding="utf-8") if fmt == "jsonl" else None
    try:
        for start in range(0, len(pending), batch_size):
            batch = pending[start:start + batch_size]
            for path, result in _answer(engine, batch, policy, speed, prompt, max_new_tokens, report, log):
                caption = result.text.strip()
                if fmt == "txt":
                    write_sidecar(path, caption)
                else:
                    metrics = {k: result.metrics[k] for k in KEPT_METRICS}
                    record = {"path": str(path), "caption": caption, "policy": result.policy, "speed": speed,
                              "params": result.params, "metrics": metrics}
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                report.captioned += 1
            if progress:
                progress(min(start + batch_size, len(pending)), len(pending), len(report.failed))
    finally:
        if sink:
            sink.close()
    return report


def _answer(engine, batch, policy, speed, prompt, max_new_tokens, report, log):
    """(path, result) for every input of ``batch`` that could be captioned."""
    conversations = [_messages(path, prompt) for path in batch]
    options = dict(policy=policy, speed=speed, max_new_tokens=max_new_tokens)
    try:
        return list(zip(batch, engine.generate_batch(conversations, **options)))
    except (MediaError, PromptError, OSError, torch.OutOfMemoryError) as error:
        if len(batch) == 1:
            report.failed.append((str(batch[0]), str(error)))
            log(f"skipped {batch[0]}: {error}")
            return []
    answered = []  # one input of the batch failed: find it, keep the others
    for path in batch:
        answered += _answer(engine, [path], policy, speed, prompt, max_new_tokens, report, log)
    return answered


def _messages(path: Path, prompt: str | None) -> list[dict]:
    kind = kind_of(path)
    text = prompt or DEFAULT_PROMPT.format(kind=kind)
    return user_message(text, [(kind, str(path))])


class ProgressBar:
    """A one-line progress bar with ETA on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # looked up now, not at import (tests swap sys.stderr)
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int, failed: int) -> None:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (total - done) if done else 0.0
        width = 30
        filled = int(width * done / total) if total else width
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
                f"{f', {failed} failed' if failed else ''}, {elapsed:.0f}s elapsed, ETA {eta:.0f}s")
        if self.stream.isatty():
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
