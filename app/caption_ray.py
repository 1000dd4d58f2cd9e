"""`glimpse caption INPUT... --ray --out DIR`: batch captioning as a Ray Data pipeline.

    inputs (keys) --> decode: CPU tasks, a pool that grows with the cluster --> caption: a pool of model
    actors, one Engine each (one GPU each on a GPU cluster) --> the driver writes Parquet shards

* **Keys.** Every input is one key: a local file's resolved path, an http(s) URL (fetched with a size cap
  and a deadline, ``glimpse.fetch``), or a URI with a scheme that a pyarrow file system reads (``s3://``,
  ``gs://``, ``hdfs://`` — as the cluster is configured). Inputs are
  folders (recursive), list files (``.txt``/``.lst``, one path per line) and manifests (``.parquet``,
  ``.jsonl``) with a column of paths or URIs (``--column``, default ``path``).
* **Decode** (``DecodeStage``) builds each input's whole prompt in a CPU task: the file read, the image
  decoded, a video's frames sampled and resized, the chat template and the tokens — with the model's
  ``Preprocessor`` (its modules on the meta device: no weights). Actors get prompts ready to prefill.
  An input that cannot be read, or whose reading takes longer than ``--media-timeout``, becomes a row with ``error``
  set, never a failed job.
* **Caption** (``CaptionStage``) decodes its batch together (``Engine.generate_batch``, the local
  captioner's batched decode: results equal captioning one by one); a batch that fails is retried in
  halves down to the input that failed, so one bad input never costs its neighbours. Actors that die are
  restarted and their batches retried, ``tries`` in all (``--tries``, default ``ACTOR_TRIES``); a batch that kills
  its actor every time is set aside, and its inputs go round again one at a time once the rest is done, so that
  only the culprit becomes an error row.
* **Output.** The driver writes finished rows as Parquet shards (every ``SHARD_ROWS`` rows or
  ``SHARD_SECONDS``), atomically (a temporary name, then a rename), under ``DIR``: ``part-<n>-<id>.parquet`` with ``key``, ``caption``, ``error``,
  ``policy``, ``speed``, ``prompt``, ``prompt_tokens``, ``answer_tokens``, ``ttft_s`` (and a
  ``_captions.jsonl`` beside them with ``--format jsonl``). One driver at a time holds ``DIR/.lock``.
* **Resuming.** A rerun reads the keys of the shards present and sends only the others; since a shard
  exists whole or not at all, a driver killed at any point and rerun gives every input exactly once. Error
  rows count as done, unless the rerun is asked to retry them (``retry_errors``: they are removed first).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glimpse.caption import is_uri, refuse_other_settings, resolved_path, stored, unlisted_failures
from glimpse.common import UserError
from glimpse.common.jsonable import one_line
from glimpse.launcher import Terminated
from glimpse.pipeline.profiles import model_key
from glimpse.pipeline.prompt import user_message
from glimpse.vision.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

# Both forms pin the Ray that Glimpse is tested with (pyproject's `ray` extra).
RAY_INSTALL = ('batch captioning on Ray needs Ray Data: pip install "glimpse-vl[ray]" '
               '(from a checkout of the repository: pip install -e ".[ray]")')
MANIFEST_EXTENSIONS = (".parquet", ".jsonl")
MEDIA_EXTENSIONS = tuple(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
SHARD_GLOB = "part-*.parquet"
# The JSON-lines copy of the shards. The underscore: readers of the folder as one Parquet dataset (pyarrow, Ray
# Data, Spark) skip files that start with "_" or ".", and would fail on this one.
JSONL_NAME = "_captions.jsonl"
SHARD_ROWS, SHARD_SECONDS = 512, 30.0
PROGRESS_SECONDS = 10.0  # the driver says how far it is at most this often
COPY_PIECE_BYTES = 8 * 2**20  # a remote input is copied to a local file this much at a time
URL_MAX_BYTES, URL_DEADLINE_S = 4 * 2**30, 600.0  # a remote input: at most 4 GiB, fetched within 10 minutes
DOWNLOAD_PREFIX = "glimpse-download-"  # a downloaded input's temporary file (videos are decoded from a file)
URI_OPEN_DEADLINE_S = 60.0  # a storage URI's file opened within a minute (then URL_DEADLINE_S for the whole copy)
ACTOR_TRIES = 3  # a batch whose model actor dies is retried on a restarted actor, this many tries in all (--tries)
COLUMNS = ("key", "caption", "error", "policy", "speed", "prompt", "prompt_tokens", "answer_tokens", "ttft_s",
           "warnings", "model")
# Added after the first release of the output layout (a shard written before them reads as null): what the answer
# could not see (a damaged video's frames past the damage), a list of strings, null if nothing; the model that
# captioned the row (``profiles.model_key``: a local folder's absolute path, else the hub id), checked by a rerun.
LATER_COLUMNS = ("warnings", "model")


def _require_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UserError(RAY_INSTALL) from None
    return ray


# ---------------------------------------------------------------------------- inputs and resuming
def collect_keys(items: list[str], column: str = "path", unreadable: list[tuple[str, str]] | None = None,
                 log: Callable[[str], None] = lambda message: None,
                 failed: list[tuple[str, str]] | None = None) -> list[str]:
    """The keys of the inputs, in a stable order, once each: files, folders and list files as the local
    captioner reads them (resolved paths), and manifests' ``column`` (paths resolved, URIs as they are).
    Folders that cannot be listed go to ``unreadable`` (``collect_inputs``). Inputs whose keys the output would
    write alike (``stored``: a byte that is not UTF-8 is written "\\xNN", and a name may hold those four characters)
    go to ``failed`` as (key, reason), none of them captioned: under one key, one was skipped as done (an outside
    pass), and no reader could tell their rows apart."""
    from glimpse.caption import LIST_EXTENSIONS, collect_inputs, list_entries

    keys, seen, local = [], set(), []
    repeated = 0

    def add(key: str) -> None:
        nonlocal repeated
        if key not in seen:
            seen.add(key)
            keys.append(key)
        else:
            repeated += 1

    for item in items:
        if is_manifest(item):
            for value in _manifest_column(item, column, log):
                add(value if is_uri(value) else str(_key_of(_under(item, value))))
        elif is_uri(item):
            add(item)
        elif item.lower().endswith(LIST_EXTENSIONS) and Path(item).is_file():
            for entry in list_entries(Path(item)):
                add(entry if is_uri(entry) else str(_key_of(Path(entry))))
        else:
            local.append(item)
    try:
        for path in collect_inputs(local, unreadable, log=log):  # (it says how far a long listing is)
            add(str(_key_of(path)))
    except FileNotFoundError as error:
        raise UserError(str(error)) from None
    if repeated:  # as empty values are: said, not passed over (47 manifest lines became "46 inputs")
        log(f"{repeated} input{'s' if repeated > 1 else ''} named more than once (the same file or URL): each "
            "input is captioned once")
    written = Counter(stored(key) for key in keys)
    alike = [key for key in keys if written[stored(key)] > 1]
    for key in alike:
        log(one_line(f"failed {key}: another input is written in the output under the same name"))
        if failed is not None:
            failed.append((stored(key), "its name is written in the output as another input's is (bytes that are "
                                        "not UTF-8 as \\xNN): rename one of them"))
    return [key for key in keys if written[stored(key)] == 1]


def is_manifest(item: str) -> bool:
    """A Parquet or JSON-lines manifest: such a file (local or a URI), or a local folder of Parquet files (Spark's
    and Ray Data's own output; a folder of 3 part files was searched for media and "no image or video files
    found"). A folder that holds media as well is a folder of inputs."""
    if item.lower().endswith(MANIFEST_EXTENSIONS) and (is_uri(item) or Path(item).is_file()):
        return True
    folder = Path(item)
    if is_uri(item) or not folder.is_dir():
        return False
    try:
        names = [p.name.lower() for p in folder.iterdir() if p.is_file() and not p.name.startswith(("_", "."))]
    except OSError:
        return False  # collect_inputs reports a folder it cannot list
    return any(n.endswith(".parquet") for n in names) and not any(n.endswith(MEDIA_EXTENSIONS) for n in names)


def _key_of(path: Path) -> Path:
    """A local input's key: its resolved path, so that one file named two ways is captioned once. A link to
    nothing keeps its own name (resolved, it would be reported under a target the user never named)."""
    return path.absolute() if path.is_symlink() and not path.exists() else resolved_path(path)


def _under(manifest: str, value: str) -> Path:
    """A manifest's local entry: a path, relative ones taken from the manifest's folder, or a file:// URL as RFC 8089
    writes it (``file://localhost/...``, percent-encoded names), as list files and arguments take them."""
    from glimpse.caption import _local_path

    path = Path(_local_path(value, f"{manifest}: "))
    return path if path.is_absolute() else Path(manifest).parent / path


def _manifest_column(manifest: str, column: str, log: Callable[[str], None] = lambda message: None) -> list[str]:
    import pyarrow.json
    import pyarrow.parquet

    import pyarrow.dataset

    try:
        if manifest.lower().endswith(".parquet") or Path(manifest).is_dir():  # a file, or a folder of them
            table = pyarrow.dataset.dataset(manifest, format="parquet")
            if column in table.schema.names:  # (a missing column asked for: pyarrow's answer is its whole schema)
                table = table.to_table(columns=[column])
        else:
            table = pyarrow.json.read_json(manifest)
    except (OSError, ValueError, KeyError) as error:  # pyarrow's errors derive from these
        raise UserError(f"{manifest}: cannot read the manifest ({error})") from None
    if column not in table.schema.names:
        raise UserError(f"{manifest}: no column {column!r} (it has {', '.join(table.schema.names)}); use --column")
    values = table.column(column).to_pylist()
    kept = [str(v) for v in values if v]
    if len(kept) < len(values):  # nothing to caption there: said, not passed over
        log(f"{manifest}: {len(values) - len(kept)} empty or null values in column {column!r} left out")
    return kept


def done_keys(out: Path, errors: set[str] | None = None, settings: list[dict] | None = None) -> set[str]:
    """Keys already in ``out``'s shards (those of error rows also into ``errors``; each shard's distinct policy,
    speed, prompt and model into ``settings``). Leftover temporary files of a killed driver are removed: their inputs
    were never counted as done."""
    for stale in out.glob(".part-*.tmp"):
        stale.unlink(missing_ok=True)
    keys: set[str] = set()
    for shard in sorted(out.glob(SHARD_GLOB)):
        table = read_shard(shard, ["key", "error", "policy", "speed", "prompt", "model"])
        for key, error in zip(table.column("key").to_pylist(), table.column("error").to_pylist()):
            keys.add(key)
            if error is not None and errors is not None:
                errors.add(key)
        if settings is not None:
            made_with = ["policy", "speed", "prompt", "model"]
            settings += table.select(made_with).group_by(made_with).aggregate([]).to_pylist()
    return keys


def read_shard(shard: Path, columns: list[str] | None = None):
    """One shard of the output, or a clear error naming it: a file cut short or another program's Parquet file in
    the output folder ended the run with pyarrow's traceback (found from outside)."""
    import pyarrow.parquet

    wanted = columns or list(COLUMNS)
    try:
        present = set(pyarrow.parquet.read_schema(shard).names)
        absent = [c for c in wanted if c in LATER_COLUMNS and c not in present]
        table = pyarrow.parquet.read_table(shard, columns=[c for c in wanted if c not in absent])
    except (OSError, ValueError, KeyError) as error:  # pyarrow's errors derive from these
        raise UserError(f"{shard}: not a shard written by glimpse caption --ray ({str(error).splitlines()[0]}); "
                        f"move it out of {shard.parent} and rerun") from None
    for column in absent:
        declared = _schema().field(column)
        table = table.append_column(declared, pyarrow.nulls(table.num_rows, declared.type))
    return table.select(wanted)


def drop_error_rows(out: Path) -> int:
    """Remove the error rows from ``out``'s shards, so that a rerun tries those inputs
    again (``--retry-errors``: a file fixed since, a storage read that timed out, an actor out of memory).
    Each shard is replaced whole by its rewritten self (a temporary file, then a rename over it), so a kill
    at any point leaves every good row once and every error row either kept or dropped. Returns how many
    rows were dropped."""
    import pyarrow.compute
    import pyarrow.parquet

    dropped = 0
    for shard in sorted(out.glob(SHARD_GLOB)):
        table = read_shard(shard)
        kept = table.filter(pyarrow.compute.is_null(table.column("error")))
        if kept.num_rows == table.num_rows:
            continue
        dropped += table.num_rows - kept.num_rows
        if kept.num_rows == 0:
            shard.unlink()
            continue
        tmp = out / f".{shard.name}.tmp"
        pyarrow.parquet.write_table(kept, tmp)
        os.replace(tmp, shard)
    return dropped


def rewrite_jsonl(out: Path) -> None:
    """Write ``out``'s JSON-lines copy afresh from its shards. A run appends to it after each shard is renamed
    into place, so a driver killed between the two leaves the copy short a shard (or a line cut in half);
    each run starts by rewriting it (under a temporary name, then a rename), so that it has every row once."""
    tmp = out / f".{JSONL_NAME}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for shard in sorted(out.glob(SHARD_GLOB)):
            f.writelines(_json_line(row) for row in read_shard(shard).to_pylist())
    os.replace(tmp, out / JSONL_NAME)


def _json_line(row: dict) -> str:
    return json.dumps({c: stored(row.get(c)) for c in COLUMNS}) + "\n"


class OutputDir:
    """The output folder, locked for one driver at a time; shards are written atomically."""

    def __init__(self, out: Path, jsonl: bool):
        from glimpse.caption import open_locked

        if out.exists() and not out.is_dir():
            raise UserError(f"{out} is a file: with --ray, --out names a folder of Parquet shards")
        self.created = not out.exists()
        self.lock = open_locked(out / ".lock", "a", out)
        # The JSON-lines copy is kept in step whenever there is one (a run without --format jsonl after one with
        # it left it short of that run's rows), and started with --format jsonl.
        self.out = out
        self.jsonl = out / JSONL_NAME if jsonl or (out / JSONL_NAME).exists() else None
        self.count = len(list(out.glob(SHARD_GLOB)))
        self.written: set[str] = set()  # the keys of this run's shards

    def write(self, rows: list[dict]) -> None:
        import pyarrow
        import pyarrow.parquet

        if not rows:
            return
        table = pyarrow.Table.from_pylist([{c: stored(row.get(c)) for c in COLUMNS} for row in rows], schema=_schema())
        name = f"part-{self.count:06d}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.out / f".{name}.tmp"
        pyarrow.parquet.write_table(table, tmp)
        # Counted as written just before, so that a stop between the two can lose rows to the rerun, never write
        # them twice.
        self.written.update(row["key"] for row in rows)
        os.replace(tmp, self.out / name)  # a shard is there whole, or not at all
        self.count += 1
        if self.jsonl is not None:  # a convenience copy; the shards are what resuming reads (rewrite_jsonl)
            with open(self.jsonl, "a", encoding="utf-8") as f:
                f.writelines(_json_line(row) for row in rows)

    def close(self) -> None:
        # A run that wrote nothing leaves no folder behind: removed while the lock is still held, so that no second
        # driver locks a file that is then removed under it.
        if self.created and not any(self.out.glob(SHARD_GLOB)):
            (self.out / ".lock").unlink(missing_ok=True)
            (self.out / JSONL_NAME).unlink(missing_ok=True)
            try:
                self.out.rmdir()
            except OSError:
                pass  # something else is there
        self.lock.close()


def _schema():
    import pyarrow as pa

    return pa.schema([("key", pa.string()), ("caption", pa.string()), ("error", pa.string()), ("policy", pa.string()),
                      ("speed", pa.float64()), ("prompt", pa.string()), ("prompt_tokens", pa.int64()),
                      ("answer_tokens", pa.int64()), ("ttft_s", pa.float64()), ("warnings", pa.list_(pa.string())),
                      ("model", pa.string())])


# ---------------------------------------------------------------------------- the two stages
def read_input(key: str):
    """A local path as it is; a URL's or URI's bytes into a temporary file (videos need a file to seek in) that
    the caller removes, copied in pieces (a long video never sits in memory whole), within a deadline."""
    if not is_uri(key):
        return key, None
    import tempfile
    from urllib.parse import urlsplit

    _remove_stale_downloads()
    handle, tmp = tempfile.mkstemp(prefix=DOWNLOAD_PREFIX, suffix=Path(urlsplit(key).path).suffix)
    try:
        with os.fdopen(handle, "wb") as f:
            if key.startswith(("http://", "https://")):
                from glimpse.fetch import Fetcher

                # The manifest is the operator's own: its URLs may name the cluster's own storage (none refused).
                fetcher = Fetcher(allow_private=True, deadline_s=URL_DEADLINE_S, max_bytes=URL_MAX_BYTES, explain=True)
                f.writelines(fetcher.pieces(key))
            else:
                _copy_from_storage(key, f)
    except BaseException:
        os.unlink(tmp)  # a read that failed leaves nothing behind
        raise
    return tmp, tmp


@functools.cache  # once per worker process
def _remove_stale_downloads() -> None:
    """Remove the downloads that a run stopped mid-fetch left in the temporary folder: a driver killed (or stopped
    with Ctrl-C) takes its workers down with no chance to clean up, and an endless body left 19.5 MB. A download
    untouched for twice the fetch deadline is no live run's: a fetch ends within the deadline, and its file is
    decoded and removed at once."""
    import tempfile

    cutoff = time.time() - 2 * URL_DEADLINE_S
    for leftover in Path(tempfile.gettempdir()).glob(f"{DOWNLOAD_PREFIX}*"):
        try:
            if leftover.is_file() and leftover.stat().st_mtime < cutoff:
                leftover.unlink()
        except OSError:
            pass  # another user's, or already gone


def _copy_from_storage(uri: str, f) -> None:
    """Copy a storage URI (s3://, gs://, hdfs://, ...) into ``f`` through its pyarrow file system, piece by piece.
    pyarrow's calls take no deadline, and a cluster not configured for a scheme can wait on them for ever (GCS
    looks for credentials), holding up its whole block of inputs: the copy runs in a thread of its own, which is
    given up on (left to finish or fail on its own) when the storage has not opened the file within
    ``URI_OPEN_DEADLINE_S`` or the copy is not done within ``URL_DEADLINE_S``."""
    opened, failure = threading.Event(), []

    def copy() -> None:
        try:
            filesystem, path = _filesystem(uri)
            with filesystem.open_input_stream(path) as stream:
                opened.set()
                copied = 0
                while piece := stream.read(COPY_PIECE_BYTES):
                    copied += len(piece)
                    if copied > URL_MAX_BYTES:
                        raise ValueError(f"larger than {URL_MAX_BYTES / 2**30:.0f} GiB")
                    f.write(piece)
        except BaseException as error:  # noqa: BLE001 — handed to the caller (or dropped once it gave up)
            failure.append(error)
        finally:
            opened.set()

    start = time.monotonic()
    worker = threading.Thread(target=copy, name="storage read", daemon=True)
    worker.start()
    if not opened.wait(URI_OPEN_DEADLINE_S):
        raise TimeoutError(f"the storage did not open it within {URI_OPEN_DEADLINE_S:g} s "
                           "(is the cluster configured for this kind of URI?)")
    worker.join(max(0.0, URL_DEADLINE_S - (time.monotonic() - start)))
    if worker.is_alive():
        raise TimeoutError(f"not read within {URL_DEADLINE_S:g} s")
    if failure:
        raise failure[0]


def _filesystem(uri: str):
    """(the pyarrow file system that reads ``uri``, the path in it): S3, GCS, HDFS, ... as the cluster is configured."""
    import pyarrow.fs

    return pyarrow.fs.FileSystem.from_uri(uri)


@functools.cache
def _preprocessor(model: str):
    from glimpse.pipeline import Preprocessor

    return Preprocessor(model)  # once per worker process: Ray reuses workers between tasks


def decode_input(row: dict, model: str, prompt: str | None, media_timeout_s: float | None = None) -> dict:
    """The decode stage, a CPU task: one input's key -> its prompt (pickled) and instruction, or its error.
    ``media_timeout_s``: the longest its reading may take, once it is fetched (None: no limit)."""
    from glimpse.caption import instruction, kind_of
    from glimpse.vision.media import detect_kind, reading_limit

    key, tmp = row["key"], None
    try:
        source, tmp = read_input(key)
        # An image or a video by its content, as the local captioner decides (a local file named .png may hold a
        # video; a URL's path need not end in an extension, and its query is not one).
        kind = kind_of(Path(key)) if tmp is None else detect_kind(source)
        text = instruction(kind, prompt, model)
        with reading_limit(media_timeout_s):
            built = _preprocessor(model).prepare(user_message(text, [(kind, source)]))
        return {"key": key, "prompt_bytes": pickle.dumps(built), "instruction": text, "error": ""}
    except Exception as error:  # noqa: BLE001 — any input that cannot become a prompt is an error row
        # The instruction depends on the kind, unknown here: the row carries the user's --prompt, if any. A
        # downloaded input's errors name the URL, not the temporary file it was copied into.
        message = _error_text(error)
        if tmp is not None:
            message = message.replace(tmp, key).replace(Path(tmp).name, key)
        return {"key": key, "prompt_bytes": b"", "instruction": prompt or "", "error": message}
    finally:
        if tmp is not None:
            os.unlink(tmp)


def _error_text(error: BaseException) -> str:
    """An error row's words: a user's error (an unreadable file, a refused URL) as it is said; anything else with its
    type, which is most of what it says (a TimeoutError, a MemoryError)."""
    return str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"


class CaptionStage:
    """A model actor: one Engine, batches of prompts decoded together."""

    def __init__(self, model: str, policy: str, speed: float, max_new_tokens: int, device: str):
        self.model, self.device, self.engine = model, device, None
        self.policy, self.speed, self.max_new_tokens = policy, speed, max_new_tokens
        # Fault injection for the tests: the first actor to see this file missing creates it and dies; an actor
        # dies on every batch holding an input whose key contains one of GLIMPSE_RAY_CRASH_ON's comma-separated
        # marks (poison inputs).
        self.crash_marker = os.environ.get("GLIMPSE_RAY_CRASH_ONCE")
        self.crash_on = os.environ.get("GLIMPSE_RAY_CRASH_ON")

    def __call__(self, batch: dict) -> dict:
        if self.crash_marker and not os.path.exists(self.crash_marker):
            Path(self.crash_marker).touch()
            os._exit(1)
        if self.crash_on and any(mark in key for key in batch["key"] for mark in self.crash_on.split(",")):
            os._exit(1)
        rows = [{"key": k, "prompt_bytes": p, "prompt": i, "error": e}
                for k, p, i, e in zip(batch["key"], batch["prompt_bytes"], batch["instruction"], batch["error"])]
        ready = [r for r in rows if not r["error"]]
        if self.engine is None:
            # Loaded here, not in __init__: Ray runs __init__ in the actor's main thread and the batches in an
            # executor thread, and on CPU torch runs ~1.8x slower in a thread other than the first to use it
            # (a second OpenMP team; docs/benchmarks.md).
            from glimpse.pipeline import load_engine

            self.engine = load_engine(self.model, device=self.device)
        answers = self._answer([pickle.loads(r["prompt_bytes"]) for r in ready])
        for row, answer in zip(ready, answers):
            row.update(answer)
        out = [self._row(r) for r in rows]
        return {c: [r[c] for r in out] for c in COLUMNS}

    def _answer(self, prompts: list) -> list[dict]:
        if not prompts:
            return []
        options = dict(policy=self.policy, speed=self.speed, max_new_tokens=self.max_new_tokens)
        try:
            results = self.engine.generate_batch(prompts, **options)
        except Exception as error:  # noqa: BLE001 — find the input that failed; keep the others
            if len(prompts) == 1:
                return [{"error": _error_text(error)}]
            half = len(prompts) // 2  # by halves: the others are still decoded in batches
            return self._answer(prompts[:half]) + self._answer(prompts[half:])
        # The warnings travel as JSON text: a batch where none has any would be a column of empty lists, of no
        # element type, which Ray cannot put beside another batch's list of strings. The driver reads them back.
        return [{"caption": r.text.strip(), "policy": r.policy, "speed": self.speed,
                 "prompt_tokens": sum(r.metrics["prompt_tokens"].values()), "answer_tokens": r.metrics["new_tokens"],
                 "ttft_s": r.metrics["ttft_s"], "error": "", "warnings": json.dumps(r.warnings) if r.warnings else None}
                for r in results]

    def _row(self, row: dict) -> dict:
        out = {c: row.get(c) for c in COLUMNS}
        out["error"] = out["error"] or None
        out["speed"] = self.speed
        out["policy"] = out["policy"] or self.policy  # an error row says what it was asked with
        out["prompt"] = out["prompt"] or None
        return out


# ---------------------------------------------------------------------------- the driver
@dataclass
class RayReport:
    captioned: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    answer_tokens: int = 0
    seconds: float = 0.0
    first_rows_s: float | None = None  # when the first captions reached the driver: Ray's start-up and one batch
    dashboard: str | None = None
    earlier_errors: int = 0  # of the skipped inputs, those whose row in the output is an error row


def _refuse_a_shadowing_folder(folder: Path) -> None:
    """Ray puts the driver's current folder first on its workers' import path, so a glimpse.py or glimpse/ there
    would be imported by the actors instead of Glimpse: they would die with no hint why. Say so before starting."""
    for name in ("glimpse.py", "glimpse"):
        found = folder / name
        if (found.is_file() or (found / "__init__.py").is_file()) and found.resolve() != Path(__file__).parent:
            raise UserError(f"{found} would be imported by Ray's workers instead of Glimpse (Ray puts the current "
                            f"folder on their path): run glimpse caption --ray from another folder")


def caption_on_ray(inputs: list[str], *, out: Path, model: str, policy: str, speed: float, prompt: str | None,
                   max_new_tokens: int, batch_size: int, actors: int, gpus_per_actor: float | None, address: str | None,
                   column: str = "path", jsonl: bool = False, device: str = "auto", num_cpus: int | None = None,
                   shard_rows: int = SHARD_ROWS, retry_errors: bool = False, media_timeout_s: float | None = None,
                   tries: int = ACTOR_TRIES, log: Callable[[str], None] = lambda message: None) -> RayReport:
    ray = _require_ray()
    _refuse_a_shadowing_folder(Path.cwd())
    unreadable: list[tuple[str, str]] = []
    alike: list[tuple[str, str]] = []
    keys = collect_keys(inputs, column, unreadable, log, alike)
    unlisted = unlisted_failures(unreadable, log) + alike
    if not keys and not alike:
        raise UserError("no image or video files found in the inputs")
    output = OutputDir(out, jsonl)
    report = RayReport(failed=list(unlisted))  # a copy: the progress line counts the failures past these
    made_by = model_key(model)  # each row's model column
    previous = _NOT_INSTALLED
    try:
        earlier_errors: set[str] = set()
        settings: list[dict] = []
        done = done_keys(out, earlier_errors, settings)
        refuse_other_settings(settings, out, policy, speed, prompt, "remove its shards to start it afresh", model)
        if retry_errors and (dropped := drop_error_rows(out)):
            log(f"{dropped} error rows removed from {out}: their inputs are tried again")
            done, earlier_errors = done - earlier_errors, set()  # (what is left is the good rows: no second read)
        if output.jsonl is not None:
            rewrite_jsonl(out)
        pending = [k for k in keys if stored(k) not in done]
        report.skipped = len(keys) - len(pending)
        report.earlier_errors = sum(1 for k in keys if stored(k) in earlier_errors)
        log(f"{len(keys)} inputs: {report.skipped} already in {out}"
            + (f" ({report.earlier_errors} of them error rows: --retry-errors tries them again)"
               if report.earlier_errors else "") + f", {len(pending)} to caption")
        if not pending:
            return report
        # A plain `kill` stops the run as Ctrl-C does ("terminated"; the shards written are kept): Ray's own
        # handler, which ray.init installs (so ours goes in again after it), printed a crash dump for it.
        previous = _stop_on_sigterm()
        writing, stop_writing = threading.Lock(), threading.Event()  # the shard writer's (below)
        writer: threading.Thread | None = None
        buffered: list[dict] = []  # rows not yet in a shard
        started_here = not ray.is_initialized()
        try:
            if started_here:
                with signals_deferred():
                    context = _start_ray(ray, address, num_cpus)
                report.dashboard = getattr(context, "dashboard_url", None) or None
                _stop_on_sigterm()
            gpus_per_actor = _check_cluster(ray, actors, gpus_per_actor, local=address is None, log=log)
            start = last_write = time.perf_counter()
            returned: set[str] = set()

            def write_due() -> None:
                """The rows held longer than SHARD_SECONDS since the last shard, written (under ``writing``)."""
                nonlocal buffered, last_write
                if buffered and time.perf_counter() - last_write >= SHARD_SECONDS:
                    output.write(buffered)
                    buffered, last_write = [], time.perf_counter()

            def write_on_time() -> None:
                # Rows are written when SHARD_SECONDS have passed, not only when more rows arrive: 40 rows done
                # while one slow input held up the rest were never written, and a kill 2 minutes later lost them.
                while not stop_writing.wait(1.0):
                    with writing:
                        try:
                            write_due()
                        except OSError as error:  # the next write in the driver's own thread raises it
                            log(f"could not write a shard yet: {error}")

            writer = threading.Thread(target=write_on_time, name="shard writer", daemon=True)
            writer.start()

            said = start

            def take(rows: list[dict]) -> None:
                nonlocal buffered, last_write, said
                if report.first_rows_s is None:
                    report.first_rows_s = time.perf_counter() - start
                for row in rows:  # before the shard writer can see them
                    if isinstance(row.get("warnings"), str):  # as the model actor sent them (_answer)
                        row["warnings"] = json.loads(row["warnings"])
                    row["model"] = made_by
                with writing:
                    buffered += rows
                    # A shard every shard_rows rows, or once rows have waited SHARD_SECONDS since the last shard
                    # (here, or in the writer above): few files on big runs, little lost to a kill.
                    while len(buffered) >= shard_rows:
                        output.write(buffered[:shard_rows])
                        buffered, last_write = buffered[shard_rows:], time.perf_counter()
                    write_due()
                for row in rows:
                    returned.add(row["key"])
                    if row["error"]:
                        report.failed.append((row["key"], row["error"]))
                    else:
                        report.captioned += 1
                        report.answer_tokens += row["answer_tokens"] or 0
                now = time.perf_counter()
                finished = len(returned) == len(pending) and rows  # (the set-aside pass ends with an empty take)
                if now - said >= PROGRESS_SECONDS or finished:  # Glimpse's own count of its inputs
                    said = now
                    log(f"captioned {report.captioned} of {len(pending)}, failed {len(report.failed) - len(unlisted)} "
                        f"({report.captioned / (now - start):.2f} inputs/s)")

            options = (model, policy, speed, prompt, max_new_tokens, media_timeout_s)
            for rows in _pipeline(ray, pending, *options, batch_size, actors, gpus_per_actor, device, tries):
                take(rows)
            # A batch whose actor died on every try (an input that exhausts memory or crashes the model) was
            # dropped with its neighbours: those inputs go round again one at a time, so only the culprit fails.
            if lost := [k for k in pending if k not in returned]:
                log(f"{len(lost)} inputs lost with a batch that failed {tries} times (a worker died): "
                    "trying them again one at a time")
                # Every batch lost: a model that cannot load on the workers, or one poison batch that took the
                # batches queued at its actor with it. A few inputs alone tell which, before all of them are tried.
                probe = lost[:batch_size + 1] if len(lost) == len(pending) > batch_size else []
                for group in (probe, lost[len(probe):]):  # (the probe is the first few)
                    if not group:
                        continue
                    for rows in _pipeline(ray, group, *options, 1, 1, gpus_per_actor, device, tries, retrying=True):
                        take(rows)
                    if group is probe and not any(k in returned for k in probe):
                        raise UserError(f"every batch failed ({len(lost)} inputs): Ray's log above has the cause (a "
                                        "model that cannot load on the workers, a missing package, out of memory, ...)")
                take([{**{c: None for c in COLUMNS}, "key": k, "speed": speed, "policy": policy, "prompt": prompt,
                       "error": f"a worker died on this input {tries} times (out of memory, or a crash decoding "
                                "it or in the model; Ray's log has the cause)"} for k in lost if k not in returned])
            stop_writing.set()
            with writing:
                output.write(buffered)
                buffered = []
            report.seconds = time.perf_counter() - start
        finally:
            stop_writing.set()
            if writer is not None:
                writer.join()  # a shard it is writing is finished before the output folder is closed
            # Stopped by Ctrl-C (or a plain kill), the rows the driver holds are written, not captioned again by the
            # rerun; those a shard of which was under way when the stop came are in it, or left to the rerun.
            if unwritten := [row for row in buffered if row["key"] not in output.written]:
                try:
                    output.write(unwritten)
                except OSError as error:
                    log(f"could not write the last {len(unwritten)} rows ({error}): the rerun captions them")
            if started_here:
                ray.shutdown()
    finally:
        if previous is not _NOT_INSTALLED:
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        output.close()
    return report


_NOT_INSTALLED = object()


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM that come inside the block take effect at its end (as KeyboardInterrupt, SIGTERM as its
    ``Terminated``). Around Ray's start:
    stopped halfway through ``ray.init``, the driver printed "interrupted" and then died in Ray's exit with a
    segmentation fault (found from outside, 3 of 9 tries); started whole, it is stopped as at any other time."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {number: signal.signal(number, lambda signum, frame: came.append(signum))
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except SystemExit as stop:
        # ray.init puts in its own SIGTERM handler as it begins (sys.exit(15)): a kill while Ray starts ended the
        # driver with status 15 and no word (found from outside, 3 of 3 tries). It stops the driver as any other.
        if stop.code != signal.SIGTERM:
            raise
        came.append(signal.SIGTERM)
    finally:
        for number, handler in previous.items():
            # (ray.init puts in a SIGTERM handler of its own: ours goes in again after it, in caption_on_ray)
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
    if came:
        raise Terminated if signal.SIGTERM in came else KeyboardInterrupt


def _stop_on_sigterm():
    """SIGTERM raises ``Terminated`` (a KeyboardInterrupt) in the driver, as ``glimpse.launcher`` has it; returns the
    handler it replaced (None: one installed from C, which cannot be put back but as the default), or
    ``_NOT_INSTALLED`` off the main thread."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return _NOT_INSTALLED

    def stop(signum, frame):
        raise Terminated

    return signal.signal(signal.SIGTERM, stop)


def _start_ray(ray, address: str | None, num_cpus: int | None):
    """Ray, started or joined: without ``address`` a local cluster of our own, even when `ray start` left one
    running or RAY_ADDRESS names one (ray.init(None) would join it, and then refuse num_cpus). A cluster that does
    not answer is said at once (Ray retries an address for minutes), and so is a Ray Client address without
    the client's package."""
    if address and not address.startswith("ray://") and address not in ("auto", "local"):
        import socket

        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError):
            raise UserError(f"no Ray cluster answers at --ray-address {address} (its head node's GCS address, "
                            "host:6379 by default; `ray start --head` prints it)") from None
    try:
        return ray.init(address=address or "local", num_cpus=(num_cpus or local_cpus()) if address is None else None,
                        log_to_driver=False, include_dashboard=False if address is None else None)
    except ConnectionError:  # "auto" with no cluster running (Ray's words name its own --address flag)
        raise UserError(f"--ray-address {address}: no Ray cluster is running here to join; start one with `ray start "
                        "--head` (or give its head's address, host:6379), or leave --ray-address out for a local one"
                        ) from None
    except (ValueError, ImportError) as error:
        if "ray[client]" in str(error) or "client" in str(error).lower():
            raise UserError(f"--ray-address {address}: a Ray Client address needs the client's package: pip install "
                            '"ray[client]==2.60.0" (or give the head node\'s GCS address, host:6379)') from None
        raise


