"""`glimpse caption --ray`: the Ray Data pipeline gives the local captioner's captions, turns bad inputs
into error rows, survives an actor that dies, and a driver killed midway then rerun gives every input
exactly once. One small local Ray cluster serves the in-process runs; the killed drivers start their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ray = pytest.importorskip("ray")  # in the test install (README); the base install does without it

from glimpse.caption_ray import caption_on_ray  # noqa: E402
from glimpse.pipeline.profiles import model_key  # noqa: E402
from conftest import refuse_listing, serve_bytes, write_damaged_video, write_video  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(checkpoints):
    return str(checkpoints["qwen2_vl"])  # takes images and video


def _inputs(folder: Path, images: int, video: bool = True) -> list[Path]:
    (folder / "nested").mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(images):
        pixels = (np.random.RandomState(i).rand(40 + i % 5, 56, 3) * 255).astype("uint8")
        path = folder / ("nested" if i % 2 else "") / f"img{i:02d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    if video:
        paths.append(write_video(folder / "nested" / "clip.mp4", frames=8, fps=4, size=(56, 56)))
    return paths


def _rows(out: Path) -> list[dict]:
    import pyarrow.parquet

    return [row for shard in sorted(out.glob("part-*.parquet")) for row in pyarrow.parquet.read_table(shard).to_pylist()]


def _ray_caption(inputs, out, model, **extra):
    options = dict(out=out, model=model, policy="auto", speed=0.5, prompt=None, max_new_tokens=6, batch_size=3,
                   actors=1, gpus_per_actor=0.0, address=None, device="cpu")
    return caption_on_ray([str(i) for i in inputs], **{**options, **extra})


def test_the_ray_pipeline_gives_the_local_captioners_captions(cluster, model, tmp_path):
    from glimpse.caption import caption_inputs, collect_inputs
    from glimpse.pipeline import load_engine

    paths = _inputs(tmp_path / "in", 5)
    paths.append(write_damaged_video(tmp_path / "in" / "nested" / "damaged.mp4", frames=30))
    report = _ray_caption([tmp_path / "in"], tmp_path / "out", model, jsonl=True)
    assert report.captioned == len(paths) and not report.failed
    rows = {r["key"]: r for r in _rows(tmp_path / "out")}
    assert set(rows) == {str(p.resolve()) for p in paths}

    local = tmp_path / "local.jsonl"
    caption_inputs(load_engine(model, device="cpu"), collect_inputs([str(tmp_path / "in")]), out=local, fmt="jsonl",
                   overwrite=False, policy="auto", speed=0.5, prompt=None, max_new_tokens=6, batch_size=3)
    for line in local.read_text().splitlines():
        record = json.loads(line)
        row = rows[record["key"]]
        assert row["caption"] == record["caption"] and row["error"] is None
        # What the answer could not see, as the local captioner says it (the damaged video's frames past the damage).
        assert row["warnings"] == record.get("warnings"), record["key"]
        assert row["model"] == record["model"] == model_key(model)
        assert row["answer_tokens"] == record["metrics"]["new_tokens"] and row["policy"] == "auto"
        assert row["prompt"].startswith("Describe this video" if record["key"].endswith(".mp4") else "Describe this image")
    copy = tmp_path / "out" / "_captions.jsonl"
    jsonl = [json.loads(line) for line in copy.read_text().splitlines()]
    assert sorted(r["key"] for r in jsonl) == sorted(rows)
    import pyarrow.parquet  # the folder reads as one Parquet dataset, the JSONL copy beside the shards included

    assert sorted(pyarrow.parquet.read_table(tmp_path / "out").column("key").to_pylist()) == sorted(rows)
    damaged = rows[str(paths[-1].resolve())]["warnings"]
    assert len(damaged) == 1 and "damaged.mp4: only " in damaged[0] and "of the 30 frames" in damaged[0]

    # A shard written before the warnings column was added reads as if it had none.
    shard = sorted((tmp_path / "out").glob("part-*.parquet"))[0]
    pyarrow.parquet.write_table(pyarrow.parquet.read_table(shard).drop_columns(["warnings"]), shard)

    again = _ray_caption([tmp_path / "in"], tmp_path / "out", model)  # a rerun finds everything done
    assert again.skipped == len(paths) and again.captioned == 0 and len(_rows(tmp_path / "out")) == len(paths)
    # A driver killed after renaming a shard but before appending its rows to the copy (or halfway through a
    # line): the next run, even with nothing left to caption, gives the copy every row once again.
    lines = copy.read_text().splitlines(keepends=True)
    copy.write_text("".join(lines[2:]) + lines[0][:10])
    _ray_caption([tmp_path / "in"], tmp_path / "out", model, jsonl=True)
    assert sorted(json.loads(line)["key"] for line in copy.read_text().splitlines()) == sorted(rows)


def test_corrupt_empty_missing_and_non_media_inputs_are_error_rows(cluster, model, tmp_path):
    good = _inputs(tmp_path / "in", 2, video=False)
    (tmp_path / "in" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    (tmp_path / "in" / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.md").write_text("not media")
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join([*(str(p) for p in good), "in/broken.png", "in/empty.jpg", "notes.md",
                                  str(tmp_path / "gone.png")]))
    import pyarrow.parquet

    # The same inputs through a Parquet manifest with another column name.
    import pyarrow as pa

    manifest = tmp_path / "manifest.parquet"
    pyarrow.parquet.write_table(pa.table({"file": listing.read_text().splitlines()}), manifest)
    for source, extra in ((listing, {}), (manifest, {"column": "file"})):
        out = tmp_path / f"out-{source.suffix[1:]}"
        report = _ray_caption([source], out, model, **extra)
        rows = {Path(r["key"]).name: r for r in _rows(out)}
        assert report.captioned == 2 and len(report.failed) == 4
        assert set(rows) == {"img00.png", "img01.png", "broken.png", "empty.jpg", "notes.md", "gone.png"}
        for name in ("broken.png", "empty.jpg", "notes.md", "gone.png"):
            assert rows[name]["error"] and rows[name]["caption"] is None, name
            assert rows[name]["policy"] == "auto" and rows[name]["speed"] == 0.5, name  # what it was asked with
        assert "empty" in rows["empty.jpg"]["error"]


def test_error_rows_are_done_until_a_rerun_retries_them_and_then_every_input_is_there_once(cluster, model, tmp_path):
    good = _inputs(tmp_path / "in", 3, video=False)
    broken = tmp_path / "in" / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n cut off")
    out = tmp_path / "out"
    first = _ray_caption([tmp_path / "in"], out, model, jsonl=True, shard_rows=2)
    assert first.captioned == 3 and [Path(k).name for k, _ in first.failed] == ["broken.png"]
    # --shard-rows is each shard's size (batches of 3 made shards of 3)
    import pyarrow.parquet

    assert [pyarrow.parquet.read_metadata(p).num_rows for p in sorted(out.glob("part-*.parquet"))] == [2, 2]
    Image.open(good[0]).save(broken)  # the file is replaced by a good one
    again = _ray_caption([tmp_path / "in"], out, model, jsonl=True)
    assert again.skipped == 4 and again.captioned == 0  # an error row counts as done ...
    assert again.earlier_errors == 1  # ... and said to be one (the command exits 1)
    # ... until retried; without --format jsonl the copy made by the first run is kept in step all the same
    retried = _ray_caption([tmp_path / "in"], out, model, retry_errors=True)
    assert retried.skipped == 3 and retried.captioned == 1 and not retried.failed
    rows = _rows(out)
    assert sorted(r["key"] for r in rows) == sorted(str(p.resolve()) for p in [*good, broken])  # each once
    assert all(r["error"] is None and r["caption"] is not None for r in rows)
    copy = [json.loads(line) for line in (out / "_captions.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in copy) == sorted(r["key"] for r in rows) and not any(r["error"] for r in copy)


def test_file_names_that_are_not_utf8_are_captioned_and_stored_escaped_and_a_rerun_skips_them(cluster, model, tmp_path):
    """Linux file names are bytes: one that is not UTF-8 reaches Python as lone surrogates, which Parquet's strings
    cannot hold. A run over one captioned everything, then failed at its first shard, and so did every rerun. The
    output holds such bytes as \\xNN escapes (key and error), and a rerun finds them done."""
    folder = tmp_path / "in"
    good = _inputs(folder, 1, video=False)[0]
    # "café" in Latin-1 (not UTF-8 before a space), and 0xFF, which UTF-8 never uses
    odd = os.fsdecode(bytes(folder) + b"/caf\xe9 \xff.png")
    broken = os.fsdecode(bytes(folder) + b"/broken\xfe.png")
    Path(odd).write_bytes(good.read_bytes())
    Path(broken).write_bytes(b"\x89PNG\r\n\x1a\n cut off")
    out = tmp_path / "out"
    said = []
    first = _ray_caption([folder], out, model, jsonl=True, log=said.append)
    assert first.captioned == 2 and len(first.failed) == 1
    assert [line for line in said if line.startswith("captioned 2 of 3, failed 1 ")], said  # (it said "failed 0")
    rows = {r["key"]: r for r in _rows(out)}
    assert set(rows) == {str(good.resolve()), str(folder.resolve()) + "/caf\\xe9 \\xff.png",
                         str(folder.resolve()) + "/broken\\xfe.png"}
    assert rows[str(folder.resolve()) + "/caf\\xe9 \\xff.png"]["caption"]
    assert "broken\\xfe.png" in rows[str(folder.resolve()) + "/broken\\xfe.png"]["error"]
    copy = [json.loads(line) for line in (out / "_captions.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(r["key"] for r in copy) == sorted(rows)
    again = _ray_caption([folder], out, model)
    assert again.skipped == 3 and again.captioned == 0 and again.earlier_errors == 1


def test_two_inputs_the_output_would_name_alike_both_fail_instead_of_one_passing_for_done(tmp_path):
    """"caf\\xe9.png" (those four characters) and "caf" + the byte 0xE9 + ".png" are one key once written (\\xNN):
    the second was skipped as done, never captioned (an outside pass). Both fail, saying so; the others are kept."""
    from glimpse.caption_ray import collect_keys

    folder = tmp_path / "in"
    good = _inputs(folder, 1, video=False)[0]
    Path(os.fsdecode(bytes(folder) + b"/caf\xe9.png")).write_bytes(good.read_bytes())
    (folder / "caf\\xe9.png").write_bytes(good.read_bytes())
    failed, said = [], []
    assert collect_keys([str(folder)], log=said.append, failed=failed) == [str(good.resolve())]
    assert [key for key, _ in failed] == [str(folder.resolve()) + "/caf\\xe9.png"] * 2
    assert all("rename one of them" in reason for _, reason in failed) and len(said) == 2


def test_manifest_entries_are_read_as_list_files_and_arguments_are(tmp_path):
    """file:// URLs as RFC 8089 writes them (they became "<manifest folder>/localhost/..." and "%20" names, error rows
    for files that were there), a manifest's suffix in any case, a link to nothing under its own name (not its
    target's), and empty entries said rather than dropped without a word."""
    import pyarrow as pa
    import pyarrow.parquet

    from glimpse.caption_ray import _manifest_column, collect_keys
    from glimpse.common import UserError

    folder = tmp_path / "a b"
    folder.mkdir()
    image = _inputs(folder, 1, video=False)[0]
    (folder / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    manifest = tmp_path / "M.PARQUET"
    entries = [f"file://{folder.as_posix().replace(' ', '%20')}/{image.name}", f"file://localhost{image}",
               str(folder / "dangling.png"), "", None]
    pyarrow.parquet.write_table(pa.table({"path": entries}), manifest)
    said = []
    keys = collect_keys([str(manifest)], log=said.append)
    assert keys == [str(image.resolve()), str(folder / "dangling.png")]
    # (the first two name one file: said, as the empty values are)
    assert said == [f"{manifest}: 2 empty or null values in column 'path' left out",
                    "1 input named more than once (the same file or URL): each input is captioned once"]
    with pytest.raises(UserError) as refused:
        collect_keys([str(manifest)], column="nope")
    assert str(refused.value) == f"{manifest}: no column 'nope' (it has path); use --column"
    # A folder of Parquet files (what Spark and Ray write; given as a URI, s3://.../listing.parquet/) is one manifest
    listing = tmp_path / "listing.parquet"
    listing.mkdir()
    pyarrow.parquet.write_table(pa.table({"path": [str(image)]}), listing / "part-0.parquet")
    assert _manifest_column(str(listing), "path") == [str(image)]
    # ... given as a local folder too, named .parquet or not, beside Spark's _SUCCESS: it was searched for media
    # ("no image or video files found"). A folder that holds media as well is a folder of inputs.
    parts = tmp_path / "parts"
    parts.mkdir()
    for i, chunk in enumerate(([str(image)], [str(folder / "dangling.png")])):
        pyarrow.parquet.write_table(pa.table({"path": chunk}), parts / f"part-{i}.parquet")
    (parts / "_SUCCESS").write_text("")
    assert collect_keys([str(listing)]) == [str(image.resolve())]
    assert collect_keys([str(parts)]) == [str(image.resolve()), str(folder / "dangling.png")]
    Image.new("RGB", (8, 8)).save(parts / "photo.png")
    assert collect_keys([str(parts)]) == [str((parts / "photo.png").resolve())]


def test_what_would_wait_for_ever_is_refused(cluster, model, tmp_path):
    """CPU actors that take every CPU leave the decode stage none (the run stood at 0 for ever), actors that want
    GPUs a local cluster does not have waited for ever, and an address where no cluster answers was retried for
    minutes; a Ray Client address without the client's package was a traceback."""
    from glimpse.caption_ray import _start_ray
    from glimpse.common import UserError

    inputs = _inputs(tmp_path / "in", 1, video=False)
    with pytest.raises(UserError, match="--actors 3 CPU actors on a cluster of 3 CPUs leave none"):
        _ray_caption(inputs, tmp_path / "out", model, actors=3)
    with pytest.raises(UserError, match="--gpus-per-actor 1, but this machine has 0 GPUs"):
        _ray_caption(inputs, tmp_path / "out", model, gpus_per_actor=1.0)
    assert not (tmp_path / "out").exists()  # a refused run leaves no folder behind

    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: nothing answers there
        with pytest.raises(UserError, match=f"no Ray cluster answers at --ray-address 127.0.0.1:{port}"):
            _start_ray(ray, f"127.0.0.1:{port}", None)

    class WithoutClient:
        @staticmethod
        def init(**kwargs):
            raise ValueError("Ray Client requires pip package `ray[client]`. If you installed the minimal Ray "
                             "(e.g. `pip install ray`), please reinstall by executing `pip install ray[client]`.")

    with pytest.raises(UserError, match=r'pip install "ray\[client\]==2.60.0"'):
        _start_ray(WithoutClient, "ray://head:10001", None)

    class NoCluster:
        @staticmethod
        def init(**kwargs):  # what Ray says to "auto" with none running: its own flag's name, not Glimpse's
            raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                                  "setting the `--address` flag or `RAY_ADDRESS` environment variable.")

    with pytest.raises(UserError, match="no Ray cluster is running here to join") as refused:
        _start_ray(NoCluster, "auto", None)
    assert "`--address`" not in str(refused.value)


