"""Memory under sustained use: starts `glimpse serve` (the embedded model unless told otherwise), sends it a long
mix of requests and samples the server's resident memory and its caches' bytes as they go, to show whether memory
levels off (the caches fill to their budgets and stay there) or keeps growing (a leak).

    python benchmarks/soak_serve.py --requests 400 --out soak.json [-- --prefix-cache-mb 256 ...]

Arguments after ``--`` go to `glimpse serve`. The mix, per request, drawn with a fixed seed: a new picture with a
question (45%), a follow-up about the previous picture with its answer in the history (20%), a text-only question
(15%), a streamed answer the client drops after its first event (10%), a corrupt picture (5%, a 400) and a
question about one of the first ten pictures again (5%). Every picture is a distinct random drawing of shapes.
Every ``--every`` requests it records the server's RSS (``/proc/PID/status``, VmRSS) and, from ``/metrics``, the
media, encoder and prefix caches' bytes. The report: that table, the RSS growth over the last half of the run in
MB per 100 requests, the count of each status, and whether ``/health`` still answers.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image, ImageDraw
from flags import check_flags

COLOURS = [(220, 30, 30), (30, 160, 60), (40, 70, 220), (240, 200, 20), (150, 60, 200), (250, 130, 20)]


def picture(seed: int) -> str:
    """A data URL of a random drawing: a plain background and one to four shapes."""
    rng = random.Random(seed)
    image = Image.new("RGB", (rng.randint(200, 480), rng.randint(200, 480)), (245, 245, 240))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 4)):
        x, y = rng.randint(0, image.width - 60), rng.randint(0, image.height - 60)
        size = rng.randint(30, 60)
        box = (x, y, x + size, y + size)
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=rng.choice(COLOURS))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def cache_mb(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for name in ("media", "encoder", "prefix"):
        found = re.search(rf"^glimpse_{name}_cache_bytes(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
        out[name] = float(found.group(1)) / 2**20 if found else float("nan")
    return out


def one_request(client: httpx.Client, rng: random.Random, i: int, state: dict) -> int:
    draw = rng.random()
    question = rng.choice(["What colour is the circle?", "How many shapes are there?", "Is there a square?"])
    image_part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    if draw < 0.45 or state.get("last") is None:
        url = picture(i)
        state["last"] = url
        if len(state.setdefault("first", [])) < 10:
            state["first"].append(url)
        messages = [{"role": "user", "content": [image_part(url), {"type": "text", "text": question}]}]
    elif draw < 0.65:
        messages = [{"role": "user", "content": [image_part(state["last"]), {"type": "text", "text": question}]},
                    {"role": "assistant", "content": state.get("answer", "Red.")},
                    {"role": "user", "content": "And what shape is it?"}]
    elif draw < 0.80:
        messages = [{"role": "user", "content": rng.choice(["What is the capital of France?", "Say hello.",
                                                            "Name three colours."])}]
    elif draw < 0.90:
        body = {"messages": [{"role": "user", "content": [image_part(picture(10_000 + i)),
                                                          {"type": "text", "text": question}]}],
                "max_tokens": 32, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for _ in response.iter_lines():
                break  # the client goes away after the first event
        return response.status_code
    elif draw < 0.95:
        broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + os.urandom(200)).decode()
        messages = [{"role": "user", "content": [image_part(broken), {"type": "text", "text": question}]}]
    else:
        messages = [{"role": "user", "content": [image_part(rng.choice(state["first"])),
                                                 {"type": "text", "text": question}]}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                         "speed": rng.choice([0.0, 0.5, 1.0])})
    if response.status_code == 200:
        state["answer"] = response.json()["choices"][0]["message"]["content"]
    return response.status_code


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--every", type=int, default=25, help="sample memory every N requests (default 25)")
    parser.add_argument("--port", type=int, default=7863)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the report as JSON here too")
    args = parser.parse_args(argv)
    check_flags(parser, args, counts=("requests", "every"))

    glimpse = str(Path(sys.executable).with_name("glimpse"))
    log = tempfile.TemporaryFile()  # the server's own words, shown if it stops before it serves
    server = subprocess.Popen([glimpse, "serve", "--port", str(args.port), *serve_args],
                              stdout=subprocess.DEVNULL, stderr=log)
    client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300)
    try:
        for _ in range(600):
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:  # a mistyped pass-through flag was only "exited before it answered"
                log.seek(0)
                said = log.read().decode(errors="replace").strip().splitlines()[-5:]
                raise SystemExit("glimpse serve exited before it answered /health:\n  " + "\n  ".join(said))
            time.sleep(1)
        rng, state, statuses, samples = random.Random(args.seed), {}, {}, []
        start = time.perf_counter()
        samples.append({"requests": 0, "seconds": 0.0, "rss_mb": rss_mb(server.pid), **cache_mb(client)})
        for i in range(1, args.requests + 1):
            status = one_request(client, rng, i, state)
            statuses[status] = statuses.get(status, 0) + 1
            if i % args.every == 0 or i == args.requests:
                time.sleep(0.5)  # a dropped stream's request ends at its next step
                samples.append({"requests": i, "seconds": round(time.perf_counter() - start, 1),
                                "rss_mb": rss_mb(server.pid), **cache_mb(client)})
                print(json.dumps(samples[-1]), flush=True)
        half = [s for s in samples if s["requests"] >= args.requests / 2]
        growth = ((half[-1]["rss_mb"] - half[0]["rss_mb"]) / (half[-1]["requests"] - half[0]["requests"]) * 100
                  if len(half) > 1 and half[-1]["requests"] > half[0]["requests"] else float("nan"))
        report = {"requests": args.requests, "serve_args": serve_args, "statuses": statuses, "samples": samples,
                  "rss_growth_mb_per_100_requests_last_half": round(growth, 1),
                  "health_after": client.get("/health").status_code}
    finally:
        server.terminate()
        server.wait(timeout=60)
    print("requests  seconds  RSS MB  media MB  encoder MB  prefix MB")
    for s in samples:
        print(f"{s['requests']:8d} {s['seconds']:8.0f} {s['rss_mb']:7.0f} {s['media']:9.1f} {s['encoder']:11.1f} "
              f"{s['prefix']:10.1f}")
    print(f"statuses {statuses}; RSS growth over the last half: {report['rss_growth_mb_per_100_requests_last_half']} "
          f"MB per 100 requests; /health after: {report['health_after']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
