"""`glimpse caption`: folders and list files, JSONL or sidecars, corrupt inputs skipped, resuming
after a kill without losing or duplicating a caption, batched equal to one by one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import refuse_listing
from glimpse.caption import collect_inputs
from glimpse.cli import main
from glimpse.pipeline.profiles import model_key

REPO = Path(__file__).resolve().parents[1]


def _images(folder: Path, count: int, start: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + count):
        pixels = (np.random.RandomState(i).rand(40 + i % 7, 50, 3) * 255).astype("uint8")
        path = folder / f"img{i:03d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def _lines(out: Path, blank_lines: bool = False) -> list[dict]:
    """The records of a JSONL output; ``blank_lines``: with blank lines (an in-place --overwrite's) among them."""
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip() or not blank_lines]


@pytest.fixture(scope="module")
def model(checkpoints):
    return str(checkpoints["llava"])


def test_a_folder_is_captioned_once_per_input_and_corrupt_files_are_skipped_with_a_summary(
        model, tmp_path, capsys):
    good = _images(tmp_path / "in", 3) + _images(tmp_path / "in" / "nested", 2, start=3)
    (tmp_path / "in" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (tmp_path / "in" / "empty.jpg").write_bytes(b"")
    (tmp_path / "in" / "notes.md").write_text("not media: ignored")
    (tmp_path / "in" / "gone.png").symlink_to(tmp_path / "deleted.png")  # an input that went missing: reported
    (tmp_path / "in" / "loop_a.png").symlink_to(tmp_path / "in" / "loop_b.png")  # a loop of links: reported too
    (tmp_path / "in" / "loop_b.png").symlink_to(tmp_path / "in" / "loop_a.png")  # (it crashed the whole run)
    os.mkfifo(tmp_path / "in" / "pipe.png")  # not a file: reported, never opened (reading it would block)
    out = tmp_path / "captions.jsonl"
    code = main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "6",
                 "--batch-size", "3", "--speed", "0.5"])
    assert code == 1  # some inputs failed
    records = _lines(out)
    assert sorted(r["path"] for r in records) == sorted(str(p) for p in good)
    for r in records:
        assert set(r) == {"path", "key", "caption", "model", "policy", "speed", "prompt", "params", "metrics"}
        assert r["prompt"] == "Describe this image in one or two sentences."  # the instruction it was asked
        assert r["key"] == str(Path(r["path"]).resolve())
        assert r["policy"] == "auto" and r["speed"] == 0.5 and r["metrics"]["new_tokens"] >= 1
    assert max(r["metrics"]["batch_size"] for r in records) > 1  # inputs were decoded together
    err = capsys.readouterr().err
    assert "failed 6" in err and "broken.png" in err and "empty.jpg" in err and "gone.png" in err
    assert "loop_a.png" in err and "loop_b.png" in err
    assert "pipe.png: not a regular file" in err  # (passed over without a word, it was never mentioned)
    assert "captioning: 100%" in err and "11/11" in err  # the progress bar (tqdm) reached the end
    # A link given by name that leads round in a loop is an input that fails saying so (it stopped the whole run
    # as "no such file or folder"), its path said once in the summary (it was said twice).
    link = str(tmp_path / "in" / "loop_a.png")
    assert main(["caption", link, str(good[0]), "--model", model, "--out", str(tmp_path / "links.jsonl"),
                 "--max-new-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert "captioned 1" in err and "leads round in a loop" in err and f"{link}: {link}" not in err, err


def test_a_damaged_video_captioned_from_the_frames_that_decoded_says_so_in_its_record(checkpoints, media, tmp_path):
    from conftest import write_damaged_video

    folder = tmp_path / "in"
    folder.mkdir()
    write_damaged_video(folder / "damaged.mp4", frames=30)
    (folder / "whole.mp4").write_bytes(media["video"].read_bytes())
    out = tmp_path / "captions.jsonl"
    assert main(["caption", str(folder), "--model", str(checkpoints["qwen2_vl"]), "--out", str(out),
                 "--max-new-tokens", "2"]) == 0
    records = {Path(r["path"]).name: r for r in _lines(out)}
    assert "warnings" not in records["whole.mp4"]
    [warning] = records["damaged.mp4"]["warnings"]
    assert warning.startswith("damaged.mp4: only ") and "of the 30 frames it declares could be decoded" in warning


def test_a_bad_input_is_read_once_and_its_batch_mates_stay_batched(model, tmp_path):
    """A batch with a corrupt file was answered one input at a time, then found by halves, reading the file again at
    every split. Each input's prompt is now built once, on its own: the corrupt one fails there and the three others
    are decoded as one batch."""
    good = _images(tmp_path / "in", 3)
    (tmp_path / "in" / "zz_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")  # last of the batch of 4
    out = tmp_path / "captions.jsonl"
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "4",
                 "--batch-size", "4"]) == 1
    batch = {Path(r["path"]).name: r["metrics"]["batch_size"] for r in _lines(out)}
    assert batch == {p.name: 3 for p in good}


class _Reading:
    """``engine.prepare`` as the captioner calls it, counting the calls per input; an input named in ``slow`` takes
    that many seconds to read, inside its reading limit (as a video that is slow to decode does), and ``endless``
    reads until its limit stops it (its ``ReadingStopped`` is kept in ``stopped``)."""

    def __init__(self, engine, slow: dict | None = None, endless: str | None = None):
        self.engine, self.prepare = engine, engine.prepare
        self.slow, self.endless = slow or {}, endless
        self.calls: dict[str, int] = {}
        self.stopped = []

    def __enter__(self) -> "_Reading":
        self.engine.prepare = self._prepare
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.prepare

    def _prepare(self, messages, caches=True, reading=None):
        from glimpse import vision

        name = Path(messages[0]["content"][0]["image"]).name
        self.calls[name] = self.calls.get(name, 0) + 1
        with reading:
            if name in self.slow:
                time.sleep(self.slow[name])
            give_up = time.monotonic() + 60  # (a reading that is never stopped fails the test, not hangs it)
            while name == self.endless and time.monotonic() < give_up:
                try:
                    vision.check_reading(name)
                except vision.ReadingStopped as stop:
                    self.stopped.append(stop)
                    raise
                time.sleep(0.01)
            return self.prepare(messages, caches)


def test_media_timeout_fails_the_input_slower_to_read_and_counts_for_each_input_on_its_own(model, tmp_path, capsys):
    """``--media-timeout``: a crafted video in a scraped dataset decodes to its end (18 s for 600 KB). Past the limit
    the input fails with the limit's words, read once, and the others are captioned: its limit is its own, so the
    input read after it in the same batch (one reader: one input at a time) is not refused."""
    from glimpse.caption import caption_inputs
    from glimpse.pipeline import load_engine

    engine = load_engine(model, device="cpu")
    images = _images(tmp_path / "in", 3)
    with _Reading(engine, slow={"img001.png": 1.5}) as reading:
        report = caption_inputs(engine, images, out=tmp_path / "c.jsonl", fmt="jsonl", overwrite=False, policy="none",
                                speed=0.0, prompt=None, max_new_tokens=2, batch_size=3, media_timeout_s=1.0,
                                readers=1)
    assert report.captioned == 2 and [path for path, _ in report.failed] == [str(images[1])]
    # (the reason without the file's name: the summary line names it, "failed: in/img001.png: img001.png: ..." twice)
    assert report.failed[0][1].startswith("reading the images and videos of this request took longer than 1 s, the "
                                          "limit")
    assert reading.calls == {p.name: 1 for p in images}
    assert [Path(r["path"]).name for r in _lines(tmp_path / "c.jsonl")] == ["img000.png", "img002.png"]
    capsys.readouterr()
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--media-timeout", "0"]) == 1
    assert "--media-timeout must be more than 0" in capsys.readouterr().err


