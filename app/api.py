"""The HTTP API `glimpse serve` exposes beside the web chat.

* ``POST /v1/chat/completions`` — OpenAI-compatible. Messages hold text and ``image_url`` parts
  (``data:`` URLs, ``http(s)`` URLs, or local paths / ``file://`` URLs under ``--allowed-root`` only),
  plus Glimpse's ``video_url`` parts (same sources); a ``developer`` message is the system message.
  ``stream: true`` answers with server-sent events (``chat.completion.chunk`` objects, then
  ``data: [DONE]``; with ``stream_options.include_usage`` a last chunk carries ``usage``). Extra request fields: ``policy`` and ``speed`` (the slider), ``params``
  (overrides). Decoding is greedy unless ``temperature`` > 0 (then ``top_p`` and ``seed`` apply);
  ``max_tokens`` / ``max_completion_tokens`` default to 256 and are capped by ``--max-new-tokens``; given,
  they must fit in the context beside the prompt (400 otherwise, as OpenAI answers), while the default lets the
  answer run to the context's end (``finish_reason`` "length");
  ``stop`` takes up to 4 strings, and the answer ends before the first one. The response's ``usage``
  counts tokens, and its ``glimpse`` field carries the policy, its parameters and the timing/memory
  metrics. Any other request field (``tools``, ``response_format``, ``logprobs``, penalties, ``n`` > 1,
  ...) is refused with 400, never ignored, unless it is sent with its "off" value (null, false, 0,
  empty), which asks for nothing.
* ``GET /v1/models`` — the one model this server answers with; ``GET /v1/models/{id}`` — it, or 404. Any other
  ``/v1/...`` route is a 404 in OpenAI's error shape.
* ``GET /health`` — ``{"status": "ok", ...}`` with the scheduler's state; 503 when the scheduler has
  stopped or has worked for ``STALL_S`` without finishing a prefill or a decode step (wedged).
* ``GET /metrics`` — Prometheus (``app/telemetry.py``).

Requests are validated by declared models (``ChatRequest``): a bad one gets a 400 with an OpenAI-style
``{"error": {...}}`` body naming the field, and changes nothing. Only ``application/json`` bodies are
read: ``text/plain``, form and untyped bodies, which a cross-origin page can send without asking, get 415.
With ``--api-key``, ``/v1/*`` requires ``Authorization: Bearer <key>``.

Requests go to the scheduler (``pipeline/scheduler.py``), shared with the chat: a full queue answers
429 with Retry-After. A client that leaves — a dropped stream, or a request given up while waiting —
cancels its request at the next decode step, or stops the fetching and decoding of its media. Parsing a request,
fetching and decoding its media never run on the event loop (requests with media URLs in at most
``FETCHING_THREADS`` worker threads at once); a request's media get ``--media-timeout`` to decode, and a
media URL gets ``FETCH_DEADLINE_S`` in all, no redirect to another host, no compressed body, and no address
that is not globally reachable unless the server allows them (``--allow-private-urls``); the address
checked is the address connected to (no second DNS lookup to rebind): ``app/fetch.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import re
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator,
                      model_validator)
from starlette.requests import ClientDisconnect

from glimpse import vision
from glimpse.vision import NamedBytes
from glimpse.common import UserError
from glimpse.common.jsonable import finite
from glimpse.connections import BODY_DONE, AbsoluteFormTargets, BodyLimits, StreamsUnbuffered, error_content
from glimpse.fetch import FETCH_DEADLINE_S, Allowance, Fetcher, FetchError
from glimpse.telemetry import CONTENT_TYPE, Telemetry
from glimpse.pipeline.engine import StreamChunk
from glimpse.pipeline.out_of_memory import OutOfMemory
from glimpse.pipeline.prompt import check_text_length
from glimpse.pipeline.scheduler import STOPPING, QueueFull, Scheduler, ServerStopping

FETCHING_THREADS = 8  # requests whose media URLs are fetched at once; more wait their turn
MAX_REQUEST_FETCH_BYTES = 64 * 2**20  # all of one request's media URLs, as much as its body may hold inline
STALL_S = 300.0  # /health reports the scheduler wedged when it finishes no prefill or decode step for this long
OFF_VALUES = (None, False, 0, [], {}, "")
# Bounds checked before any item is validated, so that a body of a million empty messages is refused at once rather
# than validated (and its million errors put in words) for a minute: OpenAI's limit on messages, and parts enough
# for any interleaving of text and pictures a context holds.
MAX_MESSAGES, MAX_PARTS = 2048, 512
# Content parts in all the messages together. The two limits above allow a million, and each part costs about 18 us to
# validate and 30 us more to decode: 250,000 one-pixel data URLs (39 MB) took 12 s before the prompt's length refused
# them (found from outside).
MAX_REQUEST_PARTS = 8192
# Fields Glimpse does not implement whose value here asks for what it does anyway: a plain-text answer, no tools,
# a text reply, the default service tier.
ASKS_NOTHING = {"response_format": ({"type": "text"},), "tool_choice": ("none",), "modalities": (["text"],),
                "service_tier": ("auto", "default")}
# Fields that ask the server for nothing it must do (an identifier for abuse reports, as `user` is, and a hint for
# the provider's prompt cache, which Glimpse keys on the prompt itself): accepted, strings as OpenAI's are. Taken
# whatever their value, one held a list of ten million empty objects for as long as the answer ran (an outside pass).
HINTS = ("safety_identifier", "prompt_cache_key")
MAX_HINT_CHARS = 1024
# JSON values a body may hold, counted by the brackets and commas that make them before it is parsed: parsed,
# "[{},{},...]" takes some 24 times its bytes (four 30 MB bodies of it took the server from 2.1 to 5.2 GB before
# their lists were refused: an outside pass). The bounds on messages and parts leave a request some 40,000; a text
# with this many commas is past any model's context.
MAX_JSON_VALUES = 500_000


class FieldError(ValueError):
    """A request-wide check's refusal that names its field: pydantic gives a model validator's error no place, and
    the 400's ``param`` was null (``_validation_message`` reads it from here)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class BadRequest(Exception):
    """A client's mistake: a 400 whose ``param`` names the field at fault, where one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------- the request, declared
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a finite JSON number; not a string or a boolean


class Declared(BaseModel):
    """A part of the request whose every field is either implemented or refused: a field Glimpse does not know is
    a 400 naming it, unless its value is "off" (null, false, 0, empty), as clients send defaults."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def refuse_unknown_fields(self):
        asked = sorted(k for k, v in (self.model_extra or {}).items() if v not in OFF_VALUES)
        if asked:
            raise ValueError(f"unsupported field(s) {', '.join(asked)}: Glimpse implements "
                             f"{', '.join(sorted(type(self).model_fields))}")
        return self


