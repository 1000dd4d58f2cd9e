"""Reading user media: images with PIL, videos with PyAV (or decord, opt-in).

Everything a user can hand Glimpse goes through this module, so it is where bad files are caught. Every
failure caused by the file itself is a `MediaError` whose message names the file and says what is wrong
in words a user understands; callers (CLI, web chat, batch captioning) show the message as is.

Safety rules, and why:

- Image pixel counts are checked from the header before any pixel is decoded: a tiny PNG can claim
  20000x20000 pixels and cost gigabytes to decode (a "decompression bomb").
- Images are fully decoded here (`Image.load()`), so a truncated file fails now with a `MediaError`
  rather than later inside a model processor with an obscure traceback.
- Videos are decoded sequentially, keeping only the requested frames, so memory is bounded by the frames
  asked for, not by the length of the video; each is passed through the caller's `transform` (a resize) as
  it is decoded, so only resized frames are held together. Long jumps between requested frames use a
  keyframe seek. Frame sizes are checked from the header too: a 200 KB MP4 can declare 8192x8192 frames.
- decord is faster than PyAV but can hang on some files, so when it is selected it runs in a separate
  'spawn' process that is killed after a timeout. PyAV, the default, runs in-process (no process start,
  no copy of the frames between processes); it returns errors on damaged files rather than hanging.
- Reading can be bounded in time and stopped from outside (`reading_limit`): a server reads media for
  clients it does not trust, and a 600 KB MP4 can hold 20,000 frames behind one keyframe, which no seek can
  skip (18 s of decoding on two cores; 50 MB can hold 80 times as many). The limit is checked between a video's
  packets and between a request's images and videos, not on a timer: no thread is interrupted.
"""

from __future__ import annotations

import errno
import importlib.util
import io
import itertools
import logging
import math
import multiprocessing
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import av
import numpy as np
from PIL import Image, ImageOps, JpegImagePlugin, UnidentifiedImageError

from glimpse.common import UserError


logger = logging.getLogger(__name__)

ImageSource = Union[str, os.PathLike, bytes, Image.Image]
FrameTransform = Callable[[np.ndarray], np.ndarray]  # one decoded uint8 RGB frame (H, W, 3) -> what is kept of it

# 64 MP covers every phone and DSLR photo; anything larger is almost certainly a mistake or an attack.
MAX_IMAGE_PIXELS = 64_000_000
# Longest side over shortest side: Qwen2-VL's processor refuses more than 200:1, and no model here sees anything in
# such a strip (it becomes a few hundred pixels wide). Refused for every model from the header, before decoding:
# a 180 KB PNG of 63,000,000x1 pixels took 14 s and 2.7 GB to become the embedded model's 224x224 input.
MAX_IMAGE_ASPECT = 200
# Video frames above this are refused before decoding: a file of a few hundred KB can declare 8192x8192
# frames (200 MB each once decoded). 8K UHD (33 MP) is the largest frame cameras record.
MAX_VIDEO_FRAME_PIXELS = 7680 * 4320
DEFAULT_VIDEO_TIMEOUT_S = 60.0
# The longest a request's images and videos may take to read (decoded and preprocessed, all of them together): the
# bound on what a crafted file can make the server do for one request, well past what real media take
# (docs/serving.md, "Admission, queue and limits"). ``glimpse serve --media-timeout``.
MEDIA_TIMEOUT_S = 60.0
# Inputs whose media are read at once: the server's requests (Scheduler.media_readers), glimpse caption's inputs.
MEDIA_READERS = max(2, os.cpu_count() or 2)
# Environment variable that opts into decord ("decord") instead of PyAV ("pyav", the default).
VIDEO_BACKEND_ENV = "GLIMPSE_VIDEO_BACKEND"
# Seeking only pays off when it skips more than a keyframe interval (x264's default is 250 frames):
# a seek lands on the keyframe before the target and decodes forward from there anyway.
SEEK_MIN_GAP_FRAMES = 300

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".avif", ".ico"})
# The PIL decoders an image may reach: the formats above (JPEG includes phones' multi-picture MPO files; DIB is
# BMP without its file header) and ICO. PIL otherwise tries each of its ~40 plugins on any bytes, EPS
# among them, which runs Ghostscript on the file when it is installed: no upload should reach that.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "DIB", "GIF", "TIFF", "AVIF", "ICO")
VIDEO_EXTENSIONS = frozenset(
    {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".wmv", ".flv", ".3gp", ".ts"}
)


class NamedBytes(bytes):
    """An image's bytes with the name its errors should use (the API's ``messages[0].content[1] (a data URL)``),
    where plain bytes are called "image data"."""

    def __new__(cls, data: bytes, name: str):
        made = super().__new__(cls, data)
        made.name = name
        return made

    def __reduce__(self):
        return (type(self), (bytes(self), self.name))


class MediaError(UserError):
    """A file Glimpse cannot use as an image or video; the message names the file and the problem."""


class ReadingStopped(MediaError):
    """Reading was stopped by whoever asked for it (``reading_limit``'s ``stop``): its client left, or the server
    is shutting down. Not the file's fault."""


@dataclass(frozen=True)
class _ReadingLimit:
    seconds: float | None
    deadline: float | None  # time.monotonic()
    stop: Callable[[], bool] | None


# The limit of the reading under way in this thread (a context variable, as ``decimal``'s context or anyio's cancel
# scopes are): set once around a request's media by whoever serves it, and read where the work is, a video's packets,
# without threading a parameter through every model's sampling code in between.
_READING_LIMIT: ContextVar[_ReadingLimit | None] = ContextVar("glimpse_media_reading_limit", default=None)


@contextmanager
def reading_limit(seconds: float | None, stop: Callable[[], bool] | None = None) -> Iterator[None]:
    """Within the block, in this thread: reading images and videos raises ``MediaError`` once ``seconds`` have passed
    since the block began (all of its media together: one request's), and ``ReadingStopped`` once ``stop()`` is
    true. Checked before each packet of a video is demuxed or decoded, before each image or video, before each read
    of an image's file (64 KB at most while it decodes), and after an image is decoded, before it is converted and
    resized (``check_reading``). ``seconds=None``: no time limit."""
    deadline = None if seconds is None else time.monotonic() + seconds
    token = _READING_LIMIT.set(_ReadingLimit(seconds, deadline, stop))
    try:
        yield
    finally:
        _READING_LIMIT.reset(token)


def check_reading(source: Any) -> None:
    """Raise if the reading under way (``reading_limit``) is to stop now; ``source``: what is being read (a path, an
    image's bytes), for the message."""
    limit = _READING_LIMIT.get()
    if limit is None:
        return
    if limit.stop is not None and limit.stop():
        raise ReadingStopped(f"{_display_name(source)}: reading it was stopped")
    if limit.deadline is not None and time.monotonic() > limit.deadline:
        raise MediaError(f"{_display_name(source)}: reading the images and videos of this request took longer than "
                         f"{limit.seconds:g} s, the limit, and was stopped: send a shorter or smaller video (one whose "
                         "frames can only be reached by decoding all of them takes longest), or fewer pictures")