def test_the_next_batch_is_read_ahead_and_a_stopped_run_stops_its_reading(model, tmp_path):
    """The next batch's inputs are read while the model answers this one (a GPU would otherwise wait for the CPU to
    decode every batch's videos). A run stopped meanwhile (Ctrl-C, an error) stops that reading at its next check
    rather than waiting for it to end, and its reading thread is gone when the call returns."""
    import threading

    from glimpse.caption import caption_inputs
    from glimpse.pipeline import load_engine

    engine = load_engine(model, device="cpu")
    images = _images(tmp_path / "in", 4)

    def stop_after_the_first_batch(done, total, failed):
        if done == 2:
            raise KeyboardInterrupt

    with _Reading(engine, endless="img002.png") as reading, pytest.raises(KeyboardInterrupt):
        caption_inputs(engine, images, out=tmp_path / "c.jsonl", fmt="jsonl", overwrite=False, policy="none",
                       speed=0.0, prompt=None, max_new_tokens=2, batch_size=2, progress=stop_after_the_first_batch)
    assert len(reading.stopped) == 1  # the second batch's reading had begun, and was stopped
    assert not [t for t in threading.enumerate() if t.name.startswith("glimpse-caption-read")]
    assert [Path(r["path"]).name for r in _lines(tmp_path / "c.jsonl")] == ["img000.png", "img001.png"]


def test_progress_starts_before_the_first_batch_and_counts_every_batch(model, tmp_path):
    """The bar appears when captioning starts, not when the first batch ends (which on a large model is
    minutes, and made tqdm's first rate count only the time after it)."""
    from glimpse.caption import caption_inputs
    from glimpse.pipeline import load_engine

    calls = []
    caption_inputs(load_engine(model, device="cpu"), _images(tmp_path / "in", 5), out=tmp_path / "c.jsonl",
                   fmt="jsonl", overwrite=False, policy="none", speed=0.0, prompt=None, max_new_tokens=2,
                   batch_size=2, progress=lambda *call: calls.append(call))
    assert calls == [(0, 5, 0), (2, 5, 0), (4, 5, 0), (5, 5, 0)]


def test_batched_captions_equal_captions_made_one_at_a_time(model, tmp_path):
    images = _images(tmp_path / "in", 4)
    listing = tmp_path / "list.txt"
    listing.write_text("# a list file\n" + "\n".join(os.path.relpath(p, tmp_path) for p in images) + "\n")
    together, alone = tmp_path / "together.jsonl", tmp_path / "alone.jsonl"
    common = ["--model", model, "--max-new-tokens", "10", "--policy", "lazyllm", "--speed", "1"]
    assert main(["caption", str(listing), "--out", str(together), "--batch-size", "4", *common]) == 0
    assert main(["caption", str(listing), "--out", str(alone), "--batch-size", "1", *common]) == 0
    assert [r["caption"] for r in _lines(together)] == [r["caption"] for r in _lines(alone)]
    assert [r["path"] for r in _lines(together)] == [str(p) for p in images]


def test_a_line_cut_short_by_a_kill_is_dropped_and_its_input_captioned_again(model, tmp_path):
    images = _images(tmp_path / "in", 3)
    out = tmp_path / "captions.jsonl"
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "4"]) == 0
    full = out.read_text().splitlines()
    out.write_text(full[0] + "\n" + full[1][: len(full[1]) // 2])  # killed while writing the second line
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "4"]) == 0
    assert sorted(r["path"] for r in _lines(out)) == sorted(str(p) for p in images)


def test_a_run_killed_midway_then_rerun_captions_every_input_exactly_once(model, tmp_path):
    images = _images(tmp_path / "in", 24)
    out = tmp_path / "captions.jsonl"
    command = [sys.executable, "-m", "glimpse.cli", "caption", str(tmp_path / "in"), "--model", model, "--out", str(out),
               "--max-new-tokens", "48", "--batch-size", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 2:
            run.send_signal(signal.SIGKILL)  # no chance to clean up
            break
        time.sleep(0.005)
    run.wait()
    assert run.returncode == -signal.SIGKILL, run.stderr.read().decode()[-2000:]
    before = out.read_text().count("\n")
    assert 0 < before < len(images)  # the kill really came midway

    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "48",
                 "--batch-size", "2"]) == 0
    paths = [r["path"] for r in _lines(out)]
    assert sorted(paths) == sorted(str(p) for p in images)  # every input, none twice


def test_txt_sidecars_are_written_next_to_inputs_skipped_when_present_and_rewritten_with_overwrite(
        model, tmp_path, capsys):
    images = _images(tmp_path / "in", 2)
    args = ["caption", str(tmp_path / "in"), "--model", model, "--format", "txt", "--max-new-tokens", "4"]
    assert main(args) == 0
    sidecars = [p.with_suffix(".txt") for p in images]
    assert all(s.read_text().endswith("\n") for s in sidecars)
    sidecars[0].write_text("kept by hand\n")
    capsys.readouterr()
    assert main(args) == 0
    assert sidecars[0].read_text() == "kept by hand\n"  # already captioned: skipped
    # and said: a sidecar records no settings, so a rerun asking for others would mix captions without a word
    assert "2 inputs already have a caption beside them" in capsys.readouterr().err
    # with nothing left to do, no model is loaded (one that does not exist is never reached)
    assert main([*args[:2], "--model", str(tmp_path / "no-model"), *args[4:]]) == 0
    assert "captioned 0, already done 2" in capsys.readouterr().err
    # A folder named as a sidecar is no caption (it counted as one: the picture was never captioned); its input
    # fails, the caption cannot be written there.
    third = _images(tmp_path / "in", 1, start=2)[0]
    third.with_suffix(".txt").mkdir()
    assert main(args) == 1 and f"cannot write {third.with_suffix('.txt')}" in capsys.readouterr().err
    third.with_suffix(".txt").rmdir()
    assert main([*args, "--overwrite"]) == 0
    assert sidecars[0].read_text() != "kept by hand\n" and sidecars[0].read_text().endswith("\n")
    assert not list((tmp_path / "in").glob(".*partial"))
    # A name of 250 bytes has a sidecar of 250 (its temporary file's name was 9 bytes longer: "File name too long")
    long = (tmp_path / "long" / ("a" * 246 + ".png"))
    long.parent.mkdir()
    long.write_bytes(images[0].read_bytes())
    assert main(["caption", str(long.parent), *args[2:]]) == 0
    assert long.with_suffix(".txt").read_text().endswith("\n") and not list(long.parent.glob(".*partial"))


def test_a_file_name_that_is_not_utf8_is_written_as_escapes_other_readers_take_and_the_rerun_finds_it(
        model, tmp_path):
    """Linux file names are bytes: one that is not UTF-8 was written into the JSONL as lone surrogates ("\\udce9"),
    which pyarrow refuses and jq replaces, and under another key than Ray's output gives it. Both outputs now hold
    the bytes as \\xNN (glimpse.caption.stored)."""
    import pyarrow.json

    folder = tmp_path / "in"
    image = _images(folder, 1)[0]
    odd = Path(os.fsdecode(bytes(folder) + b"/caf\xe9.png"))
    image.rename(odd)
    out = tmp_path / "captions.jsonl"
    args = ["caption", str(folder), "--model", model, "--out", str(out), "--max-new-tokens", "3"]
    assert main(args) == 0
    (record,) = pyarrow.json.read_json(out).to_pylist()
    assert record["key"] == str(folder.resolve()) + "/caf\\xe9.png" and record["path"].endswith("/caf\\xe9.png")
    assert main(args) == 0 and len(_lines(out)) == 1  # done: not captioned again

    # A name that holds the four characters "\xe9" is written as the one with the byte is: one key for two files.
    # The second was skipped as done (or both written under one key); it fails now, saying why.
    (folder / "caf\\xe9.png").write_bytes(odd.read_bytes())
    assert main(args) == 1 and len(_lines(out)) == 1
    assert main(args) == 1 and len(_lines(out)) == 1  # and again: never "already done"


