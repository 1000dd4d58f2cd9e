"""Per-model calibration profiles (HiDivDrop's ILVAS filtering layers), kept in the Glimpse cache.

A profile is a small JSON file under ``$GLIMPSE_CACHE/profiles`` (default ``~/.cache/glimpse``),
named after the model: a hub id as given, a local folder by its absolute path. ``load_engine``
reads the profile of the model it loads; the engine applies it to the policies it builds (an
explicit parameter override still wins).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("GLIMPSE_CACHE") or Path.home() / ".cache" / "glimpse").expanduser()


def model_key(model: str) -> str:
    """What identifies a model across runs: a local folder's absolute path, else the hub id."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def profile_path(model: str, policy: str = "hidivdrop") -> Path:
    key = model_key(model)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key).strip("-")[-60:]
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return cache_root() / "profiles" / f"{policy}-{slug}-{digest}.json"


def load_profile(model: str, policy: str = "hidivdrop") -> dict | None:
    path = profile_path(model, policy)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a damaged profile is ignored: the policy falls back to its defaults


def save_profile(model: str, profile: dict, policy: str = "hidivdrop", path: Path | None = None) -> Path:
    path = Path(path) if path else profile_path(model, policy)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(path)  # atomic: a reader never sees half a profile
    return path
