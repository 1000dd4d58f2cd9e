"""A disk quota for the chat's uploads.

Gradio keeps every file uploaded to the chat in its upload folder, for as long as the server runs, and its
upload route takes files from anyone who can reach the chat (``--max-upload-mb`` bounds one file, not their
sum). Left alone, a client that uploads in a loop fills the disk of the GPU box. ``UploadQuota`` sits in
front of the upload route: an upload is taken only if the folder stays within ``quota_bytes`` and the disk
keeps ``RESERVE_BYTES`` free; when it would not, uploads older than ``max_age_s`` are deleted first (an old
chat's earlier pictures: later turns go on without them, ``ui._usable``), and if that is not enough the upload
is refused with 507 and a message that says so. The check runs before the body is read.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from glimpse.connections import refuse


RESERVE_BYTES = 2**30  # what uploads must leave free on the disk, whatever the quota


def folder_bytes(folder: Path) -> int:
    """What the files under ``folder`` take, in bytes (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # deleted while we looked
                pass
    return total


def delete_older_than(folder: Path, max_age_s: float) -> None:
    """Delete the files under ``folder`` last modified more than ``max_age_s`` ago, and the folders this empties."""
    cutoff = time.time() - max_age_s
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            try:
                if os.lstat(path).st_mtime < cutoff:
                    os.unlink(path)
            except OSError:  # deleted while we looked
                pass
        if Path(root) != Path(folder):
            try:
                os.rmdir(root)  # only if now empty
            except OSError:
                pass


class UploadQuota:
    """ASGI middleware: POSTs to a path ending in ``/upload`` (Gradio's upload route) are refused with 507 when
    the upload folder would grow past ``quota_bytes`` or the disk would keep less than ``RESERVE_BYTES``; 411
    when they do not say their length (a browser always does)."""

    def __init__(self, app, folder: str | Path, quota_bytes: int, max_age_s: float = 24 * 3600):
        self.app, self.folder = app, Path(folder)
        self.quota_bytes, self.max_age_s = quota_bytes, max_age_s

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/").endswith("/upload"):
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length")
            if length is None or not length.isdigit():
                return await refuse(send, 411, "an upload must state its Content-Length")
            if (problem := self.room_for(int(length))) is not None:
                return await refuse(send, 507, problem)
        await self.app(scope, receive, send)

    def room_for(self, length: int) -> str | None:
        """None if ``length`` more bytes of uploads fit (after deleting expired ones if needed), else why not."""
        if self._fits(length):
            return None
        delete_older_than(self.folder, self.max_age_s)
        if self._fits(length):
            return None
        return (f"the server's room for uploads is full ({self.quota_bytes / 2**30:.1f} GiB, or the disk is nearly "
                f"full); try again later, or ask its operator to raise --max-uploads-gb")

    def _fits(self, length: int) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.folder).free
        return folder_bytes(self.folder) + length <= self.quota_bytes and free - length >= RESERVE_BYTES