def test_a_downloaded_inputs_error_names_its_url_and_a_failed_fetch_says_why(model, web):
    from glimpse.caption_ray import decode_input

    site, base = web
    (site / "empty.jpg").write_bytes(b"")
    (site / "notes.png").write_text("some text, not a picture")
    for name, words in (("empty.jpg", "the file is empty"), ("notes.png", "holds text"),
                        ("gone.png", "could not be fetched (HTTP 404 File not found)")):
        row = decode_input({"key": f"{base}/{name}"}, model, None)
        assert row["error"] and f"{base}/{name}" in row["error"] and words in row["error"], row["error"]
        assert "tmp" not in row["error"].replace(base, ""), row["error"]


def test_an_input_slower_to_read_than_media_timeout_is_an_error_row_naming_it(model, media):
    """``--media-timeout`` reaches the decode tasks: past it, reading stops and the input is an error row in the limit's
    words; with no limit the same video becomes a prompt."""
    from glimpse.caption_ray import decode_input

    row = decode_input({"key": str(media["video"])}, model, None, media_timeout_s=0.0)
    assert row["prompt_bytes"] == b"" and row["error"].startswith(
        "clip.mp4: reading the images and videos of this request took longer than 0 s, the limit"), row["error"]
    row = decode_input({"key": str(media["video"])}, model, None)
    assert row["error"] == "" and row["prompt_bytes"]


