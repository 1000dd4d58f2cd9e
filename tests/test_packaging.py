"""`pip install .` as a user does it: a wheel that is one import name, carries the embedded model's trained
weights, and answers a question from a directory that is not the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the installed product must never put into site-packages: the repository's generic folder names.
GENERIC_NAMES = ["app", "pipeline", "pruning", "vision", "common", "training", "benchmarks", "assets", "tests"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the checkout (the checkout itself is left as it is)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build",
                                                                  "out", "cache", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (root / "dist").glob("glimpse_vl-*.whl")
    return built


def test_the_wheel_holds_one_import_name_and_the_trained_weights(wheel):
    from glimpse.assets import ASSETS
    from glimpse.pipeline import embedded

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    top_level = {name.split("/")[0] for name in names}
    assert {n for n in top_level if not n.endswith(".dist-info")} == {"glimpse"}, top_level
    assert "glimpse = glimpse.launcher:main" in entry_points
    for package in ["glimpse/__init__.py", "glimpse/cli.py", "glimpse/tasks.py", "glimpse/pipeline/engine.py",
                    "glimpse/pruning/dash.py", "glimpse/vision/media.py", "glimpse/common/__init__.py",
                    "glimpse/__main__.py"]:  # python -m glimpse
        assert package in names
    # Every file the embedded model and the slider read at run time, byte for byte as in the checkout.
    shipped = [embedded.PROJECTOR_FILE, embedded.PROJECTOR_RECORD, embedded.ADAPTER_FILE, embedded.COLOUR_FILE,
               ASSETS / "embedded_frontier.json", ASSETS / "sample.png", ASSETS / "sample.mp4"]
    shipped += sorted((ASSETS / "calibration").iterdir())
    with zipfile.ZipFile(wheel) as archive:
        for path in shipped:
            name = "glimpse/assets/" + path.relative_to(ASSETS).as_posix()
            assert name in names, name
            assert archive.read(name) == path.read_bytes(), name
    assert not [n for n in names if n.startswith(("glimpse/training", "glimpse/benchmarks", "glimpse/tests"))]


def test_the_installed_wheel_answers_from_outside_the_checkout(wheel, tmp_path, embedded_cache):
    """A clean environment (the wheel, plus the already-installed dependencies on sys.path but not the editable
    install of this checkout), run from a directory that holds its own `app.py`, as users' directories do."""
    env_dir = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies (torch, transformers, the packaged SmolLM2/DINOv2 weights) come from this venv as a plain
    # path entry: a path added by a .pth file is not scanned for .pth files, so the checkout's editable finder
    # stays out and only the wheel can provide `glimpse`.
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "app.py").write_text("raise SystemExit('the working directory shadowed glimpse')\n")
    (elsewhere / "pipeline.py").write_text("raise SystemExit('the working directory shadowed glimpse')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["GLIMPSE_CACHE"] = str(embedded_cache)
    check = ("import importlib.util, glimpse, glimpse.pipeline, glimpse.assets\n"
             f"print(json.dumps({{'file': glimpse.__file__, 'assets': str(glimpse.assets.ASSETS), "
             f"'generic': [n for n in {GENERIC_NAMES!r} if importlib.util.find_spec(n)]}}))")
    # -I: the working directory is not on sys.path, so only what is installed can answer.
    proc = subprocess.run([str(python), "-I", "-c", "import json\n" + check], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert found["file"].startswith(site) and found["assets"].startswith(site), found
    assert found["generic"] == [], found  # nothing but `glimpse` was installed

    sample = elsewhere / "sample.png"  # a user's own copy: nothing of the checkout is named
    shutil.copy(REPO / "assets" / "sample.png", sample)
    proc = subprocess.run([str(env_dir / "bin" / "glimpse"), "ask", "--image", sample.name, "--max-new-tokens", "8",
                           "--json", "What colour is the circle?"], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    from glimpse.pipeline.embedded import EMBEDDED_GROUNDED

    # The trained projector was found in the installed package data (an ungrounded answer would say so).
    assert out["grounded"] is EMBEDDED_GROUNDED is True
    assert out["metrics"]["prompt_tokens"]["image"] == 256 and out["text"].strip()


def test_the_design_briefs_import_still_works_from_the_checkouts_root():
    """SPEC's `from pipeline import load_engine`, in a script run from the repository's root, is the
    installed `glimpse.pipeline.load_engine` itself (the folder re-exports it), not a second copy."""
    check = ("from pipeline import load_engine\nimport glimpse.pipeline\n"
             "assert load_engine is glimpse.pipeline.load_engine\n")
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