class _TooFewFramesError(MediaError):
    """Fewer frames could be decoded than the container declares (a truncated or damaged file).

    Carries the number of frames that did decode, so samplers can plan again over what is really there.
    """

    def __init__(self, message: str, decodable_frames: int):
        super().__init__(message)
        self.decodable_frames = decodable_frames

    def __reduce__(self):  # keep `decodable_frames` when the error crosses from a decord worker process
        return (type(self), (str(self), self.decodable_frames))


def _display_name(src: Any) -> str:
    """The name used in error messages: the file name for paths, a generic word for in-memory data."""
    if isinstance(src, (str, os.PathLike)):
        return Path(src).name or str(src)
    if isinstance(src, NamedBytes):
        return src.name
    return "image data" if isinstance(src, (bytes, bytearray)) else "image"


def local_path(value: str | os.PathLike) -> str | os.PathLike:
    """The local path a ``file://`` URL names (RFC 8089: no host or ``localhost``, percent-encoded: ``file:///a%20b``
    is ``/a b``), anything else as it is. ``file://`` was cut off as a prefix: ``file://localhost/x`` became the
    relative path ``localhost/x``, and an encoded name was looked up encoded ("file not found" for a file that is
    there). RFC 8089's minimal form ``file:/a`` (Java's ``File.toURI``) is the same file as ``file:///a``."""
    if not (isinstance(value, str) and value[:5].lower() == "file:" and value[5:6] == "/"):
        return value
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(value)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{value}: a file on another host (file://{parts.netloc}/...): only local files can be read")
    return unquote(parts.path)


def _check_file(path: str | os.PathLike) -> Path:
    """Missing and empty files get their own clear messages instead of a decoder's complaint."""
    path = local_path(path)  # the chat format allows file:// URLs
    if isinstance(path, str) and "://" in path:
        raise MediaError(f"{path}: a URL, not a local file (download it first; the server's API fetches http(s) URLs)")
    if (isinstance(path, str) and re.match(r"data:[^,;]*(;[^,;]*)*,", path[:300], re.IGNORECASE)
            and not os.path.lexists(path)):  # read as a file name, it was "File name too long"
        raise MediaError(f"{path[:40]}...: a data URL, not a local file (give its decoded bytes, or a file; the "
                         "server's API reads data URLs)")
    if "\0" in str(path):  # no file has such a name (pathlib says "file not found", the NUL unseen in a terminal)
        raise MediaError(f"{str(path)[:200]!r}: a name with a NUL byte, which no file has")
    path = Path(path)
    try:
        return _checked_file(path)
    except MediaError:
        raise
    except OSError as error:  # a name too long for the file system, a folder it may not enter: one clear line
        shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:200]}..."
        raise MediaError(f"{shown}: cannot be read as a file ({error.strerror or error})") from None


def _checked_file(path: Path) -> Path:
    if path.is_dir():
        raise MediaError(f"{_display_name(path)}: a folder, not an image or video file")
    if not path.exists():  # the path as given: which folder it was looked for in is the point
        if path.is_symlink():  # "file not found" for a name that is there, listed: say what is missing
            try:
                os.stat(path)
            except OSError as error:  # links that lead back to themselves were said to lead to nothing
                if error.errno == errno.ELOOP:
                    raise MediaError(f"{path}: a symbolic link to {os.readlink(path)}, which leads round in a "
                                     "loop") from None
            raise MediaError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist")
        raise MediaError(f"{path}: file not found")
    if not path.is_file():  # a device, pipe or socket: reading it could block or never end
        raise MediaError(f"{_display_name(path)}: not a regular file (a device, pipe or socket)")
    if path.stat().st_size == 0:
        raise MediaError(f"{_display_name(path)}: the file is empty")
    if not os.access(path, os.R_OK):  # "not an image Glimpse can read (it reads JPEG, PNG, ...)" said a damaged file
        raise MediaError(f"{_display_name(path)}: cannot be read (permission denied)")
    return path


