"""From chat messages to prompt tokens: chat template, media, placeholder expansion.

Messages follow the transformers chat format::

    [{"role": "user", "content": [{"type": "image", "image": "cat.jpg"},
                                  {"type": "text", "text": "What is this?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}, ...]

The chat template writes one placeholder token per image/video; we then expand each into as many
placeholder tokens as the encoder will produce for it, in the order the media appear.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import uuid
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass, replace

import jinja2
import torch
from PIL import Image

from glimpse import vision
from glimpse.common import UserError
from glimpse.pipeline.adapters import IMAGE, MODALITY_NAMES, TEXT, VIDEO, Adapter, MediaInput
from glimpse.pipeline.media_cache import MediaCache

# Tokenizers average well under this many characters per token on real text (about 4 on English, fewer on
# code and other scripts): a prompt with more text than this many characters per context token cannot fit,
# and is refused before it is tokenized (which takes seconds for megabytes) or its media are decoded. Only
# text made of very long tokens (pages of spaces) could be refused although it would fit.
CHARS_PER_TOKEN_BOUND = 8
ROLES = ("system", "user", "assistant")


def user_message(text: str, media=()) -> list[dict]:
    """A one-turn chat as every part of Glimpse builds it: the media first (``(kind, source)`` pairs:
    ``("image", path or PIL image)``, ``("video", path)``), then the question."""
    content = [{"type": kind, kind: source} for kind, source in media]
    return [{"role": "user", "content": content + [{"type": "text", "text": text}]}]


class PromptError(UserError):
    """The request cannot become a prompt (bad message format, too long for the model, ...)."""


class ContextOverflow(PromptError):
    """The prompt does not fit the model's context (a chat can leave out its oldest turns and try again). The API
    says so with OpenAI's code for it and ``param``, the request's field at fault; the message begins in OpenAI's
    own words with the code beside them, which is how clients know it to shorten the conversation and try again:
    LiteLLM reads the words, LangChain the code in the message (openai 3.x puts only the message in an error's
    text). Neither knew Glimpse's own wording (an outside pass, 2026-12-07)."""

    code = "context_length_exceeded"

    def __init__(self, detail: str, context: int, param: str = "messages", field: str = ""):
        message = f"This model's maximum context length is {context} tokens ({self.code}): {detail}"
        super().__init__(f"{field}: {message}" if field else message)
        self.param = param


@dataclass
class Prompt:
    input_ids: torch.Tensor  # (T,)
    modality: torch.Tensor  # (T,) TEXT / IMAGE / VIDEO per token
    media: list[MediaInput]
    text: str  # the rendered chat template, placeholders not yet expanded
    made_for: str = ""  # the building adapter's ``prompt_signature`` ("": not known, taken by any engine)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def token_counts(self) -> dict[str, int]:
        return {name: int((self.modality == k).sum()) for k, name in MODALITY_NAMES.items()}

    def media_rows(self) -> list[tuple[MediaInput, torch.Tensor]]:
        """Each media item with its placeholder rows (original indices), in prompt order: the items fill the
        non-text tokens in turn."""
        placeholders = (self.modality != TEXT).nonzero().squeeze(1)
        out, taken = [], 0
        for item in self.media:
            out.append((item, placeholders[taken:taken + item.num_tokens]))
            taken += item.num_tokens
        return out


