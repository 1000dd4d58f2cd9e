"""Batch captioning: ``glimpse caption INPUT... [--out FILE.jsonl | --format txt]``.

Inputs are image and video files, folders (searched recursively for files with an image or video
extension) and list files (``.txt``/``.lst``: one path per line, relative paths taken from the list's
folder, ``#`` comments). Each input gets one caption:

* JSONL (default ``captions.jsonl``): one object per input — ``path``, ``caption``, ``policy``,
  ``speed``, ``params``, ``metrics`` — appended and flushed as soon as its batch is done;
* ``--format txt``: a sidecar ``<name>.txt`` next to each input, written atomically (temp file +
  rename).

Resuming: inputs already captioned (a line with their path in the JSONL, or an existing sidecar)
are skipped unless ``--overwrite`` (which replaces the given inputs' records and keeps the others); a JSONL line cut
short by a killed run is dropped before appending. A killed run, rerun, therefore captions every input exactly once.
Inputs are matched by resolved path (each line also carries it as ``key``), so the same folder given as a relative or an
absolute path, or through a symlink, is not captioned again. One process at a time writes a JSONL
output: it holds an exclusive lock on it (released by the system when the process ends, however it
ends), and a second ``glimpse caption`` on the same output is refused before it loads the model, as
is an output that cannot be written.

Each input's prompt is built on its own (its file read, decoded, sampled and tokenized), once, in reading threads
that build the next batch's prompts while the model answers this one; then the batch is decoded together
(``Engine.generate_batch``, each with its own policy state). An input that cannot be read (corrupt, truncated, empty,
unsupported, or slower to read than ``--media-timeout``) is logged and skipped; a batch that fails in the model (out of
memory) is retried in halves down to the input that failed, so one bad file never costs its neighbours. A summary
lists the failures at the end.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from glimpse.common import UserError
from glimpse.common.jsonable import one_line, utf8_text
from glimpse.pipeline import OutOfMemory, PromptError
from glimpse.pipeline.adapters import VIDEO
from glimpse.pipeline.profiles import model_key
from glimpse.pipeline.prompt import user_message
from glimpse.vision.media import (IMAGE_EXTENSIONS, MEDIA_READERS, VIDEO_EXTENSIONS, MediaError, detect_kind,
                                  reading_limit)

LIST_EXTENSIONS = (".txt", ".lst")
# How often a long listing of the inputs says how far it is: a million names took minutes without a word.
LISTING_NOTE_EVERY_S = 15.0
DEFAULT_PROMPT = "Describe this {kind} in one or two sentences."
# The embedded model learnt a whole description from "Describe the image." and "Describe the video." (and "What is in
# the image?": training/train_projector.py), and answered the default above with a word ("CAT." of the README's sample
# picture: an outside pass): it is asked in its own words. (A real checkpoint asked so tends to run past
# --max-new-tokens, whose default is 64.)
EMBEDDED_PROMPT = "Describe the {kind}."
# Metric keys worth keeping per caption (the keep map and per-step series would dwarf the caption).
KEPT_METRICS = ("ttft_s", "prefill_s", "decode_tokens_per_s", "new_tokens", "prompt_tokens", "kv_bytes",
                "peak_memory_bytes", "batch_size")


@dataclass
class CaptionReport:
    captioned: int = 0
    skipped: int = 0  # already captioned by an earlier run
    failed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


def is_uri(value: str) -> bool:
    """A URL or a remote file system's URI (``https://``, ``s3://``, ...); ``file://`` names a local file."""
    return "://" in value and not value.startswith("file://")


def _local_path(value: str, where: str) -> str:
    """``vision.local_path``, its refusal (a file:// URL of another host) said as the command's error."""
    from glimpse.vision import MediaError, local_path

    try:
        return local_path(value)
    except MediaError as error:
        raise UserError(f"{where}{error}") from None


def list_entries(listing: Path) -> list[str]:
    """A list file's inputs: URLs and URIs as written, paths relative to the list's folder. One per line, blank lines
    and ``#`` comments skipped, the spaces around a line too, unless the line names a file as it is: ``ls > list.txt``
    in a folder holding ``#1 holiday.png`` listed it, and it was passed over as a comment without a word (an outside
    pass). A list with NUL bytes is one written by ``find -print0``: split at them, each name as it is (a name may
    hold a newline; until 2026-12-07 the NULs ended the run in a traceback)."""
    try:
        # (bytes decoded, not read as text: that turns a "\r" in a name into a line end). A byte order mark
        # (Windows Notepad) is not part of a path.
        text = listing.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{listing}: not a list of paths (one per line, UTF-8 text)") from None

    def named(line: str) -> Path:
        listed = Path(_local_path(line, f"{listing}: "))
        return listed if listed.is_absolute() else listing.parent / listed

    def names_a_file(line: str) -> bool:
        try:
            return not is_uri(line) and os.path.lexists(named(line))
        except (UserError, ValueError, OSError):
            return False

    # NULs (find -print0), else newlines, else carriage returns alone (classic Mac OS, old Excel for Mac exports)
    separator = next((end for end in ("\0", "\n", "\r") if end in text), "\n")
    entries = []
    for line in text.split(separator):
        if separator != "\0":
            line = line.removesuffix("\r")
            if not names_a_file(line):
                line = line.strip()
                if line.startswith("#"):
                    continue
        if not line:
            continue
        entries.append(line if is_uri(line) else str(named(line)))
    return entries