class MediaURL(Declared):
    url: StrictStr = Field(min_length=1)
    detail: StrictStr | None = None

    @field_validator("detail")
    @classmethod
    def implemented_detail(cls, detail: str | None) -> str | None:
        # OpenAI's image detail: "auto" and "high" are what Glimpse does (the model's processor at its own
        # resolution); "low" (a small fixed-size copy) is not implemented, so it is refused rather than ignored.
        if detail not in (None, "auto", "high"):
            raise ValueError(f"detail {detail!r} is not implemented: Glimpse sees a picture at the model's own "
                             "resolution ('auto' or 'high')")
        return detail


class TextPart(Declared):
    type: Literal["text"]
    text: StrictStr


class ImagePart(Declared):
    type: Literal["image_url"]
    image_url: MediaURL | Annotated[str, Field(strict=True, min_length=1)]


class VideoPart(Declared):
    type: Literal["video_url"]
    video_url: MediaURL | Annotated[str, Field(strict=True, min_length=1)]


Part = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class Message(Declared):
    # "developer" is OpenAI's newer name for the system message (its clients send it for some models): the same
    # instructions, given to the model as its system message.
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | Annotated[list[Part], Field(min_length=1, max_length=MAX_PARTS)]
    name: StrictStr | None = None  # a participant's name: the chat template has no place for it


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    # OpenAI pads streamed chunks against length side channels unless this is false; Glimpse does not pad, so only
    # false (or leaving it out) asks for what it does.
    include_obfuscation: Literal[False] | None = None


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions``: what Glimpse implements of OpenAI's request, plus the slider."""

    model_config = ConfigDict(extra="allow")  # checked below: only "off" values pass
    model: StrictStr | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=-2**63, lt=2**64)  # what torch's generator takes
    n: StrictInt | None = Field(None, ge=1, le=1)  # one choice per request
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    # (an abuse-report id, as the hints are, and as long: three of 60 MB each were held while they were answered)
    user: Annotated[StrictStr, Field(max_length=MAX_HINT_CHARS)] | None = None
    # Glimpse's own fields; null is the default, as for OpenAI's (an SDK's extra_body sends None as null).
    speed: Number | None = Field(0.0, ge=0, le=1)
    policy: StrictStr | None = "auto"
    params: dict[str, Any] | None = Field(default_factory=dict)

    @field_validator("messages", mode="before")
    @classmethod
    def few_enough_parts(cls, messages):
        """Counted before any part is validated."""
        if isinstance(messages, list):
            count = sum(len(m["content"]) for m in messages
                        if isinstance(m, dict) and isinstance(m.get("content"), list))
            if count > MAX_REQUEST_PARTS:
                raise ValueError(f"{count:,} content parts in all the messages; at most {MAX_REQUEST_PARTS:,}")
        return messages

    @field_validator("speed", "policy", "params", mode="after")
    @classmethod
    def null_is_the_default(cls, value, info):
        return cls.model_fields[info.field_name].get_default(call_default_factory=True) if value is None else value

    @model_validator(mode="after")
    def refuse_unimplemented(self) -> "ChatRequest":
        asked = sorted(k for k, v in (self.model_extra or {}).items()
                       if v not in OFF_VALUES and v not in ASKS_NOTHING.get(k, ()) and k not in HINTS)
        for hint in HINTS:
            value = (self.model_extra or {}).get(hint)
            if value is not None and not (isinstance(value, str) and len(value) <= MAX_HINT_CHARS):
                raise FieldError(f"must be a string of at most {MAX_HINT_CHARS} characters", hint)
        if asked:
            raise FieldError(f"unsupported field(s) {', '.join(asked)}: Glimpse implements "
                             f"{', '.join(sorted(ChatRequest.model_fields))}", asked[0])
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_tokens and max_completion_tokens disagree: give one of them", "max_completion_tokens")
        if self.stream_options is not None and self.stream_options.include_usage and not self.stream:
            raise FieldError("stream_options.include_usage asks for a usage chunk: only with stream: true "
                             "(a response that is not streamed carries usage anyway)", "stream_options.include_usage")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def _read_request(raw: bytes) -> "ChatRequest | tuple[str, str | None]":
    """The request body, declared and validated, or what is wrong with it and the field at fault (for a 400)."""
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if values > MAX_JSON_VALUES:
        return (f"the request body holds some {values:,} JSON values (objects, lists and their items), more than "
                f"{MAX_JSON_VALUES:,}: send fewer messages or parts"), None
    try:
        return ChatRequest.model_validate(json.loads(raw))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        if isinstance(error, ValidationError):
            return _validation_message(error)
        if "integer string conversion" in str(error):  # Python's limit on the digits of a JSON integer
            field = re.search(rb'"([^"\\]{1,64})"\s*:\s*-?\d{4300}', raw)
            name = field.group(1).decode('utf-8', 'replace') if field else None
            return f"{name + ': ' if name else ''}an integer of more than 4300 digits", name
        return "the request body is not JSON", None