def test_missing_inputs_and_folders_without_media_are_clear_errors(model, tmp_path, capsys):
    assert main(["caption", str(tmp_path / "nope"), "--model", model]) == 1
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["caption", str(tmp_path / "empty"), "--model", model]) == 1
    assert "no image or video files" in capsys.readouterr().err


def test_resuming_matches_inputs_by_resolved_path_however_they_are_named(model, tmp_path, monkeypatch):
    """The same folder given first as a relative path, then as an absolute one and through a symlink: the
    second and third runs find every input done."""
    images = _images(tmp_path / "in", 3)
    (tmp_path / "link").symlink_to(tmp_path / "in")
    out = tmp_path / "captions.jsonl"
    monkeypatch.chdir(tmp_path)
    assert main(["caption", "in", "--model", model, "--out", str(out), "--max-new-tokens", "4"]) == 0
    for name in (str(tmp_path / "in"), str(tmp_path / "link")):
        assert main(["caption", name, "--model", model, "--out", str(out), "--max-new-tokens", "4"]) == 0
    assert len(_lines(out)) == len(images)


def test_a_run_resolves_each_input_name_once_to_sort_it_out_and_once_more_for_its_record(model, tmp_path,
                                                                                          monkeypatch):
    """A resumed run over a million inputs resolved every name three or four times (listing them, the "all done?"
    check, sorting out what is left, each record), minutes before it said a word: once to list and sort them out is
    all it needs, and once more for an input it captions, as its record is written (its file just read: a link
    retargeted since the listing is written under the key of what was read)."""
    from glimpse import caption

    images = _images(tmp_path / "in", 3)
    out = tmp_path / "captions.jsonl"
    resolved, resolve = Counter(), caption.resolved_path

    def counted(path):
        resolved[path] += 1
        return resolve(path)

    monkeypatch.setattr(caption, "resolved_path", counted)
    for extra, times in (([], 2), ([], 1), (["--overwrite"], 2)):  # captions all three; all done; all again
        resolved.clear()
        assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "2",
                     *extra]) == 0
        assert {path: resolved[path] for path in images} == dict.fromkeys(images, times), extra
    assert len(_lines(out)) == len(images)


def test_a_link_retargeted_during_the_run_is_written_under_the_key_of_the_file_it_read(model, tmp_path, monkeypatch):
    """``latest.png``, a link a camera moves, listed while it named red.png and read after it moved to yellow.png:
    its caption (of yellow.png) is recorded under yellow.png's key, so a rerun over red.png still captions it
    (recorded under red.png's, it was skipped as done and never captioned: a regression hunt)."""
    from glimpse import caption

    red, yellow = _images(tmp_path / "photos", 2)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "latest.png").symlink_to(red)
    listed = caption.collect_inputs

    def moved_after_listing(*args, **kwargs):
        inputs = listed(*args, **kwargs)
        (tmp_path / "in" / "latest.png").unlink()
        (tmp_path / "in" / "latest.png").symlink_to(yellow)
        return inputs

    monkeypatch.setattr(caption, "collect_inputs", moved_after_listing)
    out = tmp_path / "captions.jsonl"
    ask = ["--model", model, "--out", str(out), "--max-new-tokens", "2"]
    assert main(["caption", str(tmp_path / "in"), *ask]) == 0
    assert [record["key"] for record in _lines(out)] == [str(yellow.resolve())]
    monkeypatch.undo()
    assert main(["caption", str(red), *ask]) == 0
    assert sorted(record["key"] for record in _lines(out)) == sorted([str(yellow.resolve()), str(red.resolve())])


def test_a_long_listing_of_the_inputs_says_how_far_it_is(tmp_path, monkeypatch):
    """A million inputs took minutes to list and resolve before the first word: a listing that takes long says
    every so often how many it has found (here "long" is any time at all)."""
    from glimpse import caption

    images = _images(tmp_path / "in" / "deeper", 3)
    monkeypatch.setattr(caption, "LISTING_NOTE_EVERY_S", 0.0)
    said: list[str] = []
    assert caption.collect_inputs([str(tmp_path / "in")], log=said.append) == images
    assert any(line.startswith(f"listing the inputs: 0 files in {tmp_path / 'in'} so far") for line in said), said
    assert [line for line in said if line.endswith(" inputs so far ...")] == [
        f"listing the inputs: {count} inputs so far ..." for count in range(3)]
    monkeypatch.setattr(caption, "LISTING_NOTE_EVERY_S", 3600.0)
    said.clear()
    assert caption.collect_inputs([str(tmp_path / "in")], log=said.append) == images and said == []


