"""`glimpse serve`: the OpenAI-compatible API (through the openai client), /health, /metrics, the
Gradio app through gradio_client, and bad requests that change nothing."""

from __future__ import annotations

import base64
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from app.cli import build_server
from pipeline import load_engine
from pruning import NoPruning


def _serve(app):
    """Run ``app`` with uvicorn on a free local port in a thread; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not running.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        running.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(checkpoints, media, tmp_path_factory):
    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    root = tmp_path_factory.mktemp("allowed")
    (root / "image.png").write_bytes(media["image"].read_bytes())
    app = build_server(engine, "tiny-llava", allowed_root=str(root), max_new_tokens=12)
    for url in _serve(app):
        yield {"url": url, "engine": engine, "root": root}


def _data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="unused")


def _question(image_url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": text}]}]


def test_health(server):
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"


def test_an_openai_client_gets_the_engines_answer_with_usage_and_glimpse_metrics(server, media):
    messages = _question(_data_url(media["image"]))
    reply = _client(server).chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8,
                                                    extra_body={"policy": "none"})
    engine_messages = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                                    {"type": "text", "text": "What is in the picture?"}]}]
    direct = server["engine"].generate(engine_messages, policy=NoPruning(), max_new_tokens=8)
    assert reply.choices[0].message.content == direct.text
    assert reply.usage.completion_tokens == len(direct.token_ids)
    assert reply.usage.prompt_tokens == sum(direct.metrics["prompt_tokens"].values())
    extra = reply.model_extra["glimpse"]
    assert extra["policy"] == "none" and extra["metrics"]["ttft_s"] > 0
    assert extra["promise"]["configuration"] == "none"
    reply = _client(server).chat.completions.create(model="tiny-llava", messages=messages, max_tokens=2,
                                                    extra_body={"speed": 1.0})
    promise = reply.model_extra["glimpse"]["promise"]  # auto on a model nobody calibrated says so
    assert promise == server["engine"].promise("auto", 1.0) and promise["text"].startswith("uncalibrated")
    reply = _client(server).chat.completions.create(model="tiny-llava", messages=messages, max_tokens=2,
                                                    extra_body={"policy": "fastv", "speed": 0.5,
                                                                "params": {"ratio": 0.2}})
    assert "overridden" in reply.model_extra["glimpse"]["promise"]["text"]


def test_streaming_sends_the_same_text_in_server_sent_events(server, media):
    client = _client(server)
    messages = _question(_data_url(media["image"]))
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=10,
                                           extra_body={"speed": 0.5})
    pieces = client.chat.completions.create(model="m", messages=messages, max_tokens=10, stream=True,
                                            extra_body={"speed": 0.5})
    chunks = list(pieces)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_local_files_only_under_the_allowed_root(server, media):
    client = _client(server)
    inside = client.chat.completions.create(model="m", messages=_question(str(server["root"] / "image.png")),
                                            max_tokens=4)
    assert inside.choices[0].message.content is not None
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="outside the allowed root"):
        client.chat.completions.create(model="m", messages=_question(str(media["image"])), max_tokens=4)


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, media):
    url = server["url"] + "/v1/chat/completions"
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n broken").decode()
    cases = [
        ({"messages": _question(corrupt)}, "image"),
        ({"messages": _question("data:image/png;base64,@@@")}, "base64"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "speed": 3}, "speed"),
        ({"messages": [{"role": "user", "content": "hi"}], "policy": "fastest"}, "policy"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "unsupported"),
    ]
    for body, word in cases:
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400 and word in response.json()["error"]["message"], (body, response.text)
    assert httpx.post(url, content=b"{not json", timeout=60).status_code == 400
    ok = httpx.post(url, json={"messages": _question(_data_url(media["image"])), "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_concurrent_requests_are_all_answered(server):
    url = server["url"] + "/v1/chat/completions"
    results = [None] * 4

    def ask(i):
        results[i] = httpx.post(url, json={"messages": [{"role": "user", "content": f"Count to {i}"}],
                                           "max_tokens": 4, "policy": "none"}, timeout=120)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 4


def test_prometheus_metrics_count_requests_and_ttft(server):
    text = httpx.get(server["url"] + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    ok = values['glimpse_requests_total{outcome="ok"}']
    assert ok >= 1 and values["glimpse_ttft_seconds_count"] == ok
    assert values['glimpse_ttft_seconds_bucket{le="+Inf"}'] == ok
    assert values['glimpse_tokens_total{kind="completion"}'] >= ok


def test_the_chat_answers_through_gradio_client_and_shows_errors_in_the_chat(server, media, tmp_path):
    from gradio_client import Client, handle_file

    client = Client(server["url"] + "/", verbose=False)
    history = [{"role": "user", "content": [{"type": "file", "file": handle_file(str(media["image"]))}]},
               {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}]
    chat, metrics, _ = client.predict(history, "auto", 0.5, "", False, api_name="/chat")
    assert chat[-1]["role"] == "assistant" and chat[-1]["content"]
    assert "time to first token" in metrics

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    history = [{"role": "user", "content": [{"type": "file", "file": handle_file(str(broken))}]},
               {"role": "user", "content": [{"type": "text", "text": "And this one?"}]}]
    chat, _, _ = client.predict(history, "auto", 0.0, "", False, api_name="/chat")
    assert "⚠️" in str(chat[-1]["content"])
    chat, metrics, _ = client.predict([{"role": "user", "content": [{"type": "text", "text": "Still there?"}]}],
                                      "none", 0.0, "", False, api_name="/chat")
    assert chat[-1]["role"] == "assistant" and "⚠️" not in str(chat[-1]["content"])


def test_keep_map_is_drawn_over_the_image_and_over_a_strip_of_video_frames(checkpoints, media):
    import numpy as np

    from app.ui import keep_map_image

    engine = load_engine(str(checkpoints["qwen2_vl"]), device="cpu")
    for kind in ("image", "video"):
        messages = [{"role": "user", "content": [{"type": kind, kind: str(media[kind])},
                                                 {"type": "text", "text": "What is it?"}]}]
        result = engine.generate(messages, policy="st3", speed=1.0, max_new_tokens=2)
        keep_map = result.metrics["keep_map"]
        t, h, w = keep_map["media"][0]["grid"]
        drawn = keep_map_image(messages, keep_map, cell=8)
        assert drawn.size == (t * w * 8, h * 8)
        # Pruned tokens are drawn redder than tokens that reached the last layer.
        depth = np.array(keep_map["depth"]).reshape(t, h, w)
        pixels = np.asarray(drawn, dtype=float)
        deepest, shallowest = np.unravel_index(depth.argmax(), depth.shape), np.unravel_index(depth.argmin(), depth.shape)
        def tile(g, y, x):
            return pixels[y * 8:(y + 1) * 8, (g * w + x) * 8:(g * w + x + 1) * 8].mean(axis=(0, 1))
        assert depth.max() > depth.min()
        assert tile(*deepest)[1] - tile(*deepest)[0] > tile(*shallowest)[1] - tile(*shallowest)[0]
        # The picture (image, or one frame per temporal group) shows through the heatmap.
        bare = keep_map_image([{"role": "user", "content": [{"type": "text", "text": "x"}]}], keep_map, cell=8)
        assert not np.array_equal(np.asarray(bare), np.asarray(drawn))


def test_a_streaming_client_that_disconnects_frees_the_model(server, media, monkeypatch):
    """A client that drops its stream mid-answer cancels the request at the next decode step: the
    model is free again (the next request is answered) and /metrics counts the request as cancelled.
    EOS is ignored here so that the answer would otherwise run for thousands of steps."""
    from app.api import create_api

    engine = server["engine"]
    monkeypatch.setattr(engine, "eos_token_ids", set())
    for url in _serve(create_api(engine, model_name="tiny-llava", max_new_tokens=3000)):
        _drop_a_stream_and_check(url, engine, media, monkeypatch)


def _drop_a_stream_and_check(url, engine, media, monkeypatch):
    before = httpx.get(url + "/metrics").text
    body = {"model": "tiny-llava", "messages": _question(_data_url(media["image"])), "max_tokens": 3000,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk
        while '"content": "' not in next(lines):  # until tokens flow
            pass
    # The connection is closed: within a generous liveness bound the model is released.
    deadline = time.monotonic() + 60
    while engine._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine._lock.locked()
    metrics = httpx.get(url + "/metrics").text
    assert _count(metrics, "cancelled") == _count(before, "cancelled") + 1
    assert _count(metrics, "ok") == _count(before, "ok")  # it never ran to the end
    monkeypatch.undo()
    reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny-llava", "messages": _question(_data_url(media["image"])), "max_tokens": 3})
    assert reply.status_code == 200


def _count(metrics: str, outcome: str) -> int:
    line = next(l for l in metrics.splitlines() if l.startswith(f'glimpse_requests_total{{outcome="{outcome}"}}'))
    return int(float(line.split()[-1]))


def test_a_media_url_that_drips_does_not_stall_the_server_and_is_refused_at_the_deadline(server, media):
    """An image URL that sends one byte a second: while it is being fetched /health still answers (the
    fetch runs off the event loop), and the request is refused once the fetch deadline passes."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from app.api import create_api

    class Drip(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for byte in media["image"].read_bytes()[:30]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(1.0)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    drip = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=drip.serve_forever, daemon=True).start()
    app = create_api(server["engine"], model_name="tiny-llava", allow_private_urls=True, fetch_deadline_s=4.0)
    try:
        for url in _serve(app):
            outcome = {}
            body = {"model": "tiny-llava", "messages": _question(f"http://127.0.0.1:{drip.server_port}/x.png")}
            asking = threading.Thread(target=lambda: outcome.update(
                reply=httpx.post(url + "/v1/chat/completions", json=body, timeout=60)))
            asking.start()
            time.sleep(1.5)  # the fetch is under way
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert asking.is_alive()  # /health answered while the media was still dripping
            asking.join(timeout=60)
            reply = outcome["reply"]
            assert reply.status_code == 400 and "not fetched within 4 s" in reply.json()["error"]["message"]
    finally:
        drip.shutdown()