def _open_regular(path: Path) -> io.FileIO:
    """``path``, checked a regular file (``_check_file``), opened for reading as one. Between that check and this
    open, whoever may write its folder can put a pipe in its place, and opening a pipe waits for a writer: a thread
    reading a captioning run's inputs waited for ever, where neither --media-timeout (checked between reads) nor
    Ctrl-C (which waits for the readers) could end it (an outside pass, 2026-12-07). Opened without waiting
    (O_NONBLOCK), what the name holds now is looked at on the descriptor itself. Videos too: FFmpeg reads the
    descriptor opened here (``_open_container``); decord, optional, still opens them by name."""
    nonblocking = getattr(os, "O_NONBLOCK", 0)  # (POSIX's: Windows has no such open, nor pipes in folders)
    fd = os.open(path, os.O_RDONLY | nonblocking | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MediaError(f"{_display_name(path)}: not a regular file (a device, pipe or socket)")
        if nonblocking:
            os.set_blocking(fd, True)
        file = io.FileIO(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    file.name = str(path)  # (its descriptor's number otherwise)
    return file


# ----------------------------------------------------------------------------------------------- kinds


def _sniff_kind(head: bytes) -> Literal["image", "video"] | None:
    """Recognise the common image and video formats from their first bytes (magic numbers)."""
    if head.startswith((b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
                        b"\x00\x00\x01\x00")):  # ... TIFF, ICO (read as the API read it; `glimpse ask` refused .ico)
        return "image"
    if head[:4] == b"RIFF":
        return {b"WEBP": "image", b"AVI ": "video"}.get(head[8:12])
    if head[4:8] == b"ftyp":  # ISO base media: mp4/mov, but also the AVIF/HEIF still-image formats
        brand = head[8:12]
        if brand in (b"avif", b"avis"):
            return "image"
        return None if brand in (b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1") else "video"
    if head.startswith((b"\x1aE\xdf\xa3", b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3", b"FLV", b"0&\xb2u", b"YUV4MPEG2")):
        return "video"  # Matroska/WebM, MPEG-PS, MPEG video, FLV, ASF/WMV, raw YUV (whose header is text)
    return None


def _holds_text(head: bytes) -> bool:
    """First bytes that are all printable text: no image or video format Glimpse reads starts so (raw YUV is
    recognised before this is asked)."""
    return all(32 <= byte < 127 or byte in (9, 10, 13) for byte in head)


def detect_kind(path: str | os.PathLike) -> Literal["image", "video"]:
    """Say whether a file is an image or a video: by content first, then by extension.

    Content wins because files are often misnamed (a PNG saved as .jpg); the extension is the fallback
    for containers without a reliable signature (e.g. MPEG-TS).
    """
    path = _check_file(path)
    with _open_regular(path) as file:
        head = file.read(32)
    kind = _sniff_kind(head)
    suffix = path.suffix.lower()
    named_media = suffix in IMAGE_EXTENSIONS or suffix in VIDEO_EXTENSIONS
    if kind is None and named_media and _holds_text(head):
        raise MediaError(f"{path.name}: not an image or video: it holds text")
    if kind is None and suffix in IMAGE_EXTENSIONS:
        kind = "image"
    elif kind is None and suffix in VIDEO_EXTENSIONS:
        kind = "video"
    if kind is None:
        reason = f"unsupported type {suffix}" if suffix else "unrecognised content, no file extension"
        raise MediaError(f"{path.name}: not an image or video Glimpse can read ({reason})")
    return kind


# ---------------------------------------------------------------------------------------------- images


def _check_pixel_count(size: tuple[int, int], max_pixels: int, name: str) -> None:
    width, height = size
    if width < 1 or height < 1:  # a PIL crop of no area: a ZeroDivisionError deep in a resize, or 256 tokens of nothing
        raise MediaError(f"{name}: the image is empty ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise MediaError(
            f"{name}: image too large ({width}x{height} = {width * height / 1e6:.0f} MP, "
            f"limit {max_pixels / 1e6:.0f} MP)"
        )
    if max(width, height) > MAX_IMAGE_ASPECT * max(1, min(width, height)):
        raise MediaError(f"{name}: image too long and thin ({width}x{height}, more than {MAX_IMAGE_ASPECT}:1)")


def _check_icon_pictures(fp, name: str, max_pixels: int) -> None:
    """An ICO's pictures checked as every picture is, from their headers: PIL decodes an icon as it opens it, before
    any check of its size, and an icon's directory may say 256x256 of a PNG 13000x13000 inside (an outside pass: 2.4
    s and 650 MB for a 656 KB file, refused only afterwards). Each entry's own header is read: a PNG's IHDR, or a
    BMP's info header (its height counts the mask too)."""
    head = fp.read(6)
    try:
        if len(head) < 6 or head[:4] != b"\0\0\1\0":  # not an icon
            return
        entries = fp.read(16 * int.from_bytes(head[4:6], "little"))
        for at in range(0, len(entries) - 15, 16):
            fp.seek(int.from_bytes(entries[at + 12:at + 16], "little"))
            picture = fp.read(24)
            if picture[:8] == b"\x89PNG\r\n\x1a\n":
                size = int.from_bytes(picture[16:20], "big"), int.from_bytes(picture[20:24], "big")
            elif picture[:4] == b"\x0c\0\0\0":  # OS/2's 12-byte BITMAPCOREHEADER: 16-bit sides
                size = int.from_bytes(picture[4:6], "little"), int.from_bytes(picture[6:8], "little") // 2
            else:
                size = (abs(int.from_bytes(picture[4:8], "little", signed=True)),
                        abs(int.from_bytes(picture[8:12], "little", signed=True)) // 2)
            if min(size) > 0:  # (an empty or cut entry is PIL's to refuse)
                _check_pixel_count(size, max_pixels, name)
    finally:
        fp.seek(0)


class _AsksBeforeEachRead:
    """Mixed into a binary file: each read first asks ``check_reading`` whether the reading goes on. PIL decodes a
    picture from reads of at most 64 KB, so a picture's decoding stops within one of them once its client has left or
    its request's time is up (a 64 MP PNG's decoding, 0.9-2.5 s on two cores, ran to its end until 2026-12-06: a stop
    0.3 s into it now takes effect at 0.30 s, not 0.93 s); a read costs one more function call (no slower measured)."""

    source: Any  # what is read, for the message

    def read(self, size: int | None = -1, /) -> bytes:
        check_reading(self.source)
        return super().read(size)


class _PictureFile(_AsksBeforeEachRead, io.BufferedReader):
    def __init__(self, path: Path, source: Any):
        super().__init__(_open_regular(path))
        self.source = source


class _PictureBytes(_AsksBeforeEachRead, io.BytesIO):
    def __init__(self, data: bytes, source: Any):
        super().__init__(data)
        self.source = source


def _open_image(src: str | os.PathLike | bytes, name: str, max_pixels: int) -> tuple[Image.Image, io.IOBase]:
    """Open an image lazily: PIL reads only the header here, no pixels are decoded yet. Its file asks
    ``check_reading`` before each read (``_AsksBeforeEachRead``), its decoding's too. Returned with the image, for
    the caller to close: PIL closes only a file it opened itself (it let go of this one unclosed, a ResourceWarning
    for every JPEG)."""
    if isinstance(src, (bytes, bytearray)) and not src:
        raise MediaError(f"{name}: the file is empty")
    try:
        fp: Any = (_PictureBytes(src, src) if isinstance(src, (bytes, bytearray))
                   else _PictureFile(_check_file(src), src))
        try:
            _check_icon_pictures(fp, name, max_pixels)
            return Image.open(fp, formats=IMAGE_FORMATS), fp
        except BaseException:
            fp.close()
            raise
    except MediaError:  # stopped or out of time (``check_reading``), or ``_check_file``'s: not an unreadable picture
        raise
    except Image.DecompressionBombError as error:
        # PIL's own guard fires in `open` for claims above 2 x Image.MAX_IMAGE_PIXELS (~179 MP); say so in
        # the same words as our own, smaller, limit.
        claimed = re.search(r"\((\d+) pixels\)", str(error))
        size = f"{int(claimed.group(1)) / 1e6:.0f} MP" if claimed else "over PIL's decompression-bomb limit"
        raise MediaError(f"{name}: image too large ({size}, limit {max_pixels / 1e6:.0f} MP)") from error
    # (RuntimeError: PIL's AVIF plugin says so of a file it cannot decode, an internal error until 2026-12-07.)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, RuntimeError) as error:
        if _is_video(src):  # the commonest mix-up: say what it is
            raise MediaError(f"{name}: this is a video, not an image; pass it as a video") from error
        if _has_image_signature(src):  # a PNG cut short, or one whose text chunk unpacks past PIL's limit
            raise MediaError(f"{name}: the image is corrupt or truncated (it starts as an image, but its header "
                             "cannot be read)") from error
        suffix = Path(src).suffix.lower() if not isinstance(src, (bytes, bytearray)) else ""
        detail = f"unsupported type {suffix}; " if suffix and suffix not in IMAGE_EXTENSIONS else ""
        raise MediaError(f"{name}: not an image Glimpse can read ({detail}it reads {', '.join(IMAGE_FORMATS)})") from error


def _has_image_signature(src: str | os.PathLike | bytes) -> bool:
    """Whether ``src`` starts with the magic number of an image format (it said "not an image Glimpse can read
    (it reads JPEG, PNG, ...)" of a truncated PNG)."""
    if isinstance(src, (bytes, bytearray)):
        return _sniff_kind(bytes(src[:32])) == "image"
    try:
        with _open_regular(Path(src)) as file:
            return _sniff_kind(file.read(32)) == "image"
    except (OSError, MediaError):
        return False


def _is_video(src: str | os.PathLike | bytes) -> bool:
    """Whether ``src`` is a video, as ``detect_kind`` judges a file (content first, then extension)."""
    if isinstance(src, (bytes, bytearray)):
        return _sniff_kind(bytes(src[:32])) == "video"
    try:
        return detect_kind(src) == "video"
    except (MediaError, OSError):
        return False


def _to_8bit(image: Image.Image) -> Image.Image:
    """16-bit and 32-bit greyscale to 8-bit "L", scaling the range instead of clipping it.

    PIL's own convert("L") clips these modes at 255, which turns most 16-bit images white. Integer
    images whose values fit in 0..255 are kept as they are.
    """
    values = np.asarray(image).astype(np.float64)
    if image.mode.startswith("I;16") or (image.mode == "I" and values.max(initial=0) > 255):
        values = values / 257.0  # 65535 -> 255
    return Image.fromarray(np.clip(np.round(values), 0, 255).astype(np.uint8), mode="L")


def _to_rgb(image: Image.Image, colour_key: bool = False) -> Image.Image:
    """Any PIL mode to RGB. Transparent pixels become white, as qwen-vl-utils does, not black: those of an alpha band,
    of a palette's transparent entries, and with ``colour_key`` (``_has_colour_key``) those of the one colour a
    PNG's tRNS chunk marks transparent in a greyscale or RGB picture."""
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        key = image.info.get("transparency") if colour_key else None
        # (PIL's convert ignores a 16-bit picture's colour key: it is matched here, on the values before scaling)
        transparent = np.asarray(image) == key if isinstance(key, int) else None
        image = _to_8bit(image)
        if transparent is not None:
            image.putalpha(Image.fromarray(np.where(transparent, 0, 255).astype(np.uint8)))  # now "LA"
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode == "P" and "transparency" in image.info
    ) or (colour_key and image.mode in ("L", "RGB"))  # convert("RGBA") applies the key
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")  # also L, 1, P, CMYK, YCbCr; always a new image


def _has_colour_key(opened: Image.Image) -> bool:
    """Whether ``opened``, a file not yet decoded, is a PNG whose tRNS chunk marks one colour transparent in a way the
    decoded pixels can be matched against: 8-bit greyscale or RGB (PIL applies the key), 16-bit greyscale (matched
    before scaling). Not 16-bit RGB, of which PIL keeps 8 bits a sample while the key keeps 16 (matched against
    them, opaque pixels turned white), nor 1-, 2- and 4-bit greyscale, whose pixels PIL scales and whose key it
    does not; nor a picture handed in already decoded (a palette picture converted to RGB keeps its key, which its
    owner took out of use)."""
    if opened.format != "PNG" or not opened.tile:
        return False
    key, rawmode = opened.info.get("transparency"), opened.tile[0][3]
    if rawmode in ("L", "I;16B"):
        return isinstance(key, int)
    return rawmode == "RGB" and isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) for v in key)


# A picture larger than what the model's processor resizes it to is resized to that size here (the processor then
# has nothing left to do), as PIL's own ``Image.thumbnail`` resizes. Up to 2 x FIT_GAP times larger on each side, by
# the one call the processor would make, to the same bytes. Larger, it is first decoded at a reduced scale where the
# format allows (JPEG's DCT scaling, ``Image.draft``) and reduced by an integer factor (a box filter), each to no less
# than FIT_GAP times the size, and then resized with the processor's filter: PIL documents a gap of 3 as
# indistinguishable from resampling the whole picture in most cases.
FIT_GAP = 3.0


@dataclass(frozen=True)
class ImageFit:
    """What a model's image processor does to a picture's size (``Adapter.image_fit``): ``size_for(width, height)``
    is the (width, height) it resizes a picture of that size to, and ``resample`` the PIL filter it resizes with.
    A JPEG is decoded at a reduced scale to no less than ``jpeg_gap`` times that size: ``FIT_GAP``, or 1 where the
    processor still reduces the fitted picture that much itself (LLaVA-NeXT's anyres, whose fit is a whole multiple of
    its tiling, no less than ``FIT_GAP`` times it)."""

    size_for: Callable[[int, int], tuple[int, int]]
    resample: int
    jpeg_gap: float = FIT_GAP


def _orientation(image: Image.Image) -> int:
    """The picture's EXIF orientation: 1 upright, 2-8 flipped or turned (6 or 8: a phone held upright)."""
    try:
        value = image.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 — a malformed EXIF block: load_image ignores its orientation too
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _upright_box(box: tuple[float, float, float, float], size: tuple[int, int], orientation: int):
    """``box`` (left, top, right, bottom) of a picture of ``size`` as stored, on the picture turned upright by its
    EXIF ``orientation`` (as ``ImageOps.exif_transpose`` turns it)."""
    width, height = size
    upright = {  # where a point (x, y) of the stored picture lands on the upright one
        2: lambda x, y: (width - x, y), 3: lambda x, y: (width - x, height - y), 4: lambda x, y: (x, height - y),
        5: lambda x, y: (y, x), 6: lambda x, y: (height - y, x), 7: lambda x, y: (height - y, width - x),
        8: lambda x, y: (y, width - x),
    }.get(orientation)
    if upright is None:
        return box
    (x0, y0), (x1, y1) = upright(*box[:2]), upright(*box[2:])
    return min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)


def _fit_size(size: tuple[int, int], fit: ImageFit | None) -> tuple[int, int] | None:
    """The (width, height) the model's processor would resize an upright picture of ``size`` to, when that is a
    reduction on both sides (an enlargement is left to the processor); None otherwise."""
    if fit is None:
        return None
    width, height = size
    try:
        target = tuple(int(n) for n in fit.size_for(width, height))
    except ValueError:  # a shape the processor refuses (Qwen's aspect ratio over 200): it says so itself
        return None
    return target if target != (width, height) and target[0] <= width and target[1] <= height else None


def _decode(opened: Image.Image, src: ImageSource, name: str) -> None:
    """``opened``'s pixels decoded; a file that does not decode raises ``MediaError``."""
    try:
        opened.load()
    except MediaError:  # stopped or out of time while it decoded (``check_reading``): not the file's fault
        raise
    except Image.DecompressionBombError as error:
        raise MediaError(f"{name}: image too large ({error})") from error
    except (OSError, SyntaxError, ValueError, EOFError, RuntimeError) as error:  # (RuntimeError: AVIF's)
        raise MediaError(f"{name}: the image is corrupt or truncated ({error})") from error
    check_reading(src)  # (its file's last read may have come before the end of its decoding)


def load_image(src: ImageSource, *, max_pixels: int = MAX_IMAGE_PIXELS, fit: ImageFit | None = None) -> Image.Image:
    """Load an image as a fully decoded, upright RGB `PIL.Image`.

    `src` is a path, the file's bytes, or a PIL image. The pixel count is checked against `max_pixels`
    from the header, before decoding; EXIF orientation is applied so phone photos are upright; palette,
    alpha, CMYK and 16-bit images become 8-bit RGB. Animated images give their first frame.
    `fit` (the model's processor, `ImageFit`): a picture larger than it takes is resized to its size here, a large
    JPEG decoded at a reduced scale (`FIT_GAP`): a 12 MP JPEG photo took 0.29 s on two cores to become the embedded
    model's 224x224 input, decoded whole and resized by the processor, and 0.03 s so (docs/benchmarks.md).
    Any problem with the file raises `MediaError`.
    """
    name = _display_name(src)
    opened, file = (src, None) if isinstance(src, Image.Image) else _open_image(src, name, max_pixels)
    try:
        _check_pixel_count(opened.size, max_pixels, name)
        colour_key = opened is not src and _has_colour_key(opened)  # (read before decoding: it reads the tile)
        # A JPEG is decoded after its orientation is read (from its header) and its reduced scale chosen; any other
        # picture first: reading a PNG's EXIF decodes it (its EXIF chunk may come after the pixels), and a corrupt
        # PNG's decoding error was taken for a bad EXIF block there, the picture marked decoded, and the model
        # answered about its garbage pixels without a word (an outside pass).
        jpeg = isinstance(opened, JpegImagePlugin.JpegImageFile) and opened is not src
        if not jpeg:
            _decode(opened, src, name)
        orientation = _orientation(opened) if fit is not None else 1
        turns = orientation in (5, 6, 7, 8)
        upright_size = opened.size[::-1] if turns else opened.size  # (before a reduced-scale decoding changes it)
        fitted = _fit_size(upright_size, fit)
        box = None  # the picture's extent in the pixels of its reduced-scale decoding
        # (A phone's JPEG with a gain map or a depth map opens as an MPO, a JPEG with more pictures after its first.)
        if fitted is not None and jpeg:
            at_least = (math.ceil(fitted[0] * fit.jpeg_gap), math.ceil(fitted[1] * fit.jpeg_gap))
            drafted = opened.draft(None, at_least[::-1] if turns else at_least)  # in the stored orientation
            if drafted is not None and opened.size != (upright_size[::-1] if turns else upright_size):
                # At 1/8 scale a side of 3001 pixels decodes to 376, the last of them 1/8 of a pixel wide: resized
                # as if it were whole, the picture was stretched by up to a pixel (1-2% of the range on average, on
                # the tests' photos). ``Image.thumbnail`` resizes by this box too.
                box = _upright_box(drafted[1], opened.size, orientation)
        if jpeg:
            _decode(opened, src, name)
        try:
            upright = ImageOps.exif_transpose(opened)
        except Exception as error:  # a malformed EXIF block must not make a readable image unusable
            logger.warning("%s: ignoring unreadable EXIF orientation (%s)", name, error)
            upright, fitted = opened, None  # (the size fitted was for the picture turned: the processor resizes it)
        try:
            rgb = _to_rgb(upright, colour_key)
        except (ValueError, OSError) as error:  # exotic modes such as LAB or HSV
            raise MediaError(f"{name}: unsupported colour mode {upright.mode}") from error
        if fitted is None or rgb.size == fitted:
            return rgb
        resized = rgb.resize(fitted, fit.resample, box=box, reducing_gap=FIT_GAP)
        # The picture's own size. Its proportions, which a model with a fixed input size (the embedded model's
        # 224x224) does not keep, draw the chat's keep map (app/ui.py); LLaVA-NeXT unpads its tiles' features by it.
        resized.info["source_size"] = upright_size
        return resized
    finally:
        if file is not None:
            opened.close()
            file.close()


# ---------------------------------------------------------------------------------------------- videos


@dataclass(frozen=True)
class VideoInfo:
    """What a video container says about its (first) video stream."""

    num_frames: int
    fps: float
    duration_s: float  # num_frames / fps, the convention qwen-vl-utils uses for sampling
    width: int
    height: int
    backend: str  # "pyav" or "decord": the reader that produced this info and will decode the frames
    # The frames the file says it holds, where that is more than it does (``num_frames``, what is there): a Matroska or
    # WebM file declares no frame count, only its duration, and one cut short was sampled from what was left without a
    # word (an outside pass); its frames are counted, and those its duration declares estimated from them.
    declared_frames: int | None = None


def _choose_backend(backend: str | None) -> str:
    """`backend` argument, else $GLIMPSE_VIDEO_BACKEND, else PyAV; decord only if it is installed."""
    requested = (backend or os.environ.get(VIDEO_BACKEND_ENV) or "pyav").lower()
    if requested not in ("pyav", "decord"):  # a user's setting: one clear line, not "a bug in Glimpse" (outside pass)
        where = "" if backend else f" (${VIDEO_BACKEND_ENV})"
        raise UserError(f"unknown video backend {requested!r}{where}: use 'pyav' or 'decord'")
    if requested == "decord" and importlib.util.find_spec("decord") is None:
        logger.warning("decord was requested but is not installed; reading videos with PyAV")
        return "pyav"
    return requested


def check_video_backend() -> None:
    """``$GLIMPSE_VIDEO_BACKEND`` checked as a server or a captioning run starts: a bad value was found at the first
    video, each request refused with it as if the client's mistake, after images had worked (an outside pass)."""
    _choose_backend(None)


# What reading a video's file can raise part-way: FFmpeg's errors, and an OSError of the file object FFmpeg reads
# through (``_VideoFile`` turns its reads' into the file's end; its seeks' are PyAV's to hand back).
_READ_ERRORS = (av.FFmpegError, OSError)


class _VideoFile:
    """What FFmpeg reads a video through (``_open_container``): the file Glimpse opened and checked. A read that
    fails part-way (EIO from a failing disk, NFS or USB drive) ends the file there, said once, as it was when FFmpeg
    opened the file itself: raised through PyAV, the OSError ended the request naming no file, and was printed as a
    traceback at each read FFmpeg tried again ("PyAV library exception being dropped")."""

    def __init__(self, file: io.FileIO):
        self.file, self.name, self.failed = file, file.name, False

    def read(self, size: int = -1) -> bytes:
        if self.failed:
            return b""
        try:
            return self.file.read(size)
        except OSError as error:
            self.failed = True
            logger.warning("%s: reading stopped early (%s)", Path(self.name).name, error.strerror or error)
            return b""

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()


@contextmanager
def _open_container(path: Path) -> Iterator[av.container.InputContainer]:
    """The video opened for demuxing, through a descriptor opened as ``_open_regular`` opens one: FFmpeg opening
    the name itself waited for ever on a pipe put in the file's place after its check (a folder whoever may write).
    FFmpeg reads it through the file object (and takes the name's extension as its hint, as it would by name)."""
    with _open_regular(path) as file:
        try:
            container = av.open(_VideoFile(file), mode="r")
        except (av.FFmpegError, OSError, ValueError) as error:
            raise MediaError(f"{path.name}: the video is corrupt or truncated: the file cannot be opened") from error
        with container:
            yield container


# Video streams that are pictures, not the video: a file's cover art, thumbnails, stills.
_STILL_STREAMS = av.stream.Disposition.attached_pic | av.stream.Disposition.timed_thumbnails \
    | av.stream.Disposition.still_image


def _video_stream(container: av.container.InputContainer, name: str) -> av.VideoStream:
    """The file's video: its first video stream that is not cover art, a thumbnail or a still (a cover picture
    first was sampled as the video, eight copies of it)."""
    if not container.streams.video:
        raise MediaError(f"{name}: the file has no video stream")
    moving = [stream for stream in container.streams.video if not stream.disposition & _STILL_STREAMS]
    stream = (moving or container.streams.video)[0]
    if stream.codec_context is None:  # a codec FFmpeg does not know, or a damaged header naming none (an outside
        # pass: "AttributeError: 'NoneType' object has no attribute 'width'", an internal error)
        raise MediaError(f"{name}: the video is corrupt or its codec is unknown (no decoder for its stream)")
    return stream


def _stream_fps(stream: av.VideoStream, name: str) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or float(rate) <= 0:
        raise MediaError(f"{name}: the video does not say its frame rate")
    return float(rate)


def _count_packets(container: av.container.InputContainer,
                   stream: av.VideoStream) -> tuple[int, tuple[float, float] | None, float | None]:
    """Frame count for containers that do not store it (Matroska/WebM, FLV): demux, without decoding. And when the
    frames start and end, in seconds (None if the packets carry no times), and when the file's last packet of any
    stream ends (an audio track may run on past the video: a file cut short cuts every stream).

    One packet holds one frame for the codecs Glimpse meets; the final flush packet is empty.
    """
    count, first, end, timed, last = 0, None, None, False, None
    try:
        for packet in container.demux():
            check_reading(container.name)  # a few megabytes of tiny packets are millions of them
            if packet.size <= 0:
                continue
            video = packet.stream.index == stream.index
            count += video
            if packet.pts is None or packet.time_base is None:
                continue
            start = float(packet.pts * packet.time_base)
            ends = start + float((packet.duration or 0) * packet.time_base)
            last = ends if last is None else max(last, ends)
            if video:
                first = start if first is None else min(first, start)
                end = ends if end is None else max(end, ends)
                timed = timed or bool(packet.duration)
    except _READ_ERRORS:
        return 0, None, None
    if first is not None and not timed and count > 1:  # (FLV's packets give no duration: the last lasts as the rest)
        end += (end - first) / (count - 1)
        last = max(last, end)
    return count, None if first is None else (first, end), last


def _declared_frames(container: av.container.InputContainer, counted: int,
                     span: tuple[float, float] | None, last: float | None) -> int | None:
    """The frames a Matroska/WebM or FLV file's declared duration holds, when its frames end short of it, and so
    does every other stream's packets (under 90%: a file cut short; an audio track running on past the video is
    no cut, and was warned of as one, an outside pass): those counted, and those its missing time holds at the rate
    they came (by time, not by the declared frame rate: a variable-rate file's is an average). None otherwise, or
    without a declared duration (a browser's MediaRecorder writes none; FLV's onMetaData has one only when the file
    was closed, not streamed). Its duration counts from time 0, as its frames' times do (a clip starting at 1000 s
    declares 1100 s)."""
    if not container.format.name.startswith(("matroska", "flv")) or not container.duration or span is None:
        return None
    (first, end), declared_s = span, container.duration / av.time_base
    if max(end, last or end) >= 0.9 * declared_s or end <= first:
        return None
    return counted + round(counted / (end - first) * (declared_s - end))


def _check_frame_size(width: int, height: int, name: str) -> None:
    if width * height > MAX_VIDEO_FRAME_PIXELS:
        raise MediaError(f"{name}: video frames too large ({width}x{height} = {width * height / 1e6:.0f} MP, "
                         f"limit {MAX_VIDEO_FRAME_PIXELS / 1e6:.0f} MP)")
    # As for pictures: CLIP's processor (LLaVA-NeXT-Video, LongVA) scales the shortest edge to 336, and a 97 KB clip
    # of 60000x2 frames asked for 10 GB a frame (an outside pass); Qwen's refused it only after decoding a frame.
    if max(width, height) > MAX_IMAGE_ASPECT * max(1, min(width, height)):
        raise MediaError(f"{name}: video frames too long and thin ({width}x{height}, more than {MAX_IMAGE_ASPECT}:1)")


def _indexed_frames(container: av.container.InputContainer, stream: av.VideoStream) -> int:
    """The frames an MP4/MOV's index lists and its decoder gives (0 for other containers). Its declared count is
    wrong both ways: a fragmented file (ffmpeg's ``-movflags frag_keyframe``, crash-safe recorders) declares the
    frames of its first fragment only, and 12 s were read as their first second, without a warning; a trimmed clip
    (an edit list: ``ffmpeg -ss ... -c copy``, a phone's trim) declares the frames its edit leaves out, which made
    a false "damaged or truncated" warning, and a long one decoded whole twice (an outside pass). The index, read
    as the file opens, lists every fragment's frames and marks those the edit leaves out as discarded."""
    if not container.format.name.startswith("mov,"):
        return 0
    return sum(1 for entry in stream.index_entries if entry.size > 0 and not entry.is_discard)


def _probe_pyav(path: Path) -> VideoInfo:
    with _open_container(path) as container:
        stream = _video_stream(container, path.name)
        fps = _stream_fps(stream, path.name)
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, path.name)
        num_frames, declared = _indexed_frames(container, stream) or stream.frames, None
        if not num_frames:
            num_frames, span, last = _count_packets(container, stream)
            declared = _declared_frames(container, num_frames, span, last)
    if num_frames <= 0:
        raise MediaError(f"{path.name}: the video is corrupt or truncated: it contains no frames")
    return VideoInfo(num_frames, fps, num_frames / fps, width, height, "pyav", declared)


class _StreamFrames:
    """The stream's frames from the current position, as they decode (iterate it). A packet the decoder refuses
    (garbage inside the data: a damaged download or disk) is skipped, as players skip it, and decoding goes on from
    the next (``skipped`` counts them): until 2026-12-07 the first one ended the video, and a clip damaged a third of
    the way in was answered from that third. Where the file itself ends early (demuxing fails: a truncated file)
    reading stops, but the frames the decoder already holds are still drained: with frame threading those are
    several frames that decoded fine."""

    def __init__(self, container: av.container.InputContainer, stream: av.VideoStream):
        self.container, self.stream, self.skipped = container, stream, 0

    def __iter__(self) -> Iterator[av.VideoFrame]:
        container, codec, reason = self.container, self.stream.codec_context, None
        try:
            for packet in container.demux(self.stream):
                check_reading(container.name)  # a video's work is in its packets: where a time limit or a stop acts
                try:
                    frames = codec.decode(packet)  # the final, empty packet flushes the decoder
                except av.FFmpegError as error:
                    self.skipped, reason = self.skipped + 1, error
                    continue
                yield from frames
            return
        except _READ_ERRORS as error:
            # The file's name, not its path (for fetched media that is a temporary folder of the server's), and
            # FFmpeg's reason without the path it appends.
            logger.warning("%s: decoding stopped early (%s)", Path(container.name).name,
                           getattr(error, "strerror", None) or error)
        finally:  # also when the reader has its frames and closes this generator early
            if self.skipped:
                logger.warning("%s: %d damaged packet%s skipped (%s)", Path(container.name).name, self.skipped,
                               "s" if self.skipped > 1 else "", getattr(reason, "strerror", None) or reason)
        try:
            yield from codec.decode(None)
        except av.FFmpegError:
            pass


class _SeekFailed(Exception):
    """A seek failed, landed after its target, or met a frame without timestamp: decode sequentially."""


def _iter_wanted_frames(
    container: av.container.InputContainer, stream: av.VideoStream, wanted: Sequence[int], seek_min_gap: float,
    lost: list[int],
) -> Iterator[tuple[int, av.VideoFrame | None]]:
    """Yield `(index, frame)` for each index of `wanted` (ascending, unique); if the stream ends before
    the last one, yield `(number of frames in the stream, None)` last.

    Frames are numbered in presentation order from 0 by counting decoded frames. To skip a long gap the
    decoder seeks to the keyframe before the target; from then on frames are numbered from their
    timestamps, which agrees with counting for constant-frame-rate video (nearly all recorded video). So are the
    frames past a damaged stretch (packets the decoder refused: ``_StreamFrames``), where counting falls short by
    the frames lost (the frames after it, and Qwen2.5-VL's and Qwen3-VL's times of them, came early by as much: an
    outside pass); a wanted frame lost there is stood for by the first frame after the stretch, and the frames lost
    are appended to ``lost``.
    """
    reader = _StreamFrames(container, stream)
    frames = iter(reader)
    first = next(frames, None)
    if first is None:
        yield 0, None
        return
    frames = itertools.chain([first], frames)
    fps = float(stream.average_rate) if stream.average_rate else 0.0
    can_seek = fps > 0 and first.pts is not None and stream.time_base is not None
    after_seek = False
    position = 0  # index of the next frame while counting (before any seek)
    held = None  # (index, frame): read past a wanted frame lost in a damaged stretch; it may stand for more
    for target in wanted:
        if held is not None and held[0] >= target:
            yield target, held[1]
            continue
        held = None
        if can_seek and target - position > seek_min_gap:
            target_pts = first.pts + int(target / fps / stream.time_base)
            try:
                container.seek(target_pts, stream=stream, backward=True, any_frame=False)
            except _READ_ERRORS as error:
                raise _SeekFailed from error
            reader = _StreamFrames(container, stream)
            frames, after_seek = iter(reader), True
        for frame in frames:
            if after_seek:
                if frame.pts is None:
                    raise _SeekFailed
                index = round(float((frame.pts - first.pts) * stream.time_base) * fps)
                if index > target and position <= target:  # landed past the target: timestamps unreliable
                    raise _SeekFailed
            elif reader.skipped and can_seek and frame.pts is not None:  # past a damaged stretch
                index = max(position, round(float((frame.pts - first.pts) * stream.time_base) * fps))
                if index > position:
                    lost.append(index - position)
            else:
                index = position
            position = index + 1
            if index == target:
                yield index, frame
                break
            if index > target:  # the target was lost in a damaged stretch: the first frame after it stands for it
                held = (index, frame)
                yield target, frame
                break
        else:  # end of stream
            if after_seek:
                # Reached only by seeking: the timestamps, not the file, may have ended short of the target (variable
                # frame rate: 1,000 frames 10 ms apart, then 100 a second apart, read as "110 of 1,100 frames").
                # Counted frame by frame instead, which also tells a truncated file's real length.
                raise _SeekFailed
            yield position, None
            return


@dataclass
class DecodedFrames:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB, one per index asked for
    lost: int = 0  # frames lost in damaged stretches before the last one asked for (stood for by the next that decoded)


def _decode_pyav(path: Path, indices: Sequence[int], transform: FrameTransform | None = None,
                 seek_min_gap: float = SEEK_MIN_GAP_FRAMES) -> DecodedFrames:
    wanted = sorted(set(indices))
    kept: dict[int, np.ndarray] = {}
    frame_count = None  # known only if the stream ends before the last wanted frame
    lost: list[int] = []
    with _open_container(path) as container:
        stream = _video_stream(container, path.name)
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, path.name)
        # The header gives the first frame's size, and a stream may change it later (MJPEG can at every frame):
        # the decoder itself refuses a frame past the limit, before allocating it (a 64x64 header hid 16000x16000
        # frames: 4 GB for one question), and a frame of another size is scaled to the header's, as players do
        # (stacking the frames failed with "all input arrays must have the same shape").
        stream.codec_context.options = {"max_pixels": str(MAX_VIDEO_FRAME_PIXELS)}
        # Frame-threaded decoding: several times faster on multi-core CPUs. Not VP8's: with frame threads its decoder
        # reports no damaged packet and hands back the garbage it made of them (a damaged MediaRecorder WebM was
        # answered from such frames without a word: an outside pass); slice threads report them.
        stream.thread_type = "SLICE" if stream.codec_context.name == "vp8" else "AUTO"
        try:
            for index, frame in _iter_wanted_frames(container, stream, wanted, seek_min_gap, lost):
                if frame is None:
                    frame_count = index
                else:
                    resized = width > 0 and height > 0 and (frame.width, frame.height) != (width, height)
                    array = (frame.to_ndarray(format="rgb24", width=width, height=height) if resized
                             else frame.to_ndarray(format="rgb24"))
                    kept[index] = transform(array) if transform is not None else array
        except _SeekFailed:
            logger.info("%s: seeking is unreliable here, decoding sequentially", path.name)
            return _decode_pyav(path, indices, transform, seek_min_gap=math.inf)
    return DecodedFrames(_assemble(kept, indices, path.name, frame_count), sum(lost))


