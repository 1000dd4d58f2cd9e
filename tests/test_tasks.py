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
                # half-way, as the module says: absent from the first half of the frames, there in the second
                shown = [bool(colour_mask(frame, s.colour).sum()) for frame in clip.frames]
                half = tasks.CLIP_FRAMES // 2
                assert shown == [False] * half + [True] * (tasks.CLIP_FRAMES - half)
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
    ("Red, the circle.", "Red.", "colour", True),  # its first words are the answer's; what follows does not count
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


def _nearest_colour(pixel) -> tuple[str, float]:
    distances = {c: float(np.linalg.norm(np.asarray(pixel, float) - rgb)) for c, rgb in tasks.COLOURS.items()}
    name = min(distances, key=distances.get)
    return name, distances[name]


def near_colour_mask(image, colour: str, tolerance: float = 45.0) -> np.ndarray:
    pixels = np.asarray(image, dtype=float)
    return np.linalg.norm(pixels - np.array(tasks.COLOURS[colour], float), axis=-1) < tolerance


def test_styled_scenes_ask_the_same_questions_and_the_pixels_still_give_every_answer():
    """A styled held-out set (dark, graded, textured and striped backgrounds, turned, shadowed and outlined shapes,
    noise, JPEG) asks what the plain set of its seed asks, and what its pictures show is still each answer: the
    object's colour at its centre (the nearest palette colour, through noise and JPEG), as many palette colours on
    the canvas as the count, each object's colour mass in its quadrant, and nothing of the look (shadows,
    backgrounds) near a palette colour."""
    plain = tasks.heldout_set(seed=8, per_category=4)
    styled = tasks.heldout_set(seed=8, per_category=4, styled=1.0)
    assert [(q.question, q.answer) for _, q in styled] == [(q.question, q.answer) for _, q in plain]
    looks = {item.scene.style.background for item, _ in styled if item.scene is not None}
    assert looks == {"plain", "gradient", "texture", "stripes"}
    assert any(i.frames[0].tobytes() != j.frames[0].tobytes() for (i, _), (j, _) in zip(styled, plain))
    for item, qa in styled:
        if item.scene is None:
            continue
        image, scene = item.frames[0], item.scene
        assert scene.style is not None
        present = [c for c in tasks.COLOURS if near_colour_mask(image, c).sum() > 80]
        assert sorted(present) == sorted(t.colour for t in scene.things)
        for thing in scene.things:
            y, x = round(thing.y), round(thing.x)
            patch = np.median(np.asarray(image, float)[y - 2:y + 3, x - 2:x + 3].reshape(-1, 3), axis=0)
            assert _nearest_colour(patch)[0] == thing.colour
            assert quadrant_of(*centroid(near_colour_mask(image, thing.colour))) == thing.quadrant
        if qa.category == "count":
            assert int(answer_words(qa)) == len(present)


def test_a_styled_clip_keeps_its_look_on_every_frame_and_its_event():
    import random

    for kind in tasks.VIDEO_CATEGORIES:
        clip = tasks.sample_clip(random.Random(4), kind, style_rng=random.Random(9))
        first, last = (np.asarray(f, float) for f in (clip.frames[0], clip.frames[-1]))
        # away from the objects the background is the same picture in every frame (texture, noise and all)
        away = ~(near_colour_mask(clip.frames[0], clip.subject.colour) | near_colour_mask(clip.frames[-1],
                                                                                          clip.subject.colour))
        assert np.abs(first - last)[away].mean() < 3.0
        s = clip.subject
        if kind == "change":
            y, x = round(s.y), round(s.x)
            assert _nearest_colour(first[y, x])[0] == s.colour
            assert _nearest_colour(last[y, x])[0] == clip.new_colour
        elif kind == "appear":
            assert near_colour_mask(clip.frames[0], s.colour).sum() < 20 < near_colour_mask(clip.frames[-1],
                                                                                          s.colour).sum()