def _driver(inputs: Path, out: Path, model: str, env: dict | None = None, *options: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "glimpse.cli", "caption", str(inputs), "--ray", "--out", str(out), "--model", model,
               "--max-new-tokens", "6", "--batch-size", "2", "--shard-rows", "2", "--device", "cpu", *options]
    # Its own session: killing the group kills the driver and the local cluster it started, as a terminal's
    # Ctrl-C or a lost machine would, and leaves no Ray process behind.
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_a_driver_killed_midway_then_rerun_gives_every_input_exactly_once(cluster, model, tmp_path):
    paths = _inputs(tmp_path / "in", 12, video=False)
    out = tmp_path / "out"
    for kill in ("SIGKILL", "SIGTERM"):  # killed twice, at the first and at a later shard
        shards = len(list(out.glob("part-*.parquet")))
        run = _driver(tmp_path / "in", out, model)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and run.poll() is None and len(list(out.glob("part-*.parquet"))) <= shards:
            time.sleep(0.02)
        if kill == "SIGKILL":  # the driver and the cluster it started, as a lost machine would
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            assert run.returncode == -signal.SIGKILL, run.stderr.read().decode()[-2000:]
        else:  # a plain `kill`: stopped as Ctrl-C stops it (it was Ray's crash dump)
            os.kill(run.pid, signal.SIGTERM)
            _, err = run.communicate(timeout=120)
            assert run.returncode == 143 and b"glimpse: terminated" in err, err.decode()[-2000:]
            assert b"SIGTERM received" not in err
    assert 0 < len(_rows(out)) < len(paths)  # the kills came midway
    report = _ray_caption([tmp_path / "in"], out, model, batch_size=2, speed=0.0)  # the drivers' settings
    keys = [r["key"] for r in _rows(out)]
    assert sorted(keys) == sorted(str(p.resolve()) for p in paths)  # every input, none twice
    assert report.skipped + report.captioned == len(paths)