def normalise_messages(messages) -> list[dict]:
    """Accept a plain string or string contents; always return list-of-items contents."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise PromptError(f"each message needs 'role' and 'content', got {m!r}")
        # The template writes the role as it is (ChatML: "<|im_start|>" + role): only the roles the models know.
        if m["role"] not in ROLES:
            raise PromptError(f"unsupported message role {m['role']!r}: use {', '.join(ROLES)}")
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not all(isinstance(item, dict) for item in content):
            raise PromptError("a message's content is a string or a list of {'type': 'text' | 'image' | 'video', ...} "
                              f"dicts, got {content!r:.200}")
        for item in content:
            if item.get("type") not in ("text", "image", "video"):
                raise PromptError(f"unsupported content item type {item.get('type')!r} (text, image or video)")
            if item["type"] == "text":
                check_text(item.get("text"))
            else:
                _media_of(item)  # names its image or video
        out.append({"role": m["role"], "content": content})
    return out


def check_text(text) -> None:
    """Refuse what no tokenizer can take: a text item that is not a string, or not valid Unicode."""
    if not isinstance(text, str):
        raise PromptError(f"a text item needs a string 'text', got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800" in JSON): no tokenizer can take it
        raise PromptError("the text is not valid Unicode (it holds a lone surrogate)") from None


# qwen-vl-utils' per-item sizing and sampling keys. Glimpse sizes and samples every image and video as the model's
# processor and adapter say (docs/models.md), the same for every request: an item that asks otherwise is refused
# rather than answered at a size or frame rate it did not ask for.
PER_ITEM_SETTINGS = ("min_pixels", "max_pixels", "total_pixels", "resized_height", "resized_width", "fps", "nframes",
                     "min_frames", "max_frames", "video_start", "video_end")


def _media_of(item: dict):
    """An image or video item's source: its ``image``/``video``, ``url`` or ``path`` — for an image a path, its
    bytes or a PIL image, for a video a path. Present but empty (``b""``) is kept, so that it fails as an empty
    file, not as a missing key."""
    asked = [key for key in PER_ITEM_SETTINGS if key in item]
    if asked:
        kind = "an image" if item["type"] == "image" else "a video"
        raise PromptError(f"{kind} item's {', '.join(map(repr, asked))} (qwen-vl-utils' per-item settings) "
                          f"is not read: Glimpse sizes and samples every {item['type']} as the model's processor says "
                          "(docs/models.md); leave it out")
    for key in (item["type"], "url", "path"):
        if item.get(key) is not None:
            source = item[key]
            kinds = (str, os.PathLike, bytes, bytearray, Image.Image) if item["type"] == "image" else (str, os.PathLike)
            if not isinstance(source, kinds):
                given = ("a path, the file's bytes or a PIL image" if item["type"] == "image"
                         else "a path (write a video's bytes to a file first)")
                raise PromptError(f"{'an image' if item['type'] == 'image' else 'a video'} is given as {given}, "
                                  f"got {type(source).__name__}")
            return source
    raise PromptError(f"{item['type']} items need '{item['type']}', 'url' or 'path'")


def _prepared(prepare, source, kind: str) -> MediaInput:
    """``prepare(source)``, with what the model's own processor refuses about the input (Qwen's: an aspect
    ratio over 200) reported as a bad picture, not as a failure of the server."""
    try:
        return prepare(source)
    except vision.MediaError:
        raise
    except ValueError as error:
        raise vision.MediaError(f"this model's processor cannot take this {kind}: {error}") from error


def load_media(adapter: Adapter, messages: list[dict], max_length: int | None = None,
               cache: MediaCache | None = None) -> list[MediaInput]:
    """Each image and video decoded and preprocessed, in prompt order (or taken from ``cache``, when it holds
    the same source). Once their tokens alone pass ``max_length``, the rest are not decoded: the prompt cannot
    fit whatever they hold."""
    cache = cache if cache is not None else MediaCache()  # off: prepares every item

    def prepare_image(source) -> MediaInput:
        image = vision.load_image(source, fit=adapter.image_fit)  # a large picture resized as it is decoded
        vision.check_reading(source)  # before the processor resizes it: for a large picture, longer than its decoding
        return _prepared(adapter.prepare_image, image, "image")

    def prepare_video(source) -> MediaInput:
        return _prepared(adapter.prepare_video, source, "video")

    media, tokens = [], 0
    for m in messages:
        for item in m["content"]:
            if item["type"] not in ("image", "video"):
                continue
            if item["type"] == "video" and not adapter.supports_video:
                raise vision.MediaError(f"this model ({adapter.name}) does not take video; send frames as images")
            source = _media_of(item)
            vision.check_reading(source)  # a server's time limit for them all, or its stop (reading_limit)
            if item["type"] == "image":
                media.append(cache.prepared("image", source, prepare_image))
            else:
                video = cache.prepared("video", source, prepare_video)
                if video.shortfall:  # said in words naming the file as this request named it (the item may be shared)
                    video = replace(video, warning=vision.shortfall_warning(Path(str(source)).name, *video.shortfall))
                media.append(video)
            tokens += media[-1].num_tokens
            if max_length and tokens >= max_length:
                raise ContextOverflow(f"the images and videos alone take {tokens:,} tokens or more; send fewer or "
                                      "smaller images, or fewer video frames", max_length)
    return media


def plain_render(placeholders: dict[str, str], messages: list[dict]) -> str:
    """For checkpoints without a chat template: 'USER: <image>\n... ASSISTANT:' turns (LLaVA-1.5's format)."""
    turns = []
    for m in messages:
        body = "".join(placeholders[it["type"]] + "\n" if it["type"] in placeholders else it["text"]
                       for it in m["content"])
        turns.append(f"{m['role'].upper()}: {body}")
    return " ".join(turns) + " ASSISTANT:"


def render(tokenizer, chat_template: str | None, messages: list[dict], placeholders: dict[str, str]) -> str:
    # Media objects (PIL images, paths) stay out of the template: it only needs the item types.
    slim = [{"role": m["role"], "content": [{k: v for k, v in it.items() if k in ("type", "text")}
                                            for it in m["content"]]} for m in messages]
    if chat_template is None and tokenizer.chat_template is None:
        return plain_render(placeholders, slim)
    try:
        return tokenizer.apply_chat_template(slim, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=True)
    except jinja2.TemplateError as error:  # its raise_exception ("roles must alternate"): the request's to mend
        # (it was a 500, "a bug in Glimpse"; an outside pass)
        raise PromptError(f"this model's chat template refuses the conversation: {error}") from None


def control_pattern(adapter: Adapter) -> re.Pattern | None:
    """What this model's tokenizer reads as control tokens: its special added tokens (turn markers, BOS/EOS,
    ...) and the image/video placeholders."""
    tok = adapter.tokenizer
    controls = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    placeholders = ((IMAGE, adapter.image_token_id), (VIDEO, adapter.video_token_id))
    controls |= {adapter.placeholder_token(kind) for kind, token in placeholders if token is not None}
    controls = sorted((c for c in controls if c), key=len, reverse=True)  # the longest match first
    return re.compile("|".join(map(re.escape, controls))) if controls else None


class _Markers:
    """Numbered markers that no text holds and no tokenizer or adapter reads as anything: ``mark(i)`` writes the
    i-th; ``put_back`` replaces each by its piece and says where the pieces are."""

    def __init__(self):
        self.prefix = f"\0{uuid.uuid4().hex}:"
        self.pattern = re.compile(re.escape(self.prefix) + r"(\d+)\0")

    def mark(self, number: int) -> str:
        return f"{self.prefix}{number}\0"

    def put_back(self, text: str, piece: Callable[[int], str]) -> tuple[str, list[tuple[int, int]]]:
        """``text`` with marker i replaced by ``piece(i)``, and the (start, end) of each piece in the result."""
        out, spans, length, at = [], [], 0, 0
        for found in self.pattern.finditer(text):
            written = piece(int(found.group(1)))
            out += [text[at:found.start()], written]
            length += found.start() - at
            spans.append((length, length + len(written)))
            length += len(written)
            at = found.end()
        return "".join(out) + text[at:], spans


def typed_spans(tokenizer, chat_template: str | None, messages: list[dict], placeholders: dict[str, str],
                text: str) -> list[tuple[int, int]]:
    """Where the messages' text items are in ``text`` (their rendering), as (start, end) character spans: the
    template is rendered again with a marker in place of each, and the markers are put back."""
    markers, typed = _Markers(), []

    def swap(item: dict) -> dict:
        if item["type"] != "text":
            return item
        typed.append(item["text"])
        return {"type": "text", "text": markers.mark(len(typed) - 1)}

    marked = render(tokenizer, chat_template, [{"role": m["role"], "content": [swap(it) for it in m["content"]]}
                                               for m in messages], placeholders)
    for fit in (str, str.strip):  # templates write a message's text as it is, or stripped of white space
        restored, spans = markers.put_back(marked, lambda number: fit(typed[number]))
        if restored == text:
            return spans
    raise PromptError("the text holds what this model reads as a control token, and its chat template changes "
                      "the text so that it cannot be told apart from the template's own: leave it out")


def _overlaps(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) overlaps one of ``spans`` (in order, apart)."""
    last = bisect.bisect_left(spans, (end,)) - 1  # the last span that starts before ``end``
    return last >= 0 and spans[last][1] > start


def tokenize(adapter: Adapter, text: str, media: list[MediaInput], typed: list[tuple[int, int]] = ()) -> list[int]:
    """The token ids of the rendered chat ``text``, in which the spans ``typed`` hold what a person or a client
    typed: control text there (``<image>``, ``<|im_end|>``) is spelled out as ordinary text tokens, so that a
    question cannot hold a placeholder without a picture, or close its own turn and write the assistant's.
    A control string counts as typed when any of it is (``<|im_`` and ``end|>`` sent as two text parts of one
    message, which the template writes side by side). Elsewhere, and wholly when no typed text is part of a
    control string, tokens are what tokenizing the whole string gives."""
    tok = adapter.tokenizer
    # A template that writes BOS itself must not get a second one from the tokenizer.
    add_special = not (tok.bos_token and text.startswith(tok.bos_token))
    controls = control_pattern(adapter) if typed else None
    # Found as the tokenizer finds its added tokens (leftmost, longest first) in the whole rendered text.
    found = [match for match in (controls.finditer(text) if controls is not None else ())
             if _overlaps(typed, match.start(), match.end())]
    if not found:
        return tok(adapter.expand_text(text, media), add_special_tokens=add_special)["input_ids"]

    # The typed control strings become markers while the template's placeholders are written out (which may
    # move them), then become themselves again, their places (``spelled``) noted.
    markers, literals = _Markers(), [match.group() for match in found]
    pieces, at = [], 0
    for number, match in enumerate(found):
        pieces += [text[at:match.start()], markers.mark(number)]
        at = match.end()
    final, spelled = markers.put_back(adapter.expand_text("".join(pieces) + text[at:], media), literals.__getitem__)
    try:
        encoded = tok(final, add_special_tokens=add_special, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no character offsets
        raise PromptError(f"the text holds {literals[0]!r}, which this model reads as a control token: "
                          "leave it out") from None
    added = tok.added_tokens_decoder
    ids = []
    for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        # A control token over typed text (its span may take in white space beside it: lstrip/rstrip tokens).
        if token in added and _overlaps(spelled, start, end):
            ids += tok(final[start:end], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        else:
            ids.append(token)
    return ids


def check_text_length(characters: int, max_length: int | None) -> None:
    """Raise ``ContextOverflow`` if ``characters`` of text cannot fit ``max_length`` tokens, whatever the
    tokenizer (``CHARS_PER_TOKEN_BOUND``)."""
    if max_length and characters > CHARS_PER_TOKEN_BOUND * max_length:
        raise ContextOverflow(f"the messages hold {characters:,} characters of text, more than that can take",
                              max_length)


def build_prompt(adapter: Adapter, messages, chat_template: str | None = None,
                 max_length: int | None = None, media_cache: MediaCache | None = None,
                 tokenizing: contextlib.AbstractContextManager | None = None,
                 reading: contextlib.AbstractContextManager | None = None) -> Prompt:
    """The prompt of ``messages``: their media decoded and preprocessed, the chat rendered and tokenized.
    ``tokenizing``: held while the (shared) tokenizer works, a lock where several threads build prompts; the media
    are read before it is taken, so that one request's long video does not hold up everyone else's prompt.
    ``reading``: entered around the reading of the media, if there are any (a server's turn to decode, and its limits:
    ``Scheduler.prepare``)."""
    messages = normalise_messages(messages)
    check_text_length(sum(len(item["text"]) for m in messages for item in m["content"] if item["type"] == "text"),
                      max_length)
    has_media = any(item["type"] in ("image", "video") for m in messages for item in m["content"])
    with reading if reading is not None and has_media else contextlib.nullcontext():
        media = load_media(adapter, messages, max_length, media_cache)
    placeholders = {"image": adapter.placeholder(IMAGE)}
    if adapter.supports_video:
        placeholders["video"] = adapter.placeholder(VIDEO)
    with tokenizing or contextlib.nullcontext():
        text = render(adapter.tokenizer, chat_template, messages, placeholders)
        controls = control_pattern(adapter)
        typed = []
        # All the typed text run together: a control string split over two text parts is found too (a second
        # rendering, ``typed_spans``, then tells typed text from the template's).
        if controls is not None and controls.search("".join(item["text"] for m in messages for item in m["content"]
                                                            if item["type"] == "text")):
            typed = typed_spans(adapter.tokenizer, chat_template, messages, placeholders, text)
        ids = tokenize(adapter, text, media, typed)

    placeholder = {IMAGE: adapter.image_token_id, VIDEO: adapter.video_token_id}
    queues = {k: [m for m in media if m.kind == k] for k in (IMAGE, VIDEO)}
    # The items in the order their placeholders come in the text, which ``Prompt.media_rows`` reads them in: a
    # template may write them in another order than the messages give them (LLaVA-NeXT-Video's own writes every
    # image before any video), and a video's rows were then taken as an image's (an outside pass: the prefix cache
    # served another picture's keys, and RLT dropped an image's tokens as a still video's).
    ordered = []
    expanded, modality = [], []
    written: dict = {}  # tokens of the current item seen so far, for modalities written out in text
    for token in ids:
        kind = next((k for k, p in placeholder.items() if p is not None and token == p), TEXT)
        if kind == TEXT:
            expanded.append(token)
            modality.append(TEXT)
            continue
        if not queues[kind]:
            raise PromptError(f"the prompt has more {MODALITY_NAMES[kind]} placeholders than {MODALITY_NAMES[kind]}s")
        if kind in adapter.expands_in_text:  # written out already: one token per feature
            expanded.append(token)
            modality.append(kind)
            if not written.get(kind):
                ordered.append(queues[kind][0])
            written[kind] = written.get(kind, 0) + 1
            if written[kind] == queues[kind][0].num_tokens:
                queues[kind].pop(0)
                written[kind] = 0
            continue
        item = queues[kind].pop(0)
        ordered.append(item)
        expanded += [token] * item.num_tokens
        modality += [kind] * item.num_tokens
    leftover = sum(len(q) for q in queues.values())
    if leftover:
        raise PromptError(f"the chat template wrote no placeholder for {leftover} image/video item(s)")

    if max_length is not None and len(expanded) >= max_length:
        raise ContextOverflow(f"the prompt is {len(expanded):,} tokens; use a shorter text, fewer or smaller images, "
                              "or fewer video frames", max_length)
    return Prompt(torch.tensor(expanded, dtype=torch.long), torch.tensor(modality, dtype=torch.long), ordered, text,
                  adapter.prompt_signature)