def collect_inputs(items: Iterable[str], unreadable: list[tuple[str, str]] | None = None,
                   log: Callable[[str], None] = lambda message: None,
                   keys: dict[Path, str] | None = None) -> list[Path]:
    """Media files from files, folders (recursive) and list files, in a stable order, once each (by resolved path:
    names that link to one file are one input, which ``log`` says). URLs are refused with a pointer to ``--ray``,
    which fetches them. A folder that cannot be listed (no permission) is added to ``unreadable`` as (folder,
    reason) for the caller to report; without that list, it is an error. ``keys``, where given, receives each
    input's ``input_key``, found here anyway: resolving a million names again (once per step of a run that used
    them) took minutes before a resumed run said a word."""
    seen: dict[Path, Path] = {}
    out, linked = [], []
    cannot_list: list[tuple[str, str]] = []
    said = [time.monotonic()]

    def progress(count: int, what: str) -> None:
        if time.monotonic() - said[0] >= LISTING_NOTE_EVERY_S:
            said[0] = time.monotonic()
            log(f"listing the inputs: {count:,} {what} so far ...")

    def add(path: Path) -> None:
        progress(len(out), "inputs")
        key = resolved_path(path)
        if key not in seen:
            seen[key] = path
            out.append(path)
            if keys is not None:
                keys[path] = stored(str(key))
        elif seen[key] != path:
            linked.append((path, seen[key]))

    def local(value: str, where: str) -> Path:
        if is_uri(value):
            raise UserError(f"{where}{value}: a URL; the local captioner reads local files (glimpse caption --ray "
                            "fetches http(s) URLs and s3://, gs://, hdfs:// URIs)")
        return Path(_local_path(value, where))

    for item in items:
        path = local(item, "")
        if path.is_dir():
            for child in _folder_files(path, cannot_list, progress):
                # Whatever is named as media is listed, to be captioned or fail saying why: a broken link (an input
                # that went missing), a FIFO, socket or device (never opened: "not a regular file"; passed over
                # without a word, they were inputs the summary never mentioned).
                if child.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
                    add(child)
        elif path.suffix.lower() in LIST_EXTENSIONS and path.is_file():
            for entry in list_entries(path):
                add(local(entry, f"{path}: "))
        elif path.exists():
            add(path)
        elif path.is_symlink():  # there, but leads nowhere (or round in a loop): an input that fails, saying why
            add(path)
        else:
            raise FileNotFoundError(f"{item}: no such file or folder")
    if linked:  # (a dataset of links, git-annex's or DVC's, links files of the same content to one object)
        path, first = linked[0]
        log(f"{len(linked)} input name{'s are' if len(linked) > 1 else ' is'} the same file as another input's "
            f"(e.g. {path} and {first}): each file is captioned once, under the first of its names")
    if cannot_list and unreadable is None:
        raise UserError("cannot list " + "; ".join(f"{folder} ({reason})" for folder, reason in cannot_list))
    if unreadable is not None:
        unreadable += cannot_list
    return out


def unlisted_failures(unreadable: list[tuple[str, str]], log: Callable[[str], None]) -> list[tuple[str, str]]:
    """Folders ``collect_inputs`` could not list, said as found and returned as the run's failures (no input of
    theirs has a key to fail under)."""
    for folder, reason in unreadable:
        log(f"cannot list {folder} ({reason}): nothing in it is captioned")
    return [(folder, f"cannot list the folder ({reason})") for folder, reason in unreadable]


def _folder_files(folder: Path, cannot_list: list[tuple[str, str]],
                  progress: Callable[[int, str], None] = lambda count, what: None) -> list[Path]:
    """Every entry under ``folder`` that is not a folder, sorted (``progress(count, what)`` before each folder's
    listing: how far a long walk is). Links to folders are followed (``photos/2023`` a link
    to another disk was passed over without a word, exit 0: an outside pass), each folder walked once whatever leads
    to it (a link back up, a loop). A folder that cannot be listed goes to ``cannot_list`` (``rglob`` passed over it
    without a word: its pictures were simply never captioned)."""
    def refused(error: OSError) -> None:
        cannot_list.append((error.filename or str(folder), error.strerror or str(error)))

    # A stack, not ``os.walk``: before Python 3.12 it recursed once per level, and a tree some 1000 folders deep
    # ended the run in a RecursionError (an outside pass).
    found, walked, pending = [], set(), [folder]
    while pending:
        progress(len(found), f"files in {folder}")
        root = pending.pop()
        try:
            here = os.stat(root)
            if (here.st_dev, here.st_ino) in walked:  # reached again through a link: its files are listed once
                continue
            walked.add((here.st_dev, here.st_ino))  # (not its realpath: an lstat per level, quadratic in depth)
            with os.scandir(root) as entries:
                for entry in entries:
                    try:
                        is_folder = entry.is_dir()  # (a link to a folder too)
                    except OSError:
                        is_folder = False
                    (pending if is_folder else found).append(Path(entry.path))
        except OSError as error:
            refused(error)
    return sorted(found)