def test_without_an_address_a_run_starts_its_own_cluster_beside_one_already_running(cluster, model, tmp_path):
    # As after `ray start --head`, which ray.init() without an address would join (and then refuse num_cpus).
    paths = _inputs(tmp_path / "in", 2, video=False)
    run = _driver(tmp_path / "in", tmp_path / "out", model, env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err.decode()[-3000:]
    assert sorted(r["key"] for r in _rows(tmp_path / "out")) == sorted(str(p.resolve()) for p in paths)


def test_an_actor_that_dies_is_replaced_and_its_batch_retried(model, tmp_path):
    paths = _inputs(tmp_path / "in", 4, video=False)
    marker = tmp_path / "crashed"
    run = _driver(tmp_path / "in", tmp_path / "out", model, env={"GLIMPSE_RAY_CRASH_ONCE": str(marker)})
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err.decode()[-3000:]
    assert marker.exists()  # an actor did die mid-batch
    assert sorted(r["key"] for r in _rows(tmp_path / "out")) == sorted(str(p.resolve()) for p in paths)
    assert "done 4, skipped 0, failed 0" in err.decode()


def test_an_input_that_kills_its_actor_every_time_is_an_error_row_and_its_batch_mates_are_captioned(model, tmp_path):
    """A poison input (one that exhausts memory or crashes the model) killed the actor, which Ray restarted and
    retried for ever. Now its batch is dropped after a few tries, its inputs go round again one at a time, and
    only the poison becomes an error row; the run ends. Here every batch holds a poison input, so every batch is
    lost, as when one poison batch takes the batches queued at its actor with it (which made this test fail now and
    then): a few inputs tried alone tell that from a model that cannot load, and the run goes on."""
    paths = _inputs(tmp_path / "in", 4, video=False)  # batches of two: (img00, img01), (img02, img03)
    # Two tries, not the default three: each try is an actor restarted (a worker process that imports torch and
    # loads the model), 8 of them here against 12.
    run = _driver(tmp_path / "in", tmp_path / "out", model, {"GLIMPSE_RAY_CRASH_ON": "img00,img02"}, "--tries", "2")
    _, err = run.communicate(timeout=600)
    assert run.returncode == 1, err.decode()[-3000:]  # an input failed
    rows = {Path(r["key"]).name: r for r in _rows(tmp_path / "out")}
    assert sorted(rows) == sorted(p.name for p in paths), err.decode()[-3000:]  # every input once
    for poison in ("img00.png", "img02.png"):
        assert "a worker died on this input 2 times" in rows[poison]["error"] and rows[poison]["caption"] is None
    assert all(rows[name]["error"] is None and rows[name]["caption"] for name in ("img01.png", "img03.png"))
    assert "done 2, skipped 0, failed 2" in err.decode()


def test_when_every_batch_fails_the_run_says_so_instead_of_blaming_each_input(cluster, model, tmp_path, monkeypatch):
    """Batches set aside (their actor died on every try) are retried one input at a time — unless every batch of
    the run failed and so do the first few inputs alone: then no input is to blame (a model that cannot load on the
    workers, a missing package), and the run stops with an error pointing to Ray's log rather than going through
    every input again."""
    from glimpse import caption_ray

    calls = []
    monkeypatch.setattr(caption_ray, "_pipeline", lambda ray, keys, *args, **kwargs: calls.append(keys) or iter(()))
    _inputs(tmp_path / "in", 5, video=False)
    with pytest.raises(caption_ray.UserError, match=r"every batch failed \(5 inputs\): Ray's log"):
        _ray_caption([tmp_path / "in"], tmp_path / "out", model, batch_size=2)
    assert len(calls) == 2 and len(calls[1]) == 3  # the batches of two, then three inputs alone: no more
    assert not list((tmp_path / "out").glob("part-*.parquet"))  # and no rows


def test_rows_done_are_written_once_their_time_is_up_even_while_no_more_arrive(cluster, model, tmp_path, monkeypatch):
    """A shard is written every SHARD_SECONDS whether or not more rows arrive: 40 rows done while one slow URL
    held up its block were written only when the next rows came, 10 minutes later, and a kill 2 minutes in lost
    them all. Here the pipeline hands over two rows, then waits (as for a slow input) until they are on disk."""
    from glimpse import caption_ray

    monkeypatch.setattr(caption_ray, "SHARD_SECONDS", 0.5)
    out = tmp_path / "out"
    keys = [str(p) for p in _inputs(tmp_path / "in", 3, video=False)]
    written_while_waiting = []

    def pipeline(ray, pending, *args, **kwargs):
        def row(key):
            return {**{c: None for c in caption_ray.COLUMNS}, "key": key, "caption": "a caption", "answer_tokens": 2}

        yield [row(k) for k in sorted(pending)[:2]]
        deadline = time.monotonic() + 15
        while not _rows(out) and time.monotonic() < deadline:  # the next rows are slow to come
            time.sleep(0.1)
        written_while_waiting.append(len(_rows(out)))
        yield [row(k) for k in sorted(pending)[2:]]

    monkeypatch.setattr(caption_ray, "_pipeline", pipeline)
    report = _ray_caption([tmp_path / "in"], out, model)
    assert written_while_waiting == [2]
    assert report.captioned == 3 and sorted(r["key"] for r in _rows(out)) == sorted(str(caption_ray._key_of(Path(k)))
                                                                                   for k in keys)


def test_downloads_a_stopped_run_left_behind_are_removed_by_the_next_one(tmp_path, monkeypatch):
    """A driver killed, or stopped with Ctrl-C, takes its workers down mid-download, and their temporary files stayed
    in /tmp (a 19.5 MB partial body among them) run after run. The next worker to download removes those untouched
    for twice the fetch deadline, and nothing else."""
    import tempfile

    from glimpse import caption_ray

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    caption_ray._remove_stale_downloads.cache_clear()
    stale, fresh = tmp_path / f"{caption_ray.DOWNLOAD_PREFIX}old.png", tmp_path / f"{caption_ray.DOWNLOAD_PREFIX}new.mp4"
    other = tmp_path / "someone-elses.png"
    for path in (stale, fresh, other):
        path.write_bytes(b"partial")
    old = time.time() - 2 * caption_ray.URL_DEADLINE_S - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    caption_ray._remove_stale_downloads()
    assert not stale.exists() and fresh.exists() and other.exists()
    caption_ray._remove_stale_downloads.cache_clear()


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    import builtins

    from glimpse.cli import main

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    _inputs(tmp_path / "in", 1, video=False)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert main(["caption", str(tmp_path / "in"), "--ray", "--out", str(tmp_path / "out")]) == 1
    assert 'pip install "glimpse-vl[ray]"' in capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused_with_what_ray_writes_there(tmp_path, capsys):
    from glimpse.cli import main

    _inputs(tmp_path / "in", 1, video=False)
    (tmp_path / "captions.jsonl").write_text('{"key": "kept"}\n')
    assert main(["caption", str(tmp_path / "in"), "--ray", "--out", str(tmp_path / "captions.jsonl")]) == 1
    assert "with --ray, --out names a folder of Parquet shards" in capsys.readouterr().err
    assert (tmp_path / "captions.jsonl").read_text() == '{"key": "kept"}\n'


def test_a_glimpse_py_in_the_current_folder_is_refused_before_it_can_shadow_glimpse_in_the_actors(
        cluster, model, tmp_path, monkeypatch, capsys):
    # Ray puts the driver's current folder on its workers' path: their `import glimpse` would find this file.
    from glimpse.cli import main

    _inputs(tmp_path / "in", 2, video=False)
    here = tmp_path / "here"
    here.mkdir()
    (here / "glimpse.py").write_text("raise SystemExit('not Glimpse')\n")
    monkeypatch.chdir(here)
    assert main(["caption", str(tmp_path / "in"), "--ray", "--out", str(tmp_path / "out"), "--model", model,
                 "--device", "cpu", "--max-new-tokens", "4"]) == 1
    assert "glimpse.py would be imported by Ray's workers" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def test_a_remote_input_is_copied_whole_into_a_local_file_in_pieces_and_a_failed_read_leaves_nothing(
        tmp_path, monkeypatch):
    """URIs (s3://, gs://, ...) are read through pyarrow's file systems; here a local one stands in for the bucket."""
    import tempfile

    import pyarrow.fs

    from glimpse import caption_ray

    video = write_video(tmp_path / "clip.mp4", frames=8, fps=4, size=(56, 56))
    reads = []

    class Recorded:  # a stream that records how much each read asks for
        def __init__(self, stream):
            self.stream = stream

        def read(self, n=-1):
            reads.append(n)
            return self.stream.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stream.close()

    class Bucket:  # a local file system in a bucket's place
        def open_input_stream(self, path):
            return Recorded(pyarrow.fs.LocalFileSystem().open_input_stream(path))

    monkeypatch.setattr(caption_ray, "_filesystem", lambda uri: (Bucket(), uri.removeprefix("s3://bucket")))
    monkeypatch.setattr(caption_ray, "COPY_PIECE_BYTES", 1000)  # many pieces
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    local, cleanup = caption_ray.read_input(f"s3://bucket{video}")
    assert local == cleanup and local.endswith(".mp4") and Path(local).read_bytes() == video.read_bytes()
    assert len(reads) > 2 and set(reads) == {1000}  # never the whole file at once
    os.unlink(local)
    with pytest.raises(FileNotFoundError):
        caption_ray.read_input(f"s3://bucket{tmp_path / 'missing.mp4'}")
    assert not list((tmp_path / "scratch").iterdir())  # no partial copy left behind


def test_a_storage_uri_that_never_opens_or_stalls_midway_is_given_up_on_and_leaves_nothing(tmp_path, monkeypatch):
    """pyarrow's file systems take no deadline (a cluster not configured for gs:// waits on credentials for ever):
    a read that does not open in time, or stalls after its first piece, is an error, not a block held up."""
    import tempfile

    from glimpse import caption_ray

    release = __import__("threading").Event()  # lets the stuck reads go at the end of the test

    class Stalled:  # the first piece, then nothing
        def __init__(self):
            self.pieces = [b"x" * 100]

        def read(self, n=-1):
            if self.pieces:
                return self.pieces.pop()
            release.wait()
            return b""

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    class Bucket:
        def open_input_stream(self, path):
            return Stalled()

    def unreachable(uri):
        release.wait()
        raise OSError("gave up")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    monkeypatch.setattr(caption_ray, "URI_OPEN_DEADLINE_S", 0.3)
    monkeypatch.setattr(caption_ray, "URL_DEADLINE_S", 1.0)
    try:
        monkeypatch.setattr(caption_ray, "_filesystem", unreachable)
        start = time.monotonic()
        row = caption_ray.decode_input({"key": "gs://bucket/a.png"}, "unused", None)
        assert row["error"].startswith("TimeoutError: the storage did not open it within 0.3 s")
        monkeypatch.setattr(caption_ray, "_filesystem", lambda uri: (Bucket(), "a.png"))
        with pytest.raises(TimeoutError, match="not read within 1 s"):
            caption_ray.read_input("gs://bucket/a.png")
        assert time.monotonic() - start < 30
        assert not list((tmp_path / "scratch").iterdir())  # no partial copy left behind
    finally:
        release.set()


@pytest.fixture()
def web(tmp_path):
    """A web server for the files in ``tmp_path / "site"``: a dataset's URLs."""
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield site, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_manifest_of_http_urls_is_captioned_each_url_judged_by_its_content(cluster, model, tmp_path, web):
    """Datasets list their media as URLs: fetched by the decode stage (size cap, deadline), an image or a video
    by what the bytes are (a URL need not end in an extension, and a query is not one); a dead URL is an error row."""
    site, base = web
    image = _inputs(tmp_path / "in", 1, video=False)[0]
    (site / "photo").write_bytes(image.read_bytes())  # no extension
    write_video(site / "clip.mp4", frames=8, fps=4, size=(56, 56))
    urls = [f"{base}/photo", f"{base}/clip.mp4?signature=abc", f"{base}/gone.png"]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"url": u}) + "\n" for u in urls))
    report = _ray_caption([manifest], tmp_path / "out", model, column="url")
    rows = {r["key"]: r for r in _rows(tmp_path / "out")}
    assert set(rows) == set(urls) and report.captioned == 2 and len(report.failed) == 1
    assert rows[urls[0]]["prompt"].startswith("Describe this image") and rows[urls[0]]["caption"] is not None
    assert rows[urls[1]]["prompt"].startswith("Describe this video") and rows[urls[1]]["caption"] is not None
    assert "could not be fetched" in rows[urls[2]]["error"] and rows[urls[2]]["caption"] is None
    # The same URLs in a plain list file, and one given on the command line, are the same inputs.
    listing = tmp_path / "urls.txt"
    listing.write_text(f"# a dataset's URLs\n{urls[0]}\n{urls[2]}\n")
    again = _ray_caption([listing, urls[1]], tmp_path / "out2", model)
    assert {r["key"]: r["caption"] for r in _rows(tmp_path / "out2")} == {k: r["caption"] for k, r in rows.items()}
    assert again.captioned == 2 and len(again.failed) == 1