def test_a_second_writer_and_an_unwritable_output_are_refused_before_the_model_loads(model, tmp_path, capsys):
    """While one captioner holds the output, another on the same output stops with a clear message, before
    loading anything (here a model that does not exist would fail later); the lock goes with its holder."""
    from glimpse.caption import CaptionOutput

    _images(tmp_path / "in", 1)
    out = tmp_path / "captions.jsonl"
    with CaptionOutput(out):
        assert main(["caption", str(tmp_path / "in"), "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 1
        assert "being written by another glimpse caption" in capsys.readouterr().err
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "4"]) == 0
    (tmp_path / "file").write_text("x")
    assert main(["caption", str(tmp_path / "in"), "--model", str(tmp_path / "no-model"),
                 "--out", str(tmp_path / "file" / "captions.jsonl")]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_a_rerun_asking_for_other_settings_is_refused_before_the_model_loads_unless_it_starts_afresh(
        model, tmp_path, capsys, monkeypatch):
    """A rerun skips the inputs already captioned: asked with another policy, speed or prompt, it said "already done"
    and left captions of two kinds in one file (found from outside). Refused before loading anything (a model that
    does not exist would fail later); the same settings resume, and --overwrite starts afresh with the new ones."""
    _images(tmp_path / "in", 2)
    out = tmp_path / "captions.jsonl"
    ask = ["caption", str(tmp_path / "in"), "--out", str(out), "--max-new-tokens", "4"]
    assert main([*ask, "--model", model, "--speed", "0.5"]) == 0
    capsys.readouterr()
    before = out.read_bytes()
    for change, said in ((["--speed", "1"], "made with --policy auto --speed 0.5, and this run asks for --policy "
                                            "auto --speed 1"),
                         (["--speed", "0.5", "--policy", "none"], "asks for --policy none --speed 0.5"),
                         (["--speed", "0.5", "--prompt", "What colour?"],
                          "--speed 0.5 and no --prompt, and this run asks for --policy auto --speed 0.5 --prompt "
                          "'What colour?'"),
                         # another model's captions were added to the file without a word (found from outside)
                         (["--speed", "0.5", "--model", str(tmp_path / "no-model")],
                          f"made with --model {model_key(model)} --policy auto --speed 0.5, and this run asks for "
                          f"--model {tmp_path / 'no-model'} --policy auto --speed 0.5")):
        assert main([*ask, "--model", model, *change]) == 1
        err = capsys.readouterr().err
        assert said in err and "would mix the two" in err and "--overwrite" in err and "loading" not in err, err
    assert out.read_bytes() == before
    assert all(r["model"] == model_key(model) for r in _lines(out))
    monkeypatch.chdir(Path(model).parent)  # the same model named by a relative path is the same model
    relative = ["--model", os.path.join(".", Path(model).name)]
    assert main([*ask, *relative, "--speed", "0.5"]) == 0 and "already done 2" in capsys.readouterr().err
    assert main([*ask, "--model", model, "--speed", "1", "--overwrite"]) == 0
    assert [r["speed"] for r in _lines(out)] == [1.0, 1.0]


def test_overwrite_replaces_the_captions_of_the_inputs_given_and_keeps_the_others(model, tmp_path, capsys):
    """Found from outside: ``--overwrite`` emptied the output, so re-captioning one picture lost every other caption
    and said "captioned 1". It replaces the given inputs' records and keeps the rest; those it keeps must have been
    made with this run's settings (the output would mix the two), and the output stays locked throughout."""
    from glimpse.caption import CaptionOutput, input_key
    from glimpse.common import UserError

    images = _images(tmp_path / "in", 3)
    out = tmp_path / "captions.jsonl"
    ask = ["--out", str(out), "--model", model, "--max-new-tokens", "4"]
    assert main(["caption", str(tmp_path / "in"), *ask]) == 0
    before = {r["key"]: r for r in _lines(out)}
    capsys.readouterr()
    assert main(["caption", str(images[0]), *ask, "--overwrite"]) == 0
    assert "1 caption of these inputs removed" in capsys.readouterr().err
    after = _lines(out)
    assert sorted(r["key"] for r in after) == sorted(before)  # every input once
    assert after[:2] == [before[input_key(p)] for p in images[1:]] and after[2]["key"] == input_key(images[0])
    kept = out.read_bytes()
    assert main(["caption", str(images[0]), *ask, "--overwrite", "--speed", "1"]) == 1  # the others are at speed 0
    assert "its captions of inputs not in this run would be kept" in capsys.readouterr().err
    assert out.read_bytes() == kept
    assert main(["caption", str(tmp_path / "in"), *ask, "--overwrite", "--speed", "1"]) == 0  # all of them: fine
    assert sorted(r["speed"] for r in _lines(out)) == [1.0] * 3

    output = CaptionOutput(out)
    try:
        assert output.forget({input_key(images[1])}) == 1
        with pytest.raises(UserError, match="being written by another glimpse caption"):
            CaptionOutput(out)
        output.write({"path": str(images[1]), "key": input_key(images[1]), "caption": "again"})
    finally:
        output.close()
    assert sorted(r["key"] for r in _lines(out)) == sorted(before) and not list(tmp_path.glob(".*.partial"))


def test_overwrite_rewrites_in_place_what_cannot_be_replaced_and_clears_a_killed_runs_leftovers(
        tmp_path, monkeypatch):
    """An output mounted on its own (``docker run -v FILE:...``) cannot be renamed over (EBUSY), nor one in a folder
    the user may not write: --overwrite then failed after the model loaded, naming a temporary file (an outside
    pass). It is rewritten in place under the lock. A killed --overwrite's temporary file is removed by the next one,
    unless a run is writing it; and a run that locks the output just as another replaced it opens the new one."""
    import errno
    import fcntl

    from glimpse import caption
    from glimpse.caption import CaptionOutput, input_key

    images = _images(tmp_path / "in", 3)
    out = tmp_path / "captions.jsonl"
    records = [{"path": str(p), "key": input_key(p), "caption": f"caption {i}"} for i, p in enumerate(images)]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    stale, busy = tmp_path / ".captions.jsonl.1.partial", tmp_path / ".captions.jsonl.2.partial"
    stale.write_text("half")
    busy.write_text("being written")
    with open(busy, "rb") as writing:
        fcntl.flock(writing, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with CaptionOutput(out) as output:
            assert output.forget({records[0]["key"]}) == 1
        assert not stale.exists() and busy.exists()
    assert _lines(out) == records[1:]

    def mounted(*args):
        raise OSError(errno.EBUSY, "Device or resource busy")

    with monkeypatch.context() as patch:
        patch.setattr(caption.os, "replace", mounted)
        with CaptionOutput(out) as output:
            assert output.forget({records[1]["key"]}) == 1
            output.write(records[0])
        assert out.read_text().splitlines()[0].isspace()  # blanked where it was
        assert _lines(out, blank_lines=True) == [records[2], records[0]]
        assert not list(tmp_path.glob(".captions.jsonl.[!2]*"))

    lock, replaced = fcntl.flock, []

    def replaced_before_the_lock(file, how):  # another run's --overwrite, between this run's open and its lock
        if not replaced:
            replaced.append(tmp_path / "new.jsonl")
            replaced[0].write_text(out.read_text())
            os.replace(replaced[0], out)
        return lock(file, how)

    monkeypatch.setattr(caption.fcntl, "flock", replaced_before_the_lock)
    with CaptionOutput(out) as output:
        assert replaced and os.fstat(output.file.fileno()).st_ino == out.stat().st_ino
        output.write(records[1])
    assert _lines(out, blank_lines=True) == [records[2], records[0], records[1]]


@pytest.mark.parametrize("killed_after", [0, 1, 57, None])  # bytes of a write that reach the file; None: at fsync
def test_a_kill_during_an_in_place_overwrite_loses_no_kept_caption(tmp_path, monkeypatch, killed_after):
    """An output that cannot be replaced is rewritten in place. Until 2026-12-07 it was emptied first, so a kill
    before the write lost every caption it kept; then its kept lines were moved up over it, and a write a kill cut
    short (Linux cuts it at a page) spliced a kept line, or lost it (an outside pass). Now only the forgotten
    records' bytes are written, blanked: whatever moment the kill comes at, every kept record is in the file as it
    was, and the next run takes the file, resumes from it and forgets the forgotten records again."""
    import errno

    from glimpse import caption
    from glimpse.caption import CaptionOutput, input_key

    images = _images(tmp_path / "in", 4)
    out = tmp_path / "captions.jsonl"
    records = [{"path": str(p), "key": input_key(p), "caption": "word " * (40 - 9 * i)} for i, p in enumerate(images)]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    forgotten = {records[0]["key"], records[2]["key"]}  # the first line among them
    kept = [json.dumps(r) for r in records if r["key"] not in forgotten]
    pwrite = os.pwrite

    def mounted(*args):
        raise OSError(errno.EBUSY, "Device or resource busy")

    def cut_short(fd, data, offset):
        pwrite(fd, data[:killed_after], offset)
        raise SystemExit("killed")

    def killed(*args):
        raise SystemExit("killed")

    with monkeypatch.context() as patch:
        patch.setattr(caption.os, "replace", mounted)
        if killed_after is None:
            patch.setattr(caption.os, "fsync", killed)
        else:
            patch.setattr(caption.os, "pwrite", cut_short)
        with pytest.raises(SystemExit), CaptionOutput(out) as output:
            output.forget(forgotten)
    assert all(line in out.read_text().splitlines() for line in kept)

    with monkeypatch.context() as patch:
        patch.setattr(caption.os, "replace", mounted)
        with CaptionOutput(out) as output:  # (taken as a captions file, its first line blank or half blank)
            assert {r["key"] for r in records if r["key"] not in forgotten} <= output.done()
            output.forget(forgotten)
    lines = out.read_text().splitlines()
    assert [line for line in lines if line.strip()] == kept and len(lines) == len(records)  # blanked, not moved
    with CaptionOutput(out) as output:  # replaceable again: the blank lines go
        output.forget({records[1]["key"]})
    assert out.read_text().splitlines() == kept[1:]


def test_an_out_that_is_not_a_captions_file_is_refused_and_left_as_it_was(tmp_path, capsys):
    """Found from outside: resuming cuts --out back to its last newline and appends, so a picture or notes
    named by a typo were damaged, and /dev/full was read whole into memory. Refused before the model loads."""
    image = _images(tmp_path / "in", 1)[0]
    notes = tmp_path / "notes.txt"
    notes.write_text("line 1\nline 2 without a newline")
    picture = tmp_path / "a.png"
    picture.write_bytes(image.read_bytes())
    # An outside pass: a minified JSON file (one line beginning with '{"', no newline) was cut to nothing and notes
    # beginning with a blank line lost their last line; a Ray manifest ({"path": ...} lines, no captions) had its
    # paths counted as captioned, and a caption file with notes after it lost them.
    config = tmp_path / "config.json"
    config.write_text('{"name": "cfg", "version": 1}')
    blank_first = tmp_path / "notes.md"
    blank_first.write_text("\nnotes line 1\nlast line, no newline")
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"path": str(image)}) + "\n")
    record = json.dumps({"path": str(image), "key": str(image.resolve()), "caption": "A square."})
    appended = tmp_path / "appended.jsonl"
    appended.write_text(record + "\nmy notes, no newline")
    for out in (notes, picture, config, blank_first, manifest, appended):
        before = out.read_bytes()
        assert main(["caption", str(image), "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 1
        assert "not a captions file" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["caption", str(image), "--model", str(tmp_path / "no-model"), "--out", os.devnull]) == 1
    assert "not a regular file" in capsys.readouterr().err
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"\xff\xfe not text")
    assert main(["caption", str(listing), "--out", str(tmp_path / "c.jsonl")]) == 1
    assert "not a list of paths" in capsys.readouterr().err