def kind_of(path: Path) -> str:
    """"image" or "video": by the file's content, as the chat decides (``detect_kind``): a video with no extension, or
    one misnamed .png, was read as a picture and failed with "pass it as a video", which nothing here can (an
    outside pass). A file whose content says neither goes by its extension, and its reading says what is wrong."""
    try:
        return detect_kind(path)
    except (MediaError, OSError):
        return "video" if path.suffix.lower() in VIDEO_EXTENSIONS else "image"


def sidecar(path: Path) -> Path:
    return path.with_suffix(".txt")


def input_key(path: Path) -> str:
    """What identifies an input across runs: its resolved path (as ``stored``)."""
    return stored(str(resolved_path(path)))


def input_keys(inputs: list[Path], known: dict[Path, str] | None = None) -> dict[Path, str]:
    """Each input's ``input_key``: from ``known`` (``collect_inputs``'s) where it is there, found otherwise."""
    known = known or {}
    return {path: known[path] if path in known else input_key(path) for path in inputs}


def stored(value):
    """``value`` as the outputs hold it (the local JSONL, Ray's shards). Linux allows any bytes in a file name but /
    and NUL, and Python hands the ones that are not UTF-8 over as lone surrogates, which Parquet's strings cannot
    hold (a Ray run over one such name captioned everything and then failed at its first shard, and so did every
    rerun) and JSON writes as escapes other readers refuse (pyarrow) or replace (jq). Those bytes are written as
    ``\\xNN``, as Python shows them (in keys, paths, and messages that name the file); resuming compares keys in
    this form too."""
    if isinstance(value, list):  # warnings
        return [stored(v) for v in value]
    return utf8_text(value) if isinstance(value, str) else value