def test_a_folder_that_cannot_be_listed_is_reported_not_passed_over(tmp_path, monkeypatch):
    """As for the local captioner (tests/test_caption.py): a subfolder without read permission is named, so
    that the run reports it as failed, instead of its inputs silently never being captioned."""
    from glimpse.caption_ray import collect_keys

    good = _inputs(tmp_path / "in", 2, video=False)
    _inputs(tmp_path / "in" / "locked", 1, video=False)
    refuse_listing(monkeypatch, tmp_path / "in" / "locked")
    unreadable: list = []
    assert collect_keys([str(tmp_path / "in")], unreadable=unreadable) == [str(p.resolve()) for p in good]
    assert unreadable == [(str(tmp_path / "in" / "locked"), "Permission denied")]


def test_rows_finished_while_a_slow_url_holds_its_block_reach_the_output_before_it_is_done(cluster, model, tmp_path):
    """Found from outside: the driver took each finished batch only once the next one had finished too (Ray's
    default of fetching one batch ahead), so the rows finished before a slow URL's block waited with it, where a
    kill lost them. Here a URL answers only once the first batch's rows are in a shard (or after 90 s)."""
    image = _inputs(tmp_path / "in", 3, video=False)
    release, released_by_rows = threading.Event(), []

    def slowly():
        release.wait(90)
        return image[2].read_bytes()

    server = serve_bytes(slowly)
    out = tmp_path / "out"

    def watch():
        deadline = time.monotonic() + 90
        while not release.is_set() and time.monotonic() < deadline:
            if out.is_dir() and _rows(out):
                released_by_rows.append(len(_rows(out)))
                release.set()
            time.sleep(0.2)

    listing = tmp_path / "inputs.txt"  # in this order: the first batch of 2, then the slow URL's batch
    listing.write_text(f"{image[0]}\n{image[1]}\nhttp://127.0.0.1:{server.server_port}/slow.png\n")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        report = _ray_caption([listing], out, model, batch_size=2, shard_rows=2)
    finally:
        release.set()
        server.shutdown()
    watcher.join()
    assert released_by_rows == [2]  # the first batch's rows were in a shard while the URL still held its block
    assert report.captioned == 3 and len(_rows(out)) == 3


