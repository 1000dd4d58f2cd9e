"""`glimpse bench serve`: a running server under concurrent clients, against the same requests one at a time.

The workload is a fixed list of requests, each with an image: "API" requests (one question, not streamed)
and "chat-like" requests (streamed, with an earlier turn in the conversation), alternating
(``--workload text``: the same without the image, asking for stories, so that decoding dominates; ``--workload
mixed``: both, two of each in turn). They are sent
twice to the same server: first one at a time (the serial baseline: every request alone), then by K
clients at once, each sending its share back to back (closed loop). Reported per phase: throughput in
requests/s and answer tokens/s, p50/p95 time to first token (first streamed content, or the server's own
``ttft_s`` for requests that are not streamed) and end-to-end latency, failures, and the peak memory the
server reported for any request. The report also checks the serving goal: p95 TTFT at most twice a lone
request's plus one prefill per other client.

``--burst N`` then sends N requests at once and counts how many were admitted and how many got 429,
polling ``/health`` for the KV reservations against the server's budget meanwhile.

Without ``--url`` the command starts ``glimpse serve`` itself (``--model``, ``--max-batch``, ...) on a free
local port, and stops it at the end.
"""

from __future__ import annotations

import base64
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from glimpse.assets import ASSETS
from glimpse.common import UserError

QUESTIONS = ["What colour is the biggest shape?", "How many shapes are there?", "Describe the picture.",
             "Which shape is on the left?", "Is there a circle?", "What is written in the picture?",
             "What colour is the background?", "Which shape is the smallest?"]


@dataclass
class Outcome:
    ok: bool
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    peak_memory_bytes: int = 0
    error: str = ""


@dataclass
class Phase:
    name: str
    clients: int
    wall_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> dict:
        good = [o for o in self.outcomes if o.ok]
        ttft = [o.ttft_s for o in good if o.ttft_s is not None]
        e2e = [o.e2e_s for o in good if o.e2e_s is not None]
        return {"phase": self.name, "clients": self.clients, "requests": len(self.outcomes),
                "failures": len(self.outcomes) - len(good),
                "failure_examples": sorted({f"{o.status}: {o.error[:120]}" for o in self.outcomes if not o.ok})[:3],
                "wall_s": self.wall_s, "requests_per_s": len(good) / self.wall_s if self.wall_s else None,
                "tokens_per_s": sum(o.tokens for o in good) / self.wall_s if self.wall_s else None,
                "ttft_p50_s": _percentile(ttft, 50), "ttft_p95_s": _percentile(ttft, 95),
                "e2e_p50_s": _percentile(e2e, 50), "e2e_p95_s": _percentile(e2e, 95),
                "peak_memory_bytes": max((o.peak_memory_bytes for o in good), default=0)}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


TOPICS = ["a dragon by the sea", "a lighthouse keeper", "a city of glass", "a robot who paints", "a winter garden",
          "a lost map", "a river that sings", "a clockmaker's cat"]