def resolved_path(path: Path) -> Path:
    """``path`` resolved, or as it is (absolute) when it cannot be: a loop of symbolic links (``resolve`` raises
    RuntimeError before Python 3.13, OSError since) is an input that fails to read, not the end of the run; so is a
    name holding a NUL byte (a list line or a manifest's path: ValueError, a traceback until 2026-12-07)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError, ValueError):
        return path.absolute()


def open_locked(path: Path, mode: str, out: Path, buffering: int = -1):
    """``path`` (its folder made if need be) opened in ``mode`` (with ``buffering``, as ``open`` takes it) and locked
    for this process alone (``flock``), for writing the captions output ``out``: a second writer, or a path that
    cannot be written, is a ``UserError`` naming ``out``, raised before any model loads."""
    for _attempt in range(3):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            file = open(path, mode, buffering=buffering)
        except OSError as error:
            raise UserError(f"cannot write {out}: {error.strerror or error}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise UserError(f"{out} is being written by another glimpse caption; wait for it to finish "
                            "or choose another --out") from None
        if _same_file(file, path):
            return file
        # Locked just as another run's --overwrite put a new file in its place (``CaptionOutput.forget``): this one
        # is no longer the output, and what was written to it would be lost. The new one is opened instead.
        file.close()
    raise UserError(f"{out} keeps being replaced while it is opened; is another program writing it?")


def _write_all(file, data: bytes) -> None:
    """``data`` written to ``file``, an unbuffered one (whose ``write`` may write less than it was given)."""
    view = memoryview(data)
    while view:
        view = view[file.write(view):]


def _same_file(file, path: Path) -> bool:
    try:
        here, there = os.fstat(file.fileno()), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _blank_in_place(target: Path, spans: list[tuple[int, int]]) -> None:
    """The lines of ``target`` at ``spans`` (offset, length) made blank in place: spaces, then the newline each ended
    with. Only their own bytes are written: every other line stays where it was, whole, whatever moment a kill comes
    at (moving the kept lines up over the file, as until 2026-12-07, could splice the line a write was cut in, even
    lose it: Linux cuts a killed write short at a page; an outside pass). A blank line is no record (JSONL readers
    such as jq and pandas skip it, and the next --overwrite that can replace the file drops it); a line a kill left
    half blank is no record either, and its input is captioned again."""
    fd = os.open(target, os.O_WRONLY)  # (not the "a+b" file: O_APPEND writes at the end, whatever the offset)
    try:
        for start, length in spans:
            blank, done = b" " * (length - 1), 0  # (its newline stays)
            while done < len(blank):
                done += os.pwrite(fd, blank[done:], start + done)
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_if_unlocked(path: Path) -> None:
    """Remove ``path``, a file a run writes under ``flock``, unless a run is writing it now."""
    try:
        with open(path, "rb") as file:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink()
    except OSError:  # (BlockingIOError: being written; or gone already, or not ours to remove)
        pass


class CaptionOutput:
    """The JSONL output, opened for appending and locked for this process alone (``flock``): a second
    writer is refused with a clear error, and an unwritable path fails here, before any model loads."""

    def __init__(self, out: Path):
        self.path = out
        _refuse_what_is_not_a_captions_file(out)
        # Unbuffered: a write the disk refuses leaves nothing behind to be written again as the file closes (that
        # second failure replaced the error saying what to do with a bare "File too large": an outside pass).
        self.file = open_locked(out, "a+b", out, buffering=0)

    def forget(self, keys: set[str]) -> int:
        """``--overwrite``: the records of ``keys`` (this run's inputs) removed, every other input's kept; returns how
        many were removed (only once captioning starts: a failed model load loses nothing). Until 2026-12-07 it
        emptied the file: re-captioning one picture lost every other caption without a word (an outside pass). The
        rest is written to a new file, locked before it takes the output's name: a kill leaves the old output or the
        new one whole, and no second writer ever finds the output unlocked."""
        self.done()  # a record a kill cut short is dropped first
        target = self.path.resolve()  # (through a link: the file it names, as ``open`` locked it)
        kept, forgotten, removed, at = [], [], 0, 0
        for line in target.read_bytes().splitlines(keepends=True):
            try:
                record = json.loads(line)
            except ValueError:
                record = None  # not one of ours: left as it is, unless blank or half blank (below)
            ours = record is not None and record_key(record) in keys
            # What an in-place --overwrite leaves goes too: blank lines, and a record it was blanking when killed (it
            # starts with the blanks, and is no JSON).
            half_blank = record is None and line[:1] == b" " and bool(line.strip())
            kept.append(b"" if ours or half_blank or not line.strip() else line)
            forgotten += [(at, len(line))] if ours or half_blank else []
            removed, at = removed + ours, at + len(line)
        if not removed:
            return 0
        try:
            self._swap_in(b"".join(kept), target)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EPERM, errno.EBUSY, errno.EXDEV, errno.EROFS):
                raise
            # It cannot be replaced: a file mounted on its own (``docker run -v FILE:...``: EBUSY), or one in a folder
            # this user may not write (found from outside). Its forgotten records are blanked in place, under the lock
            # this process holds.
            _blank_in_place(target, forgotten)
        return removed

    def _swap_in(self, data: bytes, target: Path) -> None:
        """``data`` written to a new file beside ``target`` and locked, then renamed over it: a kill leaves the old
        file or the new one whole, and no second writer ever finds the output unlocked (``open_locked`` checks it
        locked the file that has the name)."""
        for stale in target.parent.glob(f".{glob.escape(target.name)}.*.partial"):  # a killed --overwrite's
            _remove_if_unlocked(stale)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        new = open(partial, "w+b", buffering=0)
        try:
            fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(new, data)
            os.fsync(new.fileno())
            os.chmod(partial, target.stat().st_mode & 0o7777)
            os.replace(partial, target)
        except BaseException:
            new.close()
            partial.unlink(missing_ok=True)
            raise
        self.file.close()
        self.file = new  # appended to from its end, as the "a+b" file was

    def done(self) -> set[str]:
        return done_in_jsonl(self.path)

    def write(self, record: dict) -> None:
        try:
            _write_all(self.file, (json.dumps(record) + "\n").encode())
        except OSError as error:  # a full disk was "glimpse: error: File too large", naming nothing (an outside pass)
            raise OSError(error.errno, f"{error.strerror or error}: the captions written before it are kept; rerun "
                                       "the same command to caption the rest", str(self.path)) from None

    def close(self) -> None:
        self.file.close()  # releases the lock

    def __enter__(self) -> "CaptionOutput":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# How every line the captioner writes begins (``CaptionOutput.write``: ``json.dumps`` of a record whose first field is
# the path): a last line without its newline is one of ours cut short by a kill only if it begins so.
RECORD_START = b'{"path": '


def _cut_record(line: bytes) -> bool:
    """Whether ``line`` (without a newline) can be a record of ours cut short: the start of one, or a part of it."""
    return line.startswith(RECORD_START) or RECORD_START.startswith(line)


def _refuse_what_is_not_a_captions_file(out: Path) -> None:
    """An --out that exists must be a JSONL file of captions: resuming cuts a last line short of its newline
    and appends, which would damage anything else (a typo naming a picture, a device such as /dev/full that
    would be read whole). Its first line must be a caption record (a JSON object with ``caption`` and ``key`` or
    ``path``), or one cut short by a kill, and its last line too. Until 2026-12-06 a file whose first line was blank,
    or a one-line file beginning with '{"', passed: resuming then cut a minified .json file to nothing, and a Ray
    manifest (``{"path": ...}`` lines) passed as captions, its paths counted as captioned (an outside pass)."""
    if not out.exists():
        return
    if not out.is_file():
        raise UserError(f"--out {out}: not a regular file")
    with open(out, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 20)))
        tail = f.read()
    if not head.strip():
        return  # empty (whitespace at most)
    # The first line that does not start blank: an in-place --overwrite blanks records, and one a kill stopped it
    # blanking starts with the blanks.
    body = head
    while body[:1].isspace():
        body = body[body.find(b"\n") + 1:] if b"\n" in body else b""
    first, newline, _ = body.partition(b"\n")
    last = tail[tail.rfind(b"\n") + 1:]  # the part after the last newline: empty, or a line cut short
    ours = _cut_record(first) if not newline else _is_caption_record(first)
    if not ours or not (not last or _cut_record(last)):
        raise UserError(f"--out {out}: this file exists and is not a captions file (JSONL written by glimpse "
                        "caption); choose another --out, nothing was changed")


def _is_caption_record(line: bytes) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "caption" in record and ("key" in record or "path" in record)


def refuse_other_settings(rows: Iterable[dict], out: Path, policy: str, speed: float, prompt: str | None,
                          afresh: str, model: str | None = None, others_kept: bool = False) -> None:
    """A rerun skips the inputs already in ``out``: asked with another model, policy, speed or prompt, it would leave
    captions of two kinds under one output and say nothing (found from outside). Refused, naming both, from what
    the rows record (``model``: ``profiles.model_key``, ``policy``, ``speed``, ``prompt``: the instruction; older
    rows without a field pass it). ``others_kept``: the rows are those of other inputs, which ``--overwrite`` keeps."""
    # This run's model's default, and the one every model was asked before the embedded model had its own: a rerun
    # without --prompt goes on with its own (and another model's captions asked "Describe the image." are not its own).
    defaults = {instruction(kind, None, name) for kind in ("image", "video") for name in (None, model)}
    prompts = {prompt} if prompt is not None else defaults
    model = model_key(model) if model is not None else None
    for row in rows:
        other_model = model is not None and row.get("model") is not None and row["model"] != model
        differs = (other_model or (row.get("policy") is not None and row["policy"] != policy)
                   or (row.get("speed") is not None and float(row["speed"]) != float(speed))
                   or (row.get("prompt") is not None and row["prompt"] not in prompts))
        if differs:
            made_speed = speed if row.get("speed") is None else float(row["speed"])
            made = (f"--model {row['model']} " if other_model else "") + (
                f"--policy {row.get('policy') or policy} --speed {made_speed:g}")
            if row.get("prompt") is not None and row["prompt"] not in prompts:
                # (the instruction a run without --prompt used was shown as if it had been asked for)
                made += " and no --prompt" if row["prompt"] in defaults else f" --prompt {row['prompt']!r}"
            asked = (f"--model {model} " if other_model else "") + f"--policy {policy} --speed {speed:g}" + (
                f" --prompt {prompt!r}" if prompt is not None else "")
            kept = ("its captions of inputs not in this run would be kept" if others_kept
                    else "the inputs already there would be skipped")
            raise UserError(f"{out} holds captions made with {made}, and this run asks for {asked}: {kept} and the "
                            "output would mix the two. Rerun with the same settings to finish it, give another --out "
                            f"for the new ones, or {afresh}")


def records_in_jsonl(out: Path) -> Iterable[dict]:
    """The records of a captions file (a line that is not a JSON object is passed over)."""
    if not out.exists():
        return
    with open(out, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def record_key(record) -> str | None:
    """The key (resolved path) of the input a captions record is about; None for what is not a record of ours. Lines
    written before keys existed are matched by their path, resolved."""
    try:
        return record.get("key") or input_key(Path(record["path"]))
    except (KeyError, TypeError, AttributeError, OSError):
        return None


def done_in_jsonl(out: Path) -> set[str]:
    """Keys (resolved paths) of the inputs already captioned in ``out``; a last line cut short by a kill
    is removed from the file. Lines written before keys existed are matched by their path, resolved."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):  # the run was killed mid-line: drop the partial line
        if not _cut_record(data[data.rfind(b"\n") + 1:]):  # (refused as the output was opened; changed since)
            raise UserError(f"--out {out}: its last line is not a caption record cut short; nothing was changed")
        data = data[: data.rfind(b"\n") + 1]
        with open(out, "r+b") as f:
            f.truncate(len(data))
    done = set()
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            done.add(record_key(json.loads(line)))
        except ValueError:
            continue  # not one of ours: leave it alone, it never matches a path
    done.discard(None)
    return done


def without_this_runs_output(inputs: list[str], fmt: str, out: Path, log: Callable[[str], None]) -> list[str]:
    """The inputs given, less what this run writes: ``glimpse caption photos/*`` run again (the way to resume) is given
    its own output too — its captions.jsonl, refused as a manifest, or with --format txt each picture's sidecar,
    refused as a list file the caption would overwrite — and the rerun could never finish (an outside pass).
    Only a file named as an argument (one inside a folder given is not media, and passed over anyway); an output
    named like a picture is left for the refusals further on, and so is a ``<name>.txt`` that is a list — one of its
    lines names a file or a URL — beside ``<name>.png``: ``check_sidecars`` refuses to write a caption over it."""
    if fmt == "jsonl":
        if out.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS or not out.is_file():
            return inputs  # (a first run: no output yet, and no argument to resolve against it)
        written = {resolved_path(out): "this run's output"}
    else:
        pictures = [Path(i) for i in inputs if not i.lower().endswith(LIST_EXTENSIONS) and Path(i).is_file()]
        written = {resolved_path(sidecar(path)): f"the caption of {path}" for path in pictures}
    kept = []
    for given in inputs:
        what = written.get(resolved_path(Path(given)))
        if what is not None and Path(given).is_file() and not (fmt == "txt" and _is_a_list(Path(given))):
            log(f"{given}: {what}, which this run writes: not an input")
        else:
            kept.append(given)
    return kept


def _is_a_list(path: Path) -> bool:
    """Whether a ``.txt`` reads as a list of inputs (a line names a file or is a URL), not as a caption."""
    try:
        return any(is_uri(entry) or os.path.lexists(entry) for entry in list_entries(path))
    except (UserError, OSError):  # not UTF-8, unreadable: not ours to take as a caption
        return True


def check_sidecars(inputs: list[Path], list_files: Iterable[Path] = ()) -> None:
    """Refuse, before the model loads, sidecars that two inputs would share, that cannot be written (a read-only
    folder) or that would replace a list file given as input (``list.txt`` beside ``list.png``: --overwrite would
    write a caption over the list, and without it the picture would count as captioned)."""
    owners: dict[Path, Path] = {}
    for path in inputs:  # pic.png and pic.jpg: one pic.txt
        if (owner := owners.setdefault(resolved_path(sidecar(path)), path)) != path:
            raise UserError(f"{owner} and {path} would share the caption file {sidecar(path)}: rename one, or use "
                            "--out captions.jsonl")
    lists = {resolved_path(Path(p)) for p in list_files}
    if clash := next((path for path in inputs if resolved_path(sidecar(path)) in lists), None):
        raise UserError(f"the caption of {clash} would be written over the list file {sidecar(clash)}: rename one, "
                        "or use --out captions.jsonl")
    folders = sorted({sidecar(path).parent for path in inputs})
    if locked := [folder for folder in folders if not os.access(folder, os.W_OK | os.X_OK)]:
        shown = ", ".join(map(str, locked[:3])) + (f" and {len(locked) - 3} more" if len(locked) > 3 else "")
        raise UserError(f"--format txt writes <name>.txt next to each input, and {shown} cannot be written: "
                        "use --out captions.jsonl, or make the folder writable")


def write_sidecar(path: Path, caption: str) -> None:
    import uuid

    target = sidecar(path)
    # Written under a short name of its own beside it, then renamed over it: a kill never leaves half a caption. (The
    # name was the sidecar's own with 9 bytes more, too long for an input named with 247-250 bytes.)
    tmp = target.with_name(f".glimpse-{uuid.uuid4().hex[:12]}.partial")
    try:
        tmp.write_text(caption + "\n")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def caption_inputs(engine, inputs: list[Path], *, out: Path | CaptionOutput | None, fmt: str, overwrite: bool,
                   policy: str, speed: float, prompt: str | None, max_new_tokens: int, batch_size: int,
                   media_timeout_s: float | None = None, readers: int = MEDIA_READERS,
                   progress: Callable[[int, int, int], None] | None = None,
                   log: Callable[[str], None] = lambda message: None,
                   keys: dict[Path, str] | None = None) -> CaptionReport:
    """Caption ``inputs`` into ``out`` (a path, or a ``CaptionOutput`` already opened and locked);
    ``media_timeout_s``: the longest one input may take to read (None: no limit); ``readers``: inputs read at once;
    ``progress(done, total, failed)`` after every batch; ``keys``: the inputs' keys where known (``collect_inputs``),
    to sort out what is done; a record's own key is found again as it is written, its file having just been read
    (a link retargeted since the listing, hours earlier in a long run, was written under the old target's key)."""
    report = CaptionReport()
    sidecars = {}
    if fmt == "txt":
        for path in inputs:
            clash = sidecars.setdefault(resolved_path(sidecar(path)), path)
            if clash != path:
                raise UserError(f"{clash} and {path} would share the caption file {sidecar(path)}")
    sink = None
    if fmt == "jsonl":
        sink = out if isinstance(out, CaptionOutput) else CaptionOutput(out)
    try:
        keys = input_keys(inputs, keys) if sink is not None else {}
        return _caption(engine, inputs, keys, sink, fmt, overwrite, policy, speed, prompt, max_new_tokens, batch_size,
                        media_timeout_s, readers, progress, log, report)
    finally:
        if sink is not None and sink is not out:
            sink.close()


def sidecars_skipped(count: int) -> str:
    """What a --format txt rerun says of the inputs it skips: it cannot know whether they were made with its settings
    (a JSONL output records them, and a rerun asking for others is refused), and mixing them went unsaid."""
    many = count > 1
    return (f"{count} input{'s already have a caption beside them' if many else ' already has a caption beside it'} "
            "(<name>.txt), skipped: sidecars do not record the settings they were made with; --overwrite captions "
            f"{'them' if many else 'it'} again with this run's")


def _sorted_inputs(inputs: list[Path], done: set[str] | None, overwrite: bool,
                   keys: dict[Path, str]) -> tuple[list, list, int]:
    """(inputs to caption, inputs whose key another input shares, the count of those captioned already): against the
    keys ``done`` in a JSONL output (``keys``: the inputs'), or (``done`` None) the sidecars beside the inputs. Shared
    keys: two files whose names differ only as the output writes them (a byte that is not UTF-8 is written "\\xNN",
    and a name may hold those four characters) were one key, so that one was skipped as done, or both written under
    one key no reader could tell apart (an outside pass); neither is captioned."""
    keys = keys if done is not None else {}
    named = Counter(keys.values())
    pending, alike, skipped = [], [], 0
    for path in inputs:
        if named[keys.get(path)] > 1:
            alike.append(path)
        # (a folder named as a sidecar is no caption)
        elif not overwrite and (keys[path] in done if done is not None else sidecar(path).is_file()):
            skipped += 1
        else:
            pending.append(path)
    return pending, alike, skipped


def all_captioned(inputs: list[Path], output: CaptionOutput | None, keys: dict[Path, str] | None = None) -> bool:
    """Whether every input has its caption already (in ``output``'s JSONL, or beside it: ``output`` None), each under
    a key of its own: a rerun with nothing left to do needs no model (it loaded one, seconds to minutes). ``keys``:
    the inputs' keys where known (``collect_inputs``)."""
    done = output.done() if output is not None else None
    pending, alike, _ = _sorted_inputs(inputs, done, False, input_keys(inputs, keys) if done is not None else {})
    return not pending and not alike


def _caption(engine, inputs, keys, sink, fmt, overwrite, policy, speed, prompt, max_new_tokens, batch_size,
             media_timeout_s, readers, progress, log, report) -> CaptionReport:
    if sink is not None and overwrite:
        if replaced := sink.forget(set(keys.values())):
            log(f"--overwrite: {replaced} caption{'s' if replaced > 1 else ''} of these inputs removed from "
                f"{sink.path}, to be written again")
    model = model_key(engine.model_id)  # each record's (a path resolved once, not per record)
    pending, alike, report.skipped = _sorted_inputs(inputs, sink.done() if sink is not None else None, overwrite, keys)
    for path in alike:
        report.failed.append((str(path), "its name is written in the output as another input's is (bytes that are "
                                         "not UTF-8 as \\xNN): rename one of them"))
        log(f"failed {path}: another input's name is written in the output as its own is")
    if fmt == "txt" and report.skipped:
        log(sidecars_skipped(report.skipped))

    if progress:  # the bar from the start: it shows before the first batch ends, and its rate counts that batch
        progress(0, len(pending), 0)
    batches = [pending[start:start + batch_size] for start in range(0, len(pending), batch_size)]
    # Closed on the way out, whatever ends the loop: the readings under way stop then, not when the generator is freed.
    with contextlib.closing(_read_ahead(engine, batches, prompt, media_timeout_s, readers)) as read:
        for end, prompts, unreadable in read:
            for path, reason in unreadable:
                report.failed.append((str(path), reason))
                log(f"failed {path}: {reason}")
            # What each was asked, by the kind its prompt was built as (its file, read again here, may be gone).
            asked = {path: instruction("video" if any(m.kind == VIDEO for m in built.media) else "image", prompt,
                                       engine.model_id)
                     for path, built in prompts}
            for path, result in _answer(engine, prompts, policy, speed, max_new_tokens, report, log):
                caption = result.text.strip()
                if fmt == "txt":
                    try:
                        write_sidecar(path, caption)
                    except OSError as error:  # this folder (or the disk) refuses it: the others still get theirs
                        report.failed.append((str(path), f"cannot write {sidecar(path)} ({error.strerror or error})"))
                        log(f"failed {path}: cannot write {sidecar(path)} ({error.strerror or error})")
                        continue
                else:
                    metrics = {k: result.metrics[k] for k in KEPT_METRICS}
                    sink.write({"path": stored(str(path)), "key": input_key(path), "caption": caption,
                                "model": model, "policy": result.policy,
                                "speed": speed, "prompt": stored(asked[path]),
                                "params": result.params, "metrics": metrics,
                                **({"warnings": stored(result.warnings)} if result.warnings else {})})
                report.captioned += 1
            if progress:
                progress(end, len(pending), len(report.failed))
    return report


def _read_ahead(engine, batches: list[list[Path]], prompt: str | None, media_timeout_s: float | None, readers: int):
    """(inputs done after this batch, its prompts, its unreadable inputs) for each batch in turn. The inputs of a batch
    are read side by side, ``readers`` at a time (decoding a video is mostly one core's work), and the next
    batch's while the model answers this one: on a GPU box the GPU would otherwise wait for the CPU to decode every
    batch's videos. At most two batches of prompts are held. When the caller stops early (an error, Ctrl-C), the
    readings under way stop at their next check (``vision.check_reading``) and the others do not start."""
    stopped = threading.Event()
    pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="glimpse-caption-read")

    def read(batch: list[Path]) -> list:
        return [pool.submit(_prompt, engine, path, prompt, media_timeout_s, stopped.is_set) for path in batch]

    try:
        ahead = read(batches[0]) if batches else []
        done = 0
        for number, batch in enumerate(batches):
            prompts, unreadable = [], []
            for path, future in zip(batch, ahead):
                try:
                    prompts.append((path, future.result()))
                except (MediaError, PromptError, OSError) as error:
                    # (a message naming the file: "photo.png: the file is empty" was logged "failed in/photo.png:
                    # photo.png: the file is empty")
                    unreadable.append((path, str(error).removeprefix(f"{path}: ").removeprefix(f"{path.name}: ")))
                except Exception as error:  # noqa: BLE001 — a decoder's error of a kind not met yet (AVIF's
                    # RuntimeError was one): this input fails, saying what was raised; the run goes on
                    unreadable.append((path, f"cannot be read ({type(error).__name__}: {error})"))
            ahead = read(batches[number + 1]) if number + 1 < len(batches) else []
            done += len(batch)
            yield done, prompts, unreadable
    finally:
        stopped.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _prompt(engine, path: Path, prompt: str | None, media_timeout_s: float | None, stopped: Callable[[], bool]):
    """The input's prompt. Each input is read once, within ``media_timeout_s`` of its own: a batch split after a
    failure in the model reuses the prompts."""
    return engine.prepare(_messages(path, prompt, engine.model_id), reading=reading_limit(media_timeout_s, stopped))