def test_a_rerun_asking_for_other_settings_or_finding_a_foreign_shard_is_refused_before_it_starts(model, tmp_path):
    """A rerun skips the inputs already in the output: with another policy, speed or prompt it mixed captions of
    two kinds under one output without a word; a shard cut short or another program's Parquet file ended the run
    with pyarrow's traceback (both found from outside). Each is refused, saying what to do, before Ray starts."""
    from glimpse.caption_ray import COLUMNS, OutputDir, _key_of
    from glimpse.common import UserError

    keys = [str(_key_of(p)) for p in _inputs(tmp_path / "in", 2, video=False)]
    out = tmp_path / "out"
    output = OutputDir(out, jsonl=False)
    output.write([{**{c: None for c in COLUMNS}, "key": keys[0], "caption": "a caption", "policy": "auto",
                   "speed": 0.5, "prompt": "Describe this image in one or two sentences.", "model": model_key(model)}])
    output.close()
    # (the default instruction was shown as if it had been asked for with --prompt; another model was not checked)
    for change, said in (({"speed": 1.0}, "--speed 0.5, and this run asks for --policy auto --speed 1"),
                         ({"policy": "none"}, "--policy auto --speed 0.5, and this run asks for --policy none"),
                         ({"prompt": "What colour?"}, "made with --policy auto --speed 0.5 and no --prompt, and this "
                                                      "run asks for --policy auto --speed 0.5 --prompt 'What colour?'"),
                         ({"model": "embedded"}, f"made with --model {model_key(model)} --policy auto --speed 0.5, "
                                                 "and this run asks for --model embedded --policy auto --speed 0.5")):
        with pytest.raises(UserError, match="would mix the two") as refused:
            _ray_caption([tmp_path / "in"], out, **{"model": model, **change})
        assert said in str(refused.value) and str(out) in str(refused.value), str(refused.value)
    assert len(_rows(out)) == 1  # nothing changed
    shard = next(out.glob("part-*.parquet"))
    (out / "part-000009-deadbeef.parquet").write_bytes(shard.read_bytes()[:300])  # cut short
    with pytest.raises(UserError, match=r"part-000009-deadbeef\.parquet: not a shard written by glimpse caption"):
        _ray_caption([tmp_path / "in"], out, model)
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"id": [1, 2]}), out / "part-000009-deadbeef.parquet")  # foreign
    with pytest.raises(UserError, match=r"part-000009-deadbeef\.parquet: not a shard written by glimpse caption"):
        _ray_caption([tmp_path / "in"], out, model)


