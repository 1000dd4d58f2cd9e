"""The web chat in a real browser: Debian's chromium driven by Playwright (no browser downloads;
`.ci/run` installs chromium). `glimpse serve` runs on the embedded model in a subprocess, exactly as
a user starts it (one request decoded at a time, so that a second tab queues); the tests upload, ask,
watch the streamed answer and the metrics panel, move the slider, press Clear and Stop mid-answer,
retry after a mistake, use the examples, and ask from two tabs at once."""

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
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def served(embedded_cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLIMPSE_CACHE": str(embedded_cache), "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "glimpse.cli", "serve", "--port", str(port), "--max-new-tokens", "256",
                               "--max-batch", "1"],
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
def browser(served):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def _open(browser, served):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(served + "/")
    page.wait_for_selector("#input textarea", timeout=60_000)
    return page


@pytest.fixture
def page(browser, served):
    """A fresh tab per test: each starts with an empty chat."""
    page = _open(browser, served)
    yield page
    page.close()


STORY = "Write a long story about a dragon who lives by the sea."  # an answer of many tokens


def _send(page, text: str, upload: Path | None = None) -> None:
    """Type (and attach), press Enter, and wait until the question shows in the chat."""
    questions = page.locator("#chat .message.user").count()
    if upload is not None:
        page.locator("#input input[type=file]").set_input_files(str(upload))
        page.wait_for_selector("#input .thumbnail-item", timeout=30_000)  # uploaded
    page.locator("#input textarea").fill(text)
    page.locator("#input textarea").press("Enter")
    page.wait_for_function("n => document.querySelectorAll('#chat .message.user').length > n", arg=questions,
                           timeout=30_000)


def _streaming(page) -> None:
    """Wait until the answer's first words are on screen."""
    page.wait_for_function("""() => {
        const bots = document.querySelectorAll('#chat .message.bot:not(.pending)');  // not the loading dots
        const last = bots.length ? bots[bots.length - 1].innerText.trim() : '';
        return last.length > 0 && !last.startsWith('⏳');
    }""", timeout=120_000)


def _last_answer_includes(page, text: str, timeout: int = 30_000) -> None:
    """Wait until the chat's last answer shows ``text``."""
    page.wait_for_function("""text => {
        const bots = document.querySelectorAll('#chat .message.bot');
        return bots.length > 0 && bots[bots.length - 1].innerText.includes(text);
    }""", arg=text, timeout=timeout)


def _queued_behind_a_story(first, second, question: str) -> None:
    """Tab ``first`` streams a long story (the test server answers one request at a time); tab ``second`` asks
    ``question`` and shows it waits first in the queue."""
    _send(first, STORY)
    _streaming(first)
    _send(second, question)
    _last_answer_includes(second, "number 1 in the queue")


def _idle(served) -> None:
    """Wait until the server has nothing running or waiting."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = httpx.get(served + "/health", timeout=10).json()
        if state["running"] == 0 and state["waiting"] == 0:
            return
        time.sleep(0.1)
    pytest.fail("the server did not become idle")


def _ask(page, text: str, upload: Path | None = None) -> None:
    answers = page.locator("#chat .message.bot").count()
    _send(page, text, upload)
    page.wait_for_function("n => document.querySelectorAll('#chat .message.bot').length > n", arg=answers, timeout=120_000)
    # Done when the input is enabled again (the chain re-enables it after the answer) and the last
    # answer is rendered (Gradio shows "Loading content" while it re-renders the history).
    page.wait_for_function("""() => {
        const bots = document.querySelectorAll('#chat .message.bot');
        const last = bots[bots.length - 1].innerText.trim();
        return !document.querySelector('#input textarea').disabled && last && !last.includes('Loading content')
            && !last.startsWith('⏳');
    }""", timeout=120_000)


def _shipped_choice(speed: float) -> str:
    """The configuration the embedded model's shipped frontier selects at ``speed``."""
    import json

    from glimpse.pipeline.calibrate_slider import SHIPPED_FRONTIER
    from glimpse.pruning import Frontier

    return Frontier.from_json(json.loads(SHIPPED_FRONTIER.read_text())).promise(speed)["configuration"]