def _validation_message(error: ValidationError) -> tuple[str, str | None]:
    """The first problem, naming its field (``messages.0.content``), in words a client can act on; and the field
    (None: the body as a whole)."""
    # Of a union's alternatives, the one that got furthest (``content`` as a list of parts rather than a string),
    # and at the same depth one that is not just the wrong type (an empty list of parts: "at least 1 item").
    problems = error.errors(include_url=False)
    rank = lambda e: (len(e["loc"]), not e["type"].endswith("_type"))  # noqa: E731
    problem = max(problems, key=rank)
    where = _field_name(problem["loc"]) or None
    if not rank(problem)[1]:  # every alternative refused the type: name them all ("a valid string, or a valid list")
        wanted = list(dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in problems
                                    if rank(e) == rank(problem) and (_field_name(e["loc"]) or None) == where))
        problem = {**problem, "msg": "Input should be " + ", or ".join(wanted)}
    if problem["type"] == "union_tag_not_found":
        return f"{where}: a content part needs a type (text, image_url, video_url)", where
    if problem["type"] == "union_tag_invalid":
        return (f"{where}: unsupported content part type {problem['input'].get('type')!r} (text, image_url, "
                "video_url)", where)
    if problem["type"] == "value_error":
        where = where or getattr((problem.get("ctx") or {}).get("error"), "param", None)
        message = problem["msg"].removeprefix("Value error, ")
        return f"{where}: {message}" if where else message, where
    if where == "n":
        return "n must be 1: Glimpse answers one choice per request", where
    return f"{where or 'body'}: {problem['msg']}", where


def _field_name(loc: tuple) -> str:
    """``messages.0.content.0.text`` from pydantic's location, without the union members it names and, after
    a tagged union's item index, the tag ("text", "image_url") it chose."""
    parts, tagged, after_tagged_item = [], False, False
    for part in loc:
        if _is_type_name(part):
            tagged = tagged or "tagged-union" in part
            continue
        if after_tagged_item:  # the tag of the part's type, not a field
            after_tagged_item = False
            continue
        after_tagged_item = tagged and isinstance(part, int)
        parts.append(str(part))
    return ".".join(parts)


def _is_type_name(loc) -> bool:
    """Pydantic names the union member tried in an error's location ("str", "list[...]", "function-after[...]",
    "constrained-str")."""
    return isinstance(loc, str) and ("[" in loc or loc.startswith("constrained-")  # (a str with a min_length)
                                     or loc in ("str", "int", "float", "bool", "dict", "list"))


