"""Clients that hold a connection open without finishing a request (slowloris), or send more than a request needs.

uvicorn closes an idle keep-alive connection a few seconds after a response, but a connection that never
completes its request head — opened and left silent, or fed one header byte at a time — stays open for as
long as the client likes: each costs a file descriptor and a little memory, and enough of them leave no
descriptor for real clients. ``RequestHeadDeadline`` is uvicorn's own HTTP/1.1 protocol with one rule added,
nginx's ``client_header_timeout``: the request line and headers must all arrive within ``head_timeout_s`` of
the connection opening (or of its previous response ending), else the connection is closed. ``glimpse serve``
runs uvicorn with it (``uvicorn.Config(http=RequestHeadDeadline)``, uvicorn's extension point for the protocol
class).

Past the head, ``BodyLimits`` (ASGI middleware, which ``api.create_api`` installs, so that it covers the API and
the chat mounted beside it) bounds every request body but an upload's: at most ``MAX_BODY_BYTES`` (413; the
chat's JSON routes ``MAX_CHAT_BODY_BYTES``), all
arrived within ``BODY_TIMEOUT_S`` (408), and large ones ``MAX_BODIES_BYTES`` of room all together (a body finding
none waits for it, its client's sending held up, within its time). Without it a client could send the chat's JSON
routes a body of any size, read whole into memory, trickle one in for ever, or send the API so many large bodies at
once that the server ran out of memory. Uploads have their own size bounds (``--max-upload-mb``, the upload quota
in ``glimpse.uploads``) and may take long on a slow link: ``BODY_TIMEOUT_S`` plus what has arrived of them at
``UPLOAD_MIN_BYTES_PER_S`` (a 200 MB video sent at that rate or faster is taken whole, however long it takes; one
that falls silent, or announced 10 GB and sends a byte now and then, is refused a little after two minutes).
Past the body, a response its client does not read (``SEND_TIMEOUT_S``, ``RequestHeadDeadline``) closes its
connection.
And what a request makes the server log is bounded too (``CappedWrites``, its standard error under ``glimpse serve``).
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import struct
import time
from typing import Callable

import h11
from starlette.requests import ClientDisconnect
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 30.0  # nginx's client_header_timeout is 60 s; a real client sends its head in milliseconds
MAX_BODY_BYTES = 64 * 2**20  # a request body larger than this (an API request's data URLs included) gets 413
# The chat's JSON routes (everything but the API under /v1/, and uploads): a question and its conversation, its files
# sent by upload. Gradio keeps the last body of each of up to ``CHAT_SESSIONS`` browser sessions in memory (its
# session state), so their size bounds what clients can make the server hold: 20 MB bodies sent under made-up
# sessions held 20 MiB each, for good (an outside pass). 2 MiB is some 500,000 tokens of text, more than any
# supported model's context.
MAX_CHAT_BODY_BYTES = 2 * 2**20
CHAT_SESSIONS = 1000  # browser sessions whose state Gradio keeps (its default: 10,000), the least recently used dropped
# Room for the large bodies of all the requests under way together (not uploads'). Twenty 60 MB bodies at once took
# the server from 1.9 to 6.4 GB (the body, its JSON parsed, the data URLs decoded: copies of each, up to ~300 MB per
# request), so a client sending a hundred could have it killed for memory (found here, 2026-12-06). Four of the
# largest size fit at once: more would not parse faster on a few cores, and a question's pictures are rarely megabytes.
MAX_BODIES_BYTES = 4 * MAX_BODY_BYTES
# A body takes room only once this much of it has arrived: a question in words, or media sent as URLs, never waits,
# and a client that announces a large body and sends nothing holds no room.
SMALL_BODY_BYTES = 256 * 2**10
# The scope key of a function the application calls once what it made of the body no longer needs its room (the API,
# once the prompt is built); otherwise the room is given back when the response has been sent.
BODY_DONE = "glimpse.body_done"
BODY_TIMEOUT_S = 120.0  # a body that has not all arrived by then (a client trickling it in) gets 408; 64 MiB at
# 4.5 Mbit/s
# A body that holds room and from which nothing has arrived for this long gives the room up, with a 408, when other
# bodies wait for room: four clients that announced 64 MiB, sent 256 KiB and fell silent held all the room for their
# 120 s, a picture sent by anyone else waiting that long (found here, 2026-12-06). Why silence, and why this long: sixty
# 60 MB bodies sent at once from one process on the same two cores as the server (its client starved of CPU by the
# server's parsing, silent for 5.5 s once the sockets' buffers, 4 MB, were read) lost four bodies at 5 s in each of
# four runs, and two in one of two runs to a rule "would not be in by its deadline at the rate it has arrived"; none
# in 120 at 20 s. A rate seen from the server is the server's and the client's machine's as much as the network's.
ROOM_IDLE_S = 20.0
ROOM_POLL_S = 0.5  # how often a silent body holding room looks again whether others wait for it
# An upload gets BODY_TIMEOUT_S plus what has arrived of it at this rate: it must keep arriving at 32 KiB/s on average
# once its first two minutes are over. Its time was its Content-Length at this rate, announced and never sent: a
# client announcing 10 GB and sending nothing held its connection (and a file descriptor) for 3.5 days (an outside
# pass, 2026-12-07); ten thousand such, every descriptor the server had.
UPLOAD_MIN_BYTES_PER_S = 32 * 2**10
# A response its client does not read: once the connection's send buffer is full (the transport pauses writing),
# the client has this long to read some of it, else the connection is closed (nginx's send_timeout: 60 s). Without
# it, a client that asked for a 30 MB upload back over 2,000 connections and never read held 4,000 descriptors (the
# socket and the open file) and 750 MB of the kernel's socket memory for as long as it liked (an outside pass).
SEND_TIMEOUT_S = 60.0
# The kernel's send buffer of each connection (Linux doubles it: 1 MiB). Whether a client reads shows only when the
# kernel takes more of the response from the server, which it does once a third of its buffer is free: with the
# buffer Linux tunes itself (4 MiB here), that was 1.4 MB at a time, and a client reading 16 kB/s, steadily, was cut
# off as one that did not read (an outside pass). With 1 MiB a client must read some 350 KB a minute; the buffer still
# carries 10 MB/s at 100 ms of round trip, and a client that stops reading holds that much of the kernel's memory.
SEND_BUFFER_BYTES = 512 * 2**10
LOW_OPEN_FILE_LIMIT = 4096  # below this many open files, glimpse serve says so as it starts
MAX_LOG_WRITE = 16 * 2**10  # characters: one write to the server's log longer than this is cut in its middle


class CappedWrites(io.TextIOBase):
    """The server's standard error, where any one write longer than ``limit`` characters is cut in its middle,
    saying how much was left out. Why: libraries log what a client sent. The chat's routes take files as paths, and
    Gradio prints the traceback of a refused one with the path in it: a client sending a 30 MB path wrote 30 MB to the
    server's log, a request at a time, until the disk (or Docker's log) was full (found from outside). Bounded here,
    for whatever library logs it, a request's traceback stays a few kilobytes, its beginning and end both shown."""

    def __init__(self, stream, limit: int = MAX_LOG_WRITE):
        self.stream, self.limit = stream, limit

    def write(self, text: str) -> int:
        given = len(text)
        if given > self.limit:
            keep = self.limit // 2
            text = f"{text[:keep]} [... {given - 2 * keep:,} characters left out ...] {text[-keep:]}"
        self.stream.write(text)
        return given

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:
        return self.stream.encoding