def test_media_urls_on_the_servers_own_network_are_refused(server):
    """Server-side request forgery: a URL naming a loopback or private address is refused (by default)
    with one message that says nothing about what is listening there."""
    for target in (server["url"] + "/health", "http://10.0.0.1/x.png", "http://[::1]/x.png", "http://169.254.169.254/"):
        reply = httpx.post(server["url"] + "/v1/chat/completions", timeout=30,
                           json={"model": "tiny-llava", "messages": _question(target)})
        assert reply.status_code == 400, target
        assert "private, loopback and link-local addresses are not fetched" in reply.json()["error"]["message"]


def test_the_chat_uses_only_files_uploaded_to_it(tmp_path):
    """The Gradio chat endpoint names files by server path: only paths under the upload folder (or
    --allowed-root) are used, a symlink out of it included, and the refusal is the same whether or not
    the named file exists."""
    from app.ui import history_to_messages
    from vision import MediaError

    uploads, outside = tmp_path / "uploads", tmp_path / "secret"
    uploads.mkdir()
    outside.mkdir()
    (uploads / "cat.png").write_bytes(b"png")
    (outside / "key.png").write_bytes(b"png")
    (uploads / "link.png").symlink_to(outside / "key.png")
    turn = lambda path: [{"role": "user", "content": [{"type": "file", "file": {"path": str(path)}}]}]  # noqa: E731
    messages = history_to_messages(turn(uploads / "cat.png"), (uploads.resolve(),))
    assert messages[0]["content"][0]["image"] == str(uploads / "cat.png")
    refusals = []
    for path in (outside / "key.png", outside / "missing.png", uploads / "link.png", uploads / ".." / "secret" / "key.png"):
        with pytest.raises(MediaError) as error:
            history_to_messages(turn(path), (uploads.resolve(),))
        refusals.append(str(error.value).split(": ", 1)[1])
    assert len(set(refusals)) == 1 and "only files uploaded to this chat" in refusals[0]