def _check_cluster(ray, actors: int, gpus_per_actor: float | None, *, local: bool,
                   log: Callable[[str], None]) -> float:
    """GPUs per actor (None: one on a cluster that has GPUs), after refusing what would wait for ever: actors
    that want GPUs a local cluster does not have, and CPU actors that leave the decode stage no CPU."""
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0), int(resources.get("CPU", 0))
    if gpus_per_actor is None:
        gpus_per_actor = 1.0 if gpus else 0.0
    if gpus_per_actor and gpus < gpus_per_actor:
        if local:
            raise UserError(f"--gpus-per-actor {gpus_per_actor:g}, but this machine has {gpus:g} GPUs for Ray: give "
                            "--gpus-per-actor 0 (or --device cpu) to caption on its CPUs")
        log(f"the cluster has {gpus:g} GPUs now: the actors wait until it has {gpus_per_actor:g} per actor "
            "(an autoscaler adding nodes)")
    if not gpus_per_actor and actors > cpus - 1:
        if local:
            raise UserError(f"--actors {actors} CPU actors on a cluster of {cpus} CPUs leave none to decode the "
                            f"inputs (each actor takes at least one): give --actors {max(1, cpus - 1)} or fewer")
        log(f"the cluster has {cpus} CPUs now: {actors} CPU actors and the decode stage wait for more (an "
            "autoscaler adding nodes)")
    return gpus_per_actor