def test_a_list_file_saved_with_a_byte_order_mark_keeps_its_first_entry(tmp_path):
    """Windows Notepad begins a UTF-8 file with a byte order mark: the first path became "\ufeffsub/x.png", not found,
    named with an invisible character (an outside pass)."""
    images = _images(tmp_path / "in", 2)
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(f"in/{p.name}" for p in images).encode() + b"\r\n")
    assert collect_inputs([str(listing)]) == [tmp_path / "in" / p.name for p in images]



def test_a_list_line_is_a_name_as_it_is_when_a_file_has_it_and_a_find_print0_list_is_read(tmp_path):
    """``ls > list.txt`` in a folder holding ``#1 holiday.png`` and `` 3.png``: the first was passed over as a
    comment without a word, the second looked up as ``3.png``; and a ``find -print0`` list ended the run in a
    traceback (an outside pass). A line that names a file as it is, is that file; comments, blank lines and spaces
    around other lines are still what they were; NUL bytes separate names, each as it is."""
    folder = tmp_path / "in"
    picture = _images(folder, 1)[0]
    odd = [folder / "#1 holiday.png", folder / " 3.png", folder / "two\nlines.png", folder / "a\rb.png"]
    for path in odd:
        path.write_bytes(picture.read_bytes())
    listing = folder / "list.txt"
    listing.write_text("# my pictures\n\n#1 holiday.png\n 3.png\n  img000.png  \n#not a file.png\n")
    assert sorted(collect_inputs([str(listing)])) == sorted([folder / "#1 holiday.png", folder / " 3.png", picture])

    found = tmp_path / "found.lst"
    found.write_bytes(b"".join(os.fsencode(p.relative_to(tmp_path)) + b"\0" for p in [picture, *odd]))
    assert sorted(collect_inputs([str(found)])) == sorted([picture, *odd])
    # Lines ended by carriage returns alone (classic Mac OS; old Excel for Mac exports) are lines still
    found.write_bytes(b"in/img000.png\rin/#1 holiday.png\r")
    assert sorted(collect_inputs([str(found)])) == sorted([picture, folder / "#1 holiday.png"])


def test_a_nul_byte_in_a_listed_name_fails_that_input_not_the_run(model, tmp_path, capsys):
    """``file:///.../a%00.png`` in a list (or a manifest's path holding a NUL) ended the run in a traceback, exit 2
    (an outside pass): no file has such a name, so it is an input that fails, named, and the rest is captioned. The
    "failed" lines show the name's control characters escaped (a NUL printed raw was unseen in a terminal)."""
    picture = _images(tmp_path / "in", 1)[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"{picture}\nfile://{tmp_path}/in/a%00.png\n")
    out = tmp_path / "c.jsonl"
    assert main(["caption", str(listing), "--model", model, "--out", str(out), "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err and "a\\x00.png': a name with a NUL byte" in err
    failed = [line for line in err.splitlines() if line.strip().startswith("failed")]
    assert len(failed) == 2 and all("a\\x00.png" in line and "\0" not in line for line in failed)  # shown, not sent
    assert [r["path"] for r in _lines(out)] == [str(picture)]


def test_an_input_whose_reading_raises_an_error_of_an_unknown_kind_fails_alone(model, tmp_path, capsys, monkeypatch):
    """A damaged AVIF raised PIL's RuntimeError, which nothing turned into a MediaError: the whole caption run ended
    in an internal error, the other inputs' captions never written (an outside pass). Whatever reading one input
    raises, that input fails, saying what was raised, and the rest are captioned."""
    from glimpse import caption

    images = _images(tmp_path / "in", 3)
    reading = caption._prompt

    def a_decoder_s_own_error(engine, path, *args):
        if path.name == images[1].name:
            raise RuntimeError("Failed to decode frame 0")
        return reading(engine, path, *args)

    monkeypatch.setattr(caption, "_prompt", a_decoder_s_own_error)
    out = tmp_path / "c.jsonl"
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "2"]) == 1
    assert sorted(r["path"] for r in _lines(out)) == [str(images[0]), str(images[2])]
    assert "cannot be read (RuntimeError: Failed to decode frame 0)" in capsys.readouterr().err

def test_retry_errors_is_refused_without_ray_where_failed_inputs_are_retried_anyway(tmp_path, capsys):
    image = _images(tmp_path / "in", 1)[0]
    assert main(["caption", str(image), "--out", str(tmp_path / "c.jsonl"), "--retry-errors"]) == 1
    assert "--retry-errors is for --ray" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()  # refused before anything was written


@pytest.mark.parametrize("options,named", [(["--ray-address", "ray://head:10001", "--actors", "4"],
                                             "--ray-address, --actors are options"),
                                            (["--tries", "3"], "--tries is an option"),  # typed, at its default
                                            (["--act", "1"], "--actors is an option"),  # abbreviated, at its default
                                            (["--gpus-per-actor=1"], "--gpus-per-actor is an option"),
                                            (["--column", "url", "--shard-rows", "9"], "--column, --shard-rows are")])
def test_the_options_of_ray_are_refused_without_ray(tmp_path, capsys, options, named):
    """Found from outside: ``--ray-address ... --actors 4`` without ``--ray`` captioned in this process, exit 0,
    without a word of the cluster it was told to use."""
    image = _images(tmp_path / "in", 1)[0]
    assert main(["caption", str(image), "--out", str(tmp_path / "c.jsonl"), *options]) == 1
    assert f"{named}" in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()  # refused before anything was written


def test_a_url_in_the_local_captioners_inputs_points_to_ray_before_the_model_loads(tmp_path, capsys):
    image = _images(tmp_path / "in", 1)[0]
    listing = tmp_path / "list.txt"
    listing.write_text(f"{image}\nhttps://example.com/photo.jpg\n")
    for inputs in ([str(listing)], ["https://example.com/photo.jpg"]):
        assert main(["caption", *inputs, "--out", str(tmp_path / "c.jsonl")]) == 1
        err = capsys.readouterr().err
        assert "https://example.com/photo.jpg: a URL" in err and "--ray" in err and "loading" not in err
    assert not (tmp_path / "c.jsonl").exists()
    # A manifest too: it loaded the model, then called the manifest "not an image (unsupported type .jsonl)".
    manifest = tmp_path / "urls.jsonl"
    manifest.write_text(json.dumps({"path": str(image)}) + "\n")
    assert main(["caption", str(manifest), "--out", str(tmp_path / "c.jsonl")]) == 1
    err = capsys.readouterr().err
    assert f"{manifest}: a manifest" in err and "--ray" in err and "loading" not in err