def _set_speed(page, speed: float) -> str:
    """Type ``speed`` into the slider's box and wait (up to 30 s) for the promise of what it selects; returns that
    configuration's name."""
    page.locator("#speed input[type=number]").fill(f"{speed:g}")
    page.locator("#speed input[type=number]").press("Enter")
    chosen = _shipped_choice(speed)
    deadline = time.monotonic() + 30
    while chosen not in page.locator("#promise").inner_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return chosen


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
    chosen = _set_speed(page, 1.0)
    promise = page.locator("#promise").inner_text()
    assert chosen in promise and "keeps" in promise and "calibration set" in promise
    assert "Measured on single questions" in promise  # what the numbers are of, for a new user
    members = {part.split("@")[0] for part in chosen.split("+")}
    deadline = time.monotonic() + 30
    while not all(f'"{m}"' in page.locator("#params").inner_text() for m in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(f'"{m}"' in page.locator("#params").inner_text() for m in members)  # auto's members, as run
    assert _set_speed(page, 0.25) in page.locator("#promise").inner_text()
    assert page.locator("#promise a").count() == 0  # a configuration's name is no link ("divprune@0.25": an e-mail)


def test_a_corrupt_upload_shows_an_error_in_the_chat_and_the_next_question_still_works(page, tmp_path):
    broken = tmp_path / "_draft_ [v1] ~old~.png"  # named as users name files: shown as named, not read as Markdown
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    _ask(page, "And this one?", upload=broken)
    error = page.locator("#chat .message.bot").last.inner_text()
    assert "⚠️" in error and "_draft_ [v1] ~old~.png" in error, error
    _ask(page, "What is the capital of France?")
    answer = page.locator("#chat .message.bot").last.inner_text()
    assert answer.strip() and "⚠️" not in answer


def test_uploads_show_as_a_picture_and_a_video_player_not_as_links(page):
    _ask(page, "What colour is the biggest shape?", upload=REPO / "assets" / "sample.png")
    assert page.locator("#chat .message.user img").count() >= 1
    _ask(page, "What moves?", upload=REPO / "assets" / "sample.mp4")
    assert page.locator("#chat .message.user video").count() >= 1


def _interrupt_a_story(page, served, button: str) -> None:
    """Ask for a long answer, press ``button`` while it streams, and check that this ended the request
    (counted as cancelled) rather than the end of its story."""
    before = _cancelled(served)
    _send(page, STORY)
    _streaming(page)
    page.locator(button).click()
    _idle(served)
    assert _cancelled(served) == before + 1


def test_clear_while_an_answer_streams_clears_for_good_and_ends_the_request(page, served):
    _interrupt_a_story(page, served, "#chat button[aria-label='Clear']")
    time.sleep(1.0)
    assert page.locator("#chat .message").count() == 0  # the old conversation did not come back
    _ask(page, "What is the capital of France?")
    assert page.locator("#chat .message.user").count() == 1  # sent alone, without the cleared turns


def test_stop_ends_the_answer_marks_it_and_frees_the_model(page, served):
    _interrupt_a_story(page, served, "#input button.stop-button")
    _last_answer_includes(page, "(stopped)")
    assert "stopped: no metrics" in page.locator("#metrics").inner_text()  # not the previous answer's figures
    # The mark stays under the stopped answer when the next question is asked (it vanished then).
    _ask(page, "What is the capital of France?")
    bots = page.locator("#chat .message.bot")
    assert "(stopped)" in bots.nth(bots.count() - 2).inner_text()


def test_a_mistyped_override_is_explained_and_retry_answers_with_the_same_upload(page):
    page.get_by_text("advanced: parameters").click()
    page.locator("#overrides textarea").fill("dash.rho=abc")
    page.locator("#overrides textarea").press("Tab")
    page.wait_for_function("() => document.querySelector('#promise').innerText.includes('⚠️')", timeout=30_000)
    _ask(page, "What colour is the biggest shape?", upload=REPO / "assets" / "sample.png")
    error = page.locator("#chat .message.bot").last.inner_text()
    assert "⚠️" in error and "rho" in error and "internal error" not in error
    assert "no answer: no metrics" in page.locator("#metrics").inner_text()
    page.locator("#overrides textarea").fill("")
    page.locator("#chat button[aria-label='Retry']").last.click()
    page.wait_for_function("""() => {
        const bots = document.querySelectorAll('#chat .message.bot');
        const last = bots.length ? bots[bots.length - 1].innerText.trim() : '';
        return last && !last.startsWith('⚠️') && !last.startsWith('⏳')
            && document.querySelector('#metrics').innerText.includes('image 256');
    }""", timeout=120_000)  # answered, and the prompt held the image


def test_undo_takes_the_answers_metrics_and_keep_map_away_with_it(page):
    """Undo emptied the chat but left the undone answer's metrics and keep map, describing an answer no longer
    there (an outside pass); Clear already reset them."""
    _ask(page, "What colour is the circle?", upload=REPO / "assets" / "sample.png")
    assert page.locator("#keepmap img").count() == 1 and "image 256" in page.locator("#metrics").inner_text()
    page.locator("#chat button[aria-label='Undo']").last.click()
    page.wait_for_function("() => document.querySelector('#metrics').innerText.includes('metrics appear after')",
                           timeout=30_000)
    assert page.locator("#keepmap img").count() == 0


def test_a_tall_pictures_keep_map_fits_its_panel(page, tmp_path):
    """Drawn at the picture's proportions, a 1080x12000 screenshot's keep map was 4,267 pixels tall and so was the
    page (an outside pass): shown whole within the panel's height."""
    tall = tmp_path / "screenshot.png"
    Image.new("RGB", (108, 1200), (30, 160, 30)).save(tall)
    _ask(page, "What is this?", upload=tall)
    box = page.locator("#keepmap img").bounding_box()
    assert box is not None and box["height"] <= 400 and box["width"] < box["height"] / 5, box


def test_a_speed_typed_past_the_slider_is_clamped_and_the_promise_says_the_speed_used(page):
    """Typed 1.5, the promise kept saying the earlier speed's configuration while the question ran at 1 (an
    outside pass): the page clamps it to 1 first, and the promise follows."""
    _set_speed(page, 0.3)
    page.locator("#speed input[type=number]").fill("1.5")
    page.locator("#speed input[type=number]").press("Enter")
    page.wait_for_function("() => document.querySelector('#promise').innerText.includes('speed 1 ')", timeout=30_000)
    assert page.locator("#speed input[type=number]").input_value() == "1"
    assert _shipped_choice(1.0) in page.locator("#promise").inner_text()


def test_enter_in_an_empty_box_asks_for_a_question_instead_of_sending_a_blank_turn(page):
    page.locator("#input textarea").fill("  ")
    page.locator("#input textarea").press("Enter")
    _last_answer_includes(page, "type a question, or attach a picture or a video")


def test_max_answer_tokens_caps_the_answer_and_says_so(page):
    number = page.locator("#max-tokens input[type=number]")
    number.fill("3")
    number.press("Enter")
    _ask(page, STORY)
    assert "cut at 3 tokens" in page.locator("#chat .message.bot").last.inner_text()
    metrics = page.locator("#metrics").inner_text()
    assert "answer tokens\t3" in metrics or "answer tokens 3" in metrics.replace("\t", " ")
    assert "peak memory (this request)" in metrics


def test_the_model_note_and_an_example_to_click(page):
    assert "About this model" in page.locator("#model-note").inner_text()
    from glimpse.pipeline.embedded import EMBEDDED_GROUNDED

    page.get_by_text("What colour is the circle?").first.click()
    page.wait_for_function("""() => {
        const bots = document.querySelectorAll('#chat .message.bot');
        const last = bots.length ? bots[bots.length - 1].innerText.trim() : '';
        return last && !last.startsWith('⏳') && document.querySelector('#metrics').innerText.includes('image 256');
    }""", timeout=120_000)
    assert page.locator("#chat .message.user img").count() >= 1
    if EMBEDDED_GROUNDED:  # a new user's first click gets the right answer (README: "Red." at every speed)
        assert page.locator("#chat .message.bot").last.inner_text().strip().lower().startswith("red")


def test_two_tabs_at_once_the_second_sees_its_place_in_the_queue_then_its_answer(browser, served):
    first, second = _open(browser, served), _open(browser, served)
    try:
        _queued_behind_a_story(first, second, "What is the capital of France?")
        _streaming(second)
        answer = second.locator("#chat .message.bot").last.inner_text()
        assert "⚠️" not in answer and "⏳" not in answer
    finally:
        first.close()
        second.close()


def test_stop_while_queued_marks_the_question_and_the_next_one_is_sent_alone(browser, served):
    """Stop pressed before the answer began (the question still queued) left the question unanswered and
    unmarked, and the next question was sent with it run in: now it is marked, and left out."""
    first, second = _open(browser, served), _open(browser, served)
    try:
        _queued_behind_a_story(first, second, "Name a colour.")
        second.locator("#input button.stop-button").click()
        _last_answer_includes(second, "stopped before the answer began")
        _idle(served)  # the story ends
        _ask(second, "What is the capital of France?")
        first.locator("#chat button[aria-label='Clear']").click()
        time.sleep(1.0)
        _ask(first, "What is the capital of France?")  # the same question alone

        def prompt_tokens(page):  # "text 37 (24 taken from the prefix cache)": the prompt's own, not the cache's
            line = next(line for line in page.locator("#metrics").inner_text().splitlines() if "prompt tokens" in line)
            return line.split("(")[0].split()

        assert prompt_tokens(second) == prompt_tokens(first)  # the stopped question was not sent with it
    finally:
        first.close()
        second.close()


def test_closing_the_tab_mid_answer_frees_the_model(browser, served):
    page = _open(browser, served)
    before = _cancelled(served)
    _send(page, STORY)
    _streaming(page)
    page.close()
    _idle(served)
    assert _cancelled(served) == before + 1  # the request ended with the tab, not with its story


def _cancelled(served) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(httpx.get(served + "/metrics").text)
               for sample in family.samples
               if sample.name == "glimpse_requests_total" and sample.labels["outcome"] == "cancelled")


