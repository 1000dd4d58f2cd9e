"""A disk quota for the chat's uploads.

Gradio keeps every file uploaded to the chat in its upload folder, for as long as the server runs, and its upload
route takes files from anyone who can reach the chat (``--max-upload-mb`` bounds one file, not their sum). Left
alone, a client that uploads in a loop fills the disk of the GPU box. ``UploadQuota`` sits in front of the upload
route: an upload is taken only if the folder stays within ``quota_bytes`` and the disk keeps ``RESERVE_BYTES`` (and
``RESERVE_INODES`` files) free; when it would not, uploads older than ``max_age_s`` are deleted first (an old chat's
earlier pictures: later turns go on without them, ``ui._usable``), and if that is not enough the upload is refused
with 507 and a message that says so. The check runs before the body is read, in a worker thread (a folder of 30,000
files took 0.1 s to walk, on the event loop that answers everyone), one walk at a time and at most one a
``REMEASURE_S``: uploads admitted in between are added to the last measure by their length, and once their bodies
are read by their files (each takes a block and a folder at least).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import anyio
from python_multipart.multipart import parse_options_header

from glimpse.connections import error_content, refuse


RESERVE_BYTES = 2**30  # what uploads must leave free on the disk, whatever the quota
# And the files the disk can still hold (its inodes, a fixed number on ext4: one per 16 KiB by default): each upload
# takes two, a file and its folder, and the quota counts them at 8 KiB, so 20 GB of one-byte uploads wanted 5.2
# million, more than a 64 GB disk has, and the disk was full for everyone before the quota was (an outside pass).
# A tenth of the disk's inodes is left free, at most this many (a file system that has no fixed number, btrfs's, says
# it has 0).
RESERVE_INODES = 100_000
# What an upload admitted but not yet on the disk is counted to take of the disk's files, until its body is in: two
# for each part its length could hold (a file and its folder), at most Gradio's 1,000 files a POST. Counted only as
# found on the disk, fifty 200 KB POSTs of 1,000 files each admitted at once ran the disk out of files past the
# reserve (an outside pass).
MAX_UPLOAD_FILES, MIN_PART_BYTES = 1000, 100
# What the smallest file or folder takes on the disk: its block and its inode. Counted by their sizes, 30,528
# one-byte uploads were 20.9 MiB of the quota and 140 MiB of the disk, and empty ones counted for nothing.
ENTRY_BYTES = 4096
REMEASURE_S = 1.0  # the folder is walked again at most this often
# A file an upload is still writing is open in a server's process, and was written to just now; one closed and
# untouched this long is an upload's part left behind (``delete_left_parts``). Where the open files cannot be listed (no
# /proc), only age tells, and a client may pause mid-upload: ``LEFT_PART_S_BLIND``.
LEFT_PART_S, LEFT_PART_S_BLIND = 60.0, 3600.0


def folder_bytes(folder: Path) -> int:
    """What the files and folders under ``folder`` take on the disk, in bytes (0 if it does not exist): each its
    allocated blocks, and at least ``ENTRY_BYTES``."""
    total = 0
    for root, folders, files in os.walk(folder):
        total += ENTRY_BYTES * len(folders)
        for name in files:
            try:
                total += max(os.lstat(os.path.join(root, name)).st_blocks * 512, ENTRY_BYTES)
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


def delete_left_parts(folder: Path) -> None:
    """Delete the parts of uploads left in ``folder``. Gradio's upload route writes each file of an upload to a
    ``tmp...`` file directly in the upload folder, and moves it into a folder of its own once the upload is whole,
    before it answers; a part whose client left mid-upload (or that failed after the body was read, or was not a
    "files" field) stays there, used by nothing and counted against the quota until it is a day old (an outside
    pass: 20 uploads abandoned halfway left 19 MiB). Deleted: those no upload is writing, untouched for
    ``LEFT_PART_S`` and open in no process this user runs (this one, or another server sharing Gradio's default
    folder, /tmp/gradio: one deleted a part the other was still receiving, an outside pass found)."""
    try:
        open_here = _open_files("self")
        cutoff = time.time() - LEFT_PART_S
    except OSError:  # no /proc
        open_here, cutoff = set(), time.time() - LEFT_PART_S_BLIND
    try:
        entries = list(os.scandir(folder))
    except OSError:  # not made yet
        return
    left = []
    for entry in entries:
        try:
            if entry.name.startswith("tmp") and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                if st.st_mtime < cutoff and (st.st_dev, st.st_ino) not in open_here:
                    left.append((entry.path, (st.st_dev, st.st_ino)))
        except OSError:  # moved into its folder, or deleted, while we looked
            pass
    if not left:
        return
    open_anywhere = set()  # (only now: reading every process's open files takes a moment)
    for pid in (name for name in _listing("/proc") if name.isdigit()):
        try:
            open_anywhere |= _open_files(pid)
        except OSError:  # ended, or another user's
            pass
    for path, file in left:
        if file not in open_anywhere:
            try:
                os.unlink(path)
            except OSError:
                pass


def _listing(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _open_files(pid: str) -> set[tuple[int, int]]:
    """The (device, inode) of the files process ``pid`` ("self": this one) holds open (``OSError`` without /proc, or
    for a process this user may not look into)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            found.add((st.st_dev, st.st_ino))
        except OSError:  # closed while we looked (or the listing's own)
            pass
    return found