def test_a_stopped_driver_writes_the_rows_it_holds_and_says_how_far_it_got(cluster, model, tmp_path, monkeypatch):
    """Ctrl-C (or a plain kill, which stops the driver the same way) threw away the rows the driver held for its
    next shard, to be captioned again by the rerun (found from outside): they are written as one last shard. And
    Glimpse counts its inputs itself (Ray's bar counts blocks: "8/40" for 37 inputs)."""
    from glimpse import caption_ray

    monkeypatch.setattr(caption_ray, "PROGRESS_SECONDS", 0.0)
    out = tmp_path / "out"
    keys = sorted(str(caption_ray._key_of(p)) for p in _inputs(tmp_path / "in", 3, video=False))

    def pipeline(ray, pending, *args, **kwargs):
        yield [{**{c: None for c in caption_ray.COLUMNS}, "key": k, "caption": "a caption", "answer_tokens": 2,
                "policy": "auto", "speed": 0.5} for k in sorted(pending)[:2]]
        raise KeyboardInterrupt  # Ctrl-C while the third input is under way

    monkeypatch.setattr(caption_ray, "_pipeline", pipeline)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        _ray_caption([tmp_path / "in"], out, model, log=lines.append)  # 512 rows a shard, 30 s: none written yet
    assert sorted(r["key"] for r in _rows(out)) == keys[:2]
    assert "captioned 2 of 3, failed 0" in "\n".join(lines), lines