def test_client_mistakes_get_400_with_what_to_fix_never_a_server_error(server, media):
    """Wrong types and out-of-range values a client may send: each is a 400 naming the field, and the
    server's --max-new-tokens caps max_tokens (the fixture serves 12)."""
    url = server["url"] + "/v1/chat/completions"
    good = {"model": "tiny-llava", "messages": _question(_data_url(media["image"])), "max_tokens": 3}
    cases = {"temperature": {"temperature": "hot"}, "seed": {"seed": 1.5}, "top_p": {"top_p": 0},
             "max_tokens": {"max_tokens": 13}, "max_tokens ": {"max_tokens": True},
             "dash.rho": {"policy": "dash", "params": {"rho": "abc"}},
             "fastv.layer": {"policy": "fastv", "params": {"layer": "six"}}}
    for field, change in cases.items():
        reply = httpx.post(url, json={**good, **change}, timeout=60)
        assert reply.status_code == 400, (field, reply.text)
        assert field.strip() in reply.json()["error"]["message"], (field, reply.text)
    assert httpx.post(url, json=good, timeout=60).status_code == 200


def test_a_full_queue_answers_429_and_admits_again_once_there_is_room(server, media, monkeypatch):
    """--queue-size bounds the API: with no waiting room, a request that arrives while another is being
    answered gets 429 with Retry-After at once; when the first leaves, requests are admitted again."""
    from app.api import create_api

    engine = server["engine"]
    monkeypatch.setattr(engine, "eos_token_ids", set())
    question = _question(_data_url(media["image"]))
    for url in _serve(create_api(engine, model_name="tiny-llava", max_new_tokens=3000, queue_size=0)):
        body = {"model": "tiny-llava", "messages": question, "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: a dropped iterator would close the connection
            next(lines)  # admitted and answering
            busy = httpx.post(url + "/v1/chat/completions", timeout=30,
                              json={"model": "tiny-llava", "messages": question, "max_tokens": 3})
            assert busy.status_code == 429 and busy.headers["Retry-After"]
            assert busy.json()["error"]["type"] == "rate_limit_exceeded"
        monkeypatch.undo()
        deadline = time.monotonic() + 60
        while True:  # the dropped stream leaves the queue once its worker has stopped
            reply = httpx.post(url + "/v1/chat/completions", timeout=60,
                               json={"model": "tiny-llava", "messages": question, "max_tokens": 3})
            if reply.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert reply.status_code == 200


def test_oversized_bodies_and_text_beyond_the_context_are_refused_before_any_work(server, media):
    """A body over the cap is 413 before it is parsed; text that cannot fit the model's context is 400
    before it is tokenized; deeply nested JSON is a 400, not a server error; the server keeps serving."""
    from app import api

    url = server["url"] + "/v1/chat/completions"
    too_long = "word " * (api.CHARS_PER_TOKEN_BOUND * server["engine"].max_length // 5 + 10)
    reply = httpx.post(url, json={"messages": [{"role": "user", "content": too_long}]}, timeout=60)
    assert reply.status_code == 400 and "context" in reply.json()["error"]["message"]
    nested = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert httpx.post(url, content=nested, timeout=60).status_code == 400
    huge = b'{"messages": "' + b"x" * (api.MAX_BODY_BYTES + 10) + b'"}'
    reply = httpx.post(url, content=huge, timeout=120)
    assert reply.status_code == 413 and "MiB" in reply.json()["error"]["message"]
    ok = httpx.post(url, json={"messages": _question(_data_url(media["image"])), "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200


def test_fields_glimpse_does_not_implement_are_refused_not_ignored(server, media):
    """`stop`, `tools`, `response_format`, `logprobs`, penalties and n > 1 get a 400 naming them (an ignored
    `stop` would silently return text past it); /v1/models lists the served model."""
    url = server["url"] + "/v1/chat/completions"
    good = {"model": "tiny-llava", "messages": _question(_data_url(media["image"])), "max_tokens": 3}
    refused = {"stop": ["\n"], "tools": [{"type": "function", "function": {"name": "f"}}],
               "response_format": {"type": "json_object"}, "logprobs": True, "presence_penalty": 0.5, "n": 2}
    for field, value in refused.items():
        reply = httpx.post(url, json={**good, field: value}, timeout=60)
        assert reply.status_code == 400 and field in reply.json()["error"]["message"], (field, reply.text)
    assert httpx.post(url, json={**good, "n": 1, "stream_options": {"include_usage": True}}, timeout=60).status_code == 200
    off = {"stop": None, "tools": [], "logprobs": False, "presence_penalty": 0, "response_format": None}
    assert httpx.post(url, json={**good, **off}, timeout=60).status_code == 200  # "off" values ask for nothing
    models = httpx.get(server["url"] + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-llava"]


def test_a_typo_in_the_overrides_keeps_the_turns_upload_for_regenerate(server, media):
    """An error that is not about the file (here an override written without '=') is shown in the chat
    and leaves the turn's image in place, so answering again uses it; a broken file is what gets dropped."""
    from gradio_client import Client, handle_file

    client = Client(server["url"] + "/", verbose=False)
    history = [{"role": "user", "content": [{"type": "file", "file": handle_file(str(media["image"]))}]},
               {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}]
    chat, _, _ = client.predict(history, "dash", 0.5, "rho 0.5", False, api_name="/chat")
    assert "⚠️" in str(chat[-1]["content"]) and "name=value" in str(chat[-1]["content"])
    assert "[file not used]" not in str(chat)
    files = [p for m in chat if isinstance(m["content"], list) for p in m["content"] if p.get("type") == "file"]
    assert len(files) == 1  # the upload stayed in the conversation
    path = files[0]["file"] if isinstance(files[0]["file"], str) else files[0]["file"]["path"]
    retry = [{"role": "user", "content": [{"type": "file", "file": handle_file(path)}]}, history[1]]
    chat, metrics, _ = client.predict(retry, "dash", 0.5, "rho=0.5", False, api_name="/chat")
    assert "⚠️" not in str(chat[-1]["content"]) and "image" in metrics  # answered with the image