def _assemble(kept: dict[int, np.ndarray], indices: Sequence[int], name: str, frame_count: int | None) -> np.ndarray:
    """Stack the decoded frames in the order asked for, or say how many frames the file really holds."""
    if frame_count == 0:
        raise _TooFewFramesError(f"{name}: the video is corrupt or truncated: no frame could be decoded", 0)
    missing = [index for index in indices if index not in kept]
    if missing:
        decodable = frame_count if frame_count is not None else max(kept, default=-1) + 1
        raise _TooFewFramesError(
            f"{name}: the video is corrupt or truncated: frame {missing[0]} was requested "
            f"but only {decodable} frames could be decoded",
            decodable,
        )
    return np.stack([kept[index] for index in indices])


def _decord_failure(path: Path, error: Exception) -> MediaError:
    """decord's errors are C++ log lines: log them, tell the user something readable."""
    logger.warning("%s: decord failed: %s", path.name, error)
    return MediaError(f"{path.name}: the video is corrupt or truncated (decord cannot read it)")


def _probe_decord(path: Path) -> VideoInfo:
    import decord

    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        num_frames, fps = len(reader), float(reader.get_avg_fps())
        height, width = reader[0].shape[:2] if num_frames else (0, 0)
    except Exception as error:  # decord raises its own DECORDError for any bad input
        raise _decord_failure(path, error) from error
    if num_frames <= 0 or fps <= 0:
        raise MediaError(f"{path.name}: the video is corrupt or truncated: it contains no frames")
    _check_frame_size(width, height, path.name)
    return VideoInfo(num_frames, fps, num_frames / fps, width, height, "decord")