def test_ctrl_c_or_a_kill_while_ray_starts_takes_effect_once_it_has_started():
    """Stopped halfway through ray.init, the driver said "interrupted" and then died in Ray's exit with a
    segmentation fault (found from outside): a stop that comes while Ray starts is taken at the end of the start."""
    from glimpse.caption_ray import signals_deferred

    for number in (signal.SIGINT, signal.SIGTERM):
        before = signal.getsignal(number)
        finished = []
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), number)
                time.sleep(0.2)  # (a signal is handled between bytecodes: here, had it not been deferred)
                finished.append(True)
        assert finished == [True] and signal.getsignal(number) is before
    # ray.init puts in a SIGTERM handler of its own as it begins, which exits with status 15: a kill then stops the
    # driver as any other stop does (it ended it with status 15 and no word).
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_rerun_whose_only_failures_are_earlier_error_rows_exits_1(tmp_path, monkeypatch, capsys):
    """Error rows in the output are inputs without a caption, this run's or an earlier one's: a script sees it in the
    exit status even when the rerun itself captioned nothing new (docs/scale.md)."""
    import glimpse.caption_ray
    from glimpse.caption_ray import RayReport
    from glimpse.cli import main

    _inputs(tmp_path / "in", 1, video=False)
    monkeypatch.setattr(glimpse.caption_ray, "caption_on_ray",
                        lambda inputs, **options: RayReport(skipped=1, earlier_errors=1))
    assert main(["caption", str(tmp_path / "in"), "--ray", "--out", str(tmp_path / "out")]) == 1
    assert "1 skipped as error rows of earlier runs" in capsys.readouterr().err
    monkeypatch.setattr(glimpse.caption_ray, "caption_on_ray", lambda inputs, **options: RayReport(skipped=1))
    assert main(["caption", str(tmp_path / "in"), "--ray", "--out", str(tmp_path / "out")]) == 0


def test_keys_are_resolved_paths_so_a_folder_named_through_a_link_is_the_same_inputs(tmp_path):
    """Resuming matches inputs by key, a local file's resolved path: the folder given through a link (or a relative
    name) on the rerun must give the keys the first run wrote, or every input is captioned again."""
    from glimpse.caption_ray import collect_keys

    paths = _inputs(tmp_path / "in", 2, video=False)
    (tmp_path / "link").symlink_to(tmp_path / "in")
    listing = tmp_path / "list.txt"
    listing.write_text("link/" + paths[0].relative_to(tmp_path / "in").as_posix() + "\n")
    expected = sorted(str(p.resolve()) for p in paths)
    assert sorted(collect_keys([str(tmp_path / "link")])) == expected
    assert collect_keys([str(listing)]) == [str(paths[0].resolve())]
