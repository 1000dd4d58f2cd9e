"""The generated visual task set: every answer is what the pixels show, and a split is its seed."""

import hashlib

import numpy as np
import pytest

from glimpse import tasks


def colour_mask(image, colour: str) -> np.ndarray:
    return (np.asarray(image) == np.array(tasks.COLOURS[colour], dtype=np.uint8)).all(-1)


def centroid(mask: np.ndarray) -> tuple[float, float]:
    ys, xs = mask.nonzero()
    return float(xs.mean()), float(ys.mean())


def quadrant_of(x: float, y: float) -> str:
    half = tasks.CANVAS / 2
    return ("bottom" if y >= half else "top") + " " + ("right" if x >= half else "left")


def answer_words(qa: tasks.QA) -> str:
    return qa.answer.rstrip(".").lower()


@pytest.fixture(scope="module")
def scenes():
    import random

    rng = random.Random(123)
    out = []
    for _ in range(60):
        scene = tasks.sample_scene(rng)
        out.append((scene, tasks.render(scene), tasks.scene_questions(scene, rng)))
    return out


def test_every_image_answer_is_what_the_pixels_show(scenes):
    for scene, image, qas in scenes:
        present = [c for c in tasks.COLOURS if colour_mask(image, c).sum() > 50]
        for qa in qas:
            answer = answer_words(qa)
            if qa.category == "count":
                assert int(answer) == len(present) == len(scene.things)
            elif qa.category == "colour":
                shape = next(s for s in tasks.SHAPES if s in qa.question)
                thing = next(t for t in scene.things if t.colour == answer)
                assert thing.shape == shape
                assert tuple(np.asarray(image)[round(thing.y), round(thing.x)]) == tasks.COLOURS[answer]
            elif qa.category == "shape":
                colour = next(c for c in tasks.COLOURS if c in qa.question.rstrip("?").split())
                assert next(t.shape for t in scene.things if t.colour == colour) == answer
            elif qa.category == "position":
                thing = next(t for t in scene.things if t.name in qa.question or f"the {t.shape}?" in qa.question)
                actual = quadrant_of(*centroid(colour_mask(image, thing.colour)))
                assert answer in actual.split() or answer == actual
            elif qa.category == "size":
                # big and small are radii; a small circle can out-area a big star, so compare extents
                thing = next(t for t in scene.things if t.name in qa.question)
                ys, xs = colour_mask(image, thing.colour).nonzero()
                extent = max(xs.max() - xs.min(), ys.max() - ys.min())
                assert answer == ("big" if extent > 64 else "small")
            elif qa.category == "exists":
                shape = qa.question.rstrip("?").split()[-1]
                assert answer == ("yes" if shape in {t.shape for t in scene.things} else "no")
            elif qa.category == "word":
                assert scene.word == qa.answer.rstrip(".")


def test_names_in_questions_pick_exactly_one_object(scenes):
    for scene, _, _ in scenes:
        assert len({t.shape for t in scene.things}) == len(scene.things)
        assert len({t.colour for t in scene.things}) == len(scene.things)
        assert len({t.quadrant for t in scene.things}) == len(scene.things)


def test_clip_answers_are_what_the_frames_show():
    import random

    rng = random.Random(7)
    for kind in tasks.VIDEO_CATEGORIES:
        for _ in range(8):
            clip = tasks.sample_clip(rng, kind)
            first, last = clip.frames[0], clip.frames[-1]
            s = clip.subject
            (qa, *_) = tasks.clip_questions(clip, rng)
            if kind == "motion":
                (x0, y0), (x1, y1) = centroid(colour_mask(first, s.colour)), centroid(colour_mask(last, s.colour))
                moved = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}
                assert answer_words(qa) == max(moved, key=moved.get)
                assert moved[answer_words(qa)] > tasks.CANVAS / 3
            elif kind == "appear":
                assert colour_mask(first, s.colour).sum() == 0 < colour_mask(last, s.colour).sum()
                assert answer_words(qa) == s.shape
            else:
                centre = (round(s.y), round(s.x))
                assert tuple(np.asarray(first)[centre]) == tasks.COLOURS[s.colour]
                assert tuple(np.asarray(last)[centre]) == tasks.COLOURS[clip.new_colour]
                assert answer_words(qa) == clip.new_colour


