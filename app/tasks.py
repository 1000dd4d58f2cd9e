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

import io
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

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
    angle: float = 0.0  # degrees, counter-clockwise; only a styled scene turns its shapes

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} at the {self.quadrant}"


@dataclass
class Style:
    """How a styled scene is drawn beyond the plain look: what users' pictures have and the plain scenes lack.

    None of it changes an answer: backgrounds are grey (no hue of the palette), a shadow is a darker copy of the
    background under a shape, an outline is near-black, and noise and JPEG move a pixel by a few levels."""

    background: str = "plain"  # plain | gradient | texture | stripes (the scene's background tone is the base)
    second_tone: tuple[int, int, int] = (128, 128, 128)  # the gradient's far end, the stripes' other tone
    direction: str = "horizontal"  # gradient and stripes: horizontal | vertical | diagonal
    stripe_width: int = 16
    shadow: tuple[int, int] = (0, 0)  # a soft shadow under every shape, offset by (dx, dy) px; (0, 0): none
    outline: int = 0  # a near-black outline this many px wide around every shape; 0: none
    noise: float = 0.0  # standard deviation of Gaussian pixel noise, in levels of 255
    jpeg: int = 0  # the picture is JPEG-compressed at this quality and decoded; 0: not
    seed: int = 0  # the texture and the noise, so every frame of a clip gets the same


@dataclass
class Scene:
    background: tuple[int, int, int]
    things: list[Thing]
    word: str | None = None
    word_quadrant: str | None = None
    style: Style | None = None  # None: the plain look (a flat light background, flat upright shapes)


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


def _polygon(shape: str, x: float, y: float, r: float, turn: float = 0.0) -> list[tuple[float, float]]:
    if shape == "square" and not turn:  # as drawn before shapes could turn: the plain sets stay bit for bit
        s = r * 0.85
        return [(x - s, y - s), (x + s, y - s), (x + s, y + s), (x - s, y + s)]
    if shape == "square":
        angles, radii = (45, 135, 225, 315), (r * 0.85 * math.sqrt(2),) * 4  # the corners' distance from the centre
    elif shape == "triangle":
        angles, radii = (90, 210, 330), (r,) * 3
    elif shape == "star":
        angles, radii = tuple(90 + 36 * i for i in range(10)), tuple(r if i % 2 == 0 else r * 0.45 for i in range(10))
    else:
        raise ValueError(shape)
    return [(x + radius * math.cos(math.radians(a + turn)), y - radius * math.sin(math.radians(a + turn)))
            for a, radius in zip(angles, radii)]


def draw_thing(draw: ImageDraw.ImageDraw, thing: Thing, colour: str | None = None, fill=None, outline: int = 0,
               offset: tuple[float, float] = (0.0, 0.0)) -> None:
    fill = fill if fill is not None else COLOURS[colour or thing.colour]
    x, y, r = thing.x + offset[0], thing.y + offset[1], thing.radius
    edge = {"outline": (25, 25, 25), "width": outline} if outline else {}
    if thing.shape == "circle":
        draw.ellipse([x - r, y - r, x + r, y + r], fill=fill, **edge)
    else:
        draw.polygon(_polygon(thing.shape, x, y, r, thing.angle), fill=fill, **edge)


