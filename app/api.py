"""The HTTP API `glimpse serve` exposes beside the web chat.

* ``POST /v1/chat/completions`` — OpenAI-compatible. Messages hold text and ``image_url`` parts
  (``data:`` URLs, ``http(s)`` URLs, or local paths / ``file://`` URLs under ``--allowed-root`` only),
  plus Glimpse's ``video_url`` parts (same sources). ``stream: true`` answers with server-sent events
  (``chat.completion.chunk`` objects, then ``data: [DONE]``). Extra request fields: ``policy`` and
  ``speed`` (the slider), ``params`` (overrides). Decoding is greedy unless ``temperature`` > 0
  (then ``top_p`` and ``seed`` apply); ``max_tokens`` / ``max_completion_tokens`` default to 256.
  The response's ``usage`` counts tokens, and its ``glimpse`` field carries the policy, its
  parameters and the timing/memory metrics. Any other request field (``stop``, ``tools``,
  ``response_format``, ``logprobs``, penalties, ``n`` > 1, ...) is refused with 400, never ignored,
  unless it is sent with its "off" value (null, false, 0, empty), which asks for nothing.
* ``GET /v1/models`` — the one model this server answers with.
* ``GET /health`` — ``{"status": "ok", "model": ...}``.
* ``GET /metrics`` — Prometheus text: requests by outcome, tokens, a TTFT histogram, KV bytes.

A bad request gets a 400 with an OpenAI-style ``{"error": {...}}`` body and changes nothing; the
engine answers one request at a time (its lock), so concurrent requests queue. A client that leaves
— a dropped stream, or a request given up while waiting — cancels its request at the next decode step
and frees the model. Parsing a request and fetching its media never run on the event loop, and a
media URL gets ``FETCH_DEADLINE_S`` in all, no redirect to another host, and no private, loopback or
link-local address unless the server allows them (``--allow-private-urls``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import json
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urljoin, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from common import UserError
from pruning.base import check_speed

MAX_FETCH_BYTES = 50 * 2**20  # an http(s) image or video larger than this is refused
FETCH_DEADLINE_S = 30.0  # a media URL must be fetched within this, however slowly it drips
MAX_BODY_BYTES = 64 * 2**20  # a request body larger than this (data URLs included) is refused with 413
# The request fields Glimpse implements; any other is refused with 400 rather than silently ignored.
FIELDS = {"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "seed", "user", "n", "speed", "policy", "params"}
CHARS_PER_TOKEN_BOUND = 8  # text longer than this many characters per context token cannot fit: refused unread
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BadRequest(Exception):
    pass


class Counters:
    """What ``/metrics`` reports; updated after every request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {"ok": 0, "bad_request": 0, "error": 0, "cancelled": 0, "rejected": 0}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.kv_bytes_last = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0

    def record(self, outcome: str, result=None) -> None:
        with self.lock:
            self.requests[outcome] += 1
            if result is None:
                return
            m = result.metrics
            self.prompt_tokens += sum(m["prompt_tokens"].values())
            self.completion_tokens += m["new_tokens"]
            self.kv_bytes_last = m["kv_bytes"]
            ttft = m["ttft_s"]
            self.ttft_sum += ttft
            bucket = next((i for i, edge in enumerate(TTFT_BUCKETS) if ttft <= edge), len(TTFT_BUCKETS))
            self.ttft_counts[bucket] += 1

    def prometheus(self) -> str:
        with self.lock:
            lines = ["# HELP glimpse_requests_total Chat completion requests by outcome.",
                     "# TYPE glimpse_requests_total counter"]
            lines += [f'glimpse_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            lines += ["# HELP glimpse_tokens_total Tokens processed.", "# TYPE glimpse_tokens_total counter",
                      f'glimpse_tokens_total{{kind="prompt"}} {self.prompt_tokens}',
                      f'glimpse_tokens_total{{kind="completion"}} {self.completion_tokens}',
                      "# HELP glimpse_kv_bytes KV cache bytes of the last request at its end.",
                      "# TYPE glimpse_kv_bytes gauge", f"glimpse_kv_bytes {self.kv_bytes_last}",
                      "# HELP glimpse_ttft_seconds Time to first token.", "# TYPE glimpse_ttft_seconds histogram"]
            cumulative = 0
            for edge, count in zip((*TTFT_BUCKETS, "+Inf"), self.ttft_counts):
                cumulative += count
                lines.append(f'glimpse_ttft_seconds_bucket{{le="{edge}"}} {cumulative}')
            lines += [f"glimpse_ttft_seconds_sum {self.ttft_sum}", f"glimpse_ttft_seconds_count {cumulative}"]
        return "\n".join(lines) + "\n"


