"""`glimpse serve` run as a user runs it, as a process: stopped as `docker stop`, systemd or Kubernetes stop it (SIGTERM,
then SIGKILL after a grace period), and what it writes to its log.

Found by building and running the Docker image: the server had no SIGTERM handler, so on a host SIGTERM killed it
mid-answer, and in a container, where it is process 1 and the kernel ignores the signals process 1 has no handler
for, it did nothing until `docker stop` killed it 10 s later. Now the first SIGTERM stops it in order: new requests
are refused, waiting ones get a 503, answers under way finish (or, past `--shutdown-grace`, end with an error
after what they said), and the process exits 0. The embedded model runs in a subprocess, as a user starts it.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
QUESTION = "Describe the history of Rome in detail."  # some thirty tokens from the embedded model: seconds on a CPU


def _pid_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


@contextlib.contextmanager
def _serving(cache: Path, *options: str, as_pid_1: bool = False) -> Iterator[tuple[subprocess.Popen, int, str]]:
    """(the server process, the pid to signal, its URL), killed on the way out if a test left it running.
    ``as_pid_1``: process 1 of a new PID namespace, as in a container, signalled from outside it as the container
    runtime does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "glimpse.cli", "serve", "--port", str(port), "--max-batch", "1", *options]
    if as_pid_1:
        command = ["unshare", "--pid", "--fork", *command]
    env = {**os.environ, "GLIMPSE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, process.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "glimpse serve did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    pid = process.pid
    if as_pid_1:  # the server is unshare's child: process 1 inside, signalled by its pid outside
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        assert len(children) == 1
        pid = int(children[0])
    try:
        yield process, pid, url
    finally:
        if process.poll() is None:
            process.kill()


def _body(stream: bool, max_tokens: int = 40, question: str = QUESTION) -> dict:
    return {"model": "glimpse", "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": question}]}


def _events(response) -> Iterator[dict | str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def _stopped(process, seconds: float) -> tuple[int, str]:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"glimpse serve was still running {seconds} s after SIGTERM")
    return process.returncode, process.stderr.read()


@pytest.mark.parametrize("as_pid_1", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _pid_namespace_works(), reason="cannot make a PID namespace here (unshare --pid needs root)"))],
    ids=["process", "process-1-as-in-a-container"])
def test_sigterm_refuses_new_requests_turns_the_waiting_away_and_lets_the_answer_under_way_finish(embedded_cache,
                                                                                                  as_pid_1):
    with _serving(embedded_cache, "--shutdown-grace", "120", as_pid_1=as_pid_1) as (process, pid, url):
        alone = httpx.post(url + "/v1/chat/completions", json=_body(False), timeout=120).json()
        assert alone["choices"][0]["finish_reason"] in ("stop", "length")
        waiting: dict = {}

        def ask_behind() -> None:  # --max-batch 1: it waits behind the streamed answer
            reply = httpx.post(url + "/v1/chat/completions", json=_body(False, 8, "Hi"), timeout=120)
            waiting.update(status=reply.status_code, body=reply.json())

        behind = threading.Thread(target=ask_behind)
        with httpx.stream("POST", url + "/v1/chat/completions", json=_body(True), timeout=120) as response:
            events = _events(response)
            events_seen = [next(events)]  # the role chunk: sent with the first token, so the answer is under way
            behind.start()
            deadline = time.monotonic() + 30
            while httpx.get(url + "/health", timeout=5).json()["waiting"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            os.kill(pid, signal.SIGTERM)
            events_seen += list(events)
        behind.join(timeout=60)
        returncode, stderr = _stopped(process, 60)
    assert returncode == 0, stderr[-2000:]
    assert "stopping: 1 answers under way" in stderr and "1 waiting requests are turned away" in stderr
    assert "Traceback" not in stderr
    # The answer under way ended as it would have, and said so.
    assert events_seen[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events_seen[:-1] if e["choices"])
    assert text == alone["choices"][0]["message"]["content"]
    assert events_seen[-2]["choices"][0]["finish_reason"] == alone["choices"][0]["finish_reason"]
    # The one waiting was told the server is stopping (503), not that it made a mistake or that it left.
    assert waiting["status"] == 503, waiting
    assert "shutting down" in waiting["body"]["error"]["message"]
    # Nothing listens any more.
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)


