"""The web chat in a real browser: Debian's chromium driven by Playwright (no browser downloads;
`.ci/run` installs chromium). `glimpse serve` runs on the embedded model in a subprocess, exactly as
a user starts it; the test uploads an image, asks, watches the streamed answer and the metrics panel,
moves the slider and sees what it selects and its measured promise, uploads a corrupt file and sees the error in the
chat, then asks again and gets an answer."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def served(embedded_cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLIMPSE_CACHE": str(embedded_cache), "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--max-new-tokens", "24"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"glimpse serve exited: {server.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("glimpse serve did not come up")
    yield url
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def page(served):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(served + "/")
        page.wait_for_selector("#input textarea", timeout=60_000)
        yield page
        browser.close()


def _ask(page, text: str, upload: Path | None = None) -> None:
    answers = page.locator("#chat .message.bot").count()
    if upload is not None:
        page.locator("#input input[type=file]").set_input_files(str(upload))
        page.wait_for_selector("#input .thumbnail-item", timeout=30_000)  # uploaded
    page.locator("#input textarea").fill(text)
    page.locator("#input textarea").press("Enter")
    page.wait_for_function("n => document.querySelectorAll('#chat .message.bot').length > n", arg=answers, timeout=120_000)
    # Done when the input is enabled again (the chain re-enables it after the answer) and the last
    # answer is rendered (Gradio shows "Loading content" while it re-renders the history).
    page.wait_for_function("""() => {
        const bots = document.querySelectorAll('#chat .message.bot');
        const last = bots[bots.length - 1].innerText.trim();
        return !document.querySelector('#input textarea').disabled && last && !last.includes('Loading content');
    }""", timeout=120_000)


def _shipped_choice(speed: float) -> str:
    """The configuration the embedded model's shipped frontier selects at ``speed``."""
    import json

    from pipeline.calibrate_slider import SHIPPED_FRONTIER
    from pruning import Frontier

    return Frontier.from_json(json.loads(SHIPPED_FRONTIER.read_text())).promise(speed)["configuration"]


def test_upload_ask_and_see_the_answer_stream_and_the_metrics_fill_in(page):
    _ask(page, "What is in this picture?", upload=REPO / "assets" / "sample.png")
    answer = page.locator("#chat .message.bot").last.inner_text()
    assert answer.strip() and "⚠️" not in answer
    metrics = page.locator("#metrics").inner_text()
    assert "time to first token" in metrics and "image" in metrics
    assert page.locator("#keepmap img").count() == 1  # the keep map is drawn


def test_moving_the_slider_shows_what_it_selects_and_its_measured_promise_before_asking(page):
    page.get_by_text("advanced: parameters").click()
    page.wait_for_selector("#params", timeout=10_000)
    assert "exact" in page.locator("#promise").inner_text()  # speed 0: no pruning
    page.locator("#speed input[type=number]").fill("1")
    page.locator("#speed input[type=number]").press("Enter")
    chosen = _shipped_choice(1.0)
    deadline = time.monotonic() + 30
    while chosen not in page.locator("#promise").inner_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    promise = page.locator("#promise").inner_text()
    assert chosen in promise and "keeps" in promise and "calibration set" in promise
    members = {part.split("@")[0] for part in chosen.split("+")}
    deadline = time.monotonic() + 30
    while not all(f'"{m}"' in page.locator("#params").inner_text() for m in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(f'"{m}"' in page.locator("#params").inner_text() for m in members)  # auto's members, as run


def test_a_corrupt_upload_shows_an_error_in_the_chat_and_the_next_question_still_works(page, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    _ask(page, "And this one?", upload=broken)
    assert "⚠️" in page.locator("#chat .message.bot").last.inner_text()
    _ask(page, "What is the capital of France?")
    answer = page.locator("#chat .message.bot").last.inner_text()
    assert answer.strip() and "⚠️" not in answer
