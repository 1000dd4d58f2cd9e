"""A generated visual task set: scenes of simple objects and short clips, with questions, answers and captions.

This is the embedded model's training and evaluation data (see docs/embedded.md). Everything is drawn from a
seed, so a split is just a seed: `TRAIN_SEED` trains the projector, `HELDOUT_SEED` (and any other seed a
checker picks) is never seen in training.

A scene is a light background with 1-4 objects. Each object has a shape (circle, square, triangle, star), a
colour (six), a size (small or big) and sits in its own quadrant (top left, top right, bottom left, bottom
right) with a random offset, so every question below has exactly one right answer. Shapes and colours are
distinct within a scene ("the circle", "the red object" name one object). Some scenes also carry a short
rendered word in an empty quadrant.

A clip is 8 frames of such a scene in which one thing happens: an object moves (left, right, up or down),
a new object appears half-way, or an object changes colour half-way.

Questions come from a few templates per category; answers are short ("Red.", "3.", "Top left.") so that
accuracy is an exact word match. `scene_questions` gives every question a scene supports; `heldout_set`
draws one question per item, balanced over categories, for `glimpse eval --task visual`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

TRAIN_SEED = 0
HELDOUT_SEED = 1
VALIDATION_SEED = 2  # watched during training (train_projector --validate-every); reported accuracy uses HELDOUT_SEED

CANVAS = 336  # drawn at 1.5x the encoder's 224 px input; the image processor resizes as for any photo
COLOURS = {
    "red": (215, 38, 38),
    "green": (34, 160, 60),
    "blue": (35, 80, 215),
    "yellow": (240, 200, 20),
    "purple": (135, 55, 175),
    "orange": (245, 125, 25),
}
SHAPES = ("circle", "square", "triangle", "star")
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
SIZES = {"small": (20, 28), "big": (44, 56)}  # radius range in canvas pixels
WORDS = ("CAT", "SUN", "BOX", "DOG", "CUP", "MAP", "KEY", "HAT")
DIRECTIONS = ("left", "right", "up", "down")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")

CLIP_FRAMES = 8
CLIP_FPS = 4

IMAGE_CATEGORIES = ("colour", "shape", "count", "position", "size", "exists", "word")
VIDEO_CATEGORIES = ("motion", "appear", "change")


@dataclass
class Thing:
    shape: str
    colour: str
    size: str
    quadrant: str
    x: float  # centre, canvas pixels
    y: float
    radius: float

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} at the {self.quadrant}"


@dataclass
class Scene:
    background: tuple[int, int, int]
    things: list[Thing]
    word: str | None = None
    word_quadrant: str | None = None


@dataclass
class Clip:
    """Frames of a scene with one event: kind is 'motion', 'appear' or 'change'."""

    scene: Scene  # the scene at the first frame
    kind: str
    subject: Thing  # the object that moves, appears or changes
    direction: str | None = None  # motion
    new_colour: str | None = None  # change
    frames: list[Image.Image] = field(default_factory=list)


@dataclass
class QA:
    category: str
    question: str
    answer: str  # short, ends with "."

    @property
    def key(self) -> str:
        """The word(s) an answer must contain to be right, lower-case, no full stop."""
        return normalise(self.answer)


def normalise(text: str) -> str:
    words = text.lower().replace(".", " ").replace(",", " ").replace("!", " ").split()
    words = [w for w in words if w not in ("a", "an", "the", "it", "is")]
    return " ".join(words)


def is_correct(reply: str, qa: QA) -> bool:
    """The reply is right when its first words are the answer's words (digits and number words both count)."""
    got = normalise(reply).split()
    want = qa.key.split()
    if qa.category == "count" and got:
        got[0] = str(NUMBER_WORDS.index(got[0])) if got[0] in NUMBER_WORDS else got[0]
    return got[: len(want)] == want


# -- drawing --------------------------------------------------------------------------------------

def _quadrant_centre(quadrant: str) -> tuple[float, float]:
    half = CANVAS / 2
    col = 1 if quadrant.endswith("right") else 0
    row = 1 if quadrant.startswith("bottom") else 0
    return half * col + half / 2, half * row + half / 2