def workload(image: Path | None, requests: int, max_tokens: int, policy: str, speed: float,
             mixed: bool = False) -> list[dict]:
    """The request bodies: alternately an API question and a streamed chat-like turn, each with the image;
    without an image (``--workload text``), requests for stories, whose answers are long: decode-bound; ``mixed``
    (``--workload mixed``): two with the image, then two stories, and so on — prompts of very different sizes
    decoding side by side, as on a chat server."""
    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode() if image is not None else None
    bodies = []
    for i in range(requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        if url is None or (mixed and i // 2 % 2):
            picture = f"Write a story about {TOPICS[i % len(TOPICS)]}."
        else:
            picture = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
        if i % 2 == 0:  # API: one question, the whole answer at once
            messages, stream = [{"role": "user", "content": picture}], False
        else:  # chat-like: streamed, after an earlier turn
            messages = [{"role": "user", "content": "Hello! I will show you a picture."},
                        {"role": "assistant", "content": "Hello! Please show me."},
                        {"role": "user", "content": picture}]
            stream = True
        bodies.append({"model": "bench", "messages": messages, "max_tokens": max_tokens, "stream": stream,
                       "policy": policy, "speed": speed})
    return bodies


def send(client: httpx.Client, url: str, body: dict) -> Outcome:
    start = time.perf_counter()
    try:
        if not body["stream"]:
            reply = client.post(url + "/v1/chat/completions", json=body)
            if reply.status_code != 200:
                return Outcome(False, reply.status_code, error=reply.text)
            data = reply.json()
            metrics = data["glimpse"]["metrics"]
            return Outcome(True, 200, metrics["ttft_s"], time.perf_counter() - start,
                           data["usage"]["completion_tokens"], metrics["peak_memory_bytes"])
        first, tokens, peak = None, 0, 0
        with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                return Outcome(False, reply.status_code, error=reply.read().decode(errors="replace"))
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, 200, error=chunk["error"]["message"])
                choice = chunk["choices"][0] if chunk["choices"] else {}
                if choice.get("delta", {}).get("content") and first is None:
                    first = time.perf_counter() - start
                if "metrics" in chunk.get("glimpse", {}):  # the last chunk (the first carries the promise alone)
                    peak = chunk["glimpse"]["metrics"]["peak_memory_bytes"]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return Outcome(True, 200, first, time.perf_counter() - start, tokens, peak)
    except (httpx.HTTPError, ValueError, KeyError) as error:
        return Outcome(False, 0, error=f"{type(error).__name__}: {error}")


def run_phase(url: str, bodies: list[dict], clients: int, api_key: str | None, progress) -> Phase:
    phase = Phase("serial" if clients == 1 else f"{clients} clients", clients)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # One list of requests that every client takes its next one from, as it finishes the last (vLLM's
    # --max-concurrency): K requests are in flight until the list runs out. Fixed shares per client would
    # not be K clients for long: with 8 topics and 8 clients each client always got the same story, and the
    # clients with short ones were done early while the batch ran at 4 for the last quarter of the run.
    pending = iter(bodies)
    lock = threading.Lock()

    def next_body():
        with lock:
            return next(pending, None)

    def client_loop():
        with httpx.Client(timeout=600, headers=headers) as client:
            while (body := next_body()) is not None:
                outcome = send(client, url, {**body, "stream_options": {"include_usage": True}} if body["stream"] else body)
                with lock:
                    phase.outcomes.append(outcome)
                    progress(f"{phase.name}: {len(phase.outcomes)}/{len(bodies)}")

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    phase.wall_s = time.perf_counter() - start
    return phase


def burst(url: str, body: dict, count: int, api_key: str | None) -> dict:
    """``count`` requests at once: how many were answered, refused with 429, or failed otherwise; the most KV
    the running requests reserved meanwhile, against the budget."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    statuses: list[int] = []
    lock = threading.Lock()
    done = threading.Event()
    reserved = [0]
    budget = httpx.get(url + "/health", timeout=30).json().get("kv_budget_bytes")

    def one():
        try:
            status = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=600).status_code
        except httpx.HTTPError:
            status = 0
        with lock:
            statuses.append(status)

    def watch():
        while not done.is_set():
            try:
                reserved[0] = max(reserved[0], httpx.get(url + "/health", timeout=10).json()["kv_reserved_bytes"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    return {"sent": count, "answered": statuses.count(200), "refused_429": statuses.count(429),
            "other": len(statuses) - statuses.count(200) - statuses.count(429),
            "kv_reserved_max_bytes": reserved[0], "kv_budget_bytes": budget}


# The server runs this Python's Glimpse. Not `python -m glimpse.cli`: `-m` puts the current folder first on the
# path, so a glimpse.py there would be started instead (the console script does not have that problem).
GLIMPSE_COMMAND = [sys.executable, "-c", "import sys; del sys.path[0]; from glimpse.cli import main; sys.exit(main())"]


def start_server(args, progress) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [*GLIMPSE_COMMAND, "serve", "--port", str(port), "--model", args.model or "embedded",
               "--max-batch", str(args.max_batch), "--queue-size", str(args.queue_size),
               "--max-new-tokens", str(max(args.max_tokens, 16)), "--device", args.device]
    if args.kv_budget_mb is not None:
        command += ["--kv-budget-mb", str(args.kv_budget_mb)]
    if args.encoder_cache_mb is not None:
        command += ["--encoder-cache-mb", str(args.encoder_cache_mb)]
    if args.media_cache_mb is not None:
        command += ["--media-cache-mb", str(args.media_cache_mb)]
    if args.prefix_cache_mb is not None:
        command += ["--prefix-cache-mb", str(args.prefix_cache_mb)]
    progress(f"starting: glimpse {' '.join(command[len(GLIMPSE_COMMAND):])}")
    # Its messages go to a file: a pipe that nothing reads while the clients run would stop the server at the write
    # that fills it. They are shown if it fails to come up.
    said = tempfile.TemporaryFile()
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=said)
    try:  # stopped whatever ends the wait: a SIGTERM or Ctrl-C to this process alone left it loading, an orphan
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if server.poll() is not None:
                said.seek(0)
                told = said.read().decode(errors="replace")
                refusal = [line for line in told.splitlines() if line.startswith("glimpse: error: ")]
                if refusal:  # the server refused what it was given (a model that is not there): the user's to fix
                    why = refusal[-1][len("glimpse: error: "):]
                    raise UserError(f"the server started here refused to start: {why}")
                raise RuntimeError(f"glimpse serve exited: {told[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return server, url
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("glimpse serve did not come up within 15 minutes")
    except BaseException:
        stop_server(server)
        raise
    finally:
        said.close()  # (the server keeps its own handle to it)


def stop_server(server: subprocess.Popen) -> None:
    """Ask the server to stop (its in-flight requests get their grace), and kill it if it has not within a minute."""
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def run(args, progress) -> dict:
    # The key as `glimpse serve` takes it: without the whitespace around it (a key file's newline)
    args.api_key = (args.api_key or "").strip() or None
    image = Path(args.image[0]) if args.image else ASSETS / "sample.png"
    bodies = workload(image if args.workload in ("images", "mixed") else None, args.requests, args.max_tokens,
                      args.policy, args.speed, mixed=args.workload == "mixed")
    server = None
    url = args.url
    if url is None:
        server, url = start_server(args, progress)
    try:
        url = url.rstrip("/")
        try:
            health = httpx.get(url + "/health", timeout=30).json()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:  # (ValueError: not JSON, not a Glimpse)
            raise UserError(f"cannot reach a Glimpse server at {url}: {type(error).__name__}: {error}") from None
        progress("warming up")
        warm = run_phase(url, bodies[:2], 1, args.api_key, lambda _: None)
        if not any(o.ok for o in warm.outcomes):  # refused (a key, max_tokens over the server's cap): say why, once
            raise UserError(f"the server at {url} answered no request: {warm.summary()['failure_examples'][0]}")
        serial = run_phase(url, bodies, 1, args.api_key, progress)
        concurrent = run_phase(url, bodies, args.clients, args.api_key, progress)
        report = {"url": url, "model": health.get("model"), "device": health.get("device"),
                  "max_batch": health.get("max_batch"), "queue_size": health.get("queue_size"),
                  "workload": args.workload, "requests": args.requests, "max_tokens": args.max_tokens, "policy": args.policy, "speed": args.speed,
                  "serial": serial.summary(), "concurrent": concurrent.summary()}
        s, c = report["serial"], report["concurrent"]
        lone_ttft = statistics.median(o.ttft_s for o in serial.outcomes if o.ok and o.ttft_s is not None)
        prefill = _median_prefill(url, bodies[0], args.api_key)
        bound = 2 * lone_ttft + (args.clients - 1) * prefill
        report["goal"] = {
            "throughput_ratio": c["requests_per_s"] / s["requests_per_s"] if s["requests_per_s"] else None,
            "lone_ttft_s": lone_ttft, "prefill_s": prefill, "ttft_p95_bound_s": bound,
            "ttft_p95_within_bound": c["ttft_p95_s"] is not None and c["ttft_p95_s"] <= bound,
            "no_failures": s["failures"] == 0 and c["failures"] == 0}
        if args.burst:
            progress(f"burst of {args.burst}")
            report["burst"] = burst(url, {**bodies[0], "max_tokens": args.max_tokens}, args.burst, args.api_key)
        return report
    finally:
        if server is not None:
            stop_server(server)


def _median_prefill(url: str, body: dict, api_key: str | None) -> float:
    """The server's prefill time for one request alone (its own ``prefill_s``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    values = []
    for _ in range(3):
        reply = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, headers=headers, timeout=600)
        values.append(reply.json()["glimpse"]["metrics"]["prefill_s"])
    return statistics.median(values)