def test_a_message_holding_html_or_markdown_images_loads_nothing_from_another_server(page, served):
    """The chat renders Markdown and the HTML Gradio's sanitiser keeps: an answer (or a message) holding
    ``<img src=...>``, ``![](...)`` or a style's ``url(...)`` pointing elsewhere had the browser fetch it, a way for
    a prompt-injected answer to send the conversation to another server. The page's policy allows this server's
    images only."""
    import io

    from PIL import Image

    from conftest import serve_bytes

    pixel = io.BytesIO()
    Image.new("RGB", (1, 1), "red").save(pixel, format="PNG")
    fetched = []
    elsewhere = serve_bytes(lambda: fetched.append(1) or pixel.getvalue())
    try:
        site = f"http://127.0.0.1:{elsewhere.server_port}"
        _ask(page, f'Hello <img src="{site}/html.png"> ![x]({site}/markdown.png) '
                   f'<b style="background-image:url({site}/style.png)">there</b>')
        page.wait_for_timeout(1000)  # what the page would load has had time to load
        assert page.locator("#chat .message.user").last.inner_text().strip().startswith("Hello")
        assert fetched == []
        # A form the sanitiser keeps sent its fields elsewhere when its button was clicked.
        _ask(page, f'<form action="{site}/form"><input type="hidden" name="leak" value="secret">'
                   '<button id="leak">Continue</button></form>')
        if page.locator("#chat button#leak").count():
            page.locator("#chat button#leak").last.evaluate("button => button.click()")  # a navigation may follow
            page.wait_for_timeout(1000)
        assert fetched == [] and page.url.startswith(served)
    finally:
        elsewhere.shutdown()