class UploadQuota:
    """ASGI middleware: POSTs to a path ending in ``/upload`` (Gradio's upload route) are refused with 507 when
    the upload folder would grow past ``quota_bytes`` or the disk would keep less than ``RESERVE_BYTES`` (or
    ``RESERVE_INODES`` files, counting those the uploads admitted may take); 411
    when they do not say their length (a browser always does)."""

    def __init__(self, app, folder: str | Path, quota_bytes: int, max_age_s: float = 24 * 3600):
        self.app, self.folder = app, Path(folder)
        self.quota_bytes, self.max_age_s = quota_bytes, max_age_s
        self.walking = anyio.CapacityLimiter(1)  # uploads waiting for the check wait on the event loop, not in threads
        self.used, self.measured_at = 0, -float("inf")  # the folder's bytes as last measured, plus those admitted since
        self.pending_files = 0  # the disk's files the uploads admitted may take, their bodies not all in yet
        self.pending_lock = threading.Lock()  # (changed by room_for's thread and by the event loop)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].rstrip("/").endswith("/upload"):
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length")
            if length is None or not length.isdigit():
                return await refuse(send, 411, "an upload must state its Content-Length")
            problem = await anyio.to_thread.run_sync(self.room_for, int(length), limiter=self.walking)
            if problem is not None:
                return await refuse(send, 507, problem)
            files_counted = _files_for(int(length))
            # The first Content-Type, as Gradio's route reads it (a dict of the headers keeps the last one given)
            content_type = next((value for name, value in scope.get("headers") or [] if name == b"content-type"), b"")
            status, delimiters = [], _Delimiters(content_type)

            async def counting_parts():
                message = await receive()
                if message["type"] == "http.request":
                    delimiters.feed(message.get("body", b""))
                return message

            async def noting_status(message):
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                await send(message)

            try:
                return await self.app(scope, counting_parts, noting_status)
            except Exception:
                if status == [400]:  # answered by malformed_upload: the client's mistake, not a traceback in the log
                    return
                raise
            finally:
                with self.pending_lock:  # its files are on the disk now, or never will be (at once: no await here)
                    self.pending_files -= files_counted
                # each file past the first (charged on admission) takes its block and its folder's
                if (files := delimiters.count - 1) > 1:
                    await anyio.to_thread.run_sync(self.charge, (files - 1) * 2 * ENTRY_BYTES, limiter=self.walking)
        await self.app(scope, receive, send)

    def charge(self, count: int) -> None:
        """``count`` bytes more in use, until the next walk measures them (called one at a time, as room_for)."""
        self.used += count

    def room_for(self, length: int) -> str | None:
        """None if ``length`` more bytes of uploads fit (after deleting expired ones if needed), else why not. One
        call at a time (``walking``)."""
        if time.monotonic() - self.measured_at > REMEASURE_S:
            self._measure()
        if self._lacks(length) is not None:
            delete_older_than(self.folder, self.max_age_s)
            self._measure()
            if (lacking := self._lacks(length)) is not None:
                return lacking
        self.used += length + 2 * ENTRY_BYTES  # until the next walk counts it: Gradio makes a folder for each file
        with self.pending_lock:
            self.pending_files += _files_for(length)
        return None

    def _measure(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        delete_left_parts(self.folder)
        self.used, self.measured_at = folder_bytes(self.folder), time.monotonic()

    def _lacks(self, length: int) -> str | None:
        """Why an upload of ``length`` bytes does not fit, saying which limit (the operator's remedy differs); None
        if it fits."""
        if self.used + length > self.quota_bytes:
            return (f"the server's room for uploads is full ({_size(self.quota_bytes)}); try again later, or ask its "
                    "operator to raise --max-uploads-gb")
        if shutil.disk_usage(self.folder).free - length < RESERVE_BYTES:
            return ("the server's disk is nearly full (uploads leave it 1 GiB); try again later, or ask its operator "
                    "to free some of it (df -h)")
        disk = os.statvfs(self.folder)  # (a file system without a fixed number of files says it has 0)
        if disk.f_files and disk.f_favail - self.pending_files - _files_for(length) < min(RESERVE_INODES,
                                                                                          disk.f_files // 10):
            return ("the server's disk can hold few more files (uploads leave it a tenth of them); try again later, "
                    "or ask its operator to free some (df -i)")
        return None


def _files_for(length: int) -> int:
    """The disk's files (inodes) an upload of ``length`` bytes may take: a file and its folder for each part it
    could hold."""
    return 2 * min(MAX_UPLOAD_FILES, length // MIN_PART_BYTES + 1)


class _Delimiters:
    """Counts the part delimiters of a multipart body as it streams by (``--`` and the boundary; a body of n parts
    has n + 1): the files of an upload are known only once its body is read. Charged only by its length, a POST of
    1,000 one-byte files (8 MiB on the disk) counted as 150 KB, and four such overshot a 1 MiB quota 16 times."""

    def __init__(self, content_type: bytes):
        # Read as Gradio's upload route reads it (python-multipart: any case, the whole name, the last one given): read
        # another way, "BOUNDARY=B" or "xboundary=Z; boundary=B" counted no file, and a POST of 200 files was charged
        # as one (an outside pass).
        boundary = parse_options_header(content_type)[1].get(b"boundary", b"")
        self.marker, self.count, self.tail = (b"--" + boundary if boundary else b""), 0, b""

    def feed(self, data: bytes) -> None:
        if not self.marker:
            return
        data = self.tail + data  # a delimiter split between two chunks is counted once, with the second
        self.count += data.count(self.marker)
        self.tail = data[-(len(self.marker) - 1):]


def _size(count: int) -> str:
    """Bytes in the unit that shows them (a 10 MB quota was said to be "0.0 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"


async def malformed_upload(request, error: Exception):
    """The chat's handler of a request that raised (``exception_handlers`` of Gradio's app): on the upload route, a
    400. Gradio's upload route raises on a file part with no file name (AttributeError, TypeError): a 500 for the
    client's mistake. Any other route's, and a failure of the disk, stay a 500."""
    from starlette.responses import JSONResponse, PlainTextResponse

    if request.method == "POST" and request.url.path.rstrip("/").endswith("/upload") and not isinstance(error, OSError):
        return JSONResponse(error_content('a malformed upload: each file part needs a file name (Content-Disposition: '
                                          'form-data; name="files"; filename="...")', "bad_upload"), status_code=400)
    return PlainTextResponse("Internal Server Error", status_code=500)