def raise_open_file_limit(log: Callable[[str], None]) -> None:
    """Raise this process's soft limit on open files to its hard limit, as Go's runtime does at every start, and
    ``log`` a warning if it is still under ``LOW_OPEN_FILE_LIMIT``. Each connection holds a file descriptor, and
    the soft limit is often 1,024 (a login shell's, and a container's under Docker 25 and later, whose hard limit
    is 524,288): a client holding 1,024 connections open — idle ones are closed only at the head deadline, 30 s —
    left none for anyone else until then, and a client reconnecting as they close kept everyone out for as long
    as it liked (found here: 400 idle connections against a soft limit of 256 made /health time out for 30 s).
    The soft limit is there for programs that still wait on descriptors with select(), which takes none above
    1,024; the server waits with epoll, and nothing in the serving process uses select()."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 2**20  # Linux's default ceiling, fs.nr_open
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a ceiling below the hard limit (fs.nr_open): keep the soft limit
            pass
    if soft != resource.RLIM_INFINITY and soft < LOW_OPEN_FILE_LIMIT:
        log(f"warning: this process may open only {soft} files, so at most about {soft} connections at once; "
            "raise the hard limit (ulimit -Hn, or docker run --ulimit nofile=65536)")


class ClosingServer(uvicorn.Server):
    """uvicorn's server, which ``close_connections`` tells, from any thread, to close every connection still open.

    Why: once a stopping server's answers have ended, what is still open is a chat tab's event stream, which Gradio
    keeps open for as long as the tab. uvicorn's shutdown waits for every connection, so it waited for those until
    its timeout and then cancelled them with a traceback each (10-12 s with one tab open: past ``docker stop``'s
    SIGKILL). Closed, the stream sees its client leave and ends as for any client that leaves."""

    loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def close_connections(self) -> None:
        def close() -> None:
            for connection in list(self.server_state.connections):
                connection.transport.close()

        try:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(close)
        except RuntimeError:  # the loop has closed meanwhile: so have its connections
            pass


class RequestHeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11, which uvicorn brings), closing a connection whose request head has not
    all arrived ``head_timeout_s`` after the connection opened or its last response ended — and one whose request
    was answered before its body was all in (a 401, a 415, a refusal) that has not sent the rest of that body by
    then: uvicorn reads and drops such a body, and any byte of it cancelled its keep-alive timer for good, so a
    chunk now and then (or one chunk, then silence) held the connection for ever, past every other deadline
    (found from outside: 4,233 connections held silent after 200 s). And, nginx's ``send_timeout``, closing one whose
    client reads none of its response for ``send_timeout_s`` once the send buffer is full: a response is written
    only as fast as its client reads it, and uvicorn waits for that without end."""

    head_timeout_s = HEAD_TIMEOUT_S
    send_timeout_s = SEND_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._set_socket_option(socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm()

    def _set_socket_option(self, option: int, value) -> None:
        sock = self.transport.get_extra_info("socket")
        try:
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, option, value)
        except OSError:  # (not a TCP socket: a Unix one, as a test may use)
            pass

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # The head is in (or the connection failed): no deadline while the application has the request; once it
        # has answered, what is left of the body is dropped, and the deadline set then stays.
        if self.conn.their_state is not h11.IDLE and not self._answered_early():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.conn.their_state is h11.IDLE or self._answered_early()):
            self._arm()  # the next request's head, or the rest of a body answered already

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        # The transport holds more than its high-water mark (64 KiB) unsent. (A response written at once, uvicorn's
        # way, stays paused until nearly all of it is sent, however fast its client reads: what is watched is
        # whether the client reads, not the pause.)
        super().pause_writing()
        self._stop_send_timer()
        self._watch_sending(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()

    def _watch_sending(self, unsent: int) -> None:
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._check_sending, unsent)

    def _check_sending(self, unsent_before: int) -> None:
        self._send_timer = None
        if (unsent := self.transport.get_write_buffer_size()) < unsent_before:  # it read some: a slow client is
            self._watch_sending(unsent)  # never cut off while it keeps reading
        elif unsent:
            # Aborted, not closed: ``close`` would wait to send what is buffered, which the client does not read.
            # The application's pending ``send`` then sees a client that left. And reset (SO_LINGER 0): closed
            # plainly, the socket stayed in the kernel with its megabytes unsent for minutes (an outside pass).
            self._set_socket_option(socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _answered_early(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and (self.conn.their_state is h11.IDLE or self._answered_early()):
            self.transport.close()


class AbsoluteFormTargets:
    """ASGI middleware: a request whose target is a whole URL (``GET http://host/v1/models HTTP/1.1``, the absolute
    form a client sends through a forward proxy, which RFC 9112 (3.2.2) has servers accept) is routed by its path:
    uvicorn hands the whole URL over as the path, which no route matched (a 404 not in the API's shape)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"][:8].lower().startswith(("http://", "https://")):
            from urllib.parse import urlsplit

            raw = scope.get("raw_path") or scope["path"].encode()
            scope = {**scope, "path": urlsplit(scope["path"]).path or "/",
                     "raw_path": urlsplit(raw.decode("latin-1")).path.encode("latin-1") or b"/"}
        await self.app(scope, receive, send)


class StreamsUnbuffered:
    """ASGI middleware: an event stream (the API's streamed answers, the chat's queue) is marked for proxies to pass
    on as it comes: ``X-Accel-Buffering: no`` (nginx, which buffers responses by default) and ``Cache-Control:
    no-cache``. Behind nginx as tutorials set it up, a streamed answer arrived in two bursts, or over TLS all at once
    at its end, in the chat too (an outside pass, 2026-12-07); docs/serving.md has the proxy's settings."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, with_headers(send, self.unbuffered) if scope["type"] == "http" else send)

    @staticmethod
    def unbuffered(headers: list) -> list:
        """The headers an event stream's head gets (none for another response)."""
        names = {name.lower() for name, _ in headers}
        content_type = next((value for name, value in headers if name.lower() == b"content-type"), b"")
        if content_type.split(b";")[0].strip().lower() != b"text/event-stream":
            return []
        cache = [] if b"cache-control" in names else [(b"cache-control", b"no-cache")]
        return [(b"x-accel-buffering", b"no"), *cache]


class BodyLimits:
    """ASGI middleware: a request body (but an upload's, a POST to a path ending in ``/upload``) larger than
    ``MAX_BODY_BYTES`` (the API's, under /v1/; the chat's routes ``MAX_CHAT_BODY_BYTES``) is refused with 413 —
    from its Content-Length before it is read, or as soon as a body sent without one passes the cap — and one not
    all arrived ``BODY_TIMEOUT_S`` after the request began gets 408 (an upload: ``BODY_TIMEOUT_S`` plus what has
    arrived of it at ``UPLOAD_MIN_BYTES_PER_S``).
    Once ``SMALL_BODY_BYTES`` of a body have arrived it takes room for all of it (its Content-Length, or
    ``MAX_BODY_BYTES`` when it has none) out of ``MAX_BODIES_BYTES``, waiting for the room within its
    ``BODY_TIMEOUT_S`` (the application reads no more of it meanwhile, so neither does the server from its
    connection), and gives it back when the application calls ``scope[BODY_DONE]()`` or the response has been sent. A
    burst of large bodies is so received a few at a time, each answered whole. (A 503 would have reached few of their
    clients: closing a connection whose body is unread resets it. Room taken as bytes arrive instead deadlocked: twenty
    bodies half arrived filled it, and all waited for one another until their 408.) A body holding room from which
    nothing has arrived for ``ROOM_IDLE_S`` gets a 408 as soon as another body waits for room: a client that stops
    sending holds room only while nobody needs it. Small bodies never wait, and a request the application refuses
    before reading its body (a 401) takes none. The application then sees the client as gone (``http.disconnect``)
    and whatever it answers is replaced by the refusal. ``on_refused(path)`` is told of each refusal (the API counts
    its own in /metrics)."""

    def __init__(self, app, on_refused: Callable[[str], None] = lambda path: None):
        self.app, self.on_refused = app, on_refused
        self.bodies_bytes = 0  # the room the large bodies under way hold (only the event loop changes it)
        self.freed: asyncio.Event | None = None  # set when room is given back (made in the event loop, as needed)
        self.waiting = 0  # bodies waiting for room now

    async def _take_room(self, size: int, deadline: float) -> bool:
        """Take ``size`` bytes of room, waiting for it until ``deadline`` at the latest (then False)."""
        while self.bodies_bytes + size > MAX_BODIES_BYTES:
            self.freed = self.freed or asyncio.Event()
            self.waiting += 1
            try:
                await asyncio.wait_for(self.freed.wait(), timeout=max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                return False
            finally:
                self.waiting -= 1
        self.bodies_bytes += size
        return True

    def _give_room(self, size: int) -> None:
        self.bodies_bytes -= size
        freed, self.freed = self.freed, None
        if freed is not None:
            freed.set()  # every waiter looks again

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length and b"transfer-encoding" in headers:
            # Framed two ways: a proxy in front that reads the other one sees a second request in this body. RFC
            # 9112 (6.3) has the server close the connection after its answer, so nothing after it is read.
            send = _closing(send)
        # An upload has no cap here (the upload quota's), and its time grows with what arrives of it (below).
        upload = scope["path"].rstrip("/").endswith("/upload")
        cap = None if upload else MAX_BODY_BYTES if scope["path"].startswith("/v1/") else MAX_CHAT_BODY_BYTES
        if cap is not None and length.isdigit() and int(length) > cap:
            return await self._refuse(scope, send, 413, cap=cap)
        began = time.monotonic()
        deadline = began + BODY_TIMEOUT_S  # None once the body is in
        refusal: int | None = None
        refusal_message: str | None = None  # why, where not the deadline
        received, room, started = 0, None, False  # room: what this body holds of MAX_BODIES_BYTES (None: none yet)
        last_arrival = 0.0  # when the last of it arrived (or it took its room, if later)

        def body_done() -> None:
            nonlocal room
            if room:
                self._give_room(room)
            room = 0  # taken once, given back once

        async def limited_receive():
            nonlocal refusal, refusal_message, received, room, deadline, last_arrival
            if refusal is not None:
                return {"type": "http.disconnect"}
            if deadline is None:  # the body is in: what the application waits for now is the client leaving
                return await receive()
            if cap is not None and room is None and received >= SMALL_BODY_BYTES:
                size = int(length) if length.isdigit() else cap
                if not await self._take_room(size, deadline):  # meanwhile no more of it is read
                    refusal = 408
                    return {"type": "http.disconnect"}
                room, last_arrival = size, time.monotonic()
            while True:
                now = time.monotonic()
                wait_s = deadline - now
                if room:  # holding room: silent from ``idle_at`` on
                    idle_at = last_arrival + ROOM_IDLE_S
                    wait_s = min(wait_s, max(idle_at - now, ROOM_POLL_S))
                try:
                    message = await asyncio.wait_for(receive(), timeout=max(wait_s, 0.0))
                    break
                except asyncio.TimeoutError:
                    now = time.monotonic()
                    if now >= deadline:
                        refusal = 408
                        if upload:
                            refusal_message = (f"the upload did not keep arriving at {UPLOAD_MIN_BYTES_PER_S:,} bytes "
                                               f"a second or more once its first {BODY_TIMEOUT_S:.0f} s were over")
                        return {"type": "http.disconnect"}
                    if room and now >= idle_at and self.waiting:  # its 408 now, and the room to those waiting
                        refusal, refusal_message = 408, (
                            f"nothing of the request body arrived for {ROOM_IDLE_S:.0f} s while other requests were "
                            "waiting for the room it held")
                        return {"type": "http.disconnect"}
                    # silent, but nobody needs its room (yet): it may take its time until its deadline
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                last_arrival = time.monotonic()
                if cap is not None and received > cap:
                    refusal = 413
                    return {"type": "http.disconnect"}
                if not message.get("more_body", False):
                    deadline = None
                elif upload:  # (not by its Content-Length: announced, never sent, it held the connection for days)
                    deadline = began + BODY_TIMEOUT_S + received / UPLOAD_MIN_BYTES_PER_S
            return message

        async def watched_send(message):
            nonlocal started
            if refusal is not None:
                return  # the application's answer to a client it was told is gone
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app({**scope, BODY_DONE: body_done}, limited_receive, watched_send)
        except ClientDisconnect:
            if refusal is None:
                return  # the client left while sending its body: nobody to answer, nothing to log
        except Exception:
            if refusal is None:
                raise  # not ours: reading a refused body raises in the application (Starlette's ClientDisconnect)
        finally:
            body_done()
        if refusal is not None and not started:
            await self._refuse(scope, send, refusal, refusal_message, cap)

    async def _refuse(self, scope, send, status: int, message: str | None = None, cap: int | None = None) -> None:
        self.on_refused(scope["path"])
        cap = cap or MAX_BODY_BYTES
        size = f"{cap / 2**20:g} MiB" if cap >= 2**20 else f"{cap / 2**10:g} KiB"
        message = message or (f"the request body is larger than {size}" if status == 413
                              else f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")
        await refuse(send, status, message, headers=((b"connection", b"close"),))


# The refusals' ``code``: a string, as the API's errors have (typed clients parse a number there as an error).
REFUSAL_CODES = {403: "forbidden", 408: "request_timeout", 411: "length_required", 413: "request_too_large",
                 507: "insufficient_storage"}


def with_headers(send, added: Callable[[list], list]):
    """``send`` with ``added(headers)`` appended to the response head's headers (the middlewares' edits of a head)."""
    async def sending(message):
        if message["type"] == "http.response.start":
            headers = message.get("headers", [])
            message = {**message, "headers": [*headers, *added(headers)]}
        await send(message)
    return sending


def _closing(send):
    """``send`` with ``Connection: close`` added to the response head (uvicorn then closes after the response)."""
    return with_headers(send, lambda _: [(b"connection", b"close")])


def error_content(message: str, code: str | None, kind: str = "invalid_request_error",
                  param: str | None = None) -> dict:
    """An error in the API's shape (OpenAI's: `code` a string or null, `param` the field at fault or null; typed
    clients parse them so), for the API's routes and for what answers without them."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def refuse(send, status: int, message: str, headers: tuple = ()) -> None:
    """An ASGI error response in the API's shape, sent without the application (the middlewares' refusals)."""
    body = json.dumps(error_content(message, REFUSAL_CODES.get(status))).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
