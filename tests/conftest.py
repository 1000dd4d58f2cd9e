"""Shared fixtures: tiny checkpoints of each architecture, a sample image and a sample video."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import BUILDERS  # noqa: E402

ARCHS = list(BUILDERS)
VIDEO_ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "longva"]
DEEP_LAYERS = 12


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def deep_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """12-layer tiny Qwen2-VL and LLaVA: deep enough for multi-stage schedules (ST3, LazyLLM, HiDivDrop)."""
    from tiny_models import build_llava, build_qwen2_vl

    root = tmp_path_factory.mktemp("deep")
    return {"qwen2_vl": build_qwen2_vl(root / "qwen2_vl", layers=DEEP_LAYERS),
            "llava": build_llava(root / "llava", layers=DEEP_LAYERS)}


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("media")
    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(90, 120, 3) * 255).astype("uint8"))
    image.save(root / "image.png")
    write_video(root / "clip.mp4", frames=20, fps=10, size=(64, 48))
    return {"image": root / "image.png", "video": root / "clip.mp4",
            "moving_square": write_moving_square(root / "square.mp4")}


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory) -> Path:
    """A cache folder holding the embedded model, converted once per test session."""
    from glimpse.pipeline.embedded import embedded_checkpoint

    root = tmp_path_factory.mktemp("glimpse-cache")
    embedded_checkpoint(root, progress=lambda line: None)
    return root


def write_moving_square(path: Path) -> Path:
    """A still, textured scene in which one white square moves right, 6 s at 8 fps: most of its tokens repeat
    over time, the square's do not (RLT). Written losslessly, so the still part is the same in every frame."""
    from glimpse.tasks import write_clip

    rng = np.random.RandomState(0)
    scene = (rng.rand(112, 224, 3) * 255).astype(np.uint8)
    frames = []
    for i in range(48):  # Qwen2-VL samples 12 frames: 6 temporal steps
        frame = scene.copy()
        frame[28:56, 8 + 4 * i:36 + 4 * i] = 255
        frames.append(frame)
    return write_clip(frames, path, 8, crf=0)


def refuse_listing(monkeypatch, locked: Path) -> None:
    """``locked`` cannot be listed, as for a user without read permission on it (the tests may run as root,
    whom permissions do not stop): os.walk lists folders with os.scandir."""
    import os

    real = os.scandir

    def scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


def write_video(path: Path, frames: int, fps: int, size: tuple[int, int], container_options: dict | None = None) -> Path:
    """A small H.264/MPEG-4 clip whose frame i is a solid colour that encodes i."""
    import av

    with av.open(str(path), "w", options=container_options or {}) as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            array = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            array[..., 0] = (i * 12) % 256
            array[: size[1] // 2, :, 1] = 200
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_damaged_video(path: Path, frames: int = 30) -> Path:
    """A clip that declares ``frames`` frames but decodes fewer: its index is at the front (faststart), and garbage
    overwrites part of its data near the end, as a damaged download or disk would."""
    data = bytearray(write_video(path, frames=frames, fps=10, size=(64, 48),
                                 container_options={"movflags": "faststart"}).read_bytes())
    start = int(len(data) * 0.9)
    data[start:start + 200] = b"\xff" * 200
    path.write_bytes(bytes(data))
    return path


def serve_bytes(body):
    """An HTTP server on 127.0.0.1, in a thread, answering every GET with ``body()``'s bytes (``body`` may take its
    time: a slow URL). Its port is ``server_port``; ``shutdown()`` it when done."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            data = body()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class RawServer:
    """A TCP server on 127.0.0.1 that misbehaves as a test needs: every connection, once its request head has
    arrived, is handed to ``answer(connection, head)`` in a thread of its own and closed after; without ``answer``,
    a response head that does not end (``slow_head``). ``url``, the ``heads`` it was sent and the ``connections``
    it accepted; ``close()`` (or leaving the ``with``) stops accepting and sets ``release``, on which slow heads
    give up."""

    def __init__(self, answer=None):
        import socket
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.heads, self.connections, self.release = [], [], threading.Event()
        answer = answer or (lambda connection, head: slow_head(self.release, connection, head))
        threading.Thread(target=self._serve, args=(answer,), daemon=True).start()

    def _serve(self, answer) -> None:
        import threading

        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(connection)
            head = b""
            while b"\r\n\r\n" not in head and (piece := connection.recv(4096)):
                head += piece
            self.heads.append(head.decode("latin-1"))
            threading.Thread(target=self._answer_and_close, args=(answer, connection, self.heads[-1]),
                             daemon=True).start()

    @staticmethod
    def _answer_and_close(answer, connection, head) -> None:
        try:
            answer(connection, head)
        except OSError:
            pass  # the client gave up and closed its end
        finally:
            connection.close()

    def close(self) -> None:
        self.release.set()
        self.listener.close()

    def __enter__(self) -> "RawServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def slow_head(release, connection, head) -> None:
    """A ``RawServer`` answer whose response head does not end: a header line every 0.2 s, until ``release`` is set
    (at most 40 s). A read timeout starts again with every line."""
    connection.sendall(b"HTTP/1.1 200 OK\r\n")
    for i in range(200):
        if release.wait(0.2):
            return
        connection.sendall(f"X-Slow-{i}: yes\r\n".encode())


@pytest.fixture(params=["ctrl-c", "sigterm"])
def stop(request, monkeypatch):
    """How a user stops a long command — Ctrl-C, or a plain ``kill`` (SIGTERM, through the handler the ``glimpse``
    entry point puts in) — as ``(stop_now, exit status that says which)``: ``stop_now()`` stops it where called."""
    from glimpse import launcher

    if request.param == "ctrl-c":
        def ctrl_c():
            raise KeyboardInterrupt

        yield ctrl_c, 130
        return
    monkeypatch.setattr(launcher, "_terminated", False)
    previous = signal.getsignal(signal.SIGTERM)
    launcher.stop_on_sigterm()

    def kill():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises here at once
        raise AssertionError("SIGTERM did not stop the command")

    try:
        yield kill, 143
    finally:
        signal.signal(signal.SIGTERM, previous)