def _pipeline(ray, keys, model, policy, speed, prompt, max_new_tokens, media_timeout_s, batch_size, actors,
              gpus_per_actor, device, tries: int = ACTOR_TRIES, retrying: bool = False):
    """The finished rows, one list per caption batch, as the pipeline streams them out. A batch whose actor died
    ``tries`` times (restarted each time) is left out rather than retried for ever or failing the run:
    the caller finds its inputs missing. ``retrying``: a second pass over such inputs, whose CPU actor takes one
    CPU (the first pass's actor holds its CPUs until Ray has stopped restarting it, up to a minute)."""
    context = ray.data.DataContext.get_current()  # a dataset takes a copy of it when it is created
    allowed, context.max_errored_blocks = context.max_errored_blocks, -1  # a failed block does not end the run
    try:
        # Small blocks keep work flowing to the actors and each shard small: what a killed driver loses is
        # only what was in flight.
        dataset = ray.data.from_items([{"key": k} for k in keys],
                                      override_num_blocks=max(1, -(-len(keys) // batch_size)))
        decoded = dataset.map(decode_input, fn_kwargs={"model": model, "prompt": prompt,
                                                       "media_timeout_s": media_timeout_s}, num_cpus=1)
        if gpus_per_actor:
            placement = {"num_gpus": gpus_per_actor, "num_cpus": 1}
        elif retrying:
            placement = {"num_cpus": 1}
        else:  # CPU actors share the machine's cores (Ray sets each actor's torch threads to its CPUs)
            placement = {"num_cpus": max(1, int(ray.cluster_resources().get("CPU", 2) - 1) // actors)}
        # Retrying, the actor is given one input at a time: tasks queued at an actor die with it, so an input
        # waiting behind the poison one would die with it on every try and become an error row of its own.
        pool = ({"compute": ray.data.ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=1)} if retrying
                else {"concurrency": actors})
        captioned = decoded.map_batches(
            CaptionStage, batch_size=batch_size, **pool,
            fn_constructor_kwargs={"model": model, "policy": policy, "speed": speed,
                                   "max_new_tokens": max_new_tokens, "device": device},
            max_restarts=-1, max_task_retries=tries - 1, **placement)
    finally:
        context.max_errored_blocks = allowed
    # No prefetch: with Ray's default of one batch ahead, each finished batch reached the driver only once the next
    # one had finished too, so rows done behind a slow input waited with it, where a kill lost them (found from
    # outside).
    for batch in captioned.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
        yield batch.to_pylist()


def local_cpus() -> int:
    """Logical CPUs of a local cluster: the machine's cores plus one, so that the decode stage has a slot
    beside CPU actors that take every core."""
    return (os.cpu_count() or 1) + 1
