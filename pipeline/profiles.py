"""Per-model calibration profiles (HiDivDrop's ILVAS filtering layers, the slider's frontier), kept in
the Glimpse cache.

A profile is a small JSON file under ``$GLIMPSE_CACHE/profiles`` (default ``~/.cache/glimpse``),
named after the model: a hub id as given, a local folder by its absolute path. It records the
identity of the weights it was measured on (``checkpoint_identity``): ``load_engine`` reads the
profile of the model it loads only when that identity and the depth match, so new weights under
the same name (a fine-tune saved over its folder, a new hub revision, the embedded model's retrained
files) run uncalibrated until they are calibrated, never under another model's measurements. The
engine applies the profile to the policies it builds (an explicit parameter override still wins).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from glimpse.common import UserError

logger = logging.getLogger(__name__)
# The damaged profiles already warned of, as (path, size, modification time): the slider's profile is read for the
# policy and again for its promise, and the warning printed twice.
_WARNED: set[tuple[str, int, int]] = set()


def cache_root() -> Path:
    """Where Glimpse keeps what it makes (the embedded model's conversion, slider profiles): $GLIMPSE_CACHE, else
    ~/.cache/glimpse."""
    try:
        return Path(os.environ.get("GLIMPSE_CACHE") or Path.home() / ".cache" / "glimpse").expanduser()
    except RuntimeError:  # no $HOME and no passwd entry for this user (a pod's arbitrary runAsUser, `env -i`)
        raise UserError("no home folder to keep Glimpse's cache in: set GLIMPSE_CACHE to a writable folder") from None


def model_key(model: str) -> str:
    """What identifies a model across runs: a local folder's absolute path, else the hub id."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def checkpoint_identity(source: str) -> str:
    """What changes when a checkpoint's weights do: its folder (a hub download's snapshot folder, which
    names the revision) and the name, size and modification time of each weight file in it. A hub id
    not in the local cache is its own identity."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from transformers.utils import cached_file

        try:
            # the download load_engine just read: no second trip to the hub on every load
            config = cached_file(source, "config.json", local_files_only=True,
                                 _raise_exceptions_for_missing_entries=False,
                                 _raise_exceptions_for_connection_errors=False)
        except OSError:
            config = None
        if not config:
            return str(source)
        folder = Path(config).parent
    weights = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
    return f"{folder.resolve()}#{hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:12]}"


def profile_matches(profile: dict | None, checkpoint: str, num_layers: int) -> bool:
    """Whether a stored profile was measured on these weights (a profile from before identities were
    recorded was not, as far as anyone can tell)."""
    return bool(profile) and profile.get("checkpoint") == checkpoint and profile.get("num_layers") == num_layers


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
        profile = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not a whole JSON profile"
        # Ignored, and said: the policy falls back to its defaults (the slider to its shipped or uncalibrated
        # frontier), which an outside pass found happening without a word after a profile was cut short.
        warn_file_once(path, f"ignoring the {policy} profile {path} ({reason}): using the defaults; calibrate "
                             "again to replace it")
        return None
    if not isinstance(profile, dict):
        warn_file_once(path, f"ignoring the {policy} profile {path} (not a profile): using the defaults")
        return None
    return profile


def warn_unusable(model: str, policy: str, profile: dict, num_layers: int, damaged: str = "") -> None:
    """Say why a stored profile that ``profile_matches`` turned down (or whose ``damaged`` content could not be
    used) is not used (once per state of the file): an outside pass saw a profile of ``{}`` passed over without a
    word, and a profile of older weights is as silent."""
    path = profile_path(model, policy)
    if damaged:
        warn_file_once(path, f"ignoring the {policy} profile {path} ({damaged}): using the defaults; calibrate "
                             "again to replace it")
    elif "checkpoint" not in profile or "num_layers" not in profile:
        warn_file_once(path, f"ignoring the {policy} profile {path} (not a profile): using the defaults; "
                             "calibrate again to replace it")
    elif profile.get("num_layers") != num_layers:
        warn_file_once(path, f"ignoring the {policy} profile {path}: it was measured on a model of "
                             f"{profile['num_layers']} layers, this one has {num_layers}; calibrate again to replace "
                             "it")
    else:
        warn_file_once(path, f"ignoring the {policy} profile {path}: it was measured on other weights "
                             f"({profile['checkpoint']}); calibrate again to replace it")


def warn_file_once(path: Path, message: str) -> None:
    """``message`` once for this state of the file (changed, it is said again)."""
    try:
        state = path.stat()
        seen = (str(path), state.st_size, state.st_mtime_ns)
    except OSError:
        seen = (str(path), -1, -1)
    if seen not in _WARNED:
        _WARNED.add(seen)
        logger.warning("%s", message)


def save_profile(model: str, profile: dict, policy: str = "hidivdrop", path: Path | None = None) -> Path:
    path = Path(path) if path else profile_path(model, policy)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own beside it: ``path.with_suffix(".tmp")`` replaced a user's notes.tmp next to notes.json (an
    # outside pass), and two writers would have shared it.
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(profile, indent=1))
        os.chmod(tmp, 0o644)  # mkstemp's file is private; a profile in a shared cache is read by other users
        os.replace(tmp, path)  # atomic: a reader never sees half a profile
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