def test_a_subfolder_that_cannot_be_listed_is_reported_and_fails_the_run_while_the_rest_is_captioned(
        model, tmp_path, monkeypatch, capsys):
    """Found from outside: a folder without read permission was passed over without a word (Path.rglob skips
    it), so its pictures were never captioned and the run said it had done everything."""
    good = _images(tmp_path / "in", 2)
    _images(tmp_path / "in" / "locked", 2, start=2)
    refuse_listing(monkeypatch, tmp_path / "in" / "locked")
    out = tmp_path / "captions.jsonl"
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--max-new-tokens", "3"]) == 1
    err = capsys.readouterr().err
    assert f"cannot list {tmp_path / 'in' / 'locked'} (Permission denied)" in err
    assert f"failed: {tmp_path / 'in' / 'locked'}: cannot list the folder" in err
    assert sorted(r["path"] for r in _lines(out)) == sorted(map(str, good))


def test_txt_sidecars_a_folder_refuses_are_refused_before_loading_and_a_failed_write_loses_only_its_caption(
        model, tmp_path, monkeypatch, capsys):
    """A read-only folder (here: os.access says so, as it would to a user) is refused before the model loads
    (a model that does not exist would fail later); a list file that an input's sidecar would replace too;
    a sidecar the disk refuses mid-run is that input's failure, and the others are written."""
    from glimpse import caption

    images = _images(tmp_path / "in", 3)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != tmp_path / "in" and real_access(path, mode))
    txt = ["--format", "txt", "--max-new-tokens", "3"]
    assert main(["caption", str(tmp_path / "in"), "--model", str(tmp_path / "no-model"), *txt]) == 1
    assert f"{tmp_path / 'in'} cannot be written" in capsys.readouterr().err
    monkeypatch.setattr(os, "access", real_access)

    listing = tmp_path / "in" / "img000.txt"  # the list of inputs is also img000.png's sidecar
    listing.write_text("\n".join(map(str, images)) + "\n")
    assert main(["caption", str(listing), "--model", str(tmp_path / "no-model"), *txt, "--overwrite"]) == 1
    assert "would be written over the list file" in capsys.readouterr().err
    assert listing.read_text() == "\n".join(map(str, images)) + "\n"
    listing.unlink()
    twin = tmp_path / "in" / "img000.jpg"  # img000.png's sidecar too: refused before loading (it was after)
    twin.write_bytes(images[0].read_bytes())
    assert main(["caption", str(tmp_path / "in"), "--model", str(tmp_path / "no-model"), *txt]) == 1
    err = capsys.readouterr().err
    assert "would share the caption file" in err and "loading" not in err, err
    twin.unlink()

    real_write = caption.write_sidecar

    def write_sidecar(path, text):
        if path == images[1]:
            raise OSError(28, "No space left on device")
        real_write(path, text)

    monkeypatch.setattr(caption, "write_sidecar", write_sidecar)
    assert main(["caption", str(tmp_path / "in"), "--model", model, *txt]) == 1
    err = capsys.readouterr().err
    assert f"failed: {images[1]}: cannot write {images[1].with_suffix('.txt')} (No space left on device)" in err
    assert "captioned 2, already done 0, failed 1" in err  # the one it could not write is not counted captioned
    assert [p.with_suffix(".txt").exists() for p in images] == [True, False, True]


def test_a_prompt_no_input_could_be_asked_with_is_refused_once_not_blamed_on_every_input(model, tmp_path, capsys):
    """Found from outside: a --prompt too long for the model, or not valid Unicode, listed every input as failed
    after the model had loaded, and an empty one silently used the default instruction."""
    from glimpse.pipeline import load_engine

    _images(tmp_path / "in", 2)
    out = tmp_path / "c.jsonl"
    absent = str(tmp_path / "no-model")  # refused before loading: a model that does not exist is never reached
    for prompt, said in (("", "--prompt is empty"), (" \n", "--prompt is empty"),
                         ("describe \udcff", "--prompt: the text is not valid Unicode")):
        assert main(["caption", str(tmp_path / "in"), "--model", absent, "--out", str(out), "--prompt", prompt]) == 1
        assert said in capsys.readouterr().err
    too_long = "word " * (2 * load_engine(model, device="cpu").max_length)
    assert main(["caption", str(tmp_path / "in"), "--model", model, "--out", str(out), "--prompt", too_long]) == 1
    err = capsys.readouterr().err
    assert "--prompt: This model's maximum context length is" in err and "the messages hold" in err
    assert "failed:" not in err and not _lines(out)


def test_a_loop_of_symbolic_links_is_an_input_not_the_end_of_collecting_them(tmp_path):
    """Named in a folder, in a list file or directly, for the local and the Ray captioner alike: collected as an
    input (its reading then fails, reported), where resolving it raised and ended the whole run."""
    from glimpse.caption import collect_inputs
    from glimpse.caption_ray import collect_keys

    good = _images(tmp_path / "in", 1)
    (tmp_path / "in" / "loop_a.mp4").symlink_to(tmp_path / "in" / "loop_b.mp4")
    (tmp_path / "in" / "loop_b.mp4").symlink_to(tmp_path / "in" / "loop_a.mp4")
    listing = tmp_path / "inputs.txt"
    listing.write_text(f"{tmp_path / 'in' / 'loop_a.mp4'}\n{good[0]}\n")
    names = sorted(p.name for p in collect_inputs([str(tmp_path / "in")]))
    assert names == ["img000.png", "loop_a.mp4", "loop_b.mp4"]
    assert sorted(p.name for p in collect_inputs([str(listing)])) == ["img000.png", "loop_a.mp4"]
    assert sorted(Path(k).name for k in collect_keys([str(tmp_path / "in"), str(listing)])) == names


def test_links_to_folders_are_followed_and_each_folder_is_walked_once(tmp_path):
    """``photos/2023`` a link to another disk: its pictures were passed over without a word, exit 0 (an outside
    pass). Followed, for the local and the Ray captioner alike; a link back up lists nothing twice."""
    from glimpse.caption_ray import collect_keys

    mine = _images(tmp_path / "photos", 1)
    elsewhere = _images(tmp_path / "other_disk" / "2023", 2, start=1)
    (tmp_path / "photos" / "2023").symlink_to(tmp_path / "other_disk" / "2023")
    (tmp_path / "other_disk" / "2023" / "up").symlink_to(tmp_path / "photos")  # a loop
    found = collect_inputs([str(tmp_path / "photos")])
    assert sorted(p.resolve() for p in found) == sorted(p.resolve() for p in mine + elsewhere)
    assert len(collect_keys([str(tmp_path / "photos")])) == 3


def test_a_folder_tree_deeper_than_the_recursion_limit_is_walked(tmp_path):
    """A tree some 1000 folders deep ended collecting in a RecursionError (``os.walk`` recursed once per level
    before Python 3.12: an outside pass). Its pictures are found like any other's."""
    import sys

    folders = [tmp_path / "tree"]
    for _ in range(sys.getrecursionlimit() + 50):
        folders.append(folders[-1] / "x")
    try:
        for folder in folders:
            folder.mkdir()  # (not makedirs, nor rmtree below: both recurse once per level too)
        picture = _images(folders[-1], 1)[0]
        assert collect_inputs([str(folders[0])]) == [picture]
    finally:
        for folder in reversed(folders):
            for file in folder.glob("*.png"):
                file.unlink()
            folder.rmdir() if folder.exists() else None