def format_report(report: dict) -> str:
    def fmt(v, unit=""):
        return "—" if v is None else f"{v:.2f}{unit}"

    lines = [f"glimpse bench serve: {report['model']} on {report['device']} (max batch {report['max_batch']}), "
             f"{report['requests']} requests ({report['workload']}), max_tokens {report['max_tokens']}, "
             f"policy {report['policy']} at speed {report['speed']:g}", "",
             "| phase | requests/s | tokens/s | TTFT p50 | TTFT p95 | e2e p50 | e2e p95 | peak memory | failures |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in ("serial", "concurrent"):
        p = report[key]
        lines.append(f"| {p['phase']} | {fmt(p['requests_per_s'])} | {fmt(p['tokens_per_s'])} | "
                     f"{fmt(p['ttft_p50_s'], ' s')} | {fmt(p['ttft_p95_s'], ' s')} | {fmt(p['e2e_p50_s'], ' s')} | "
                     f"{fmt(p['e2e_p95_s'], ' s')} | {p['peak_memory_bytes'] / 2**20:.0f} MiB | {p['failures']} |")
    g = report["goal"]
    lines += ["", f"throughput: {fmt(g['throughput_ratio'])}x the serial server's; p95 TTFT "
                  f"{fmt(report['concurrent']['ttft_p95_s'], ' s')} against a bound of {fmt(g['ttft_p95_bound_s'], ' s')} "
                  f"(2 x lone {fmt(g['lone_ttft_s'], ' s')} + {report['concurrent']['clients'] - 1} x prefill "
                  f"{fmt(g['prefill_s'], ' s')}): {'within' if g['ttft_p95_within_bound'] else 'OVER'}; "
                  f"{'no request failed' if g['no_failures'] else 'SOME REQUESTS FAILED'}"]
    for key in ("serial", "concurrent"):
        if report[key]["failure_examples"]:
            lines.append(f"{key} failures: {report[key]['failure_examples']}")
    if "burst" in report:
        b = report["burst"]
        lines.append(f"burst: {b['sent']} at once: {b['answered']} answered, {b['refused_429']} refused with 429, "
                     f"{b['other']} other; KV reserved at most {b['kv_reserved_max_bytes'] / 2**20:.0f} MiB of a "
                     f"{(b['kv_budget_bytes'] or 0) / 2**20:.0f} MiB budget")
    return "\n".join(lines)