def _answer(engine, prompts, policy, speed, max_new_tokens, report, log):
    """(path, result) for every (path, prompt) of ``prompts`` that could be captioned."""
    if not prompts:
        return []
    options = dict(policy=policy, speed=speed, max_new_tokens=max_new_tokens)
    try:
        return list(zip([path for path, _ in prompts], engine.generate_batch([p for _, p in prompts], **options)))
    except (PromptError, OutOfMemory) as error:
        if len(prompts) == 1:  # (a failure in the model names no file: the prompt was built already)
            (path, _), = prompts
            report.failed.append((str(path), str(error)))
            log(f"failed {path}: {error}")
            return []
    # An input of the batch failed in the model (out of memory): find it by halves, so that the others are still
    # decoded in batches (one by one, a long video among 8 cost its 7 neighbours their batching).
    half = len(prompts) // 2
    return [*_answer(engine, prompts[:half], policy, speed, max_new_tokens, report, log),
            *_answer(engine, prompts[half:], policy, speed, max_new_tokens, report, log)]


def instruction(kind: str, prompt: str | None, model: str | None = None) -> str:
    """What each input is asked: ``--prompt``, or the default for its kind ("image" or "video") and ``model`` (as
    ``--model`` names it)."""
    return prompt or (EMBEDDED_PROMPT if model == "embedded" else DEFAULT_PROMPT).format(kind=kind)