def test_a_failure_said_while_the_progress_bar_is_drawn_is_a_line_of_its_own(model, tmp_path, capsys):
    """"failed ..." was printed onto the progress bar's line (``captioning: 50%|... [...]failed in/b.png: ...``): a
    grep for lines starting with "failed" missed it (an outside pass). Each is a line of its own under the bar."""
    folder = tmp_path / "in"
    _images(folder, 1)
    (folder / "img001.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    _images(folder, 1, start=2)
    assert main(["caption", str(folder), "--model", model, "--out", str(tmp_path / "c.jsonl"), "--batch-size", "1",
                 "--max-new-tokens", "2"]) == 1
    lines = capsys.readouterr().err.split("\n")  # as a log file holds them (stderr is no terminal here)
    assert any(line.startswith(f"failed {folder / 'img001.png'}") for line in lines), lines
    assert not any("|" in line and "failed " + str(folder) in line for line in lines), lines


def test_an_output_the_disk_cannot_take_is_named_and_what_to_do_said(model, tmp_path):
    """A full disk ended a run with "glimpse: error: File too large" alone, stuck onto the progress bar's line (two
    outside passes): the error names the output, says the captions written are kept and that the same command goes
    on, on a line of its own; and the same command then does. The disk fills here as a file-size limit makes it
    (RLIMIT_FSIZE: writes past it fail with EFBIG, as ENOSPC fails them), in a run of its own."""
    pytest.importorskip("resource")
    folder, out = tmp_path / "in", tmp_path / "c.jsonl"
    _images(folder, 3)
    args = ["caption", str(folder), "--model", model, "--out", str(out), "--batch-size", "1", "--max-new-tokens", "2"]
    assert main([*args[:1], str(folder / "img000.png"), *args[2:]]) == 0
    one_record = out.stat().st_size
    limit = int(one_record * 2.5)  # room for the next record, not for the one after it
    script = ("import resource, sys; from glimpse.cli import main; "
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); sys.exit(main({args!r}))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("glimpse: error: ")]
    assert said == [f"glimpse: error: {out}: File too large: the captions written before it are kept; rerun the "
                    "same command to caption the rest"], run.stderr
    assert main(args) == 0
    assert sorted(Path(r["path"]).name for r in _lines(out)) == ["img000.png", "img001.png", "img002.png"]


def test_an_input_is_an_image_or_a_video_by_its_content(checkpoints, media, tmp_path):
    """A clip saved as .png in a folder, or named without an extension (or another one) in a list: read as a picture
    by its name, each failed with "this is a video, not an image; pass it as a video", which the captioner cannot
    (an outside pass). By its content, as the chat decides, each is captioned as the video it is."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("clip.png", "clip", "clip.bin"):
        (folder / name).write_bytes(media["video"].read_bytes())
    listing = folder / "list.txt"
    listing.write_text("clip\nclip.bin\n")
    out = tmp_path / "c.jsonl"
    assert main(["caption", str(folder), str(listing), "--model", str(checkpoints["qwen2_vl"]), "--out", str(out),
                 "--max-new-tokens", "2"]) == 0
    rows = _lines(out)
    assert sorted(Path(r["path"]).name for r in rows) == ["clip", "clip.bin", "clip.png"]
    assert all(r["metrics"]["prompt_tokens"]["video"] > 0 and "video" in r["prompt"] for r in rows), rows


def test_a_batch_the_memory_cannot_hold_is_split_and_an_input_that_never_fits_fails_alone(model, checkpoints, tmp_path):
    """Out of memory decoding a batch, the engine undoes the step and decodes the batch in smaller parts until
    they fit: every caption is the one made without the shortage, and every input is read once. An input whose
    prefill alone does not fit fails with what ran out (the captioner halves the batch to find it); the others
    go on."""
    from glimpse.caption import caption_inputs
    from glimpse.pipeline import load_engine
    from tiny_models import RunsOutOfMemory

    engine = load_engine(model, device="cpu")
    images = _images(tmp_path / "in", 4)
    options = dict(fmt="jsonl", overwrite=False, policy="none", speed=0.0, prompt=None, max_new_tokens=4,
                   batch_size=4)
    caption_inputs(engine, images, out=tmp_path / "plenty.jsonl", **options)
    # Prompts have dozens of rows: they still fit, as do decode steps of two requests; four together do not.
    with RunsOutOfMemory(engine.adapter.layers[1].mlp, "cpu", lambda rows: 3 <= rows <= 8) as fault, \
            _Reading(engine) as reading:
        report = caption_inputs(engine, images, out=tmp_path / "short.jsonl", **options)
    assert fault.refused and report.failed == []
    assert reading.calls == {p.name: 1 for p in images}
    short = _lines(tmp_path / "short.jsonl")
    assert [r["caption"] for r in short] == [r["caption"] for r in _lines(tmp_path / "plenty.jsonl")]
    assert [r["metrics"]["batch_size"] for r in short] == [4, 4, 4, 4]  # one batch, decoded in parts

    # On Qwen2-VL a larger picture is a longer prompt: the one whose prefill does not fit.
    qwen = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    huge = tmp_path / "huge.png"
    Image.fromarray((np.random.RandomState(9).rand(224, 224, 3) * 255).astype("uint8")).save(huge)
    rows = [qwen.prepare(_messages_for(path)).input_ids.shape[0] for path in (images[0], huge)]
    assert rows[1] > max(rows[0], 8)
    with RunsOutOfMemory(qwen.adapter.layers[1].mlp, "cuda", lambda n: n >= rows[1]):
        report = caption_inputs(qwen, [*images, huge], out=tmp_path / "huge.jsonl", **options)
    assert [path for path, _ in report.failed] == [str(huge)]
    assert report.failed[0][1].startswith("out of CPU memory prefilling this prompt")
    assert [r["path"] for r in _lines(tmp_path / "huge.jsonl")] == [str(p) for p in images]


def _messages_for(path: Path) -> list[dict]:
    from glimpse.caption import _messages

    return _messages(path, None)


def test_a_sidecar_write_the_disk_cuts_short_leaves_the_old_caption_whole(model, tmp_path, monkeypatch):
    """A sidecar is written beside and renamed over the old one: a write the disk cuts short (ENOSPC half way)
    leaves the old caption whole, not half a new one that a later run would skip as done."""
    images = _images(tmp_path / "in", 2)
    args = ["caption", str(tmp_path / "in"), "--model", model, "--format", "txt", "--max-new-tokens", "4"]
    assert main(args) == 0
    sidecar = images[0].with_suffix(".txt")
    sidecar.write_text("an old caption, whole\n")
    real_write_text = Path.write_text

    def disk_full(self, data, *more, **options):
        if self.parent == tmp_path / "in" and self.name != images[1].with_suffix(".txt").name:
            real_write_text(self, data[: len(data) // 2], *more, **options)
            raise OSError(28, "No space left on device")
        return real_write_text(self, data, *more, **options)

    monkeypatch.setattr(Path, "write_text", disk_full)
    main([*args, "--overwrite"])
    monkeypatch.undo()
    assert sidecar.read_text() == "an old caption, whole\n"
    assert not list((tmp_path / "in").glob(".*partial"))


def test_overwrite_keeps_the_output_s_permissions(model, tmp_path):
    """--overwrite replaces the output by a new file: it keeps the user's permissions (a private 0600 output stays
    private, not the umask's 0644)."""
    images = _images(tmp_path / "in", 2)
    out = tmp_path / "captions.jsonl"
    ask = ["--out", str(out), "--model", model, "--max-new-tokens", "4"]
    assert main(["caption", str(tmp_path / "in"), *ask]) == 0
    out.chmod(0o600)
    assert main(["caption", str(images[0]), *ask, "--overwrite"]) == 0
    assert len(_lines(out)) == 2
    assert out.stat().st_mode & 0o777 == 0o600