def create_api(engine, *, model_name: str, allowed_root: str | None = None, app: FastAPI | None = None,
               allow_private_urls: bool = False, fetch_deadline_s: float = FETCH_DEADLINE_S,
               max_new_tokens: int = 4096, queue_size: int = 32) -> FastAPI:
    app = app or FastAPI(title="Glimpse")
    counters = Counters()
    root = Path(allowed_root).resolve() if allowed_root else None
    fetcher = Fetcher(allow_private_urls, fetch_deadline_s)
    admission = Admission(queue_size + 1)
    app.state.counters = counters

    @app.get("/health")
    def health():
        return {"status": "ok", "model": model_name, "device": str(engine.device)}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "glimpse"}]}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(counters.prometheus(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = bytearray()
        async for piece in request.stream():  # read with a cap: a huge body never lands in memory whole
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                counters.record("bad_request")
                return _error(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            counters.record("bad_request")
            return _error(400, "the request body is not JSON")
        if not admission.enter():  # the running answer plus --queue-size waiting: refuse, don't pile up
            counters.record("rejected")
            return _error(429, f"the server is busy ({admission.limit - 1} requests are waiting); retry shortly",
                          "rate_limit_exceeded", headers={"Retry-After": "5"})
        scratch = tempfile.TemporaryDirectory(prefix="glimpse-api-")
        streaming = False
        try:
            # Off the event loop: fetching a slow media URL must not stall /health or other requests.
            messages, options, speed, promise = await run_in_threadpool(_parse, body, engine, root,
                                                                        Path(scratch.name), fetcher, max_new_tokens)
            if body.get("stream"):
                job = StreamJob(engine, messages, options, scratch, on_done=admission.leave)
                streaming = True  # the job cleans up and leaves the queue when it ends
                return StreamingResponse(_stream(job, speed, promise, model_name, counters),
                                         media_type="text/event-stream")
            cancel = threading.Event()
            result = await _until_disconnected(request, cancel, run_in_threadpool(
                engine.generate, messages, cancel=cancel, **options))
            if result is None:  # the client left before its answer: nobody to answer
                counters.record("cancelled")
                return _error(499, "the client closed the request", "cancelled")
        except (BadRequest, UserError) as error:
            counters.record("bad_request")
            return _error(400, str(error))
        except Exception as error:  # the server keeps serving; the client learns what happened
            counters.record("error")
            return _error(500, f"{type(error).__name__}: {error}", "server_error")
        finally:
            if not streaming:
                scratch.cleanup()
                admission.leave()
        counters.record("ok", result)
        return _completion(result, model_name, speed, promise)

    return app


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


class Admission:
    """How many API requests may be in the server at once (the one the model answers and those
    waiting for it): ``limit``. One more is refused with 429 instead of queueing without bound."""

    def __init__(self, limit: int):
        self.limit, self.count, self.lock = limit, 0, threading.Lock()

    def enter(self) -> bool:
        with self.lock:
            if self.count >= self.limit:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.count -= 1


def _text_length(messages: list) -> int:
    """Characters of text in the (not yet validated) messages."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return total


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse(body: dict, engine, root: Path | None, scratch: Path, fetcher: "Fetcher", max_new_tokens: int
           ) -> tuple[list[dict], dict, float, dict]:
    """The engine's messages, the generate options, the requested speed (reported back) and what the
    slider promises at it (the calibrated agreement and cost, or that the model is uncalibrated)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequest("'messages' must be a non-empty list")
    # A field sent with its "off" value (null, false, 0, empty) asks for nothing: accepted, as clients send them.
    unsupported = sorted(k for k in set(body) - FIELDS if body[k] not in (None, False, 0, [], {}, ""))
    if unsupported:
        raise BadRequest(f"unsupported field(s) {', '.join(unsupported)}: Glimpse implements "
                         f"{', '.join(sorted(FIELDS))}")
    if body.get("n") not in (None, 1):
        raise BadRequest("n must be 1: Glimpse answers one choice per request")
    options_of_stream = body.get("stream_options")
    if options_of_stream is not None and (not isinstance(options_of_stream, dict)
                                          or set(options_of_stream) - {"include_usage"}):
        raise BadRequest("stream_options takes only include_usage (the final chunk always carries usage)")
    if engine.max_length:  # text that cannot fit the context is refused before it is tokenized
        limit = CHARS_PER_TOKEN_BOUND * engine.max_length
        text = _text_length(body["messages"])
        if text > limit:
            raise BadRequest(f"the messages hold {text:,} characters of text, more than this model's context "
                             f"({engine.max_length:,} tokens) can take")
    messages = []
    for message in body["messages"]:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise BadRequest("every message needs a role: system, user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest("message content must be a string or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image_url", "video_url"):
                spec = part.get(kind)
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str) or not url:
                    raise BadRequest(f"a {kind} part needs a url")
                media = "image" if kind == "image_url" else "video"
                parts.append({"type": media, media: _media_source(url, media, root, scratch, fetcher)})
            else:
                raise BadRequest(f"unsupported content part type {kind!r} (text, image_url, video_url)")
        messages.append({"role": message["role"], "content": parts})

    speed = body.get("speed", 0.0)
    if not _is_number(speed):
        raise BadRequest(f"speed must be a number in [0, 1], got {speed!r}")
    check_speed(speed)
    policy_name = body.get("policy", "auto")
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise BadRequest("params must be an object of parameter overrides")
    try:
        policy = engine.make_policy(str(policy_name), float(speed), params)
    except (UserError, KeyError, TypeError) as error:  # the request's own policy, params or their values
        raise BadRequest(f"policy: {error}") from None
    promise = engine.promise(str(policy_name), float(speed), params)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or min(256, max_new_tokens)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest("max_tokens must be a positive integer")
    if max_tokens > max_new_tokens:
        raise BadRequest(f"max_tokens must be at most {max_new_tokens} on this server (--max-new-tokens)")
    temperature, top_p, seed = body.get("temperature", 0.0), body.get("top_p", 1.0), body.get("seed")
    if temperature is not None and (not _is_number(temperature) or not 0 <= temperature <= 2):
        raise BadRequest(f"temperature must be a number in [0, 2], got {temperature!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise BadRequest(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    options = {"policy": policy, "max_new_tokens": max_tokens, "do_sample": bool(temperature and temperature > 0),
               "temperature": float(temperature or 1.0), "top_p": float(1.0 if top_p is None else top_p),
               "seed": seed}
    return messages, options, float(speed), promise


def _media_source(url: str, kind: str, root: Path | None, scratch: Path, fetcher: "Fetcher"):
    """Bytes (images) or a file path (videos) for a data: / http(s) / local URL."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise BadRequest("data URLs must be base64-encoded")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("the data URL is not valid base64") from None
    elif url.startswith(("http://", "https://")):
        data = fetcher.fetch(url)
    else:
        path = Path(url.removeprefix("file://"))
        if root is None:
            raise BadRequest("local files are not allowed (start the server with --allowed-root DIR)")
        resolved = path.resolve()
        if not resolved.is_relative_to(root):
            raise BadRequest(f"{url}: outside the allowed root")
        if not resolved.is_file():
            raise BadRequest(f"{url}: no such file")
        return str(resolved)
    if kind == "image":
        return data
    target = scratch / f"video-{uuid.uuid4().hex}"
    target.write_bytes(data)
    return str(target)


class Fetcher:
    """Media URLs, fetched with limits: ``MAX_FETCH_BYTES``, ``deadline_s`` for the whole body however slowly
    it drips, redirects followed only on the same host, and no private, loopback, link-local or reserved
    address (the server's own network) unless ``allow_private`` — so a request cannot make the server
    probe its neighbours (server-side request forgery)."""

    def __init__(self, allow_private: bool = False, deadline_s: float = FETCH_DEADLINE_S):
        self.allow_private, self.deadline_s = allow_private, deadline_s

    def fetch(self, url: str) -> bytes:
        import httpx

        deadline = time.monotonic() + self.deadline_s
        host = urlsplit(url).hostname
        try:
            for _ in range(5):  # redirects, on the same host only
                self._check_address(url)
                timeout = httpx.Timeout(min(10.0, self.deadline_s))
                with httpx.stream("GET", url, timeout=timeout, follow_redirects=False) as response:
                    if response.is_redirect:
                        target = urljoin(url, response.headers.get("location", ""))
                        if urlsplit(target).hostname != host:
                            raise BadRequest(f"{url}: redirects to another host ({urlsplit(target).hostname})")
                        url = target
                        continue
                    response.raise_for_status()
                    chunks, size = [], 0
                    for chunk in response.iter_bytes():
                        size += len(chunk)
                        if size > MAX_FETCH_BYTES:
                            raise BadRequest(f"{url}: larger than {MAX_FETCH_BYTES // 2**20} MiB")
                        if time.monotonic() > deadline:
                            raise BadRequest(f"{url}: not fetched within {self.deadline_s:g} s")
                        chunks.append(chunk)
                    return b"".join(chunks)
            raise BadRequest(f"{url}: too many redirects")
        except httpx.HTTPError:
            raise BadRequest(f"{url}: could not be fetched") from None  # no detail: it would map the network

    def _check_address(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadRequest(f"{url}: only http(s) URLs with a host are fetched")
        if self.allow_private:
            return
        try:
            infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        except (socket.gaierror, UnicodeError):
            raise BadRequest(f"{url}: could not be fetched") from None
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if (address.is_private or address.is_loopback or address.is_link_local or address.is_reserved
                    or address.is_multicast or address.is_unspecified):
                raise BadRequest(f"{url}: private, loopback and link-local addresses are not fetched "
                                 "(start the server with --allow-private-urls to allow them)")


def _usage(result) -> dict:
    prompt = sum(result.metrics["prompt_tokens"].values())
    return {"prompt_tokens": prompt, "completion_tokens": result.metrics["new_tokens"],
            "total_tokens": prompt + result.metrics["new_tokens"]}


def _glimpse(result, speed: float, promise: dict) -> dict:
    keys = ("ttft_s", "prefill_s", "decode_tokens_per_s", "prompt_tokens", "kv_bytes", "peak_memory_bytes",
            "prefill_flops", "prefill_flops_baseline")
    return {"policy": result.policy, "speed": speed, "params": result.params, "summary": result.summary,
            "promise": promise, "metrics": {k: result.metrics[k] for k in keys}}


def _completion(result, model_name: str, speed: float, promise: dict) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": result.finish_reason}],
            "usage": _usage(result), "glimpse": _glimpse(result, speed, promise)}


async def _until_disconnected(request: Request, cancel: threading.Event, work):
    """Await ``work`` (an engine call given ``cancel``), setting ``cancel`` if the client disconnects
    first: the engine stops at its next step (or before prefill, if it is still queued) and the model
    is free. Returns the work's result, or None once cancelled."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            cancel.set()
    try:
        result = task.result()
    except Exception:
        if cancel.is_set():  # e.g. cancelled while queued: no answer was made, and nobody is waiting for one
            return None
        raise
    return None if cancel.is_set() else result


class StreamJob:
    """One streamed answer: the engine runs in a worker thread, started at once, that hands chunks to
    the event loop over a queue. ``cancel`` stops it before its next step; when it ends it closes the
    engine's generator (releasing the model), deletes the request's fetched media, and calls ``on_done``
    — whether or not anybody is still reading."""

    def __init__(self, engine, messages, options, scratch, on_done):
        self.loop = asyncio.get_running_loop()
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.engine, self.messages, self.options, self.scratch, self.on_done = engine, messages, options, scratch, on_done
        threading.Thread(target=self._work, name="glimpse-api-stream", daemon=True).start()

    def _hand_over(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def _work(self) -> None:
        stream = self.engine.stream(self.messages, cancel=self.cancel, **self.options)
        try:
            for chunk in stream:
                self._hand_over(("chunk", chunk))
        except BaseException as error:  # reported to the client by the event loop's side
            self._hand_over(("error", error))
        finally:
            stream.close()  # releases the model if the loop above stopped early
            self.scratch.cleanup()  # only now: the engine may still have been reading a fetched video
            self.on_done()
            self._hand_over(("end", None))


async def _stream(job: StreamJob, speed, promise, model_name, counters):
    """Server-sent events: a role chunk, content chunks as tokens come, a final chunk with usage. When
    the client disconnects, the server stops iterating this generator, whose ``finally`` cancels the
    job: the engine stops before its next step and releases the model."""
    ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def event(delta: dict, finish=None, **extra) -> str:
        chunk = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    finished = False
    try:
        yield event({"role": "assistant", "content": ""})
        while True:
            kind, item = await job.chunks.get()
            if kind == "end":
                finished = True
                break
            if kind == "error":
                if isinstance(item, UserError):
                    counters.record("bad_request")
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'invalid_request_error'}})}\n\n"
                else:
                    counters.record("error")
                    message = f"{type(item).__name__}: {item}"
                    yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                continue
            if item.text:
                yield event({"content": item.text})
            if item.result is not None:
                counters.record("ok", item.result)
                yield event({}, item.result.finish_reason, usage=_usage(item.result),
                            glimpse=_glimpse(item.result, speed, promise))
        yield "data: [DONE]\n\n"
    finally:
        if not finished and not job.cancel.is_set():
            job.cancel.set()  # the client left mid-answer (or the server stopped): free the model
            counters.record("cancelled")