def _polygon(shape: str, x: float, y: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        s = r * 0.85
        return [(x - s, y - s), (x + s, y - s), (x + s, y + s), (x - s, y + s)]
    if shape == "triangle":
        return [(x + r * math.cos(math.radians(a)), y - r * math.sin(math.radians(a))) for a in (90, 210, 330)]
    if shape == "star":
        points = []
        for i in range(10):
            radius = r if i % 2 == 0 else r * 0.45
            angle = math.radians(90 + 36 * i)
            points.append((x + radius * math.cos(angle), y - radius * math.sin(angle)))
        return points
    raise ValueError(shape)


def draw_thing(draw: ImageDraw.ImageDraw, thing: Thing, colour: str | None = None) -> None:
    fill = COLOURS[colour or thing.colour]
    x, y, r = thing.x, thing.y, thing.radius
    if thing.shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    else:
        draw.polygon(_polygon(thing.shape, x, y, r), fill=fill)


def render(scene: Scene, hidden: Thing | None = None, recolour: dict[int, str] | None = None) -> Image.Image:
    image = Image.new("RGB", (CANVAS, CANVAS), scene.background)
    draw = ImageDraw.Draw(image)
    for i, thing in enumerate(scene.things):
        if thing is not hidden:
            draw_thing(draw, thing, (recolour or {}).get(i))
    if scene.word:
        font = ImageFont.load_default(size=44)
        cx, cy = _quadrant_centre(scene.word_quadrant)
        draw.text((cx, cy), scene.word, fill=(20, 20, 20), font=font, anchor="mm")
    return image


# -- sampling -------------------------------------------------------------------------------------

def _background(rng: random.Random) -> tuple[int, int, int]:
    base = rng.randint(205, 250)
    return tuple(min(255, max(0, base + rng.randint(-12, 12))) for _ in range(3))


def _place(rng: random.Random, shape: str, colour: str, size: str, quadrant: str) -> Thing:
    radius = rng.uniform(*SIZES[size])
    cx, cy = _quadrant_centre(quadrant)
    slack = CANVAS / 4 - radius - 6  # stays inside its quadrant
    return Thing(shape, colour, size, quadrant, cx + rng.uniform(-slack, slack), cy + rng.uniform(-slack, slack), radius)


def sample_scene(rng: random.Random, count: int | None = None, word: bool | None = None) -> Scene:
    count = count or rng.randint(1, 4)
    shapes = rng.sample(SHAPES, count)
    colours = rng.sample(list(COLOURS), count)
    quadrants = rng.sample(QUADRANTS, 4)
    things = [_place(rng, s, c, rng.choice(list(SIZES)), q) for s, c, q in zip(shapes, colours, quadrants)]
    scene = Scene(_background(rng), things)
    if word is None:
        word = count < 4 and rng.random() < 0.25
    if word and count < 4:
        scene.word, scene.word_quadrant = rng.choice(WORDS), quadrants[count]
    return scene


def sample_clip(rng: random.Random, kind: str | None = None) -> Clip:
    kind = kind or rng.choice(VIDEO_CATEGORIES)
    scene = sample_scene(rng, count=rng.randint(1, 2), word=False)
    if kind == "appear":
        free_shapes = [s for s in SHAPES if s not in {t.shape for t in scene.things}]
        free_colours = [c for c in COLOURS if c not in {t.colour for t in scene.things}]
        taken = {t.quadrant for t in scene.things}
        quadrant = rng.choice([q for q in QUADRANTS if q not in taken])
        subject = _place(rng, rng.choice(free_shapes), rng.choice(free_colours), "big", quadrant)
        scene.things.append(subject)
        frames = [render(scene, hidden=subject if i < CLIP_FRAMES // 2 else None) for i in range(CLIP_FRAMES)]
        return Clip(scene, kind, subject, frames=frames)
    subject = scene.things[0]
    if kind == "change":
        index = 0
        new_colour = rng.choice([c for c in COLOURS if c not in {t.colour for t in scene.things}])
        frames = [render(scene, recolour={index: new_colour} if i >= CLIP_FRAMES // 2 else None)
                  for i in range(CLIP_FRAMES)]
        return Clip(scene, kind, subject, new_colour=new_colour, frames=frames)
    # motion: the subject crosses from one half to the other along a lane; the other object (if any)
    # sits in the other lane, so the two never overlap.
    direction = rng.choice(DIRECTIONS)
    subject.size, subject.radius = "big", rng.uniform(*SIZES["big"]) * 0.8
    horizontal = direction in ("left", "right")
    start, end = (CANVAS * 0.8, CANVAS * 0.2) if direction in ("left", "up") else (CANVAS * 0.2, CANVAS * 0.8)
    across = CANVAS * rng.choice((0.25, 0.75))
    if len(scene.things) > 1:
        other = scene.things[1]
        if horizontal:
            other.y = CANVAS - across
        else:
            other.x = CANVAS - across
    frames = []
    for i in range(CLIP_FRAMES):
        t = i / (CLIP_FRAMES - 1)
        along = start + (end - start) * t
        subject.x, subject.y = (along, across) if horizontal else (across, along)
        frames.append(render(scene))
    return Clip(scene, kind, subject, direction=direction, frames=frames)


# -- questions ------------------------------------------------------------------------------------

def _pick(rng: random.Random, templates: tuple[str, ...], **names) -> str:
    return rng.choice(templates).format(**names)


def _object_questions(thing: Thing, rng: random.Random) -> list[QA]:
    """The questions about one object: its colour (named by shape), shape (named by colour), size, position."""
    qas = [
        QA("colour", _pick(rng, ("What colour is the {s}?", "What is the colour of the {s}?",
                                 "Which colour does the {s} have?"), s=thing.shape), f"{thing.colour.capitalize()}."),
        QA("shape", _pick(rng, ("What shape is the {c} object?", "Which shape is {c}?",
                                "What is the {c} shape?"), c=thing.colour), f"{thing.shape.capitalize()}."),
        QA("size", _pick(rng, ("Is the {n} big or small?", "Is the {n} small or big?"), n=thing.name),
           f"{thing.size.capitalize()}."),
    ]
    style = rng.randrange(3)
    if style == 0:
        qas.append(QA("position", _pick(rng, ("Where is the {n}?", "Where is the {s}?"), n=thing.name, s=thing.shape),
                      f"{thing.quadrant.capitalize()}."))
    elif style == 1:
        side = thing.quadrant.split()[1]
        qas.append(QA("position", f"Is the {thing.name} on the left or the right?", f"{side.capitalize()}."))
    else:
        side = thing.quadrant.split()[0]
        qas.append(QA("position", f"Is the {thing.name} at the top or the bottom?", f"{side.capitalize()}."))
    return qas


def scene_questions(scene: Scene, rng: random.Random, every_object: bool = False) -> list[QA]:
    """The questions this scene answers: colour, shape, size and position of one object picked at random (of
    every object with `every_object`, as training asks them), then count, exists and the word if any."""
    things = scene.things if every_object else [rng.choice(scene.things)]
    qas = [qa for thing in things for qa in _object_questions(thing, rng)]
    qas.append(QA("count", _pick(rng, ("How many shapes are there?", "How many objects are in the image?",
                                       "Count the shapes.")), f"{len(scene.things)}."))
    present = {t.shape for t in scene.things}
    asked = rng.choice(SHAPES)
    qas.append(QA("exists", f"Is there a {asked}?", "Yes." if asked in present else "No."))
    if scene.word:
        qas.append(QA("word", _pick(rng, ("What word is written in the image?", "What does the text say?")),
                      f"{scene.word}."))
    return qas


def caption(scene: Scene) -> str:
    parts = [t.phrase() for t in scene.things]
    text = (", ".join(parts[:-1]) + " and " + parts[-1]) if len(parts) > 1 else parts[0]
    if scene.word:
        text += f", and the word {scene.word}"
    return text[0].upper() + text[1:] + "."


def clip_questions(clip: Clip, rng: random.Random) -> list[QA]:
    s = clip.subject
    if clip.kind == "motion":
        return [QA("motion", _pick(rng, ("Which way does the {n} move?", "In which direction does the {s} move?"),
                                   n=s.name, s=s.shape), f"{clip.direction.capitalize()}.")]
    if clip.kind == "appear":
        return [QA("appear", _pick(rng, ("Which shape appears?", "What new shape appears in the video?")),
                   f"{s.shape.capitalize()}."),
                QA("appear", "What colour is the shape that appears?", f"{s.colour.capitalize()}.")]
    return [QA("change", _pick(rng, ("What colour does the {s} turn?", "What colour does the {s} become?"),
                               s=s.shape), f"{clip.new_colour.capitalize()}."),
            QA("change", f"What colour is the {s.shape} at the start?", f"{s.colour.capitalize()}.")]


def clip_caption(clip: Clip) -> str:
    s = clip.subject
    if clip.kind == "motion":
        return f"A {s.colour} {s.shape} moves {clip.direction}."
    if clip.kind == "appear":
        return f"A {s.colour} {s.shape} appears at the {s.quadrant}."
    return f"The {s.shape} turns from {s.colour} to {clip.new_colour}."


# -- sets -----------------------------------------------------------------------------------------

@dataclass
class Item:
    """One image or clip with its questions (training uses all of them, evaluation one)."""

    frames: list[Image.Image]  # one image, or the clip's frames
    qas: list[QA]
    caption: str
    scene: Scene | None = None  # an image's scene (what each pixel shows), for the projector's alignment stage

    @property
    def is_video(self) -> bool:
        return len(self.frames) > 1


def training_items(seed: int, images: int, clips: int) -> list[Item]:
    """`images` scenes and `clips` clips, each with every question it supports (about every object of a scene,
    in random order). Binding an attribute to the right object is what the model finds hardest (asked about
    one of several objects it tends to answer another's colour), so every object is asked about."""
    rng = random.Random(seed)
    items = []
    for _ in range(images):
        scene = sample_scene(rng)
        qas = scene_questions(scene, rng, every_object=True)
        rng.shuffle(qas)
        items.append(Item([render(scene)], qas, caption(scene), scene))
    for _ in range(clips):
        clip = sample_clip(rng)
        items.append(Item(clip.frames, clip_questions(clip, rng), clip_caption(clip)))
    rng.shuffle(items)
    return items


def heldout_set(seed: int = HELDOUT_SEED, per_category: int = 10,
                categories: tuple[str, ...] = IMAGE_CATEGORIES + VIDEO_CATEGORIES) -> list[tuple[Item, QA]]:
    """`per_category` (item, question) pairs per category, each item drawn fresh from `seed`."""
    rng = random.Random(seed)
    out = []
    for category in categories:
        for _ in range(per_category):
            if category in VIDEO_CATEGORIES:
                clip = sample_clip(rng, category)
                item = Item(clip.frames, clip_questions(clip, rng), clip_caption(clip))
            else:
                count = rng.randint(1, 3) if category == "word" else None  # a word needs a free quadrant
                scene = sample_scene(rng, count=count, word=True if category == "word" else None)
                item = Item([render(scene)], scene_questions(scene, rng), caption(scene), scene)
            qa = rng.choice([q for q in item.qas if q.category == category])
            out.append((item, qa))
    return out


def write_clip(frames, path: str | Path, fps: int = CLIP_FPS, crf: int | None = 18) -> Path:
    """Encode frames (PIL images or HxWx3 uint8 arrays) as an H.264 (or MPEG-4 where the wheel lacks x264)
    .mp4 that Glimpse's video reader takes; ``crf`` sets x264's quality (None: its default)."""
    import av

    path = Path(path)
    frames = [np.asarray(frame) for frame in frames]
    with av.open(str(path), "w") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264" and crf is not None:
            stream.options = {"crf": str(crf)}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