def _messages(path: Path, prompt: str | None, model: str | None = None) -> list[dict]:
    kind = kind_of(path)  # (in the reading thread: it opens the file)
    return user_message(instruction(kind, prompt, model), [(kind, str(path))])


class ProgressBar:
    """Progress through tqdm on stderr: inputs done of those pending, failures, rate and ETA."""

    def __init__(self, stream=None):
        self.stream = stream  # None: tqdm's default, stderr (looked up now: tests swap sys.stderr)
        self.bar = None

    def __call__(self, done: int, total: int, failed: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="input", desc="captioning", file=self.stream, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)
        if failed:
            self.bar.set_postfix(failed=failed)
        if done >= total:
            self.bar.close()

    def close(self) -> None:
        """The bar ended where it is, its line finished: what is said next (an error that ended the run) starts a
        line of its own, not the bar's (an outside pass)."""
        if self.bar is not None:
            self.bar.close()

    def log(self, message: str) -> None:
        """A line on stderr under the bar: printed while the bar was drawn, "failed ..." was stuck onto its line
        (``captioning: 0%| | 0/17 [...]failed e1/broken.png: ...``, which a grep for lines starting with "failed"
        missed: an outside pass). ``tqdm.write`` clears the bar, prints the line and draws the bar again."""
        from tqdm import tqdm

        stream, message = self.stream or sys.stderr, one_line(message)
        if self.bar is None or self.bar.disable or getattr(stream, "isatty", lambda: False)():
            tqdm.write(message, file=stream)
        else:  # a file or a pipe: tqdm's clearing "\r" ends no line there, so the message starts one of its own
            stream.write(f"\n{message}\n")
            stream.flush()