def test_an_input_that_never_fits_among_others_in_its_batch_fails_alone(checkpoints, tmp_path):
    """An input whose prefill never fits, in a batch with others: the batch is split in halves until it is alone,
    and it alone fails; the others are captioned. (The existing test had it alone in its batch already.)"""
    from glimpse.caption import _messages, caption_inputs
    from glimpse.pipeline import load_engine
    from tiny_models import RunsOutOfMemory

    qwen = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    images = _images(tmp_path / "in", 4)
    huge = tmp_path / "huge.png"
    Image.fromarray((np.random.RandomState(9).rand(224, 224, 3) * 255).astype("uint8")).save(huge)
    rows = [qwen.prepare(_messages(path, None)).input_ids.shape[0] for path in (images[0], huge)]
    inputs = [images[0], huge, *images[1:]]
    options = dict(fmt="jsonl", overwrite=False, policy="none", speed=0.0, prompt=None, max_new_tokens=4,
                   batch_size=8)
    with RunsOutOfMemory(qwen.adapter.layers[1].mlp, "cuda", lambda n: n >= rows[1]):
        report = caption_inputs(qwen, inputs, out=tmp_path / "out.jsonl", **options)
    assert [path for path, _ in report.failed] == [str(huge)]
    assert sorted(r["path"] for r in _lines(tmp_path / "out.jsonl")) == sorted(str(p) for p in images)


def test_one_file_named_twice_in_one_run_is_one_input_and_said(tmp_path):
    """README: names that link to one file are one input (said, with an example); the folder and a link to one of its
    pictures, given together, list that picture once (twice, both would fail as "written alike")."""
    images = _images(tmp_path / "in", 2)
    (tmp_path / "alias.png").symlink_to(images[0])
    said = []
    found = collect_inputs([str(tmp_path / "in"), str(tmp_path / "alias.png"), str(images[1])], log=said.append)
    assert found == images
    assert any("the same file as another input" in line for line in said), said


def test_each_folder_is_listed_once_however_many_links_lead_back_to_it(tmp_path, monkeypatch):
    """README: links to folders are followed, each folder once: a link back up must not list the tree again
    (and again, down to the system's limit of links in one path)."""
    from glimpse import caption

    images = _images(tmp_path / "photos", 2)
    (tmp_path / "photos" / "sub").mkdir()
    (tmp_path / "photos" / "sub" / "up").symlink_to(tmp_path / "photos")  # a loop
    listed = []
    real = os.scandir
    monkeypatch.setattr(caption.os, "scandir", lambda path: listed.append(Path(path).resolve()) or real(path))
    assert sorted(p.resolve() for p in collect_inputs([str(tmp_path / "photos")])) == [p.resolve() for p in images]
    assert Counter(listed) == {(tmp_path / "photos").resolve(): 1, (tmp_path / "photos" / "sub").resolve(): 1}


def test_a_folders_inputs_come_in_sorted_order_whatever_order_the_file_system_lists_them_in(tmp_path, monkeypatch):
    """Inputs come in a stable order (the JSONL's order, a rerun's batches): a folder's files sorted by name, not in
    the order the file system happens to list them."""
    from glimpse import caption

    images = _images(tmp_path / "in", 4) + _images(tmp_path / "in" / "sub", 2, start=4)
    real = os.scandir

    class Backwards:  # a file system that lists a folder's entries in reverse name order
        def __init__(self, path):
            with real(path) as entries:
                self.entries = sorted(entries, key=lambda e: e.name, reverse=True)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(caption.os, "scandir", Backwards)
    assert collect_inputs([str(tmp_path / "in")]) == sorted(images)


def test_upper_case_extensions_are_media_too(tmp_path):
    """A camera's IMG_0001.JPG or a clip's .MP4 is as much an input as a .jpg: a folder of them was captioned
    with "no image or video files found", or its pictures passed over without a word."""
    images = _images(tmp_path / "in", 2)
    upper = images[1].rename(tmp_path / "in" / "IMG_0001.PNG")
    assert sorted(collect_inputs([str(tmp_path / "in")])) == sorted([images[0], upper])


def test_a_kill_that_cut_the_last_record_within_its_first_bytes_is_resumed_not_refused(tmp_path):
    """A kill may cut the last line after a few bytes ('{"pa'): still a record of ours cut short, dropped as the
    output is opened again, not a file refused as "not a captions file" (the rerun could never finish)."""
    from glimpse.caption import CaptionOutput

    out = tmp_path / "captions.jsonl"
    record = {"path": "a.png", "key": str(tmp_path / "a.png"), "caption": "a cat"}
    whole = json.dumps(record) + "\n"
    for cut in (1, 4, 8):
        out.write_text(whole + json.dumps({**record, "path": "b.png"})[:cut])
        with CaptionOutput(out) as output:
            assert output.done() == {record["key"]}
        assert out.read_text() == whole


def test_progress_counts_the_failures_as_they_come(model, tmp_path):
    """The bar says how many inputs failed so far (``failed=N``): an unreadable input counts in the batch it was in."""
    from glimpse.caption import caption_inputs
    from glimpse.pipeline import load_engine

    images = _images(tmp_path / "in", 3)
    broken = tmp_path / "in" / "img001.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    calls = []
    report = caption_inputs(load_engine(model, device="cpu"), images, out=tmp_path / "c.jsonl", fmt="jsonl",
                            overwrite=False, policy="none", speed=0.0, prompt=None, max_new_tokens=2, batch_size=2,
                            progress=lambda *call: calls.append(call))
    assert [f for f, _ in report.failed] == [str(broken)]
    assert calls == [(0, 3, 0), (2, 3, 1), (3, 3, 1)]


def test_a_rerun_over_a_glob_that_now_matches_its_own_output_resumes(model, tmp_path, capsys, monkeypatch):
    """`glimpse caption photos/*` run again (the way to resume) is also given what the first run wrote there: its
    captions.jsonl (`cd photos && glimpse caption *`), or with --format txt each picture's sidecar. They are this
    run's output, said and left out, and the rerun finishes; they were refused as a manifest and as list files the
    captions would overwrite, and the run could never be resumed (an outside pass)."""
    from glimpse.cli import main

    for fmt in ("jsonl", "txt"):
        folder = tmp_path / fmt
        images = _images(folder, 2)
        monkeypatch.chdir(folder)
        run = ["caption", "--model", model, "--max-new-tokens", "2", "--format", fmt]
        assert main([*run, *sorted(p.name for p in folder.iterdir())]) == 0
        written = [folder / "captions.jsonl"] if fmt == "jsonl" else [p.with_suffix(".txt") for p in images]
        before = [path.read_bytes() for path in written]
        capsys.readouterr()
        glob = sorted(p.name for p in folder.iterdir())  # what the shell gives the rerun
        assert len(glob) == len(images) + len(written)
        assert main([*run, *glob]) == 0
        err = capsys.readouterr().err
        assert "already done 2" in err or "2 inputs already have a caption beside them" in err, err
        assert all(f"{path.name}: " in err for path in written) and "which this run writes: not an input" in err, err
        assert [path.read_bytes() for path in written] == before  # nothing captioned again
    # A list named like a picture's sidecar, given beside it, is still a list: refused, never written over
    folder = tmp_path / "listed"
    images = _images(folder, 3)
    listing = images[0].with_suffix(".txt")
    listing.write_text("".join(f"{p.name}\n" for p in images[1:]))
    for again in ([], ["--overwrite"]):
        assert main(["caption", "--model", model, "--format", "txt", *again, str(images[0]), str(listing)]) == 1
        assert "would be written over the list file" in capsys.readouterr().err
        assert listing.read_text() == "".join(f"{p.name}\n" for p in images[1:])
    # ... and an output named like a picture is not said to be left out (it is refused as before)
    assert main(["caption", "--model", model, str(images[1]), str(images[2]), "--out", str(images[1])]) == 1
    err = capsys.readouterr().err
    assert "not an input" not in err and "is not a captions file" in err, err