def _decode_decord(path: Path, indices: Sequence[int]) -> np.ndarray:
    import decord

    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        num_frames = len(reader)
    except Exception as error:
        raise _decord_failure(path, error) from error
    wanted = sorted(set(indices))
    if num_frames == 0 or wanted[-1] >= num_frames:
        raise _TooFewFramesError(
            f"{path.name}: the video is corrupt or truncated: frame {wanted[-1]} was requested "
            f"but the video has {num_frames} frames",
            num_frames,
        )
    try:
        batch = reader.get_batch(wanted).asnumpy()
    except Exception as error:
        raise _decord_failure(path, error) from error
    return _assemble(dict(zip(wanted, batch)), indices, path.name, num_frames)


def _worker_main(connection: Any, function: Callable[..., Any], args: tuple) -> None:
    """Entry point of the decord worker process: send back (True, result) or (False, MediaError)."""
    try:
        reply: tuple[bool, Any] = (True, function(*args))
    except MediaError as error:
        reply = (False, error)
    except Exception as error:
        reply = (False, MediaError(f"{Path(args[0]).name}: the video cannot be read ({error})"))
    connection.send(reply)
    connection.close()


def _run_in_worker(function: Callable[..., Any], args: tuple, *, timeout_s: float, name: str) -> Any:
    """Run `function(*args)` in a fresh 'spawn' process and kill it if it takes more than `timeout_s`.

    A process, not a thread, because a thread stuck inside native decoder code cannot be stopped; 'spawn',
    not 'fork', because forking a process that holds torch/CUDA or decoder threads is unsafe. Startup
    costs about a second (the child imports this package), small next to decoding a video.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_worker_main, args=(sender, function, args), daemon=True)
    process.start()
    sender.close()  # the child holds the only sending end: EOF now means the child died
    killed_at = time.monotonic() + timeout_s
    try:
        # Waited for in slices, so that ``reading_limit``'s time limit and stop act on it too.
        while not receiver.poll(min(0.25, max(0.0, killed_at - time.monotonic()))):
            check_reading(name)
            if time.monotonic() >= killed_at:
                raise MediaError(
                    f"{name}: reading the video took longer than {timeout_s:g} s and was stopped; "
                    "the file may be damaged"
                )
        succeeded, payload = receiver.recv()
    except EOFError:
        process.join(5)
        raise MediaError(f"{name}: the video decoder crashed (exit code {process.exitcode})") from None
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receiver.close()
    if succeeded:
        return payload
    raise payload


def check_media(path: str | os.PathLike, kind: Literal["image", "video"]) -> None:
    """What can be told of a media file from its first bytes and its header, without decoding it: missing, empty,
    a folder, the other kind (a picture given as a video), an unreadable type, an image's or a video's frame size
    over the limits, a video with no video stream. A ``MediaError`` saying which, so that a command can refuse
    it before loading a model; decoding can still fail later (a truncated file)."""
    detect_kind(path)  # missing, empty, a folder, text, an unsupported type
    if kind == "video":
        probe_video(path)  # refuses a picture too
        return
    name = _display_name(Path(local_path(path)))
    image, file = _open_image(path, name, MAX_IMAGE_PIXELS)  # refuses a video too
    try:
        _check_pixel_count(image.size, MAX_IMAGE_PIXELS, name)
    finally:
        image.close()
        file.close()


def probe_video(
    path: str | os.PathLike, *, backend: str | None = None, timeout_s: float = DEFAULT_VIDEO_TIMEOUT_S
) -> VideoInfo:
    """Frame count, frame rate, duration and size of a video, without decoding its frames.

    Containers that do not store a frame count (Matroska/WebM) are counted by demuxing.
    """
    path = _check_file(path)
    with _open_regular(path) as file:
        head = file.read(32)
    kind = _sniff_kind(head)
    if kind == "image":  # PyAV reads a picture as a one-frame clip (in which things "moved")
        raise MediaError(f"{path.name}: this is an image, not a video; pass it as an image")
    if kind is None and _holds_text(head):  # said as `glimpse ask` says it before loading (check_media), not
        raise MediaError(f"{path.name}: not an image or video: it holds text")  # "corrupt"; nor is a playlist opened
    if _choose_backend(backend) == "decord":
        return _run_in_worker(_probe_decord, (path,), timeout_s=timeout_s, name=path.name)
    return _probe_pyav(path)


def decode_frames(
    path: str | os.PathLike,
    indices: Sequence[int],
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_VIDEO_TIMEOUT_S,
    transform: FrameTransform | None = None,
) -> DecodedFrames:
    """Decode the frames at `indices` (0-based, any order, repeats allowed) as uint8 RGB, (T, H, W, 3).

    `transform` (a resize, typically) is applied to each frame as it is decoded, so that only what it returns
    is kept: the full-size frames of a long video never sit in memory together. Frames larger than
    `MAX_VIDEO_FRAME_PIXELS` are refused before any is decoded.

    The backend is PyAV unless `backend="decord"` or $GLIMPSE_VIDEO_BACKEND=decord and decord is
    installed; decord then runs in a worker process killed after `timeout_s` seconds (PyAV runs
    in-process; `timeout_s` does not apply to it, `reading_limit` applies to both). Frames are numbered as decoded,
    in presentation order; rotation metadata of phone videos is not applied (neither qwen-vl-utils nor decord applies it).
    A file that cannot be decoded, or that holds fewer frames than asked for, raises `MediaError`. A damaged
    stretch inside the file is skipped (PyAV): a frame asked for that was lost there is stood for by the first frame
    after it, and `DecodedFrames.lost` counts the frames lost.
    """
    path = _check_file(path)
    indices = [int(index) for index in indices]
    if not indices or min(indices) < 0:
        raise ValueError(f"frame indices must be a non-empty list of non-negative integers, got {indices[:8]}")
    if _choose_backend(backend) == "decord":
        frames = _run_in_worker(_decode_decord, (path, indices), timeout_s=timeout_s, name=path.name)
        return DecodedFrames(frames if transform is None else np.stack([transform(frame) for frame in frames]))
    return _decode_pyav(path, indices, transform)


def read_frames(
    path: str | os.PathLike,
    indices: Sequence[int],
    *,
    backend: str | None = None,
    timeout_s: float = DEFAULT_VIDEO_TIMEOUT_S,
    transform: FrameTransform | None = None,
) -> np.ndarray:
    """``decode_frames``'s frames, (T, H, W, 3) uint8 RGB."""
    return decode_frames(path, indices, backend=backend, timeout_s=timeout_s, transform=transform).frames