@pytest.mark.parametrize("as_pid_1", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _pid_namespace_works(), reason="cannot make a PID namespace here (unshare --pid needs root)"))],
    ids=["process", "process-1-as-in-a-container"])
def test_sigterm_before_the_server_serves_stops_the_command_as_ctrl_c_does(tmp_path, as_pid_1):
    """SIGTERM while the model loads (here the embedded model converted into an empty cache: some twenty seconds):
    the command stops at once, as on Ctrl-C, with exit status 143 (128 + SIGTERM), and no model is left as if built. It
    had no handler until it served: a process was killed without a word, and process 1 of a container ignored it,
    loaded the model and served (``docker stop`` killed it 10 s later; an outside pass)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "glimpse", "serve", "--port", str(port)]  # the entry point users run
    if as_pid_1:
        command = ["unshare", "--pid", "--fork", *command]
    cache = tmp_path / "cache"
    env = {**os.environ, "GLIMPSE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    pid = process.pid
    try:
        said = []
        for line in process.stderr:  # until the conversion has begun
            said.append(line)
            if line.startswith("Converting the embedded model"):
                break
        assert said and said[-1].startswith("Converting"), "".join(said)[-2000:]
        if as_pid_1:
            pid = int(Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
        returncode, stderr = _stopped(process, 30)
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the server itself: killing unshare would leave it running
            process.kill()
    assert returncode == 143 and stderr.rstrip().endswith("glimpse: terminated"), stderr[-2000:]
    assert "serving on" not in stderr and "Traceback" not in stderr
    # No model taken for whole (a half-built one is a hidden folder, which the next conversion deletes).
    assert [p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")] == []


def test_sigterm_past_the_grace_period_ends_the_answer_with_an_error_after_what_it_said(embedded_cache):
    with _serving(embedded_cache, "--shutdown-grace", "0") as (process, pid, url):
        alone = httpx.post(url + "/v1/chat/completions", json=_body(False), timeout=120).json()
        with httpx.stream("POST", url + "/v1/chat/completions", json=_body(True), timeout=120) as response:
            events = _events(response)
            events_seen = [next(events)]
            t_signal = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            events_seen += list(events)
        returncode, stderr = _stopped(process, 30)
        stopped_s = time.monotonic() - t_signal
    assert returncode == 0, stderr[-2000:]
    assert stopped_s < 10  # within docker stop's default grace, before its SIGKILL
    assert events_seen[-1] == "[DONE]"
    error = events_seen[-2]["error"]
    assert error["type"] == "server_error" and "shut down before this answer ended" in error["message"]
    said = "".join(e["choices"][0]["delta"].get("content", "") for e in events_seen[:-2] if e.get("choices"))
    full = alone["choices"][0]["message"]["content"]
    assert full.startswith(said) and len(said) < len(full)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_sigterm_with_a_chat_tab_open_stops_within_docker_s_grace_and_without_a_traceback(embedded_cache):
    """A chat tab keeps an event stream open for as long as it is open: the server waited for it until uvicorn's
    shutdown timeout and then cancelled it with a traceback (12 s with one tab, past `docker stop`'s SIGKILL). The
    answer under way still ends whole in the tab."""
    from playwright.sync_api import sync_playwright

    with _serving(embedded_cache) as (process, pid, url):  # the default grace
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_selector("#input textarea", timeout=60_000)
            page.fill("#input textarea", QUESTION)
            page.keyboard.press("Enter")
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health", timeout=5).json()["running"] < 1:  # the answer is under way
                assert time.monotonic() < deadline
                time.sleep(0.02)
            t_signal = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            returncode, stderr = _stopped(process, 30)
            stopped_s = time.monotonic() - t_signal
            chat = page.inner_text("#chat")
            browser.close()
    assert returncode == 0 and "stopping: 1 answers under way" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr[-2000:]
    assert stopped_s < 10
    assert "broke off" not in chat and QUESTION in chat


def test_a_second_sigterm_stops_at_once_without_waiting_for_the_answer(embedded_cache):
    """The operator who will not wait (a second `docker stop`, `kill` twice): the answer under way is not waited
    for. It ends with an error, or its connection closes, before its end."""
    events_seen = []
    with _serving(embedded_cache, "--shutdown-grace", "600") as (process, pid, url):
        with httpx.stream("POST", url + "/v1/chat/completions", json=_body(True), timeout=120) as response:
            events = _events(response)
            events_seen.append(next(events))  # the answer is under way: some thirty tokens, seconds, to come
            t_signal = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.3)  # two signals sent at once may arrive as one
            os.kill(pid, signal.SIGTERM)
            try:
                events_seen += list(events)
            except httpx.HTTPError:  # the connection closed under it
                pass
            returncode, stderr = _stopped(process, 30)
            stopped_s = time.monotonic() - t_signal
    assert returncode == 0, stderr[-2000:]
    assert stopped_s < 10
    finished = [e for e in events_seen if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]
    assert not finished, events_seen[-3:]  # the answer was not waited for


def test_sigterm_while_a_media_url_is_fetched_stops_the_fetch_and_tells_the_client(embedded_cache):
    """Found by trying it: SIGTERM while a request's image was still coming from a slow URL closed its connection
    under it (the client saw the server disconnect, and could not tell whether its request had been done). Now its
    fetch stops and it gets the 503 the waiting requests get."""
    image = (REPO / "assets" / "sample.png").read_bytes()
    sent = {"bytes": 0}

    class Slow(http.server.BaseHTTPRequestHandler):  # 64 bytes every half second: minutes for the whole image
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            for start in range(0, len(image), 64):
                try:
                    self.wfile.write(image[start:start + 64])
                    self.wfile.flush()
                except OSError:  # the fetch was stopped
                    return
                sent["bytes"] += 64
                time.sleep(0.5)

        def log_message(self, *args):
            pass

    media = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    reply: dict = {}

    def ask() -> None:
        body = {"model": "glimpse", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{media.server_address[1]}/a.png"}},
            {"type": "text", "text": "What colour is it?"}]}]}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        reply.update(status=response.status_code, body=response.json())

    try:
        with _serving(embedded_cache, "--allow-private-urls") as (process, pid, url):
            asking = threading.Thread(target=ask)
            asking.start()
            deadline = time.monotonic() + 30
            while sent["bytes"] < 128:  # the fetch is under way
                assert time.monotonic() < deadline
                time.sleep(0.05)
            os.kill(pid, signal.SIGTERM)
            returncode, stderr = _stopped(process, 30)
            asking.join(timeout=30)
    finally:
        media.shutdown()
    assert returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert reply["status"] == 503 and "shutting down" in reply["body"]["error"]["message"], reply
    assert sent["bytes"] < len(image)  # the fetch stopped; the image was not read to its end


def test_what_a_request_makes_the_server_log_is_bounded(embedded_cache):
    """Found from outside: the chat's routes take files as paths, and Gradio prints the traceback of a refused one with
    the path in it; a 30 MB path wrote 30 MB to the server's log, a request at a time, until the disk was full. Each
    write to the log is now cut in its middle past 16 KiB (``glimpse.connections.CappedWrites``)."""
    with _serving(embedded_cache) as (process, pid, url):
        path = "/x" * 500_000  # a megabyte
        body = {"data": [{"text": "What colour?", "files": [{"path": path, "meta": {"_type": "gradio.FileData"}}]},
                         "none", 0.0, 4, "", False]}
        event = httpx.post(url + "/gradio_api/call/chat", json=body, timeout=30).json()["event_id"]
        stream = httpx.get(f"{url}/gradio_api/call/chat/{event}", timeout=30).text
        assert "event: error" in stream
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
        os.kill(pid, signal.SIGTERM)
        returncode, stderr = _stopped(process, 30)
    assert returncode == 0
    assert "characters left out" in stderr and len(stderr) < 100_000, len(stderr)


def test_serve_on_port_0_says_the_port_it_took(embedded_cache):
    """``--port 0`` has the system choose a free port: the server said "serving on http://127.0.0.1:0", an address
    nobody can reach (an outside mutation pass). It names the port it took, where /health answers."""
    command = [sys.executable, "-m", "glimpse.cli", "serve", "--port", "0", "--max-batch", "1"]
    env = {**os.environ, "GLIMPSE_CACHE": str(embedded_cache), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        while "serving on " not in said:
            line = process.stderr.readline()
            assert line, f"the server ended: {said[-2000:]}"
            said += line
        url = said.split("serving on ", 1)[1].split()[0]
        assert not url.endswith(":0"), said
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
