"""A corpus of malformed and hostile requests against a running `glimpse serve`: each is sent, its status and the
start of its answer printed, and at the end the count of 2xx, 4xx and 5xx answers and whether the server still
answers /health. Nothing here should be a 5xx. The 2xx are odd but valid requests: a system or assistant message
last (OpenAI answers those too), a bare string as `image_url`, a data URL whose declared type is wrong (the bytes
are read for what they are), a negative seed, an empty or long stop string, a NUL in the text, any `model` name
(the server has one), `user`, `max_completion_tokens`, a still image sent as a video (a one-frame clip), the
picture under --allowed-root, a temperature of 1e-40 (sampled as greedy), an image's detail "high", a data URL's
scheme in capitals, and HEAD on /health, /metrics and /v1/models. The CORS preflight is a 405 (before
2026-11-27 a 200 without Access-Control-Allow-Origin): either way a browser does not send the request. The chat's routes are also sent files named
by server path, which must be refused ("chat by path refused").

    glimpse serve --port 7861 --allowed-root /tmp/glimpse-allowed &
    python benchmarks/hostile_api.py --url http://127.0.0.1:7861 --allowed-root /tmp/glimpse-allowed

``--allowed-root`` must be the server's: the script puts a picture, a symlink out of it, a symlink to a picture
outside it, and the hostile and odd media of ``media_corpus`` there.

``--disconnects S`` then runs 16 clients for S seconds that mostly give up: streams dropped after 0, 1, 2 or 5
events, whole answers abandoned after 0.05 or 0.3 s (a fifth of each run to the end); it prints what they got,
then the server's running and waiting requests and KV once it settles (all should be 0: nothing leaked).

``--large-bodies N`` then has N clients send 60 MiB data URLs at once, and asks a text question every second
meanwhile: how long the refusals and the questions took (2026-12-05: decoding a data URL's base64 took 1.8 s of a core
per 60 MB, and 16 such requests took 46 s to refuse).

``--stalled-bodies N`` then has N clients announce 64 MiB bodies, send 300 KB of each and fall silent, and asks a
question with a 2.7 MB data URL: how long it waited for the room the silent ones hold, and what they were answered
(before 2026-12-06 four held all the room for their 120 s; now a body silent for ``ROOM_IDLE_S``, 20 s, while another
waits for room is refused).

``--slow-clients N`` then opens N connections that send nothing and N that send a request head a line at a time
without ever ending it (slowloris), checks that the server answers others meanwhile, and after the server's
head deadline (``glimpse.connections.HEAD_TIMEOUT_S``, 30 s) counts how many of them it closed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from flags import check_flags

ASSETS = Path(__file__).resolve().parents[1] / "assets"
ONE_PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


def corpus(ROOT: str, PORT: str) -> tuple[dict, dict]:  # noqa: N803 — spelled as they read in the URLs below
    png = base64.b64encode((ASSETS / "sample.png").read_bytes()).decode()

    def msg(content):
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}

    def img(url):
        return msg([{"type": "text", "text": "colour?"}, {"type": "image_url", "image_url": {"url": url}}])

    cases = {
        "messages dict": {"messages": {"role": "user", "content": "hi"}},
        "messages empty": {"messages": []},
        "content number": msg(5),
        "content null": msg(None),
        "role tool": {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
        "role missing": {"messages": [{"content": "x"}]},
        "only system": {"messages": [{"role": "system", "content": "x"}]},
        "last is assistant": {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "max_tokens": 3},
        "part type unknown": msg([{"type": "audio", "audio": "x"}]),
        "part text missing": msg([{"type": "text"}]),
        "image_url string": msg([{"type": "image_url", "image_url": "data:image/png;base64," + png}]),
        "data url not base64": img("data:image/png;base64,@@@@"),
        "data url whitespace": img("data:image/png;base64," + png[:100] + "\n" + png[100:]),
        "data url wrong mime": img("data:text/html;base64," + png),
        "data url no comma": img("data:image/png;base64"),
        "data url gif1x1": img("data:image/gif;base64,R0lGODlhAQABAAAAACw="),
        "file passwd": img("file:///etc/passwd"),
        "file localhost": img("file://localhost/etc/passwd"),
        "proc environ": img("/proc/self/environ"),
        "traversal": img(ROOT + "/../../../etc/passwd"),
        "encoded traversal": img("file://" + ROOT + "/%2e%2e/%2e%2e/etc/passwd"),
        "symlink out": img(ROOT + "/link.png"),
        "symlink to outside picture": img(ROOT + "/good_link.png"),
        "allowed ok": img(ROOT + "/sample.png"),
        "dir": img(ROOT + "/"),
        "0.0.0.0": img("http://0.0.0.0:" + PORT + "/health"),
        "::1": img("http://[::1]:" + PORT + "/health"),
        "hex ip": img("http://0x7f000001:" + PORT + "/health"),
        "int ip": img("http://2130706433:" + PORT + "/health"),
        "127.1": img("http://127.1:" + PORT + "/health"),
        "v4mapped": img("http://[::ffff:127.0.0.1]:" + PORT + "/health"),
        "localhost.": img("http://localhost.:" + PORT + "/health"),
        "userinfo": img("http://user:pw@127.0.0.1:" + PORT + "/health"),
        "gopher": img("gopher://127.0.0.1:" + PORT + "/"),
        "ftp": img("ftp://example.com/x.png"),
        "upper scheme": img("HTTP://127.0.0.1:" + PORT + "/health"),
        "metadata": img("http://169.254.169.254/latest/meta-data/"),
        "speed NaN": {**msg("hi"), "speed": float("nan")},
        "speed inf": {**msg("hi"), "speed": float("inf")},
        "speed -1": {**msg("hi"), "speed": -1},
        "speed 2": {**msg("hi"), "speed": 2},
        "max_tokens 0": {**msg("hi"), "max_tokens": 0},
        "max_tokens -1": {**msg("hi"), "max_tokens": -1},
        "max_tokens 2^63": {**msg("hi"), "max_tokens": 2**63},
        "max_tokens 1.0": {**msg("hi"), "max_tokens": 1.0},
        "temperature nan": {**msg("hi"), "temperature": float("nan")},
        "temperature inf": {**msg("hi"), "temperature": float("inf")},
        "temperature -1": {**msg("hi"), "temperature": -1},
        "temperature 1e308": {**msg("hi"), "temperature": 1e308},
        "top_p 0": {**msg("hi"), "temperature": 1, "top_p": 0},
        "top_p 2": {**msg("hi"), "temperature": 1, "top_p": 2},
        "top_p nan": {**msg("hi"), "temperature": 1, "top_p": float("nan")},
        "seed neg": {**msg("hi"), "temperature": 1, "seed": -5},
        "seed 2^70": {**msg("hi"), "temperature": 1, "seed": 2**70},
        "stop empty": {**msg("hi"), "stop": [""]},
        "stop 5": {**msg("hi"), "stop": ["a","b","c","d","e"]},
        "stop long": {**msg("hi"), "stop": ["x"*10000]},
        "stop number": {**msg("hi"), "stop": 5},
        "params huge": {**msg("hi"), "policy": "dash", "speed": 0.5, "params": {"rho": 1e308}},
        "params nan": {**msg("hi"), "policy": "dash", "speed": 0.5, "params": {"rho": float("nan")}},
        # 2026-11-26: ST3's range check let NaN through, and its decode step then ended the server.
        "params nan st3": {**msg("hi"), "policy": "st3", "speed": 0.5, "params": {"first_drop": float("nan")}},
        "params nan st3 tau": {**msg("hi"), "policy": "st3", "speed": 0.5, "params": {"anneal_tau": float("nan")}},
        "params inf lazyllm": {**msg("hi"), "policy": "lazyllm", "params": {"percentiles": [float("inf")] * 3}},
        "params nested": {**msg("hi"), "policy": "dash", "params": {"rho": {"a": 1}}},
        "params unknown member": {**msg("hi"), "policy": "auto", "params": {"nosuch.x": 1}},
        "params list": {**msg("hi"), "policy": "dash", "params": [1, 2]},
        "policy path": {**msg("hi"), "policy": "../../etc"},
        "policy space": {**msg("hi"), "policy": "auto "},
        "policy int": {**msg("hi"), "policy": 3},
        "NUL text": msg("hi\u0000there"),
        "stream_options no stream": {**msg("hi"), "stream_options": {"include_usage": True}},
        "stream string": {**msg("hi"), "stream": "yes"},
        "model other": {**msg("hi"), "model": "gpt-4"},
        "n 2": {**msg("hi"), "n": 2},
        "n 0": {**msg("hi"), "n": 0},
        "many messages": {"messages": [{"role": "user", "content": ""}] * 100000, "max_tokens": 2},
        "user field": {**msg("hi"), "user": "bob"},
        "max_completion_tokens": {"messages": msg("hi")["messages"], "max_completion_tokens": 3},
        # 2026-11-27, from an outside pass: each a 500, a stall or a silent 200 before.
        "max and max_completion disagree": {**msg("hi"), "max_tokens": 300, "max_completion_tokens": 2},
        "temperature 1e-40": {**msg("hi"), "temperature": 1e-40},
        "message tool_calls": {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "1"}]}]},
        "message unknown key": {"messages": [{"role": "user", "content": "hi", "foo": "bar"}]},
        "part cache_control": msg([{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]),
        "detail low": msg([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png, "detail": "low"}}]),
        "detail high": msg([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png, "detail": "high"}}]),
        "content empty list": msg([]),
        "DATA: upper case": img("DATA:image/png;base64," + png),
        "path NUL": img(f"{ROOT}/sample.png\u0000"),
        "path 1.6 MB of /x": img("/x" * 800_000),
        "path name too long": img(f"{ROOT}/{'n' * 300}.png"),
        "video as image": img("data:video/mp4;base64," + base64.b64encode((ASSETS / "sample.mp4").read_bytes()).decode()),
        "image as video": msg([{"type": "video_url", "video_url": {"url": "data:image/png;base64," + png}}]),
        # 2026-12-05: a million parts fit the per-message and per-request limits; 250,000 took 12 s to refuse.
        "250,000 tiny data URLs": {"messages": [msg([{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + ONE_PIXEL_PNG}}] * 500)["messages"][0]] * 500, "max_tokens": 2},
        "data URL non-ASCII": img("data:image/png;base64," + png[:40] + "\u00e9" + png[40:]),
    }
    raw = {
        "not json": (b"{not json", "application/json"),
        "json array": (b"[1,2]", "application/json"),
        "json string": (b'"hi"', "application/json"),
        "deep array": (b"[" * 50000 + b"]" * 50000, "application/json"),
        "latin1": ('{"messages":[{"role":"user","content":"caf\xe9"}],"max_tokens":2}'.encode("latin-1"), "application/json; charset=latin-1"),
        "bad utf8": (b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', "application/json"),
        "dup keys": (b'{"messages":[{"role":"user","content":"a"}],"max_tokens":2,"max_tokens":99999999}', "application/json"),
        "empty body": (b"", "application/json"),
        "text/plain": (json.dumps(msg("hi")).encode(), "text/plain"),
        "no ctype": (json.dumps(msg("hi")).encode(), None),
        "xml ctype": (json.dumps(msg("hi")).encode(), "application/xml"),
        "lone surrogate escaped": (b'{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}', "application/json"),
        "NaN literal": (b'{"messages":[{"role":"user","content":"a"}],"speed":NaN}', "application/json"),
        "huge int literal": (b'{"messages":[{"role":"user","content":"a"}],"max_tokens":' + b"9"*5000 + b"}", "application/json"),
    }
    return cases, raw


def media_corpus(root: Path) -> dict:
    """Hostile and odd media written under ``root``, each sent by path (and the still images also as data URLs):
    decompression bombs (a header claiming 60,000 x 60,000 pixels; a real 20,000 x 20,000 one-bit PNG; an MP4 of
    8192 x 8192 frames that compress to almost nothing), truncated
    JPEG/PNG/MP4, an MP4 of 64 bytes and one of random bytes behind a valid `ftyp`, an audio-only MP4, a video as
    an image (also misnamed .png), SVG, PDF and EPS named .png, an XBM, empty and one-byte files — all 4xx — and the odd but
    valid: an animated GIF of 500 frames and an animated WebP (their first frame), 1 x 20,000 and 20,000 x 1
    pictures, CMYK, 16-bit grey, grey with alpha, palette, BMP, TIFF, ICO, a 4 x 4 video and a one-frame video."""
    import io
    import struct
    import zlib

    import av
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    files: dict[str, bytes] = {}

    def png_claiming(width: int, height: int) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 10))
                + chunk(b"IEND", b""))

    def encoded(image: Image.Image, fmt: str, **options) -> bytes:
        out = io.BytesIO()
        image.save(out, fmt, **options)
        return out.getvalue()

    def video(width: int, height: int, frames: int, still: bool = False) -> bytes:
        out = io.BytesIO()
        with av.open(out, "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=10)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"preset": "ultrafast"}
            for _ in range(frames):
                pixels = (np.zeros((height, width, 3), dtype=np.uint8) if still  # compresses to almost nothing
                          else rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
                frame = av.VideoFrame.from_ndarray(pixels, "rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        return out.getvalue()

    picture = Image.open(ASSETS / "sample.png").convert("RGB")
    noise = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(500)]
    clip = (ASSETS / "sample.mp4").read_bytes()
    audio = io.BytesIO()
    with av.open(audio, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=44100)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 44100
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    files.update({
        "bomb_header.png": png_claiming(60000, 60000),
        "bomb_real.png": encoded(Image.new("1", (20000, 20000)), "PNG", optimize=True),
        "truncated.jpg": encoded(picture, "JPEG")[:1500],
        "truncated.png": encoded(picture, "PNG")[:2000],
        "svg.png": b'<svg xmlns="http://www.w3.org/2000/svg" width="100000" height="100000"></svg>',
        "pdf.png": b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF",
        # PostScript, which PIL hands to Ghostscript when installed, and a format PIL reads from plain text
        "eps.png": encoded(picture, "EPS"), "text.xbm": encoded(picture.convert("1"), "XBM"),
        "empty.png": b"",
        "one_byte.png": b"\x89",
        "video_named.png": clip,
        "many_frames.gif": encoded(noise[0], "GIF", save_all=True, append_images=noise[1:], duration=10),
        "animated.webp": encoded(noise[0], "WEBP", save_all=True, append_images=noise[1:50]),
        "thin.png": encoded(Image.new("RGB", (1, 20000), "red"), "PNG"),
        "wide.png": encoded(Image.new("RGB", (20000, 1), "red"), "PNG"),
        "cmyk.jpg": encoded(picture.convert("CMYK"), "JPEG"),
        "grey16.png": encoded(Image.fromarray(rng.integers(0, 65535, (64, 64), dtype=np.uint16)), "PNG"),
        "grey_alpha.png": encoded(picture.convert("LA"), "PNG"),
        "palette.gif": encoded(picture.convert("P"), "GIF"),
        "picture.bmp": encoded(picture, "BMP"), "picture.tiff": encoded(picture, "TIFF"),
        "picture.ico": encoded(picture, "ICO"),
        "truncated.mp4": clip[: len(clip) // 3], "head.mp4": clip[:64],
        "garbage.mp4": b"\x00\x00\x00\x18ftypmp42" + rng.bytes(5000), "audio_only.mp4": audio.getvalue(),
        "tiny.mp4": video(4, 4, 20), "one_frame.mp4": video(320, 240, 1), "clip.mp4": clip,
        "huge_frames.mp4": video(8192, 8192, 2, still=True),  # 200 KB declaring 200 MB frames
    })
    cases = {}
    for name, data in files.items():
        (root / name).write_bytes(data)
        kinds = ("video", "image") if name.endswith(".mp4") else ("image",)
        for kind in kinds:
            cases[f"{kind} {name}"] = {"type": f"{kind}_url", f"{kind}_url": {"url": str(root / name)}}
        if kinds == ("image",) and data:
            url = "data:image/png;base64," + base64.b64encode(data).decode()
            cases[f"data {name}"] = {"type": "image_url", "image_url": {"url": url}}
    return cases


def disconnects(url: str, seconds: float, client: httpx.Client) -> str:
    """16 clients asking for long answers and mostly leaving before the end, for ``seconds``; then the server's
    state once it settles."""
    png = base64.b64encode((ASSETS / "sample.png").read_bytes()).decode()
    counts = {"finished": 0, "left": 0, "failed": 0}
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def body(i: int) -> dict:
        content = (f"Write a long story, number {i}." if i % 2 else [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
            {"type": "text", "text": f"Describe the picture in detail, take {i}."}])
        return {"model": "m", "max_tokens": 200, "stream": i % 3 != 0, "messages": [{"role": "user", "content": content}]}

    def one_client(c: int) -> None:
        rnd, i = random.Random(c), c
        while time.monotonic() < stop:
            i += 16
            request = body(i)
            try:
                if request["stream"]:
                    events = rnd.choice([0, 1, 2, 5, None])  # None: read to the end
                    with httpx.stream("POST", url + "/v1/chat/completions", json=request, timeout=60) as reply:
                        for n, _ in enumerate(reply.iter_lines()):
                            if events is not None and n >= events:
                                break
                    outcome = "finished" if events is None else "left"
                else:
                    patience = rnd.choice([0.05, 0.3, 0.3, 0.3, 60])
                    try:
                        httpx.post(url + "/v1/chat/completions", json=request, timeout=patience)
                        outcome = "finished"
                    except httpx.TimeoutException:
                        outcome = "left"
            except httpx.HTTPError:
                outcome = "failed"
            with lock:
                counts[outcome] += 1

    threads = [threading.Thread(target=one_client, args=(c,)) for c in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _ in range(40):  # the last cancellations take effect at the next step
        health = client.get(url + "/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.5)
    state = ", ".join(f"{key} {health[key]}" for key in ("running", "waiting", "kv_bytes", "kv_reserved_bytes"))
    return (f"disconnects: {sum(counts.values())} requests in {seconds:.0f} s ({counts['finished']} read to the end, "
            f"{counts['left']} left early, {counts['failed']} failed); then /health {health['status']}: {state}")


def large_bodies(url: str, count: int, client: httpx.Client) -> str:
    """``count`` clients at once, each sending a 60 MiB data URL (random bytes: refused as no picture); a text question
    every second meanwhile. How long the refusals took, and how long the text questions waited (alone about 0.3 s on
    the embedded model)."""
    payload = base64.b64encode(os.urandom(45 * 2**20)).decode()
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64," + payload}}]}], "max_tokens": 2}).encode()
    statuses: list = []

    def send() -> None:
        try:
            statuses.append(httpx.post(url + "/v1/chat/completions", content=body, timeout=600,
                                       headers={"content-type": "application/json"}).status_code)
        except httpx.HTTPError as error:
            statuses.append(type(error).__name__)

    senders = [threading.Thread(target=send) for _ in range(count)]
    start = time.monotonic()
    for sender in senders:
        sender.start()
    waits = []
    while any(sender.is_alive() for sender in senders):
        asked = time.monotonic()
        client.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2})
        waits.append(time.monotonic() - asked)
        time.sleep(1)
    took = time.monotonic() - start
    return (f"large bodies: {count} x {len(body) / 2**20:.0f} MiB at once answered {sorted(set(map(str, statuses)))} "
            f"within {took:.1f} s; text questions meanwhile waited {', '.join(f'{w:.1f}' for w in waits)} s")


def stalled_bodies(url: str, count: int, client: httpx.Client) -> str:
    """``count`` connections that announce a 64 MiB body, send 300 KB of it and fall silent; then a question with a
    2.7 MB data URL (a noise picture: a large body that must wait for room). How long it took, and what the silent
    ones got."""
    import io

    from PIL import Image

    from glimpse.connections import MAX_BODY_BYTES

    address = (urlsplit(url).hostname, urlsplit(url).port or 80)
    silent = []
    for _ in range(count):
        sock = socket.create_connection(address, timeout=10)
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {MAX_BODY_BYTES}\r\n\r\n".encode() + b"{" + b" " * 300_000)
        silent.append(sock)
    time.sleep(1)
    picture = io.BytesIO()
    Image.effect_noise((900, 900), 64).convert("RGB").save(picture, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    asked = time.monotonic()
    reply = client.post(url + "/v1/chat/completions", timeout=300, json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What colour is it?"}, {"type": "image_url", "image_url": {"url": data_url}}]}],
        "max_tokens": 2})
    waited = time.monotonic() - asked
    answers = []
    for sock in silent:
        sock.settimeout(1)
        try:
            answers.append(sock.recv(100).split(b"\r\n")[0].decode() or "closed")
        except OSError:
            answers.append("nothing yet")
        sock.close()
    return (f"stalled bodies: a {len(data_url) / 2**20:.1f} MiB question beside {count} silent 64 MiB bodies answered "
            f"{reply.status_code} after {waited:.1f} s; the silent ones: {', '.join(answers)}")


def slow_clients(url: str, count: int, client: httpx.Client) -> str:
    """Open ``count`` silent connections and ``count`` that dribble an endless request head; report whether the
    server kept serving and how many of them it had closed once its head deadline passed."""
    from glimpse.connections import HEAD_TIMEOUT_S

    address = (urlsplit(url).hostname, urlsplit(url).port or 80)
    silent = [socket.create_connection(address, timeout=10) for _ in range(count)]
    dribbling = [socket.create_connection(address, timeout=10) for _ in range(count)]
    for sock in dribbling:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    served = [client.get(url + "/health").status_code]
    deadline = time.monotonic() + HEAD_TIMEOUT_S + 5
    while time.monotonic() < deadline:
        time.sleep(5)
        for i, sock in enumerate(dribbling):
            try:
                sock.sendall(f"X-Slow-{i}: {time.monotonic():.0f}\r\n".encode())  # more head, never its end
            except OSError:  # closed by the server
                pass
        served.append(client.get(url + "/health").status_code)

    def closed(sock) -> bool:
        sock.setblocking(False)
        try:
            return sock.recv(1) == b""
        except BlockingIOError:
            return False  # still open, nothing to read
        except OSError:
            return True

    shut = sum(closed(sock) for sock in silent + dribbling)
    for sock in silent + dribbling:
        sock.close()
    ok = sum(status == 200 for status in served)
    return (f"slow clients: {2 * count} connections ({count} silent, {count} dribbling a head); /health answered "
            f"{ok} of {len(served)} times meanwhile; {shut} of {2 * count} closed by the server after "
            f"{HEAD_TIMEOUT_S:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7861")
    parser.add_argument("--allowed-root", required=True, help="the server's --allowed-root")
    parser.add_argument("--disconnects", type=float, default=0, metavar="S",
                        help="then S seconds of 16 clients that mostly leave before their answer ends")
    parser.add_argument("--slow-clients", type=int, default=0, metavar="N",
                        help="then N silent and N slowly dribbling connections (takes about 40 s)")
    parser.add_argument("--stalled-bodies", type=int, default=0, metavar="N",
                        help="then N silent 64 MiB bodies, and a 2.7 MB data-URL question that needs their room")
    parser.add_argument("--large-bodies", type=int, default=0, metavar="N",
                        help="then N clients at once sending 60 MiB data URLs, and text questions meanwhile")
    args = parser.parse_args()
    check_flags(parser, args, or_none=("disconnects", "slow_clients", "stalled_bodies", "large_bodies"))
    try:  # said in a line where it ended in a connection traceback
        httpx.get(args.url + "/health", timeout=10)
    except httpx.TransportError as error:
        parser.error(f"no server answers at {args.url} ({error}): start `glimpse serve --allowed-root "
                     f"{args.allowed_root} ...` first, or give its --url")
    root = Path(args.allowed_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "sample.png").write_bytes((ASSETS / "sample.png").read_bytes())
    for name, target in (("link.png", Path("/etc/passwd")), ("good_link.png", ASSETS / "sample.png")):
        if not (root / name).is_symlink():
            os.symlink(target, root / name)
    cases, raw = corpus(str(root), str(urlsplit(args.url).port or 80))
    counts = {"2xx": 0, "4xx": 0, "5xx": 0}
    client = httpx.Client(timeout=120)
    endpoint = args.url + "/v1/chat/completions"

    def show(name, response):
        kind = f"{response.status_code // 100}xx"
        counts[kind] = counts.get(kind, 0) + 1
        print(f"{response.status_code} {name:26s} {response.text[:150].replace(chr(10), ' ')}"
              + ("   <-- server error" if response.status_code >= 500 else ""))

    for name, body in cases.items():
        show(name, client.post(endpoint, content=json.dumps(body, allow_nan=True),
                               headers={"content-type": "application/json"}))
    for name, part in media_corpus(root).items():
        show(name, client.post(endpoint, json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, part]}], "max_tokens": 4}))
    for name, (data, content_type) in raw.items():
        show(name, client.post(endpoint, content=data, headers={"content-type": content_type} if content_type else {}))
    # Bodies past the 64 MiB cap, with and without a Content-Length, to the API and to the chat's JSON routes.
    huge = b'{"messages": "' + b"x" * (65 * 2**20) + b'"}'
    for path in ("/v1/chat/completions", "/gradio_api/call/chat", "/gradio_api/queue/join"):
        show(f"65 MiB to {path}", client.post(args.url + path, content=huge, headers={"content-type": "application/json"}))
        chunks = (huge[i:i + 2**20] for i in range(0, len(huge), 2**20))
        show(f"65 MiB chunked to {path}", client.post(args.url + path, content=chunks,
                                                      headers={"content-type": "application/json"}))
    for path in ("/health", "/metrics", "/v1/models"):
        show(f"HEAD {path}", client.head(args.url + path))
        show(f"PUT {path}", client.put(args.url + path))
    # The chat's routes take files as server paths: one outside the uploads, named by path, must be refused (it
    # was copied into the uploads and answered about) -- the POST is accepted, its event stream says error.
    for named in (str(ASSETS / "sample.png"), "/x" * 200_000):
        body = {"data": [{"text": "colour?", "files": [{"path": named, "meta": {"_type": "gradio.FileData"}}]},
                         "auto", 0.0, 4, "", False]}
        started = client.post(args.url + "/gradio_api/call/chat", json=body)
        stream = client.get(f"{args.url}/gradio_api/call/chat/{started.json()['event_id']}").text
        refused = "event: error" in stream and "event: complete" not in stream
        counts["chat by path refused" if refused else "chat by path ANSWERED"] = \
            counts.get("chat by path refused" if refused else "chat by path ANSWERED", 0) + 1
        print(f"{'refused' if refused else 'ANSWERED'} chat file by path {named[:40]!r}: {stream[-150:]!r}")
    for method in ("GET", "PUT", "DELETE", "OPTIONS"):
        show(method, client.request(method, endpoint, headers={"Origin": "http://evil.example",
                                                               "Access-Control-Request-Method": "POST"}))
    for path in ("/gradio_api/file=/etc/passwd", "/file=/etc/passwd", "/gradio_api/file=../../../etc/passwd",
                 "/v1/models/../../etc/passwd", "/static/../../etc/passwd"):
        show(path, client.get(args.url + path))
    if args.disconnects:
        print(disconnects(args.url, args.disconnects, client))
    if args.slow_clients:
        print(slow_clients(args.url, args.slow_clients, client))
    if args.stalled_bodies:
        print(stalled_bodies(args.url, args.stalled_bodies, client))
    if args.large_bodies:
        print(large_bodies(args.url, args.large_bodies, client))
    health = client.get(args.url + "/health")
    print(f"\n{sum(counts.values())} requests: " + ", ".join(f"{n} {k}" for k, n in counts.items())
          + f"; /health afterwards: {health.status_code} {health.json().get('status')}")


if __name__ == "__main__":
    main()