def _styled_background(scene: Scene, style: Style) -> Image.Image:
    base, other = np.array(scene.background, np.float32), np.array(style.second_tone, np.float32)
    ys, xs = np.mgrid[0:CANVAS, 0:CANVAS].astype(np.float32) / (CANVAS - 1)
    along = {"horizontal": xs, "vertical": ys, "diagonal": (xs + ys) / 2}[style.direction]
    if style.background == "gradient":
        pixels = base + (other - base) * along[..., None]
    elif style.background == "stripes":
        band = (np.floor(along * (CANVAS - 1) / style.stripe_width) % 2)[..., None]
        pixels = base + (other - base) * band
    elif style.background == "texture":  # blotchy grey, as paper, cloth or a wall
        rng = np.random.default_rng(style.seed)
        blotches = Image.fromarray(rng.integers(0, 256, (CANVAS, CANVAS), dtype=np.uint8))
        blotches = np.asarray(blotches.filter(ImageFilter.GaussianBlur(3)), np.float32)
        spread = (blotches - blotches.mean()) / (blotches.std() + 1e-6)
        pixels = base + spread[..., None] * np.abs(other - base).mean() / 2
    else:
        pixels = np.broadcast_to(base, (CANVAS, CANVAS, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def render(scene: Scene, hidden: Thing | None = None, recolour: dict[int, str] | None = None) -> Image.Image:
    style = scene.style
    image = Image.new("RGB", (CANVAS, CANVAS), scene.background) if style is None else _styled_background(scene, style)
    shown = [(i, t) for i, t in enumerate(scene.things) if t is not hidden]
    if style is not None and style.shadow != (0, 0):
        mask = Image.new("L", image.size, 0)
        for _, thing in shown:
            draw_thing(ImageDraw.Draw(mask), thing, fill=255, offset=style.shadow)
        mask = mask.filter(ImageFilter.GaussianBlur(3)).point(lambda v: v * 0.55)
        image.paste(Image.new("RGB", image.size, (0, 0, 0)), mask=mask)
    draw = ImageDraw.Draw(image)
    for i, thing in shown:
        draw_thing(draw, thing, (recolour or {}).get(i), outline=style.outline if style else 0)
    if scene.word:
        font = ImageFont.load_default(size=44)
        cx, cy = _quadrant_centre(scene.word_quadrant)
        ink = (20, 20, 20) if sum(scene.background) > 3 * 128 else (235, 235, 235)
        draw.text((cx, cy), scene.word, fill=ink, font=font, anchor="mm")
    if style is not None and style.noise:
        noise = np.random.default_rng(style.seed + 1).normal(0.0, style.noise, (CANVAS, CANVAS, 1))
        image = Image.fromarray(np.clip(np.asarray(image, np.float32) + noise, 0, 255).astype(np.uint8))
    if style is not None and style.jpeg:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=style.jpeg)
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
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


def stylise(scene: Scene, rng: random.Random) -> Scene:
    """Give the scene a random look of other pictures (`Style`): a dark, graded, textured or striped grey
    background, turned shapes, soft shadows, outlines, noise, JPEG. Every answer stays what it was."""
    dark = rng.random() < 0.3
    level = rng.randint(25, 85) if dark else rng.randint(170, 250)
    scene.background = tuple(min(255, max(0, level + rng.randint(-8, 8))) for _ in range(3))
    spread = rng.randint(25, 60) * (1 if dark else -1)
    second = tuple(min(255, max(0, c + spread)) for c in scene.background)
    for thing in scene.things:
        thing.angle = rng.uniform(0.0, 360.0) if rng.random() < 0.6 else 0.0
    scene.style = Style(
        background=rng.choice(("plain", "gradient", "texture", "stripes")), second_tone=second,
        direction=rng.choice(("horizontal", "vertical", "diagonal")), stripe_width=rng.randint(6, 28),
        shadow=(rng.randint(3, 8), rng.randint(3, 8)) if not dark and rng.random() < 0.35 else (0, 0),
        outline=rng.randint(2, 4) if rng.random() < 0.25 else 0,
        noise=rng.uniform(3.0, 10.0) if rng.random() < 0.35 else 0.0,
        jpeg=rng.randint(25, 80) if rng.random() < 0.4 else 0, seed=rng.randrange(2**31))
    return scene


def sample_clip(rng: random.Random, kind: str | None = None, style_rng: random.Random | None = None) -> Clip:
    """A clip of one event; with `style_rng`, of a scene given a random look (`stylise`) drawn from it."""
    kind = kind or rng.choice(VIDEO_CATEGORIES)
    scene = sample_scene(rng, count=rng.randint(1, 2), word=False)
    if style_rng is not None:
        stylise(scene, style_rng)
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


def _style_draws(seed: int, share: float):
    """Which items are styled, and the stream their looks come from: a stream of its own, so that the scenes,
    questions and order of a seed are the same with and without styles (share 0 gives the plain set exactly)."""
    draws = random.Random(f"style-{seed}")
    return lambda: draws if share > 0 and draws.random() < share else None


def training_items(seed: int, images: int, clips: int, styled: float = 0.0) -> list[Item]:
    """`images` scenes and `clips` clips, each with every question it supports (about every object of a scene,
    in random order). Binding an attribute to the right object is what the model finds hardest (asked about
    one of several objects it tends to answer another's colour), so every object is asked about. A `styled`
    share of the items get a random look of other pictures (`stylise`)."""
    rng = random.Random(seed)
    style_draw = _style_draws(seed, styled)
    items = []
    for _ in range(images):
        scene = sample_scene(rng)
        qas = scene_questions(scene, rng, every_object=True)
        rng.shuffle(qas)
        if (style_rng := style_draw()) is not None:
            stylise(scene, style_rng)
        items.append(Item([render(scene)], qas, caption(scene), scene))
    for _ in range(clips):
        clip = sample_clip(rng, style_rng=style_draw())
        items.append(Item(clip.frames, clip_questions(clip, rng), clip_caption(clip)))
    rng.shuffle(items)
    return items


def heldout_set(seed: int = HELDOUT_SEED, per_category: int = 10,
                categories: tuple[str, ...] = IMAGE_CATEGORIES + VIDEO_CATEGORIES,
                styled: float = 0.0) -> list[tuple[Item, QA]]:
    """`per_category` (item, question) pairs per category, each item drawn fresh from `seed`; a `styled` share of
    them with a random look of other pictures (`stylise`), the questions unchanged."""
    rng = random.Random(seed)
    style_draw = _style_draws(seed, styled)
    out = []
    for category in categories:
        for _ in range(per_category):
            if category in VIDEO_CATEGORIES:
                clip = sample_clip(rng, category, style_rng=style_draw())
                item = Item(clip.frames, clip_questions(clip, rng), clip_caption(clip))
            else:
                count = rng.randint(1, 3) if category == "word" else None  # a word needs a free quadrant
                scene = sample_scene(rng, count=count, word=True if category == "word" else None)
                if (style_rng := style_draw()) is not None:
                    stylise(scene, style_rng)
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