# ---------------------------------------------------------------------------- the app
def create_api(engine, *, model_name: str, scheduler: Scheduler | None = None, allowed_root: str | None = None,
               app: FastAPI | None = None, allow_private_urls: bool = False, fetch_deadline_s: float = FETCH_DEADLINE_S,
               max_new_tokens: int = 4096, queue_size: int = 32, api_key: str | None = None,
               telemetry: Telemetry | None = None) -> FastAPI:
    # No /docs or /openapi.json: the chat completion is read by hand (its schema there would be empty), and those
    # pages would be open under --api-key.
    app = app or FastAPI(title="Glimpse", docs_url=None, redoc_url=None, openapi_url=None)
    api_key = api_key or None  # an empty key (GLIMPSE_API_KEY= in compose) is no key, not one nobody can send
    scheduler = scheduler or Scheduler(engine, queue_size=queue_size)
    telemetry = telemetry or Telemetry(scheduler, model_name)
    root = Path(allowed_root).resolve() if allowed_root else None
    fetcher = Fetcher(allow_private_urls, fetch_deadline_s)
    # A request with http(s) media is parsed (its media fetched, up to the fetch deadline each) by at most
    # FETCHING_THREADS worker threads at once, fewer than the pool the chat's handlers and the other requests use:
    # slow media URLs wait for one of these, never for every thread the server has.
    fetching = anyio.CapacityLimiter(FETCHING_THREADS)
    fetches = {"in": 0}  # requests fetching their media or waiting to (only the event loop changes it)
    app.state.scheduler, app.state.telemetry = scheduler, telemetry
    # Every request body but an upload's, here and in the chat mounted on this app: 413 past 64 MiB, 408 if it has
    # not all arrived in 120 s; large ones wait while the bodies of the requests under way hold 256 MiB
    # (glimpse.connections).
    app.add_middleware(BodyLimits, on_refused=lambda path: telemetry.refused("bad_request") if path.startswith("/v1/")
                       else None)
    app.add_middleware(StreamsUnbuffered)  # streamed answers and the chat's events pass a proxy as they come
    app.add_middleware(AbsoluteFormTargets)  # outermost: the limits and the routes see the path alone

    def unauthorized(request: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        if len(sent := request.headers.getlist("authorization")) > 1:  # the first one decided: right then wrong passed
            return _error(400, f"one Authorization header, not {len(sent)}", "invalid_request_error",
                          code="invalid_api_key")
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # The scheme's name is case-insensitive (RFC 9110); the key is compared in constant time.
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
            return None
        # A 401 names the scheme to use (RFC 9110, 11.6.1): clients and proxies read it to know how to ask again.
        return _error(401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_request_error",
                      headers={"WWW-Authenticate": 'Bearer realm="glimpse"'}, code="invalid_api_key")

    # HEAD as well as GET (probes and `curl -I`); another method is a 405 naming the one to use, where the chat
    # mounted at "/" would have answered 404.
    # These three answer on the event loop, never waiting for a worker thread: while slow media fetches hold the
    # threads, a probe of /health still gets its answer.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        state = scheduler.state()
        wedged = not state["alive"] or state["stalled_s"] > STALL_S
        body = {"status": "wedged" if wedged else "ok", "model": model_name, "device": str(engine.device), **state,
                # Whether plain decode steps replay as a CUDA graph, and why not if a capture failed (an operator
                # sees at once that a GPU box decodes on the slower eager path).
                "decode_graphs": engine.decode_graphs, "decode_graph_error": engine.decode_graph_error}
        return JSONResponse(body, status_code=503 if wedged else 200)

    the_model = {"id": model_name, "object": "model", "created": 0, "owned_by": "glimpse"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        if (refusal := unauthorized(request)) is not None:
            return refusal
        return {"object": "list", "data": [the_model]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model_id: str):
        if (refusal := unauthorized(request)) is not None:
            return refusal
        if model_id != model_name:
            return _error(404, f"the model {model_id!r} does not exist: this server answers with {model_name!r}",
                          "invalid_request_error", code="model_not_found")
        return the_model

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(telemetry.render(), media_type=CONTENT_TYPE)

    for path, allowed in (("/health", "GET, HEAD"), ("/v1/models", "GET, HEAD"), ("/metrics", "GET, HEAD"),
                          ("/v1/chat/completions", "POST")):
        others = sorted({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"} - set(allowed.split(", ")))
        app.add_api_route(path, _method_not_allowed(allowed), methods=others, include_in_schema=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        received = time.perf_counter()  # its time to first token starts here: its body and media are read first
        if (refusal := unauthorized(request)) is not None:
            telemetry.refused("unauthorized")
            return refusal
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            # A page on another origin can make a browser POST a body with no content type, or with one of the
            # "simple" types, without asking (no CORS preflight); only JSON is read.
            telemetry.refused("bad_request")
            return _error(415, "the request body must be JSON, sent as Content-Type: application/json")
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):  # a compressed body is not unpacked (a few KB of gzip unpack to GBs)
            telemetry.refused("bad_request")
            return _error(415, f"the request body is sent compressed (Content-Encoding: {encoding[:40]}); send it "
                               "uncompressed")
        try:
            # Bounded in size and time by connections.BodyLimits (413, 408). Read as a stream: ``request.body()`` would
            # keep the bytes on the request for as long as it is answered.
            raw = b"".join([chunk async for chunk in request.stream()])
        except ClientDisconnect:  # the client left while sending it
            telemetry.refused("cancelled")
            return _error(499, "the client closed the request", "cancelled")
        # Read off the event loop: tens of megabytes of JSON, and the words for a million validation errors, take
        # seconds, which /health and every other client would wait out.
        body = await anyio.to_thread.run_sync(_read_request, raw)
        if isinstance(body, tuple):
            telemetry.refused("bad_request")
            return _error(400, body[0], param=body[1])
        scratch = Scratch()
        # A whole answer is sent at once: its channel takes the last chunk only (and an error, or None for a
        # request cancelled before it started), so that its tokens do not wake the event loop one by one.
        channel = Channel(asyncio.get_running_loop(), last_only=not body.stream)

        # What the request's media URLs may take in all; ``cancelled`` is set when its client leaves meanwhile.
        allowance = Allowance(time.monotonic() + fetch_deadline_s, MAX_REQUEST_FETCH_BYTES)
        submitted = []

        def parse_and_submit():
            # The deadline counts from here, once the request holds a fetching thread: a wait for one is the
            # server's business (bounded by the queue's room, 429 past it), and with eight slow URLs ahead a good
            # one was refused, 400 "not fetched within 30 s", after a fraction of a second of fetching (an outside
            # pass).
            allowance.deadline = time.monotonic() + fetch_deadline_s
            local_parts: dict[str, str] = {}
            messages, options, promise = _parse(body, engine, root, scratch, fetcher, max_new_tokens, allowance,
                                                local_parts)
            try:
                ticket = scheduler.submit(messages, sink=channel.put, left=allowance.cancelled.is_set,
                                          received=received, **options)
            except vision.MediaError as error:
                message = _naming_its_part(str(error), local_parts)
                raise BadRequest(message, _param_of_part(message, body)) from None
            submitted.append(ticket)
            if allowance.cancelled.is_set():  # the client left meanwhile (its handler cancels what it finds too)
                ticket.cancel.set()
            return ticket, promise

        try:
            scheduler.check_room()  # refuse a full server before fetching anything
            # Off the event loop, in one hop to a worker thread: fetching a slow media URL must not stall
            # /health or other requests; each hop waits for a CPU that the model's threads keep busy.
            if not _has_media(body):
                ticket, promise = await _in_worker_thread(parse_and_submit)  # the pool others share
            else:
                # With media, the request's thread is watched: a client that leaves while its media are fetched or
                # decoded stops that work (a video whose frames can only be reached by decoding all of them is
                # minutes of a core for a few megabytes).
                fetching_urls = _fetches(body)
                # Counted here, not read from the limiter (a request joins its wait queue only after a checkpoint):
                # no more wait for a fetching thread than the queue has room for.
                if fetching_urls and fetches["in"] >= FETCHING_THREADS + queue_size:
                    waiting = fetches["in"] - FETCHING_THREADS
                    raise QueueFull(waiting, fetch_deadline_s * (1 + waiting // FETCHING_THREADS))
                fetches["in"] += int(fetching_urls)
                try:
                    parsed = await _unless_client_leaves(request, allowance, parse_and_submit,
                                                         fetching if fetching_urls else None,
                                                         stopping=lambda: scheduler.closed)
                finally:
                    fetches["in"] -= int(fetching_urls)
                if parsed is None:  # the client left while its media were fetched, or while it waited to be
                    for ticket in submitted:
                        ticket.cancel.set()
                    telemetry.refused("cancelled")
                    return _error(499, "the client closed the request", "cancelled")
                ticket, promise = parsed
        except QueueFull as full:
            telemetry.refused("rejected")
            # (OpenAI's shape: type "requests", code "rate_limit_exceeded"; the code was sent as the type)
            return _error(429, str(full), "requests", code="rate_limit_exceeded",
                          headers={"Retry-After": str(max(1, round(full.retry_s)))})
        except ServerStopping as error:  # SIGTERM came: another instance, or this one restarted, can answer
            telemetry.refused("rejected")
            return _error(503, str(error), "server_error")
        except (BadRequest, UserError) as error:
            telemetry.refused("bad_request")
            return _error(400, str(error), param=getattr(error, "param", None), code=getattr(error, "code", None))
        except Exception as error:  # the server keeps serving; the client learns what happened
            telemetry.refused("error")
            return _error(500, f"{type(error).__name__}: {error}", "server_error")
        finally:
            scratch.cleanup()  # the prompt is built: its media are decoded into it
        # The body's text (data URLs: tens of megabytes, raw and parsed) is not needed past the prompt: it goes now,
        # and with it the room it held among the large bodies under way (connections.BodyLimits), not at the end of
        # the answer.
        del raw
        body = body.model_copy(update={"messages": []})
        if body.model_extra:  # (its hints, and fields given "off": nothing past this point reads them)
            body.model_extra.clear()
        request.scope.get(BODY_DONE, lambda: None)()
        try:
            # Streamed or not, nothing is sent before the first token (or the answer): a request that fails
            # at its prefill (a policy parameter this model cannot take) is a plain 400, not a stream of one error.
            first = await _first(request, ticket, channel, whole=not body.stream)
        except (OutOfMemory, ServerStopping) as error:  # not the request's fault: beside fewer others, or later, it may fit
            return _error(503, str(error), "server_error")
        except UserError as error:
            return _error(400, str(error))
        except Exception as error:
            return _error(500, f"{type(error).__name__}: {error}", "server_error")
        if first is None:  # the client left before its answer: nobody to answer
            return _error(499, "the client closed the request", "cancelled")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_events(ticket, channel, first, body.speed, promise, model_name, include_usage),
                                     media_type="text/event-stream")
        return _completion(first.result, model_name, body.speed, promise)

    @app.api_route("/v1/{anything:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
                   include_in_schema=False)
    async def not_here(request: Request, anything: str):
        # Last, after every route it would hide. An OpenAI client that asks for what Glimpse does not serve
        # (/v1/completions, /v1/embeddings) gets an error in OpenAI's shape, which its library reads, not FastAPI's
        # {"detail": ...}.
        if (refusal := unauthorized(request)) is not None:
            return refusal
        shown = anything if len(anything) <= 200 else anything[:200] + "…"  # never echo a 64 KB path back
        return _error(404, f"/v1/{shown} is not served here: Glimpse serves /v1/chat/completions and /v1/models",
                      "invalid_request_error", code="not_found")

    return app


def _method_not_allowed(allowed: str):
    def refuse():
        return _error(405, f"method not allowed here: use {allowed}", headers={"Allow": allowed})
    return refuse


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None,
           code: str | None = None, param: str | None = None) -> JSONResponse:
    # A client's lone surrogate quoted back (a parameter named "\ud800") cannot be encoded as UTF-8 JSON: escaped.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(error_content(message, code, kind, param), status_code=status, headers=headers)


def _text_length(messages: list) -> int:
    total = 0
    for message in messages:
        if isinstance(message.content, str):
            total += len(message.content)
        else:
            total += sum(len(part.text) for part in message.content if isinstance(part, TextPart))
    return total


def _parse(body: ChatRequest, engine, root: Path | None, scratch: "Scratch", fetcher: "Fetcher", max_new_tokens: int,
           allowance: Allowance | None = None, local_parts: dict[str, str] | None = None
           ) -> tuple[list[dict], dict, dict]:
    """The engine's messages, the scheduler's options, and what the slider promises at the requested speed
    (the calibrated agreement and cost, or that the model is uncalibrated). ``local_parts`` gets, for each local
    file, its name and the part of the request that named it (for the errors about it, ``_naming_its_part``)."""
    # Text that cannot fit the context is refused before its media are fetched (build_prompt checks it again,
    # for every other entry point).
    check_text_length(_text_length(body.messages), engine.max_length)
    try:
        policy = engine.make_policy(body.policy, body.speed, body.params)
    except (UserError, KeyError, TypeError) as error:  # the request's own policy, params or their values
        unknown = str(error).startswith("unknown policy")  # (said as it is: "policy: unknown policy ..." repeated it)
        param = "params" if body.params and not unknown else "policy"
        raise BadRequest(str(error) if unknown else f"policy: {error}", param) from None
    promise = engine.promise(body.policy, body.speed, body.params)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(256, max_new_tokens)
    if max_tokens > max_new_tokens:  # named as sent (a client sending max_completion_tokens was told max_tokens)
        field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise BadRequest(f"{field} must be at most {max_new_tokens} on this server (--max-new-tokens)", field)
    messages = []
    if allowance is None:  # one deadline and one byte budget for all of the request's media URLs
        allowance = Allowance(time.monotonic() + fetcher.deadline_s, MAX_REQUEST_FETCH_BYTES)
    for number, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if isinstance(message.content, str):
            messages.append({"role": role, "content": message.content})
            continue
        parts = []
        for index, part in enumerate(message.content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            media = "image" if isinstance(part, ImagePart) else "video"
            url = _url_of(part)
            where = f"messages[{number}].content[{index}]"  # as the request's JSON has it (the validation errors' words)
            try:
                source = _media_source(url, media, root, scratch, fetcher, where, allowance)
            except (BadRequest, FetchError) as error:  # refused, or could not be fetched: the URL is at fault
                raise BadRequest(str(error), f"messages.{number}.content.{index}.{media}_url.url") from None
            if local_parts is not None and isinstance(source, str) and not Path(source).name.startswith("messages["):
                local_parts.setdefault(Path(source).name, where)  # (a video's own file is named after its part)
            parts.append({"type": media, media: source})
        messages.append({"role": role, "content": parts})
    temperature = body.temperature or 0.0
    options = {"policy": policy, "max_new_tokens": max_tokens, "do_sample": temperature > 0,
               "temperature": float(temperature or 1.0), "top_p": float(1.0 if body.top_p is None else body.top_p),
               "seed": body.seed, "stop": body.stops(),
               # Asked for explicitly, max_tokens must fit beside the prompt (a 400 otherwise, as OpenAI answers);
               # left out, the answer may run to the end of the context.
               # (named as sent: "max_tokens: ..." answered a client that had sent max_completion_tokens)
               "refuse_past_context": ("max_completion_tokens" if body.max_completion_tokens is not None
                                       else "max_tokens" if body.max_tokens is not None else None)}
    return messages, options, promise


def _naming_its_part(message: str, local_parts: dict[str, str]) -> str:
    """An error about a local file ("clip.gif: this is an image, not a video"), led by the part of the request that
    named it, as every error about a part is ("messages[0].content[1]: clip.gif: ...")."""
    for name, where in local_parts.items():
        if message.startswith(f"{name}: "):
            return f"{where}: {message}"
    return message


def _param_of_part(message: str, body: ChatRequest) -> str | None:
    """The ``param`` of an error about the media part its message names first ("messages[0].content[1]: ..."): the
    path of the part's URL, as a refusal of the URL itself has it (a decoding error had none)."""
    named = re.match(r"messages\[(\d+)\]\.content\[(\d+)\]", message)
    if named is None:
        return None
    number, index = int(named.group(1)), int(named.group(2))
    content = body.messages[number].content if number < len(body.messages) else None
    if not isinstance(content, list) or index >= len(content) or isinstance(content[index], TextPart):
        return None
    media = "image" if isinstance(content[index], ImagePart) else "video"
    return f"messages.{number}.content.{index}.{media}_url.url"


MAX_PATH_BYTES = 4096  # PATH_MAX: a longer local path cannot name a file (and resolving one costs time)


async def _unless_client_leaves(request: Request, allowance: Allowance, parse_and_submit, limiter,
                                stopping: Callable[[], bool] = lambda: False):
    """``parse_and_submit()`` in a worker thread of ``limiter`` (None: the pool every request shares), or None once the
    client has left: waiting for a thread, it gives up its place; fetching, its fetches stop within half a second
    (``allowance.cancelled``); decoding its media, that stops within half a second too (``Scheduler.prepare``). An
    abandoned request kept its place and had every URL fetched: 40 of them held the queue for 150 s.
    Once ``stopping()`` (SIGTERM) the same, and ``ServerStopping`` is raised: the client is told (503) while the
    server can still answer, where a slow media URL had it fetching until the server closed the connection under it."""
    # What the watch saw: "left" or "stopping". Only that: the watch, cancelled, ends up in a reference cycle of
    # anyio's (its CancelledError's traceback holds its frame), and whatever its closure reaches stays until Python's
    # next full garbage collection; the parsed request (the ticket, and with it the prompt's pictures and the answer's
    # prefill) must not be among it.
    seen: dict[str, bool] = {}
    parsed, failure = None, None
    async with anyio.create_task_group() as group:
        async def watch():
            while not stopping():
                if await request.is_disconnected():
                    seen["left"] = True
                    break
                await anyio.sleep(0.25)
            else:
                seen["stopping"] = True
            allowance.cancelled.set()
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            parsed = await _in_worker_thread(parse_and_submit, limiter=limiter, abandon_on_cancel=True)
        except Exception as error:  # raised below as itself: out of the group it would be an ExceptionGroup
            failure = error
        group.cancel_scope.cancel()  # parsed: the watch ends
    if seen.get("left"):
        return None
    if parsed is not None:  # submitted, if only just: the scheduler answers it (a closing one with ServerStopping)
        return parsed
    if seen.get("stopping"):  # its fetch was stopped: whatever it raised for that is not the request's fault
        raise ServerStopping(STOPPING)
    try:
        raise failure
    finally:  # else this frame, in the error's traceback, holds the error: a cycle (_in_worker_thread)
        del failure


async def _in_worker_thread(work, **options):
    """``anyio.to_thread.run_sync(work, **options)``, where an error comes without its traceback (the handler answers
    every error with its message, and logs none). anyio keeps an error raised in a worker thread in a future that a
    frame of its traceback holds: a cycle, which kept the request's body, parsed and decoded (hundreds of MB for large
    data URLs), until Python's next full garbage collection, far apart in a process holding a model's objects (found
    here, 2026-12-06: twenty refused 60 MB data URLs left 3.4 GB behind until then; a 429 after its prompt was built,
    its pictures)."""
    try:
        return await anyio.to_thread.run_sync(work, **options)
    except Exception as error:
        raise error.with_traceback(None)


def _media_parts(body: ChatRequest) -> list[ImagePart | VideoPart]:
    """The image and video parts of ``body`` (URLs, data URLs and paths), in order."""
    return [part for message in body.messages
            for part in (message.content if isinstance(message.content, list) else ())
            if isinstance(part, (ImagePart, VideoPart))]


def _has_media(body: ChatRequest) -> bool:
    return bool(_media_parts(body))


def _fetches(body: ChatRequest) -> bool:
    """Whether parsing ``body`` fetches a media URL."""
    return any(_url_of(part)[:8].lower().startswith(("http://", "https://")) for part in _media_parts(body))


def _url_of(part: ImagePart | VideoPart) -> str:
    spec = part.image_url if isinstance(part, ImagePart) else part.video_url
    return spec.url if isinstance(spec, MediaURL) else spec


def _media_source(url: str, kind: str, root: Path | None, scratch: "Scratch", fetcher: "Fetcher", where: str = "media",
                  allowance: Allowance | None = None):
    """Bytes (images) or a file path (videos) for a data: / http(s) / local URL. URL schemes are matched as
    RFC 3986 has them, in any case. A video's bytes go to a file named after ``where`` (the part of the request
    it came from), so that an error about it names that part, not a random temporary name."""
    scheme = url[:8].lower()
    # A scheme is two or more letters before a colon (one letter would be a drive, which is no URL here):
    # javascript:, about:, jar:http://... are refused as schemes, not looked for as files under the root.
    named = re.match(r"([A-Za-z][A-Za-z0-9+.-]{1,31}):", url)
    if named and named.group(1).lower() not in ("data", "http", "https", "file"):
        shown = named.group(0) + ("//" if url[named.end():].startswith("//") else "")
        raise BadRequest(f"{where}: an unsupported URL scheme ({shown}); send a data: URL, an http(s):// "
                         "URL or a file:// URL under the allowed root")
    if named and named.group(1).lower() in ("http", "https") and not scheme.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: {url[:40]!r} is not an http(s) URL (http://host/...)")
    if scheme.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header.lower():
            raise BadRequest(f"{where}: data URLs must be base64-encoded")
        data = NamedBytes(_base64(payload, where), f"{where} (a data URL)")
        if not data:
            raise BadRequest(f"{where}: the data URL holds no data (data:<type>;base64,<data>)")
    elif scheme.startswith(("http://", "https://")):
        try:
            data = NamedBytes(fetcher.fetch(url, allowance), f"{where} ({_url_name(url)})")
        except FetchError as error:
            raise FetchError(f"{where}: {error}") from None
    else:
        try:
            name = vision.local_path(url)  # file://localhost/..., percent-encoded names
            return _local_file(name, url, root)
        except (vision.MediaError, BadRequest) as error:
            raise BadRequest(f"{where}: {error}") from None
    if kind == "image":
        return data
    folder = scratch.path() / uuid.uuid4().hex
    folder.mkdir()
    target = folder / (f"{where} (a data URL)" if scheme.startswith("data:") else f"{where} ({_url_name(url)})")
    target.write_bytes(data)
    return str(target)


ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"  # what MIME base64 may hold between its characters (line breaks)


def _base64(payload: str, where: str) -> bytes:
    """A data URL's bytes: base64 as written in MIME (line breaks), percent-encoded or URL-safe, padded or not.
    Worked on as bytes: regular expressions over a 60 MB payload took 1.8 s of CPU (found from outside: 16 such
    requests at once took 49 s to refuse, and a text question sent meanwhile waited up to 27 s); this takes 0.13 s."""
    from urllib.parse import unquote

    try:
        text = (unquote(payload) if "%" in payload else payload).encode("ascii").translate(None, ASCII_WHITESPACE)
        altchars = b"-_" if b"-" in text or b"_" in text else None
        return base64.b64decode(text + b"=" * (-len(text) % 4), altchars=altchars, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):  # (no base64 character is outside ASCII)
        raise BadRequest(f"{where}: the data URL is not valid base64") from None


def _url_name(url: str) -> str:
    """The last part of a URL's path, as a file name can hold it (for messages about what was fetched)."""
    from urllib.parse import unquote, urlsplit

    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1]).replace("/", "_").replace("\0", "")
    # A video's file is named after it: at most 80 bytes of UTF-8 (a file name holds 255 bytes, and 80 emoji were
    # 320).
    name = name.encode("utf-8", "surrogatepass")[:80].decode("utf-8", "ignore")
    return name or "a URL"


def _local_file(name: str, url: str, root: Path | None) -> str:
    """A file under ``root`` named by a client (a relative name: relative to ``root``; the server's working folder
    means nothing to a client), as its resolved path. Checked for what cannot be a path before the file system
    sees it: resolving is a system call per component, and a megabyte of "/x" held a server thread for minutes."""
    shown = url if len(url) <= 200 else url[:200] + "…"  # a refusal never echoes megabytes back
    if root is None:
        raise BadRequest("local files are not allowed (start the server with --allowed-root DIR)")
    if "\0" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise BadRequest(f"{shown}: not a file name (a NUL byte, or longer than {MAX_PATH_BYTES} bytes)")
    try:
        resolved = (root / name).resolve()
        if not resolved.is_relative_to(root):
            raise BadRequest(f"{shown}: outside the allowed root")
        if not resolved.is_file():
            raise BadRequest(f"{shown}: no such file")
    except OSError as error:  # a name too long for the file system, a folder it may not enter, ...
        raise BadRequest(f"{shown}: cannot be read ({error.strerror or type(error).__name__})") from None
    except RuntimeError:  # Path.resolve's "Symlink loop" (Python before 3.13)
        raise BadRequest(f"{shown}: a loop of symbolic links") from None
    return str(resolved)


class Scratch:
    """A request's temporary folder, for the bytes of its videos (their decoders read files): made on first
    use, so that requests without a video make none, and removed once the prompt is built."""

    def __init__(self):
        self._folder: tempfile.TemporaryDirectory | None = None

    def path(self) -> Path:
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="glimpse-api-")
        return Path(self._folder.name)

    def cleanup(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()


def _usage(result) -> dict:
    prompt = sum(result.metrics["prompt_tokens"].values())
    return {"prompt_tokens": prompt, "completion_tokens": result.metrics["new_tokens"],
            "total_tokens": prompt + result.metrics["new_tokens"],
            # OpenAI's field for prompt tokens served from a cache of earlier prompts (the prefix cache)
            "prompt_tokens_details": {"cached_tokens": result.metrics["prefix_reused_tokens"]}}


def _glimpse(result, speed: float, promise: dict) -> dict:
    keys = ("ttft_s", "queue_s", "prompt_s", "prefill_s", "decode_tokens_per_s", "prompt_tokens", "kv_bytes",
            "peak_memory_bytes", "prefill_flops", "prefill_flops_baseline", "prefill_flops_unpruned",
            "prefix_reused_tokens")
    return finite({"policy": result.policy, "speed": speed, "params": result.params, "summary": result.summary,
                   "promise": promise, "metrics": {k: result.metrics[k] for k in keys}, "warnings": result.warnings})


def _completion(result, model_name: str, speed: float, promise: dict) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": result.finish_reason}],
            "usage": _usage(result), "glimpse": _glimpse(result, speed, promise)}


class Channel:
    """Hands a ticket's chunks from the scheduler's thread to the event loop (``put`` is its sink)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, last_only: bool = False):
        self.loop, self.items, self.last_only = loop, asyncio.Queue(), last_only

    def put(self, item) -> None:
        if self.last_only and isinstance(item, StreamChunk) and item.result is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    async def get(self):
        return await self.items.get()


async def _first(request: Request, ticket, channel: Channel, whole: bool):
    """The ticket's first chunk (``whole``: its last, with the result), or None when the client disconnects
    first — the ticket is then cancelled: it stops before its next step, or never starts if still waiting.
    Raises the ticket's error."""
    while True:
        try:
            item = await asyncio.wait_for(channel.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                ticket.cancel.set()
                return None
            continue
        if item is None:  # ended before it started (cancelled)
            return None
        if isinstance(item, BaseException):
            try:
                raise item
            finally:  # else this frame, in the error's traceback, holds the error: a cycle (_in_worker_thread)
                del item
        if not whole or item.result is not None:
            return item


async def _events(ticket, channel: Channel, first, speed, promise, model_name, include_usage: bool):
    """Server-sent events: a role chunk (with ``glimpse``: the speed's promise), content chunks as tokens come, a
    final chunk with the finish reason (and ``glimpse``, the metrics too), then with ``include_usage`` a chunk with
    ``usage`` and no choices. When the client disconnects, the server stops iterating this generator, whose
    ``finally`` cancels the ticket: it stops before its next step and frees its cache."""
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def event(choices: list, **extra) -> str:
        chunk = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                 "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    def delta(content: dict, finish=None) -> list:
        return [{"index": 0, "delta": content, "finish_reason": finish}]

    try:
        # The first chunk says what the speed selected and what it was measured to keep, before the answer (the last
        # one repeats it in ``glimpse`` with the metrics).
        yield event(delta({"role": "assistant", "content": ""}), glimpse={"speed": speed, "promise": promise})
        item = first
        while True:
            if item is None:
                break
            if isinstance(item, BaseException):
                kind = ("invalid_request_error"
                        if isinstance(item, UserError) and not isinstance(item, (OutOfMemory, ServerStopping))
                        else "server_error")
                message = str(item) if isinstance(item, UserError) else f"{type(item).__name__}: {item}"
                # (in the shape of every other error: param and code were missing here)
                yield f"data: {json.dumps(error_content(message, getattr(item, 'code', None), kind))}\n\n"
                break
            if item.text:
                yield event(delta({"content": item.text}))
            if item.result is not None:
                yield event(delta({}, item.result.finish_reason), glimpse=_glimpse(item.result, speed, promise))
                if include_usage:
                    yield event([], usage=_usage(item.result))
                break
            item = await channel.get()
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel.set()  # a no-op once it ended; the client left mid-answer otherwise