def _digest(image) -> str:
    return hashlib.sha256(np.asarray(image).tobytes()).hexdigest()


def test_a_split_is_its_seed_and_heldout_never_meets_training():
    a = tasks.heldout_set(seed=5, per_category=2)
    b = tasks.heldout_set(seed=5, per_category=2)
    assert [(_digest(i.frames[0]), q.question) for i, q in a] == [(_digest(i.frames[0]), q.question) for i, q in b]
    other = tasks.heldout_set(seed=6, per_category=2)
    assert {_digest(i.frames[0]) for i, _ in a}.isdisjoint(_digest(i.frames[0]) for i, _ in other)
    training = {_digest(f) for item in tasks.training_items(tasks.TRAIN_SEED, 200, 20) for f in item.frames}
    heldout = {_digest(f) for item, _ in tasks.heldout_set(tasks.HELDOUT_SEED, 5) for f in item.frames}
    assert training.isdisjoint(heldout)


def test_heldout_set_is_balanced_over_categories():
    pairs = tasks.heldout_set(seed=3, per_category=4)
    counts = {c: sum(q.category == c for _, q in pairs) for c in tasks.IMAGE_CATEGORIES + tasks.VIDEO_CATEGORIES}
    assert set(counts.values()) == {4}
    assert all(q in item.qas for item, q in pairs)


@pytest.mark.parametrize("reply, answer, category, right", [
    ("Red.", "Red.", "colour", True),
    ("red", "Red.", "colour", True),
    ("The circle is red.", "Red.", "colour", False),  # the answer must come first
    ("Blue.", "Red.", "colour", False),
    ("Three.", "3.", "count", True),
    ("3", "3.", "count", True),
    ("Top left.", "Top left.", "position", True),
    ("Left.", "Top left.", "position", False),
    ("A circle.", "Circle.", "shape", True),
])
def test_is_correct(reply, answer, category, right):
    assert tasks.is_correct(reply, tasks.QA(category, "?", answer)) is right


def test_clip_is_a_video_glimpse_reads(tmp_path):
    import random

    from glimpse import vision

    clip = tasks.sample_clip(random.Random(0), "change")
    path = tasks.write_clip(clip.frames, tmp_path / "clip.mp4")
    sampled = vision.sample_video_uniform(path, num_frames=4)
    assert sampled.indices == [0, 2, 4, 7] and len(sampled.frames) == 4
    # the codec is lossy, but the object's colour at its centre survives
    s = clip.subject
    got = sampled.frames[-1][round(s.y), round(s.x)].astype(int)
    assert np.abs(got - np.array(tasks.COLOURS[clip.new_colour])).max() < 40


def test_alignment_labels_each_cell_with_what_covers_it():
    import random

    from training.train_projector import patch_words

    rng = random.Random(11)
    for _ in range(20):
        scene = tasks.sample_scene(rng, word=True)
        item = tasks.Item([tasks.render(scene)], [], "", scene)
        words = patch_words(item, 16)
        cell = tasks.CANVAS / 16
        for thing in scene.things:
            # the cell under the object's centre is the object's, and no cell of it lies outside the object
            centre = int(thing.y // cell) * 16 + int(thing.x // cell)
            assert words[centre] == f"{thing.colour} {thing.shape}"
            for k, w in enumerate(words):
                if w == f"{thing.colour} {thing.shape}":
                    cx, cy = (k % 16 + 0.5) * cell, (k // 16 + 0.5) * cell
                    assert max(abs(cx - thing.x), abs(cy - thing.y)) <= thing.radius + cell / 2
        if scene.word:
            assert scene.word in words
        assert words.count(None) > len(words) // 2  # mostly background
