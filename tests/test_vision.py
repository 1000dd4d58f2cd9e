"""vision/: media loading and its errors, qwen-vl-utils sampling rules, Qwen2-VL video patches.

All media are generated in temporary folders. Test videos encode each frame's index in its colour
(`_frame_colour` / `_frame_index`), so a test can check which source frames were picked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import os
import re
import struct
import time
import zlib
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import EpsImagePlugin, Image, ImageFile

from conftest import write_damaged_video
from glimpse.common import UserError
from glimpse import vision
from glimpse.assets import ASSETS
from glimpse.vision import media as media_module
from glimpse.vision import sampling


# ------------------------------------------------------------------------------------------- helpers

CLIP_FRAMES, CLIP_FPS, CLIP_SIZE = 30, 10, (64, 48)  # 3 s at 10 fps, width x height


def _frame_colour(index: int) -> tuple[int, int, int]:
    """Index -> colour with 16 grey levels between neighbours, far more than lossy coding changes."""
    return (index % 16) * 16, (index // 16) * 16, 128


def _frame_index(frame: np.ndarray) -> int:
    red, green = frame[..., 0].mean(), frame[..., 1].mean()
    return round(red / 16) + 16 * round(green / 16)


def _write_video(path: Path, frames: int = CLIP_FRAMES, fps: int = CLIP_FPS, gop: int | None = None,
                 container_options: dict | None = None, size: tuple[int, int] = CLIP_SIZE,
                 pts: list[int] | None = None, time_base=None) -> Path:
    """Frame i a solid colour that encodes i (``_frame_index``); ``pts``: each frame's timestamp in ``time_base``."""
    width, height = size
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w", options=container_options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if time_base is not None:
            stream.time_base = time_base
        if gop:
            stream.codec_context.gop_size = gop
        for index in range(frames):
            array = np.empty((height, width, 3), dtype=np.uint8)
            array[...] = _frame_colour(index)
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[index], time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _decodable_frame_count(path: Path) -> int:
    """Ground truth for damaged files: how many frames a plain PyAV loop gets before the first error."""
    count = 0
    with av.open(str(path)) as container:
        try:
            for _ in container.decode(video=0):
                count += 1
        except av.FFmpegError:
            pass
    return count


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height 1-bit pixels but holds no pixel data: opening it reads the
    header; decoding it must fail. So "too large" proves the size was checked before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # bit depth 1, greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return _write_video(tmp_path_factory.mktemp("video") / "clip.mp4")


# -------------------------------------------------------------------------------------------- images


def test_load_image_applies_exif_orientation():
    # Stored 40x20 with red left, blue right; orientation 6 = "rotate 90 degrees clockwise to display",
    # so the upright image is 20x40 with red on top.
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, "JPEG", exif=exif, quality=95)

    image = vision.load_image(buffer.getvalue())

    assert image.size == (20, 40)
    top, bottom = np.asarray(image)[5, 10], np.asarray(image)[35, 10]
    assert top[0] > 200 and top[2] < 50
    assert bottom[2] > 200 and bottom[0] < 50


def test_a_picture_whose_turn_cannot_be_applied_is_not_fitted_to_its_turned_size(monkeypatch):
    """A picture resized as it is decoded (``ImageFit``) is fitted upright. When its EXIF orientation names a turn
    that cannot be applied (a malformed block), it stays as stored, and is not squashed into the size fitted for it
    turned: the model's processor resizes it."""
    stored = Image.new("RGB", (1200, 600), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, "JPEG", exif=exif, quality=95)
    fit = vision.ImageFit(lambda width, height: (width // 10, height // 10), Image.Resampling.BICUBIC)
    assert vision.load_image(buffer.getvalue(), fit=fit).size == (60, 120)  # upright, fitted

    def unreadable(image):
        raise SyntaxError("not a TIFF file")

    monkeypatch.setattr(media_module.ImageOps, "exif_transpose", unreadable)
    image = vision.load_image(buffer.getvalue(), fit=fit)
    assert image.width == 2 * image.height and image.width >= 120  # as stored (decoded at a reduced scale)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_jpeg_decoded_at_a_reduced_scale_is_fitted_without_stretching_whatever_its_orientation(orientation):
    """A JPEG whose sides the reduced scale does not divide (1001x603 at 1/8: 126x76 pixels, the last column 1/8 and the
    last row 3/8 of a pixel wide) fits as the picture decoded whole and resized does, stored in each of EXIF's eight
    orientations: the partial pixels are where the turned picture has them. Resized as if they were whole pixels,
    the picture was stretched towards that corner (found 2026-12-06: 2% of the range on average here, 0.18% now)."""
    from glimpse.pipeline.random_checkpoint import photo_like

    upright = photo_like(1001, 603, seed=3)
    to_stored = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
                 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
                 8: Image.Transpose.ROTATE_270}  # the inverse of each orientation's turn
    stored = upright.transpose(to_stored[orientation]) if orientation in to_stored else upright
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    stored.save(buffer, "JPEG", exif=exif, quality=95)
    fit = vision.ImageFit(lambda width, height: (width // 40, height // 40), Image.Resampling.BICUBIC)

    fitted = vision.load_image(buffer.getvalue(), fit=fit)
    whole = vision.load_image(buffer.getvalue())
    assert whole.size == (1001, 603) and fitted.size == (25, 15)
    reference = whole.resize(fitted.size, Image.Resampling.BICUBIC)
    difference = np.abs(np.asarray(fitted, dtype=float) - np.asarray(reference, dtype=float)) / 255
    assert difference.mean() < 0.004 and difference.max() < 0.05, (difference.mean(), difference.max())


def test_a_phone_jpeg_with_a_second_picture_is_fitted_as_a_plain_jpeg_is():
    """A phone's JPEG that carries a gain map or a depth map after its picture opens in PIL as an MPO. It is decoded
    at a reduced scale as a plain JPEG is: the same pixels as the plain JPEG of its first picture (decoded whole and
    resized, an MPO took 6x as long to fit, and gave other pixels)."""
    from glimpse.pipeline.random_checkpoint import photo_like

    picture, gain_map = photo_like(1600, 1200), photo_like(400, 300, seed=1)
    plain, with_map = io.BytesIO(), io.BytesIO()
    picture.save(plain, "JPEG", quality=90)
    picture.save(with_map, "MPO", save_all=True, append_images=[gain_map], quality=90)
    assert Image.open(with_map).format == "MPO"
    fit = vision.ImageFit(lambda width, height: (width // 16, height // 16), Image.Resampling.BICUBIC)
    fitted = vision.load_image(with_map.getvalue(), fit=fit)
    assert fitted.size == (100, 75)
    assert np.array_equal(np.asarray(fitted), np.asarray(vision.load_image(plain.getvalue(), fit=fit)))


@pytest.mark.parametrize(
    "source, expected",
    [
        (Image.new("RGBA", (2, 2), (255, 0, 0, 0)), (255, 255, 255)),  # fully transparent -> white
        (Image.new("RGBA", (2, 2), (255, 0, 0, 128)), (255, 127, 127)),  # half over white: 255*127/255
        (Image.new("LA", (2, 2), (0, 0)), (255, 255, 255)),
        (Image.new("CMYK", (2, 2), (0, 255, 255, 0)), (255, 0, 0)),  # no cyan, full magenta+yellow = red
        (Image.new("L", (2, 2), 77), (77, 77, 77)),
        (Image.fromarray(np.full((2, 2), 65535, dtype=np.uint16)), (255, 255, 255)),  # 16-bit: 65535/257
        (Image.fromarray(np.full((2, 2), 32896, dtype=np.uint16)), (128, 128, 128)),  # 32896/257 = 128
    ],
    ids=["rgba-clear", "rgba-half", "la", "cmyk", "l", "16bit-max", "16bit-mid"],
)
def test_load_image_converts_modes_to_rgb(source, expected):
    image = vision.load_image(source)
    assert image.mode == "RGB"
    assert np.abs(np.asarray(image)[0, 0].astype(int) - expected).max() <= 1


def test_load_image_palette_transparency_becomes_white():
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 0  # palette entry 0 (black) is transparent
    assert np.asarray(vision.load_image(image)).tolist() == [[[255, 255, 255], [255, 0, 0]]]


def test_a_file_the_user_may_not_read_is_said_to_be_so(tmp_path, monkeypatch):
    """A picture in a folder the user may not read was "not an image Glimpse can read (it reads JPEG, PNG, ...)", as
    if damaged, and a video gave Python's raw error (an outside pass). (Checked by ``os.access``: root reads all.)"""
    import glimpse.vision.media as media_module

    picture = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(picture)
    monkeypatch.setattr(media_module.os, "access", lambda path, mode, **kwargs: False)
    for read in (vision.load_image, vision.probe_video):
        with pytest.raises(vision.MediaError, match=r"photo\.png: cannot be read \(permission denied\)"):
            read(picture)


def test_pixel_cap_is_checked_before_decoding():
    # 3000x3000 = 9 MP over a 1 MP cap: rejected from the header, never decoded (there are no pixels).
    with pytest.raises(vision.MediaError, match=r"image too large \(3000x3000 = 9 MP, limit 1 MP\)"):
        vision.load_image(_png_header_only(3000, 3000), max_pixels=1_000_000)
    # Under the cap, the same kind of file gets to decoding, which fails: so the check above came first.
    with pytest.raises(vision.MediaError, match="corrupt or truncated"):
        vision.load_image(_png_header_only(300, 300), max_pixels=1_000_000)


def test_a_long_thin_strip_is_refused_from_the_header_before_decoding():
    """A 63,000,000 x 1 PNG of 180 KB took 14 s and 2.7 GB to become a 224x224 input: past 200:1 (Qwen2-VL's own
    processor limit) nothing is decoded, for every model; at 200:1 the file gets to decoding (here it fails)."""
    for width, height in ((30_000, 100), (100, 30_000), (63_000_000, 1)):
        with pytest.raises(vision.MediaError, match=rf"too long and thin \({width}x{height}, more than 200:1\)"):
            vision.load_image(_png_header_only(width, height))
    with pytest.raises(vision.MediaError, match="corrupt or truncated"):
        vision.load_image(_png_header_only(20_000, 100))


def test_an_icons_pictures_are_checked_from_their_headers_before_pil_decodes_them(tmp_path):
    """PIL decodes an icon as it opens it: an ICO whose directory says 256x256 of a PNG 13000x13000 inside took 2.4 s
    and 650 MB before the size check refused it (an outside pass). Each entry's own header is checked first."""
    import struct

    def icon(picture: bytes, side: int = 0, depth: int = 32) -> bytes:  # (a side of 0 in the directory: 256)
        return (struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", side, side, 0, 0, 1, depth, len(picture), 22)
                + picture)

    with pytest.raises(vision.MediaError, match=r"image too large \(13000x13000 = 169 MP"):
        vision.load_image(icon(_png_header_only(13000, 13000)))
    with pytest.raises(vision.MediaError, match=r"too long and thin \(63000x1"):
        vision.load_image(icon(_png_header_only(63000, 1)))
    bitmap = struct.pack("<IiiHH", 40, 20000, 2 * 20000, 1, 32)  # a BMP entry's header: its height counts the mask
    with pytest.raises(vision.MediaError, match=r"image too large \(20000x20000"):
        vision.load_image(icon(bitmap + bytes(32)))
    core = struct.pack("<IHHHH", 12, 16, 32, 1, 24) + bytes(16 * 16 * 3 + 64)  # OS/2's header: 16-bit sides
    assert vision.load_image(icon(core, side=16, depth=24)).size == (16, 16)
    real = io.BytesIO()  # an icon of several sizes, as PIL writes one
    Image.new("RGB", (64, 64), (200, 10, 10)).save(real, format="ICO", sizes=[(16, 16), (32, 32), (64, 64)])
    assert vision.load_image(real.getvalue()).getpixel((5, 5)) == (200, 10, 10)


def test_pil_decompression_bomb_guard_becomes_media_error(tmp_path):
    # 20000x20000 = 400 MP exceeds PIL's own hard limit (2 x Image.MAX_IMAGE_PIXELS), raised in open().
    path = tmp_path / "big.png"
    path.write_bytes(_png_header_only(20000, 20000))
    with pytest.raises(vision.MediaError, match=r"big\.png: image too large \(400 MP"):
        vision.load_image(path)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image_raises_media_error(tmp_path, fmt):
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    path = tmp_path / f"photo.{fmt.lower()}"
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(vision.MediaError, match=rf"photo\.{fmt.lower()}: the image is corrupt or truncated"):
        vision.load_image(path)



# (Overwritten bytes are found in a PNG, whose compressed pixels are checked; a JPEG or a WebP decodes them as pixels.)
@pytest.mark.parametrize("fmt,damage", [("JPEG", "truncated"), ("PNG", "truncated"), ("WEBP", "truncated"),
                                        ("TIFF", "truncated"), ("PNG", "overwritten")])
def test_a_damaged_picture_is_refused_when_it_is_fitted_to_the_model_too(fmt, damage):
    """The prompt builder loads pictures fitted to the model (``fit``): reading a PNG's EXIF there decoded it, the
    decoding error of a damaged PNG was taken for a bad EXIF block, and the model answered about its garbage pixels
    without a word (an outside pass). Loaded fitted or not, a damaged picture is a ``MediaError``."""
    pixels = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    data = bytearray(buffer.getvalue())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # bytes in the middle of the compressed pixels overwritten, the file's length as it was
        data[len(data) // 3: len(data) // 3 + 200] = bytes(200)
    fit = vision.ImageFit(lambda width, height: (width // 2, height // 2), Image.Resampling.BICUBIC)
    for fitted in (None, fit):
        with pytest.raises(vision.MediaError, match="the image is corrupt or truncated"):
            vision.load_image(bytes(data), fit=fitted)


def test_a_picture_s_file_is_closed_once_it_is_read(tmp_path):
    """PIL closes only a file it opened itself: every JPEG loaded, and every picture checked before a model loads,
    left its file open until the garbage collector found it (a ResourceWarning each; an outside pass)."""
    import gc
    import warnings

    for fmt in ("JPEG", "PNG"):
        path = tmp_path / f"photo.{fmt.lower()}"
        Image.new("RGB", (64, 48), (10, 200, 30)).save(path, fmt)
        fit = vision.ImageFit(lambda width, height: (width // 2, height // 2), Image.Resampling.BICUBIC)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", ResourceWarning)
            vision.load_image(path)
            vision.load_image(path, fit=fit)
            vision.check_media(path, "image")
            gc.collect()
        left_open = [str(w.message) for w in said if issubclass(w.category, ResourceWarning)]
        assert not [message for message in left_open if path.name in message], left_open  # (others' leftovers aside)

def test_empty_missing_and_unreadable_images(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "noise.png").write_bytes(np.random.default_rng(0).bytes(256))
    with pytest.raises(vision.MediaError, match=r"^empty\.png: the file is empty$"):
        vision.load_image(tmp_path / "empty.png")
    with pytest.raises(vision.MediaError, match="the file is empty"):
        vision.load_image(b"")
    # A missing file is named as it was given: "sample.png: file not found" did not say where it was looked for
    # (glimpse ask --image assets/sample.png run outside the checkout).
    with pytest.raises(vision.MediaError, match=f"^{re.escape(str(tmp_path / 'missing.jpg'))}: file not found$"):
        vision.load_image(tmp_path / "missing.jpg")
    with pytest.raises(vision.MediaError, match=r"^assets/nowhere\.png: file not found$"):
        vision.load_image("assets/nowhere.png")
    (tmp_path / "gone.png").symlink_to(tmp_path / "moved.png")  # listed in its folder: "not found" read as a bug
    with pytest.raises(vision.MediaError, match=r"gone\.png: a symbolic link to .*moved\.png, which does not exist$"):
        vision.load_image(tmp_path / "gone.png")
    (tmp_path / "one.png").symlink_to(tmp_path / "two.png")  # each leads to the other: said as a loop (found from
    (tmp_path / "two.png").symlink_to(tmp_path / "one.png")  # outside: "to two.png, which does not exist")
    with pytest.raises(vision.MediaError, match=r"one\.png: a symbolic link to .*two\.png, which leads round in a "
                                                r"loop$"):
        vision.load_image(tmp_path / "one.png")
    with pytest.raises(vision.MediaError, match=r"noise\.png: not an image Glimpse can read"):
        vision.load_image(tmp_path / "noise.png")
    with pytest.raises(vision.MediaError, match="a folder, not an image or video file"):
        vision.load_image(tmp_path)
    os.mkfifo(tmp_path / "pipe.png")  # opening it would wait for a writer forever
    for special in (tmp_path / "pipe.png", Path("/dev/zero")):  # ... and /dev/zero never ends
        with pytest.raises(vision.MediaError, match="not a regular file"):
            vision.load_image(special)
        with pytest.raises(vision.MediaError, match="not a regular file"):
            vision.probe_video(special)
    # A video given as an image (an API client's image_url part, a caption list): say what it is.
    video = (ASSETS / "sample.mp4").read_bytes()
    (tmp_path / "clip.mp4").write_bytes(video)
    (tmp_path / "clip.png").write_bytes(video)  # misnamed: the content says video
    for source, name in ((tmp_path / "clip.mp4", "clip.mp4"), (tmp_path / "clip.png", "clip.png"),
                         (video, "image data")):
        message = rf"^{re.escape(name)}: this is a video, not an image; pass it as a video$"
        with pytest.raises(vision.MediaError, match=message):
            vision.load_image(source)
    with pytest.raises(vision.MediaError, match="a URL, not a local file"):
        vision.load_image("https://example.com/cat.png")


def _refusal_of(read, path: Path) -> Exception:
    """What ``read(path)`` raised, ``path`` being a pipe; fails the test if it waited on the pipe for a writer."""
    import threading

    outcome: list = []

    def attempt():
        try:
            read(path)
        except Exception as error:  # noqa: BLE001 (the test's verdict)
            outcome.append(error)

    reader = threading.Thread(target=attempt, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # waiting on the pipe: a writer lets it go, so that the test ends
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail(f"{getattr(read, '__name__', read)} waited on a pipe for a writer")
    assert len(outcome) == 1, f"{path} was read, not refused"
    return outcome[0]


def test_a_file_replaced_by_a_pipe_after_its_check_is_refused_not_waited_on(tmp_path, monkeypatch):
    """Between the check that a name is a regular file and its opening, whoever may write the folder can put a pipe
    in its place, and opening a pipe waits for a writer: a captioning run's reader waited for ever (an outside pass
    raced renames against it). Here the check passes as if the pipe came just after it: the opening itself refuses
    what the name holds then."""
    from glimpse.vision import media

    monkeypatch.setattr(media, "_checked_file", lambda path: path)  # the check saw the regular file it replaced
    os.mkfifo(tmp_path / "swapped.png")
    for read in (vision.load_image, vision.detect_kind, vision.probe_video):
        refusal = _refusal_of(read, tmp_path / "swapped.png")
        assert isinstance(refusal, vision.MediaError) and "swapped.png: not a regular file" in str(refusal), refusal


def test_a_video_replaced_by_a_pipe_after_its_checks_is_refused_not_waited_on_by_ffmpeg(tmp_path, monkeypatch):
    """The same race for a video's decoding: FFmpeg opened the video by its name, after Glimpse's checks, and a pipe
    put there in between made it wait for a writer for ever (neither the media time limit, checked between packets,
    nor Ctrl-C could end it). Here the name becomes a pipe just as its check passes."""
    from glimpse.vision import media

    video = tmp_path / "clip.mp4"

    def swapped():  # the name becomes a pipe
        video.unlink()
        os.mkfifo(video)

    def swapped_at_check(path):
        swapped()
        return path

    def swapped_after_sniffing(head):  # probe_video's look at the file's head (through its descriptor) passed
        swapped()
        return "video"

    for read, patch in ((lambda path: media.decode_frames(path, [0, 1]), ("_checked_file", swapped_at_check)),
                        (vision.probe_video, ("_sniff_kind", swapped_after_sniffing))):
        video.unlink(missing_ok=True)
        video.write_bytes((ASSETS / "sample.mp4").read_bytes())
        monkeypatch.setattr(media, *patch)
        refusal = _refusal_of(read, video)
        assert isinstance(refusal, vision.MediaError) and "clip.mp4: not a regular file" in str(refusal), refusal
        monkeypatch.undo()


@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_a_video_whose_disk_fails_part_way_is_answered_from_what_was_read_and_says_why(tmp_path, monkeypatch,
                                                                                        caplog, capfd, suffix):
    """FFmpeg reads a video through the file object Glimpse opened (``_open_container``): a read that fails part
    way (EIO from a failing disk, NFS or USB drive) came back as Python's OSError, and ended the request
    ("Input/output error", naming no file; a 500 from the API), or made a Matroska file "contain no frames" with a
    traceback printed at each read FFmpeg tried again, where a file opened by FFmpeg itself was answered from the
    frames read before the failure, saying why (a regression hunt). It ends the file there, said once."""
    import errno
    import logging

    from glimpse.vision import media

    path = tmp_path / f"clip{suffix}"
    options = {"movflags": "faststart"} if suffix == ".mp4" else {}  # (its index first, then the frames)
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(100):  # noise: some 180 KB, read in several parts
            frame = np.random.RandomState(i).randint(0, 255, (48, 64, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    half, opened = path.stat().st_size // 2, media._open_regular

    class FailingDisk(io.FileIO):
        def read(self, size=-1):
            if self.tell() > half:
                raise OSError(errno.EIO, "Input/output error")
            return super().read(size)

    def failing_disk(name):
        file = opened(name)
        failing = FailingDisk(os.dup(file.fileno()), "rb")
        failing.name = file.name
        file.close()
        return failing

    monkeypatch.setattr(media, "_open_regular", failing_disk)
    with caplog.at_level(logging.WARNING, logger="glimpse.vision"):
        video = sampling.sample_video_uniform(path, 8)
    decoded, declared = video.shortfall
    assert 0 < decoded < declared == 100 and len(video.indices) == 8
    assert f"clip{suffix}: reading stopped early (Input/output error)" in caplog.text
    assert "Traceback" not in capfd.readouterr().err


def test_an_image_whose_header_cannot_be_read_is_said_to_be_corrupt_not_of_an_unknown_type():
    """A PNG cut short, a bare PNG signature and a PNG whose compressed text chunk unpacks past PIL's limit were
    "not an image Glimpse can read (it reads JPEG, PNG, ...)": they are PNGs, and the message sent the user
    looking for a format problem."""
    from PIL.PngImagePlugin import PngInfo

    whole = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(whole, "PNG")
    info = PngInfo()
    info.add_text("comment", "x" * (4 * 2**20), zip=True)  # 4 MiB unpacked, a few KiB sent
    bomb = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(bomb, "PNG", pnginfo=info)
    for source in (whole.getvalue()[:20], b"\x89PNG\r\n\x1a\n", bomb.getvalue(), b"\xff\xd8\xff\xe0garbage"):
        with pytest.raises(vision.MediaError, match=r"the image is corrupt or truncated \(it starts as an image"):
            vision.load_image(source)


def test_a_text_file_named_as_media_is_said_to_hold_text(tmp_path):
    """A text file named .mp4 was called a corrupt or truncated video."""
    for name in ("notes.mp4", "notes.png", "notes.ts"):
        (tmp_path / name).write_text("meeting notes: bring the clip\n")
        with pytest.raises(vision.MediaError, match=rf"^{re.escape(name)}: not an image or video: it holds text$"):
            vision.detect_kind(tmp_path / name)
    (tmp_path / "clip.ts").write_bytes(bytes([0x47, 0x40, 0x00, 0x10]) + bytes(184))  # MPEG-TS: no signature, binary
    assert vision.detect_kind(tmp_path / "clip.ts") == "video"


def test_decoding_a_text_file_as_a_video_says_it_holds_text_as_the_check_before_loading_does(tmp_path):
    """`glimpse ask` said "it holds text" (check_media), the API and the captioner, which go straight to decoding,
    said "corrupt or truncated". A text file is not handed to FFmpeg at all, a playlist among them (FFmpeg would open
    what it lists); raw YUV, whose header is text, is still a video."""
    (tmp_path / "notes.mp4").write_text("meeting notes: bring the clip\n")
    (tmp_path / "list.mp4").write_text("#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nhttp://127.0.0.1/a.ts\n")
    for name in ("notes.mp4", "list.mp4"):
        for read in (vision.probe_video, vision.sample_video_qwen, lambda p: vision.sample_video_uniform(p, 4)):
            with pytest.raises(vision.MediaError, match=rf"^{re.escape(name)}: not an image or video: it holds text$"):
                read(tmp_path / name)
    raw = tmp_path / "raw.mp4"
    with av.open(str(raw), "w", format="yuv4mpegpipe") as container:
        stream = container.add_stream("rawvideo", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), index * 20, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    assert raw.read_bytes().startswith(b"YUV4MPEG2 ") and vision.sample_video_uniform(raw, 4).indices == [0, 3, 6, 9]


def test_only_the_common_image_formats_reach_a_decoder(tmp_path, monkeypatch):
    # PIL would open any of its ~40 formats; EPS runs Ghostscript on the upload when it is installed. An upload
    # in a format outside the list is refused before any decoder sees its bytes — even named .png.
    picture = Image.new("RGB", (32, 32), "red")
    calls = []
    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: calls.append("gs") or True)
    for fmt in ("EPS", "PCX", "SGI", "XBM"):
        buffer = io.BytesIO()
        picture.convert("1" if fmt == "XBM" else "RGB").save(buffer, fmt)
        (tmp_path / f"{fmt}.png").write_bytes(buffer.getvalue())
        for source in (buffer.getvalue(), tmp_path / f"{fmt}.png"):
            with pytest.raises(vision.MediaError, match=r"not an image Glimpse can read \(it reads JPEG, PNG, WEBP"):
                vision.load_image(source)
    assert not calls
    for fmt in ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "ICO"):  # ... and those in it still load
        buffer = io.BytesIO()
        picture.save(buffer, fmt)
        assert np.asarray(vision.load_image(buffer.getvalue()))[0, 0].tolist()[0] > 200, fmt


def test_media_error_is_a_value_error():
    assert issubclass(vision.MediaError, ValueError)


# ------------------------------------------------------------------------------------------ kinds


def test_detect_kind_by_content_then_extension(tmp_path, clip):
    Image.new("RGB", (4, 4)).save(tmp_path / "photo.png")
    (tmp_path / "misnamed.dat").write_bytes((tmp_path / "photo.png").read_bytes())  # content wins
    (tmp_path / "clip.bin").write_bytes(clip.read_bytes())
    (tmp_path / "stream.ts").write_bytes(b"\x47" + bytes(187))  # no signature we sniff: by extension
    assert vision.detect_kind(tmp_path / "photo.png") == "image"
    assert vision.detect_kind(tmp_path / "misnamed.dat") == "image"
    assert vision.detect_kind(clip) == "video"
    assert vision.detect_kind(tmp_path / "clip.bin") == "video"
    assert vision.detect_kind(tmp_path / "stream.ts") == "video"
    # ICO, a format the decoders take, was "unsupported type .ico" to `glimpse ask` and the captioner (an outside pass)
    Image.new("RGB", (32, 32), "red").save(tmp_path / "icon.ico")
    (tmp_path / "icon.bin").write_bytes((tmp_path / "icon.ico").read_bytes())
    assert vision.detect_kind(tmp_path / "icon.ico") == vision.detect_kind(tmp_path / "icon.bin") == "image"


def test_detect_kind_rejects_unknown_empty_and_missing(tmp_path):
    (tmp_path / "photo.xyz").write_bytes(np.random.default_rng(1).bytes(64))
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(vision.MediaError, match=r"photo\.xyz: not an image or video .*unsupported type \.xyz"):
        vision.detect_kind(tmp_path / "photo.xyz")
    with pytest.raises(vision.MediaError, match="the file is empty"):
        vision.detect_kind(tmp_path / "empty.mp4")
    with pytest.raises(vision.MediaError, match="file not found"):
        vision.detect_kind(tmp_path / "nothing.png")


# ------------------------------------------------------------------------------------------ videos


def test_probe_video(clip):
    info = vision.probe_video(clip)
    assert info == vision.VideoInfo(CLIP_FRAMES, float(CLIP_FPS), CLIP_FRAMES / CLIP_FPS, *CLIP_SIZE, "pyav")


def test_probe_counts_frames_when_container_does_not_store_them(tmp_path):
    path = _write_video(tmp_path / "clip.mkv")
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # Matroska keeps no frame count
    assert vision.probe_video(path).num_frames == CLIP_FRAMES


def test_read_frames_returns_requested_frames_in_order(clip):
    indices = [29, 0, 7, 7, 15]
    frames = vision.read_frames(clip, indices)
    assert frames.shape == (len(indices), CLIP_SIZE[1], CLIP_SIZE[0], 3) and frames.dtype == np.uint8
    assert [_frame_index(frame) for frame in frames] == indices


def test_seeking_picks_the_same_frames_as_sequential_decoding(tmp_path, monkeypatch):
    path = _write_video(tmp_path / "long_gop.mp4", frames=60, gop=5)  # keyframe every 5 frames
    indices = [2, 40, 41, 59]
    decoded = []
    original = media_module._StreamFrames.__iter__

    def counting(reader):
        for frame in original(reader):
            decoded.append(frame)
            yield frame

    monkeypatch.setattr(media_module._StreamFrames, "__iter__", counting)
    with_seeks = media_module._decode_pyav(path, indices, seek_min_gap=8).frames
    frames_decoded_with_seeks = len(decoded)
    sequential = media_module._decode_pyav(path, indices, seek_min_gap=math.inf).frames

    assert [_frame_index(frame) for frame in with_seeks] == indices
    np.testing.assert_array_equal(with_seeks, sequential)
    assert frames_decoded_with_seeks < len(decoded) - frames_decoded_with_seeks  # the seeks skipped frames


def test_a_variable_frame_rate_video_is_sampled_whole_not_taken_for_a_truncated_one(tmp_path):
    """Found from outside: 1,000 frames 10 ms apart then 100 a second apart, declared at 1 fps. Seeking by the
    declared rate ran past the end of the timestamps, which read as "only 110 of the 1,100 frames it declares could
    be decoded", and every sampled frame came from the first 1.1 s. Here 160 frames 10 ms apart, then 40 a second
    apart."""
    import fractions

    pts = [10 * index if index <= 160 else 1600 + 1000 * (index - 160) for index in range(200)]
    path = _write_video(tmp_path / "vfr.mkv", frames=200, fps=1, gop=10, size=(32, 32), pts=pts,
                        time_base=fractions.Fraction(1, 1000))
    assert _decodable_frame_count(path) == 200
    indices = [0, 66, 133, 199]  # seeking to 66 at the declared 1 fps is 66 s: past the last timestamp (41.6 s)
    frames = media_module._decode_pyav(path, indices, seek_min_gap=8).frames
    assert [_frame_index(frame) for frame in frames] == indices


def test_a_fragmented_or_trimmed_mp4_is_sampled_over_the_frames_it_holds_without_a_false_warning(tmp_path):
    """An outside pass: a fragmented MP4 (ffmpeg's -movflags frag_keyframe) declares its first fragment's frames
    only, and 12 s were sampled from their first second, without a word; a trimmed clip (an edit list, frames before
    its start) declares the frames its edit leaves out, and was said to be damaged. Both are counted by their index."""
    import fractions

    fragmented = _write_video(tmp_path / "fragmented.mp4", frames=120, fps=10, gop=10,
                              container_options={"movflags": "frag_keyframe"})
    with av.open(str(fragmented)) as container:
        assert container.streams.video[0].frames < 120  # what the file declares
    assert vision.probe_video(fragmented).num_frames == 120 == _decodable_frame_count(fragmented)
    sampled = sampling.sample_video_uniform(fragmented, 8)
    assert [_frame_index(frame) for frame in sampled.frames] == sampled.indices and sampled.indices[-1] == 119
    assert sampled.shortfall is None

    # The first 5 frames before the clip's start (negative timestamps): an edit list leaves them out.
    trimmed = _write_video(tmp_path / "trimmed.mp4", frames=30, fps=10, size=(32, 32),
                           pts=[index - 5 for index in range(30)], time_base=fractions.Fraction(1, 10))
    assert vision.probe_video(trimmed).num_frames == _decodable_frame_count(trimmed) == 25
    sampled = sampling.sample_video_uniform(trimmed, 8)
    assert sampled.shortfall is None and [_frame_index(frame) - 5 for frame in sampled.frames] == sampled.indices


def test_a_matroska_file_cut_short_says_so_and_one_starting_late_does_not(tmp_path):
    """Matroska and WebM declare no frame count, only a duration: one cut in half was sampled from the half left,
    without a word (an outside pass). Its frames are counted, and its duration says how many it should hold."""
    import fractions

    whole = _write_video(tmp_path / "whole.mkv", frames=60, fps=10, gop=10)
    data = whole.read_bytes()
    (tmp_path / "cut.mkv").write_bytes(data[: len(data) // 2])
    cut = sampling.sample_video_uniform(tmp_path / "cut.mkv", 8)
    decoded, declared = cut.shortfall
    assert decoded == _decodable_frame_count(tmp_path / "cut.mkv") < 45 and 50 <= declared <= 65
    # Sampled over the frames that are there, as a plain decoding gives them (a frame the cut left undecodable is
    # not among them).
    with av.open(str(tmp_path / "cut.mkv")) as container:
        there = [_frame_index(frame.to_ndarray(format="rgb24")) for frame in container.decode(video=0)]
    assert [_frame_index(frame) for frame in cut.frames] == [there[index] for index in cut.indices]
    assert sampling.sample_video_uniform(whole, 8).shortfall is None
    # Frames whose times start at 1000 s (an excerpt): the duration counts from 0, and nothing is missing.
    late = _write_video(tmp_path / "late.mkv", frames=60, fps=10, pts=[10_000 + index for index in range(60)],
                        time_base=fractions.Fraction(1, 10))
    assert vision.probe_video(late).declared_frames is None
    assert sampling.sample_video_uniform(late, 8).shortfall is None



def _checkered_frames(count: int, width: int = 160, height: int = 120):
    """Frames with detail enough that each is a packet of its own size (a solid colour compresses to nothing)."""
    y, x = np.mgrid[0:height, 0:width]
    for index in range(count):
        frame = np.zeros((height, width, 3), np.uint8)
        frame[..., 0], frame[..., 1], frame[..., 2] = x * 255 // width, y * 255 // height, index * 255 // count
        frame[(y // 20 + x // 20 + index) % 2 == 0] //= 2
        yield frame


def _write_checkered(path: Path, codec: str, frames: int = 60, fps: int = 20) -> Path:
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg has no {codec} encoder")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        for array in _checkered_frames(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_a_damaged_vp8_webm_says_so_and_a_truncated_flv_counts_the_frames_it_declares(tmp_path):
    """Two damaged videos were answered from what was left without a word (an outside pass): a VP8 WebM (a browser's
    MediaRecorder's) with a damaged packet, whose decoder reported nothing under frame threading and handed back the
    garbage it made; and an FLV cut short, whose duration was not read. Each now says what was used."""
    import random

    webm = _write_checkered(tmp_path / "clip.webm", "libvpx")
    with av.open(str(webm)) as container:
        packets = [(p.pos, p.size) for p in container.demux(video=0) if p.size > 0 and not p.is_keyframe]
    position, size = packets[len(packets) // 2]
    data, noise = bytearray(webm.read_bytes()), random.Random(0)
    for at in range(position + min(16, size // 4), position + size - 4):
        data[at] = noise.randrange(256)
    (tmp_path / "damaged.webm").write_bytes(data)
    with av.open(str(tmp_path / "damaged.webm")) as container:  # a plain (unthreaded) decoding refuses packets
        refused = 0
        for packet in container.demux(video=0):
            try:
                container.streams.video[0].codec_context.decode(packet)
            except av.FFmpegError:
                refused += 1
    assert refused > 0
    sampled = sampling.sample_video_uniform(tmp_path / "damaged.webm", 16)
    assert sampled.shortfall is not None and sampled.shortfall[0] < sampled.shortfall[1] == 60

    flv = _write_checkered(tmp_path / "clip.flv", "flv")
    data = flv.read_bytes()
    (tmp_path / "cut.flv").write_bytes(data[: int(len(data) * 0.3)])
    sampled = sampling.sample_video_uniform(tmp_path / "cut.flv", 4)
    assert sampled.shortfall == (_decodable_frame_count(tmp_path / "cut.flv"), 60)
    assert sampling.sample_video_uniform(flv, 4).shortfall is None


@pytest.mark.parametrize("container_format", ["flv", "matroska"])
def test_a_whole_file_whose_audio_runs_on_past_its_video_is_not_called_cut_short(tmp_path, container_format):
    """FLV and Matroska declare the duration of their longest stream: a screen recording whose audio runs on past
    its video was warned of as "damaged or truncated" (an outside pass). A file cut short cuts every stream; this
    one is whole, and sampled without a warning."""
    if "mp3" not in av.codecs_available or "flv" not in av.codecs_available:
        pytest.skip("this FFmpeg has no mp3 or flv encoder")
    path = tmp_path / f"recording.{'flv' if container_format == 'flv' else 'mkv'}"
    with av.open(str(path), "w", format=container_format) as container:
        video = container.add_stream("flv" if container_format == "flv" else "mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("mp3", rate=22050)
        for index in range(20):  # 2 s of video
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 10, np.uint8), format="rgb24")
            frame.pts = index
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        for start in range(0, 22050 * 6, 1152):  # 6 s of audio
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1152), np.float32), format="fltp", layout="mono")
            samples.sample_rate, samples.pts = 22050, start
            for packet in audio.encode(samples):
                container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        assert container.duration / av.time_base > 5  # the declared duration: the audio's
    assert vision.probe_video(path).declared_frames is None
    assert sampling.sample_video_uniform(path, 8).shortfall is None


def test_a_video_whose_codec_is_unknown_is_a_media_error(tmp_path):
    """An MP4 whose sample description names a codec FFmpeg does not know (or a damaged one) opens with no decoder:
    "AttributeError: 'NoneType' object has no attribute 'width'", an internal error, a 500, the end of a caption
    run (an outside pass)."""
    clip = _write_video(tmp_path / "clip.mp4")
    data = clip.read_bytes()
    fourcc = b"avc1" if b"avc1" in data else b"mp4v"
    (tmp_path / "unknown.mp4").write_bytes(data.replace(fourcc, b"zzzz"))
    for read in (vision.probe_video, lambda path: sampling.sample_video_uniform(path, 4)):
        with pytest.raises(vision.MediaError, match=r"unknown\.mp4: the video is corrupt or its codec is unknown"):
            read(tmp_path / "unknown.mp4")


def test_a_damaged_avif_is_a_media_error():
    """PIL's AVIF plugin raises RuntimeError for a file it cannot decode: an internal error, a 500, the end of a
    caption run (an outside pass)."""
    import random

    from PIL import features

    if not features.check("avif"):
        pytest.skip("this Pillow reads no AVIF")
    buffer = io.BytesIO()
    Image.fromarray(next(_checkered_frames(1, 160, 160))).save(buffer, "AVIF")
    data, noise = bytearray(buffer.getvalue()), random.Random(0)
    for at in range(len(data) - 64, len(data) - 48):
        data[at] = noise.randrange(256)
    with pytest.raises(RuntimeError):  # (what PIL itself says of these bytes)
        Image.open(io.BytesIO(bytes(data))).load()
    fit = vision.ImageFit(lambda width, height: (width // 2, height // 2), Image.Resampling.BICUBIC)
    for fitted in (None, fit):
        with pytest.raises(vision.MediaError, match="the image is corrupt or truncated"):
            vision.load_image(bytes(data), fit=fitted)

def test_a_cover_picture_or_thumbnail_stream_is_not_taken_for_the_video():
    """A file whose first video stream is its cover art was sampled as eight copies of the cover (an outside pass;
    ffmpeg writes cover art last, other muxers may not). The streams as PyAV lists them, in that order."""
    from types import SimpleNamespace

    Disposition = av.stream.Disposition
    decoder = object()  # (a stream FFmpeg has a decoder for)
    cover, thumbnails = SimpleNamespace(disposition=Disposition.attached_pic, codec_context=decoder), SimpleNamespace(
        disposition=Disposition.timed_thumbnails, codec_context=decoder)
    video = SimpleNamespace(disposition=Disposition.default, codec_context=decoder)
    container = SimpleNamespace(streams=SimpleNamespace(video=[cover, thumbnails, video]))
    assert media_module._video_stream(container, "clip.mp4") is video
    only_cover = SimpleNamespace(streams=SimpleNamespace(video=[cover]))  # nothing else: the cover, as before
    assert media_module._video_stream(only_cover, "clip.mp4") is cover


def test_video_frames_too_long_and_thin_are_refused_before_decoding(tmp_path):
    """As pictures are (200:1): CLIP's processor scales the shortest edge to 336, and 60000x2 frames asked for 10 GB
    each (an outside pass)."""
    thin = _write_video(tmp_path / "thin.mp4", frames=4, size=(2016, 8))
    with pytest.raises(vision.MediaError, match=r"thin.mp4: video frames too long and thin \(2016x8"):
        vision.probe_video(thin)
    assert vision.probe_video(_write_video(tmp_path / "wide.mp4", frames=4, size=(1600, 8))).width == 1600


def test_damaged_videos_raise_media_error(tmp_path, clip):
    data = clip.read_bytes()
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) // 2])  # moov index is at the end: gone
    (tmp_path / "noise.mp4").write_bytes(np.random.default_rng(2).bytes(4096))
    with pytest.raises(vision.MediaError, match=r"^empty\.mp4: the file is empty$"):
        vision.probe_video(tmp_path / "empty.mp4")
    for name in ("cut.mp4", "noise.mp4"):
        with pytest.raises(vision.MediaError, match=rf"^{name}: the video is corrupt or truncated"):
            vision.probe_video(tmp_path / name)
        with pytest.raises(vision.MediaError, match="corrupt or truncated"):
            vision.read_frames(tmp_path / name, [0])
    with pytest.raises(vision.MediaError, match="file not found"):
        vision.sample_video_uniform(tmp_path / "nothing.mp4")


def test_truncated_video_with_index_but_no_frames(tmp_path):
    # faststart puts the index first: the container opens and declares 30 frames, but the data is cut.
    full = _write_video(tmp_path / "full.mp4", container_options={"movflags": "faststart"}).read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(full[: len(full) // 2])
    assert vision.probe_video(path).num_frames == CLIP_FRAMES and _decodable_frame_count(path) == 0
    with pytest.raises(vision.MediaError, match=r"^cut\.mp4: the video is corrupt or truncated: no frame could be"):
        vision.sample_video_qwen(path)


def test_truncated_video_samples_the_frames_that_decode(tmp_path, caplog):
    full = _write_video(tmp_path / "full.mp4", container_options={"movflags": "faststart"}).read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(full[: int(len(full) * 0.9)])
    decodable = _decodable_frame_count(path)
    assert 8 <= decodable < CLIP_FRAMES  # the cut really loses frames (and leaves enough to sample)

    with pytest.raises(vision.MediaError, match=f"only {decodable} frames could be decoded"):
        vision.read_frames(path, [CLIP_FRAMES - 1])
    with caplog.at_level("WARNING"):
        sampled = vision.sample_video_uniform(path, num_frames=8)
    assert f"cut.mp4: only {decodable} of the {CLIP_FRAMES} frames it declares could be decoded" in caplog.text
    expected = np.linspace(0, decodable - 1, 8, dtype=int).tolist()  # planned again over what decodes
    assert sampled.indices == expected
    assert [_frame_index(frame) for frame in sampled.frames] == expected

    # Garbage inside the data (not a cut): the decoder refuses those packets. The log names the file, never its
    # folder: for a fetched URL that is the server's temporary folder.
    write_damaged_video(tmp_path / "damaged.mp4")
    caplog.clear()
    with caplog.at_level("WARNING"):
        vision.sample_video_uniform(tmp_path / "damaged.mp4", num_frames=8)
    assert re.search(r"damaged\.mp4: \d+ damaged packets? skipped \(Invalid data", caplog.text), caplog.text
    assert str(tmp_path) not in caplog.text


@pytest.mark.parametrize("sampler", ["uniform", "qwen"])
def test_a_video_damaged_midway_is_sampled_past_the_damage_at_the_frames_it_planned(tmp_path, caplog, sampler):
    """Found from outside: the first packet the decoder refused ended the video, so a clip damaged a third of the way
    in was answered from that third alone. The damaged packets are skipped, as players skip them, and the frames
    after them keep their own numbers (counted, they came early by the frames lost, and so did Qwen2.5-VL's and
    Qwen3-VL's times of them): each planned frame is itself, or, lost in the damage, the first frame after it; the
    answer says how many frames were lost."""
    frames = 60
    path = _write_video(tmp_path / "clip.mp4", frames=frames, gop=10)
    with av.open(str(path)) as container:
        packets = [(p.pos, p.size) for p in container.demux(video=0) if p.size]
    data = bytearray(path.read_bytes())
    for start, size in packets[frames // 3:frames // 3 + 6]:
        data[start:start + size] = b"\xff" * size
    path.write_bytes(bytes(data))
    intact = []  # ground truth: what a plain loop that skips what it cannot decode gets, by each frame's colour
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            with contextlib.suppress(av.FFmpegError):
                decoded = stream.codec_context.decode(packet)
                intact += [_frame_index(frame.to_ndarray(format="rgb24")) for frame in decoded]
    assert len(intact) < frames and intact[-1] == frames - 1  # frames lost in the middle, the end intact
    with caplog.at_level("WARNING"):
        sampled = (vision.sample_video_uniform(path, num_frames=8) if sampler == "uniform"
                   else vision.sample_video_qwen(path))
    assert re.search(r"clip\.mp4: \d+ damaged packets? skipped", caplog.text), caplog.text
    assert sampled.shortfall == (len(intact), frames)  # said: the answer lacks the frames lost
    assert sampled.indices[-1] == frames - 1 and sampled.timestamps_s[-1] == pytest.approx((frames - 1) / CLIP_FPS)
    seen = [_frame_index(frame) for frame in sampled.frames]
    assert seen == [min(i for i in intact if i >= planned) for planned in sampled.indices], (sampled.indices, seen)
    assert set(seen) - set(sampled.indices)  # a planned frame was lost, and the next one stood for it


def test_decord_worker_timeout_kills_a_hanging_call():
    start = time.monotonic()
    with pytest.raises(vision.MediaError, match=r"x\.mp4: reading the video took longer than 1 s"):
        media_module._run_in_worker(time.sleep, (60,), timeout_s=1, name="x.mp4")
    assert time.monotonic() - start < 15


def test_reading_a_video_asks_before_each_packet_whether_to_stop_and_stops_there(clip, tmp_path):
    """A server reads videos for clients it does not trust, and a 600 KB MP4 can hold 20,000 frames behind one keyframe,
    which no seek can skip (18 s of decoding on two cores; found from outside). Under ``reading_limit`` decoding asks
    before every packet whether to stop: told to at the sixth, it stops there, not at the end of the clip; a
    Matroska file's frames counted by demuxing are asked about the same way. Outside it, the same reads go on."""
    asked = iter(range(1, 1000))
    with vision.reading_limit(None, stop=lambda: next(asked) > 5):
        with pytest.raises(vision.ReadingStopped, match=r"^clip\.mp4: reading it was stopped"):
            vision.read_frames(clip, [CLIP_FRAMES - 1])
    assert next(asked) == 7  # asked six times, of the clip's 30 packets
    assert [_frame_index(f) for f in vision.read_frames(clip, [CLIP_FRAMES - 1])] == [CLIP_FRAMES - 1]

    matroska = _write_video(tmp_path / "clip.mkv")  # no frame count stored: probing demuxes every packet
    asked = iter(range(1, 1000))
    with vision.reading_limit(None, stop=lambda: next(asked) > 5), pytest.raises(vision.ReadingStopped):
        vision.probe_video(matroska)
    assert next(asked) == 7 and vision.probe_video(matroska).num_frames == CLIP_FRAMES


def test_a_picture_told_to_stop_while_it_decodes_stops_within_its_decoding(tmp_path, monkeypatch):
    """Each read of a picture's file asks whether the reading goes on, and PIL decodes from reads of at most 64 KB:
    told to stop part-way through its decoding (its client left), the decoding stops at its next read, and nothing
    that follows runs, neither the conversion to RGB nor the model's processor (a 64 MP PNG's decoding, 0.9-2.5 s on
    two cores, ran to its end until 2026-12-06). Told to stop between the stages, it stops there. Past the
    request's time limit it stops the same way, in words that say so, not as a corrupt file. Let go on, the picture
    is read whole."""
    from types import SimpleNamespace

    from glimpse.pipeline.prompt import load_media
    from glimpse.pipeline.random_checkpoint import photo_like

    path = tmp_path / "large.png"
    photo_like(1200, 900).save(path)
    converted, resized = [], []
    to_rgb = media_module._to_rgb
    monkeypatch.setattr(media_module, "_to_rgb",
                        lambda image, *rest: converted.append(image.size) or to_rgb(image, *rest))
    adapter = SimpleNamespace(prepare_image=lambda image: resized.append(image) or SimpleNamespace(num_tokens=1),
                              supports_video=True, image_fit=None)
    messages = [{"role": "user", "content": [{"type": "image", "image": str(path)}]}]
    asks = []
    with vision.reading_limit(None, stop=lambda: asks.append(1) and False):
        load_media(adapter, messages)
    # Asked before the picture, before each read of its file, after its decoding and before the processor.
    whole = len(asks)
    assert whole > 20 and converted == [(1200, 900)] and len(resized) == 1
    converted.clear()
    resized.clear()
    for stop_at, stage in ((whole // 2, "in its decoding"), (whole - 1, "before its conversion"),
                           (whole, "before the processor")):
        asked = iter(range(1, 10**6))
        with vision.reading_limit(None, stop=lambda: next(asked) >= stop_at), \
                pytest.raises(vision.ReadingStopped, match=r"^large\.png: reading it was stopped"):
            load_media(adapter, messages)
        assert next(asked) == stop_at + 1, stage  # it stopped where it was first told to
        assert (converted, resized) == ([(1200, 900)] if stage == "before the processor" else [], []), stage
        converted.clear()

    clock = iter(range(10**6))  # a second passes at each ask: the limit of 10 s is reached part-way through
    monkeypatch.setattr(media_module.time, "monotonic", lambda: float(next(clock)))
    with vision.reading_limit(10.0), pytest.raises(vision.MediaError) as refused:
        load_media(adapter, messages)
    assert not isinstance(refused.value, vision.ReadingStopped) and "took longer than 10 s" in str(refused.value)
    assert next(clock) < whole and (converted, resized) == ([], [])


def test_reading_past_the_time_limit_is_refused_in_words_naming_the_file(clip):
    """The time limit of ``reading_limit`` counts from the start of the block: a video read once it is over is refused
    with a ``MediaError`` naming it and the limit (the server's 400), not as a stop from outside."""
    with vision.reading_limit(0.0), pytest.raises(vision.MediaError) as refused:
        vision.read_frames(clip, [0])
    assert not isinstance(refused.value, vision.ReadingStopped)
    assert str(refused.value).startswith("clip.mp4: reading the images and videos of this request took longer than 0 s")
    with vision.reading_limit(3600.0):  # within it, the frames as ever
        assert [_frame_index(f) for f in vision.read_frames(clip, [3, 1])] == [3, 1]


def test_worker_returns_results_and_media_errors(tmp_path, clip):
    (tmp_path / "noise.mp4").write_bytes(np.random.default_rng(3).bytes(512))
    info = media_module._run_in_worker(media_module._probe_pyav, (clip,), timeout_s=60, name="clip.mp4")
    assert info.num_frames == CLIP_FRAMES
    with pytest.raises(vision.MediaError, match=r"^noise\.mp4: the video is corrupt"):
        media_module._run_in_worker(media_module._probe_pyav, (tmp_path / "noise.mp4",), timeout_s=60, name="n")


def test_backend_choice(monkeypatch):
    monkeypatch.setenv(media_module.VIDEO_BACKEND_ENV, "decord")
    decord_installed = importlib.util.find_spec("decord") is not None
    assert media_module._choose_backend(None) == ("decord" if decord_installed else "pyav")
    assert media_module._choose_backend("pyav") == "pyav"  # the argument wins over the environment
    monkeypatch.delenv(media_module.VIDEO_BACKEND_ENV)
    assert media_module._choose_backend(None) == "pyav"
    with pytest.raises(UserError, match="unknown video backend 'ffmpeg': use 'pyav' or 'decord'"):
        media_module._choose_backend("ffmpeg")
    # Mistyped in the environment: the command says so in one line (it printed a traceback as "a bug in Glimpse")
    monkeypatch.setenv(media_module.VIDEO_BACKEND_ENV, "Decord2")
    with pytest.raises(UserError, match=r"unknown video backend 'decord2' \(\$GLIMPSE_VIDEO_BACKEND\)"):
        media_module._choose_backend(None)


def test_decord_backend_matches_pyav(clip):
    pytest.importorskip("decord")
    indices = [0, 13, 29]
    assert vision.probe_video(clip, backend="decord").num_frames == CLIP_FRAMES
    frames = vision.read_frames(clip, indices, backend="decord")
    assert [_frame_index(frame) for frame in frames] == indices


# ---------------------------------------------------------------------------------------- sampling


def test_factor_rounding():
    assert (vision.round_by_factor(41, 28), vision.ceil_by_factor(29, 28), vision.floor_by_factor(55, 28)) == (
        28, 56, 28,
    )


@pytest.mark.parametrize(
    "height, width, min_pixels, max_pixels, expected",
    [
        # Within budget: round each side. 1080/28 = 38.57 -> 39*28 = 1092; 1920/28 = 68.57 -> 69*28 = 1932.
        (1080, 1920, sampling.MIN_PIXELS, sampling.MAX_PIXELS, (1092, 1932)),
        # Over the video budget 602112: scale = sqrt(1080*1920/602112) = 1.8558;
        # 1080/1.8558 = 581.97 -> floor to 560; 1920/1.8558 = 1034.6 -> floor to 1008.
        (1080, 1920, sampling.MIN_PIXELS, sampling.VIDEO_MAX_PIXELS, (560, 1008)),
        # Under the budget 3136: scale = sqrt(3136/100) = 5.6; 10*5.6 = 56 -> ceil to 56.
        (10, 10, sampling.MIN_PIXELS, sampling.MAX_PIXELS, (56, 56)),
        # A sliver (ratio 196) keeps at least one factor per side: 10 -> 28, 1960/28 = 70 exactly.
        (10, 1960, 28 * 28, sampling.MAX_PIXELS, (28, 1960)),
    ],
)
def test_smart_resize_hand_computed(height, width, min_pixels, max_pixels, expected):
    assert vision.smart_resize(height, width, 28, min_pixels, max_pixels) == expected


@pytest.mark.parametrize("height, width", [(480, 640), (720, 1280), (3000, 4000), (33, 517), (4096, 128), (60, 60)])
@pytest.mark.parametrize("min_pixels, max_pixels", [(sampling.MIN_PIXELS, sampling.MAX_PIXELS),
                                                    (sampling.VIDEO_MIN_PIXELS, sampling.VIDEO_MAX_PIXELS)])
def test_smart_resize_invariants(height, width, min_pixels, max_pixels):
    resized_height, resized_width = vision.smart_resize(height, width, 28, min_pixels, max_pixels)
    assert resized_height % 28 == 0 and resized_width % 28 == 0
    assert min_pixels <= resized_height * resized_width <= max_pixels
    # Aspect ratio kept up to rounding: one scale s puts both sides within a factor of s * side, i.e. the
    # ranges of s allowed by each side overlap.
    lowest = max((resized_height - 28) / height, (resized_width - 28) / width)
    highest = min((resized_height + 28) / height, (resized_width + 28) / width)
    assert lowest < highest


def test_smart_resize_rejects_extreme_aspect_ratio():
    vision.smart_resize(28, 28 * 200)  # exactly 200 is allowed
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        vision.smart_resize(10, 2010)


@pytest.mark.parametrize(
    "total_frames, video_fps, kwargs, expected",
    [
        (300, 30, {}, 20),  # 10 s at 2 fps
        (30, 10, {}, 6),  # 3 s at 2 fps
        (300, 30, {"fps": 0.1}, 4),  # 1 frame wanted, min_frames 4
        (108_000, 30, {}, 768),  # 1 hour: 7200 wanted, max_frames 768
        (7, 1, {}, 6),  # 14 wanted, capped by 7 frames, rounded down to even
        (5, 1, {"min_frames": 4}, 4),  # min_frames cannot exceed the frames there are
        (300, 30, {"fps": 1.5}, 14),  # 15 wanted -> even 14
        (300, 30, {"nframes": 6}, 6),  # explicit count, already even
        (300, 30, {"nframes": 10, "max_frames": 4}, 10),  # explicit count ignores the fps bounds
    ],
)
def test_smart_nframes(total_frames, video_fps, kwargs, expected):
    count = vision.smart_nframes(total_frames, video_fps, **kwargs)
    assert count == expected and count % vision.FRAME_FACTOR == 0


def test_smart_nframes_rejects_clips_too_short():
    with pytest.raises(ValueError):
        vision.smart_nframes(1, 30)
    with pytest.raises(ValueError):
        vision.smart_nframes(10, 30, nframes=12)


def test_video_frame_max_pixels_shares_the_total_budget():
    total = sampling.VIDEO_TOTAL_PIXELS
    assert vision.video_frame_max_pixels(20) == sampling.VIDEO_MAX_PIXELS  # budget/10 pairs is far above
    assert vision.video_frame_max_pixels(768) == total / 768 * 2  # between the per-frame bounds
    floor = int(sampling.VIDEO_MIN_PIXELS * 1.05)
    assert vision.video_frame_max_pixels(768, total_pixels=1_000_000) == floor
    assert vision.video_frame_max_pixels(20, max_pixels=200_000) == 200_000  # a caller may only lower it


def test_sample_video_qwen_picks_qwen_frames(clip):
    sampled = vision.sample_video_qwen(clip)

    nframes = vision.smart_nframes(CLIP_FRAMES, CLIP_FPS)  # 6: 3 s at 2 fps
    expected = np.round(np.linspace(0, CLIP_FRAMES - 1, nframes)).astype(int).tolist()
    assert sampled.indices == expected == [0, 6, 12, 17, 23, 29]
    assert [_frame_index(frame) for frame in sampled.frames] == expected
    height, width = vision.smart_resize(
        CLIP_SIZE[1], CLIP_SIZE[0], 28, vision.VIDEO_MIN_PIXELS, vision.video_frame_max_pixels(nframes)
    )
    assert sampled.frames.shape == (nframes, height, width, 3) and sampled.frames.dtype == np.uint8
    assert sampled.sample_fps == pytest.approx(nframes / CLIP_FRAMES * CLIP_FPS)  # = 2.0
    assert sampled.timestamps_s == pytest.approx([index / CLIP_FPS for index in expected])
    assert sampled.source_fps == CLIP_FPS


def test_sample_video_qwen_rejects_a_single_frame_video(tmp_path):
    path = _write_video(tmp_path / "still.mp4", frames=1)  # Qwen2-VL needs a pair of frames
    with pytest.raises(vision.MediaError, match=r"^still\.mp4: the video is too short to sample \(1 frame: this "
                                                 r"model reads a video's frames in pairs; send a still as an image\)"):
        vision.sample_video_qwen(path)


def test_sample_video_qwen_without_resize_keeps_size(clip):
    sampled = vision.sample_video_qwen(clip, fps=1.0, resize=False)
    assert sampled.frames.shape == (4, CLIP_SIZE[1], CLIP_SIZE[0], 3)  # 3 frames wanted, min 4


def test_sample_video_uniform_spreads_frames_over_the_clip(clip):
    sampled = vision.sample_video_uniform(clip, num_frames=8)
    expected = np.linspace(0, CLIP_FRAMES - 1, 8, dtype=int).tolist()
    assert sampled.indices == expected and expected[0] == 0 and expected[-1] == CLIP_FRAMES - 1
    assert [_frame_index(frame) for frame in sampled.frames] == expected
    assert sampled.frames.shape == (8, CLIP_SIZE[1], CLIP_SIZE[0], 3)  # original size
    assert sampled.sample_fps == pytest.approx(8 / CLIP_FRAMES * CLIP_FPS)


def test_a_video_declaring_frames_over_the_limit_is_refused_before_a_frame_is_decoded(clip, monkeypatch):
    """A file of a few hundred KB can declare 8192x8192 frames (200 MB each decoded): refused from the header.
    The limit is lowered here so that the test's clip stands for such a file."""
    monkeypatch.setattr(media_module, "MAX_VIDEO_FRAME_PIXELS", CLIP_SIZE[0] * CLIP_SIZE[1] - 1)
    monkeypatch.setattr(av.VideoFrame, "to_ndarray", lambda *a, **k: pytest.fail("a frame was decoded"))
    for read in (vision.probe_video, lambda path: vision.read_frames(path, [0]), vision.sample_video_qwen,
                 vision.sample_video_uniform):
        with pytest.raises(vision.MediaError, match=rf"^clip\.mp4: video frames too large \({CLIP_SIZE[0]}x"):
            read(clip)


def _size_switching_video(path: Path, small=(64, 48), large=(128, 96), frames_each: int = 6) -> Path:
    """An MJPEG AVI whose header says ``small`` and whose frames switch to ``large`` half-way: each MJPEG frame
    carries its own size, so a header cannot vouch for the frames after the first."""
    from fractions import Fraction

    out = av.open(str(path), "w", format="avi")
    stream = out.add_stream("mjpeg", rate=10)
    stream.width, stream.height, stream.pix_fmt = *small, "yuvj420p"
    larger = av.CodecContext.create("mjpeg", "w")
    larger.width, larger.height, larger.pix_fmt, larger.time_base = *large, "yuvj420p", Fraction(1, 10)
    for i in range(2 * frames_each):
        width, height = small if i < frames_each else large
        pixels = np.full((height, width, 3), 40 + 15 * i, dtype=np.uint8)
        frame = av.VideoFrame.from_ndarray(pixels, format="rgb24").reformat(format="yuvj420p")
        frame.pts, frame.time_base = i, Fraction(1, 10)
        for packet in (stream.encode(frame) if i < frames_each else larger.encode(frame)):
            packet.stream = stream
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path


def test_frames_that_change_size_mid_video_are_scaled_to_the_header_s_and_none_past_the_limit_is_decoded(
        tmp_path, monkeypatch):
    """A stream may change its frame size after the header (MJPEG at any frame): frames of another size are
    scaled to the header's (stacking them failed: "all input arrays must have the same shape"), and the decoder
    refuses a frame past the pixel limit before allocating it (a 64x64 header hid 16000x16000 frames, 4 GB)."""
    path = _size_switching_video(tmp_path / "switch.avi")
    frames = vision.read_frames(path, list(range(12)))
    assert frames.shape == (12, 48, 64, 3)
    assert abs(int(frames[11].mean()) - (40 + 15 * 11)) <= 3  # the large frame's content, scaled
    assert vision.sample_video_qwen(path).frames.shape[0] >= 2
    monkeypatch.setattr(media_module, "MAX_VIDEO_FRAME_PIXELS", 64 * 48)  # the header's size, not the later frames'
    assert vision.read_frames(path, [0, 5]).shape == (2, 48, 64, 3)
    with pytest.raises(vision.MediaError, match=r"only 6 frames could be decoded"):
        vision.read_frames(path, [0, 8])


def test_qwen_sampling_keeps_only_resized_frames_with_the_pixels_of_resizing_the_stack(tmp_path):
    """Each frame is resized as it is decoded (a long HD video once held all its full-size frames: a 592 KB
    file took 4.8 GB): the same pixels as resizing the decoded stack, in a fraction of the memory."""
    import tracemalloc

    path = _write_video(tmp_path / "hd.mp4", frames=16, size=(1920, 1080))
    sampled = vision.sample_video_qwen(path, nframes=16)
    full = vision.read_frames(path, sampled.indices)
    height, width = vision.smart_resize(1080, 1920, 28, vision.VIDEO_MIN_PIXELS, vision.video_frame_max_pixels(16))
    assert np.array_equal(sampled.frames, vision.resize_frames_bicubic(full, height, width))
    tracemalloc.start()
    try:
        vision.sample_video_qwen(path, nframes=16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The resized frames (kept, then stacked) and one full-size frame at a time: well under the full-size stack
    # alone, which the decode-then-resize path held twice (the frames kept, then stacked).
    assert peak < 0.75 * full.nbytes


def test_uniform_sampling_scales_frames_over_4k_down_as_it_decodes(tmp_path, monkeypatch):
    monkeypatch.setattr(sampling, "UNIFORM_MAX_FRAME_PIXELS", 160 * 120)  # the test's clip stands for an 8K one
    path = _write_video(tmp_path / "big.mp4", frames=8, size=(320, 240))
    sampled = vision.sample_video_uniform(path, num_frames=4)
    assert sampled.frames.shape == (4, 120, 160, 3)  # aspect kept, at most the limit
    assert [_frame_index(f) for f in sampled.frames] == sampled.indices  # the same frames, smaller


def test_resize_image_qwen():
    image = Image.new("RGB", (1920, 1080), (10, 20, 30))
    resized = vision.resize_image_qwen(image)
    assert resized.size[::-1] == vision.smart_resize(1080, 1920)
    assert resized.getpixel((5, 5)) == (10, 20, 30)


def test_resize_frames_matches_pil_bicubic():
    frames = np.random.default_rng(4).integers(0, 256, (2, 30, 50, 3), dtype=np.uint8)
    resized = vision.resize_frames_bicubic(frames, 56, 84)
    reference = np.asarray(Image.fromarray(frames[1]).resize((84, 56), Image.Resampling.BICUBIC))
    assert resized.shape == (2, 56, 84, 3)
    assert np.abs(resized[1].astype(int) - reference).max() <= 2  # both are antialiased bicubic


# ----------------------------------------------------------------------------------- video patches


def _pil_processor(**size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**({"size": size} if size else {}))


def test_video_patches_equal_image_processor_on_a_repeated_frame():
    # 56x84 is a multiple of 28 inside the image processor's budget, so it does not resize either.
    frame = np.random.default_rng(5).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    ours = vision.qwen2vl_video_inputs(np.stack([frame, frame]), resize=False)
    reference = _pil_processor()(images=Image.fromarray(frame), return_tensors="np")

    assert ours["video_grid_thw"].tolist() == reference["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert ours["pixel_values_videos"].dtype == vision.qwen_video.torch.float32
    assert ours["video_grid_thw"].dtype == vision.qwen_video.torch.long
    np.testing.assert_allclose(ours["pixel_values_videos"].numpy(), reference["pixel_values"], atol=1e-5, rtol=0)


def test_video_patches_with_resize_match_image_processor_sizes():
    frame = np.random.default_rng(6).integers(0, 256, (90, 130, 3), dtype=np.uint8)  # not a multiple of 28
    ours = vision.qwen2vl_video_inputs(np.stack([frame, frame]))
    reference = _pil_processor(shortest_edge=vision.VIDEO_MIN_PIXELS, longest_edge=vision.VIDEO_MAX_PIXELS)(
        images=Image.fromarray(frame), return_tensors="np"
    )
    assert ours["video_grid_thw"].tolist() == reference["image_grid_thw"].tolist()
    # Same size; pixels from torch's vs PIL's uint8 bicubic differ by at most 2 grey levels.
    tolerance = 2 / 255 / min(vision.OPENAI_CLIP_STD) + 1e-5
    np.testing.assert_allclose(ours["pixel_values_videos"].numpy(), reference["pixel_values"], atol=tolerance, rtol=0)


def test_video_patch_layout_and_odd_frame_count():
    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, (3, 56, 56, 3), dtype=np.uint8)
    three = vision.qwen2vl_video_inputs(frames, resize=False)
    first_pair = vision.qwen2vl_video_inputs(frames[:2], resize=False)
    last_repeated = vision.qwen2vl_video_inputs(frames[[2, 2]], resize=False)

    # 3 frames -> padded to 4 -> 2 temporal patches of (56/14)^2 = 16 patches each.
    assert three["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert three["pixel_values_videos"].shape == (2 * 16, 3 * 2 * 14 * 14)
    np.testing.assert_array_equal(three["pixel_values_videos"][:16], first_pair["pixel_values_videos"])
    np.testing.assert_array_equal(three["pixel_values_videos"][16:], last_repeated["pixel_values_videos"])

    # Token order within a 2x2 merge block: (0, 0), (0, 1), (1, 0) in patches; each token is its 14x14
    # patch in both frames, flattened (channel, frame in pair, row, col) and normalized.
    mean = np.array(vision.OPENAI_CLIP_MEAN, dtype=np.float32) * 255
    std = np.array(vision.OPENAI_CLIP_STD, dtype=np.float32) * 255

    def token(row: int, col: int) -> np.ndarray:
        patch = frames[:2, 14 * row : 14 * (row + 1), 14 * col : 14 * (col + 1)].astype(np.float32)
        return ((patch - mean) / std).transpose(3, 0, 1, 2).reshape(-1)  # (T, 14, 14, C) -> (C, T, 14, 14)

    for position, (row, col) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]):
        np.testing.assert_allclose(first_pair["pixel_values_videos"][position].numpy(), token(row, col), atol=1e-5)


def test_video_patches_reject_bad_input():
    with pytest.raises(ValueError, match="multiple of 28"):
        vision.qwen2vl_video_inputs(np.zeros((2, 50, 56, 3), dtype=np.uint8), resize=False)
    with pytest.raises(ValueError, match="uint8"):
        vision.qwen2vl_video_inputs(np.zeros((2, 56, 56, 3), dtype=np.float32))


@pytest.mark.parametrize("rescale_factor", [1 / 255, 1 / 127.5])  # Qwen's; another checkpoint's (the float64 path)
def test_image_patch_bytes_normalize_to_the_image_processor_s_values_for_every_byte(rescale_factor):
    """normalize_image_patches gives, for each of the 256 byte values in each channel, what transformers' own
    rescale (float64, then float32) and normalize give: a Qwen image's patches can stay bytes until the encoder."""
    from transformers.image_transforms import normalize, rescale

    import torch

    values = np.arange(256, dtype=np.uint8)
    patches = torch.from_numpy(np.tile(values, (4, 3, 2)).reshape(4, 3 * 512))  # 4 rows of (channel, value) runs
    ours = vision.normalize_image_patches(patches, rescale_factor, vision.OPENAI_CLIP_MEAN, vision.OPENAI_CLIP_STD)
    image = rescale(patches.numpy().reshape(4, 3, 512).transpose(1, 0, 2), rescale_factor,
                    input_data_format="channels_first")  # (C, rows, values): channels first, as the processor has it
    reference = normalize(image, vision.OPENAI_CLIP_MEAN, vision.OPENAI_CLIP_STD, input_data_format="channels_first")
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy().reshape(4, 3, 512), reference.transpose(1, 0, 2))
    with pytest.raises(ValueError, match="uint8"):
        vision.normalize_image_patches(ours)


def test_paths_no_file_can_have_and_pictures_of_no_pixels_are_refused_in_one_clear_line(tmp_path, monkeypatch):
    """Found from outside, through the Python API: a path longer than the file system takes (a data URL pasted where
    a path goes) raised a raw OSError, "File name too long"; a PIL crop of no area raised a ZeroDivisionError deep in
    a resize on Qwen2-VL and LLaVA and got an answer on the embedded model."""
    import base64

    for source in (f"/tmp/{'a' * 5000}.png", f"/tmp/{'b' * 5000}.mp4"):
        with pytest.raises(vision.MediaError, match="cannot be read as a file"):
            (vision.sample_video_uniform(source, num_frames=2) if source.endswith(".mp4") else
             vision.load_image(source))
    data_url = "data:image/png;base64," + base64.b64encode((ASSETS / "sample.png").read_bytes()).decode()
    with pytest.raises(vision.MediaError, match="a data URL, not a local file"):
        vision.load_image(data_url)
    monkeypatch.chdir(tmp_path)  # a file that is named so is still read
    (tmp_path / "data:a,b.png").write_bytes((ASSETS / "sample.png").read_bytes())
    assert vision.load_image("data:a,b.png").size == Image.open(ASSETS / "sample.png").size
    picture = Image.open(ASSETS / "sample.png")
    for box, size in (((10, 10, 10, 10), "0x0"), ((10, 10, 10, 300), "0x290"), ((5, 5, 60, 5), "55x0")):
        with pytest.raises(vision.MediaError, match=rf"the image is empty \({size} pixels\)"):
            vision.load_image(picture.crop(box))


def _gif_claiming(width: int, height: int) -> bytes:
    """A real 8x8 GIF whose header and image descriptor are patched to claim width x height."""
    buffer = io.BytesIO()
    Image.new("P", (8, 8)).save(buffer, "GIF")
    data = bytearray(buffer.getvalue())
    data[6:10] = struct.pack("<HH", width, height)  # logical screen
    at = data.index(b"\x2c")  # image descriptor: left, top, width, height
    data[at + 5:at + 9] = struct.pack("<HH", width, height)
    return bytes(data)


def test_the_pixel_limit_holds_for_a_gif_as_for_a_png():
    """The pixel limit is checked from any format's header before decoding (only PNG headers were tried): a GIF
    claiming 72 MP, under Pillow's own limits, is refused."""
    with pytest.raises(vision.MediaError, match=r"image too large \(9000x8000 = 72 MP, limit 64 MP\)"):
        vision.load_image(_gif_claiming(9000, 8000))
    with pytest.raises(vision.MediaError, match=r"image too large \(3000x3000 = 9 MP, limit 1 MP\)"):
        vision.load_image(_gif_claiming(3000, 3000), max_pixels=1_000_000)


def test_a_32_bit_integer_tiff_is_scaled_to_8_bits_not_clipped_white():
    """32-bit integer greyscale (mode "I": a TIFF of scientific data) is scaled to 8 bits as 16-bit is, not clipped
    at 255 (a mid grey would be white)."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4), 32896, dtype=np.int32)).save(buffer, "TIFF")
    assert Image.open(io.BytesIO(buffer.getvalue())).mode == "I"
    pixel = np.asarray(vision.load_image(buffer.getvalue()))[0, 0].astype(int)
    assert np.abs(pixel - 128).max() <= 1, pixel


def test_a_stop_that_comes_as_a_picture_finishes_decoding_stops_it(tmp_path, monkeypatch):
    """A stop (a client that left, or the time limit) that comes while a picture decodes, after its file's last
    read, is seen once it is decoded, before it is converted: a one-picture request checks nothing after."""
    path = tmp_path / "photo.png"
    Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8")).save(path)
    decoded = []
    real_load = ImageFile.ImageFile.load

    def load(self):
        result = real_load(self)
        decoded.append(True)  # the decoding ends: the client left meanwhile
        return result

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    with vision.reading_limit(None, stop=lambda: bool(decoded)):
        with pytest.raises(vision.ReadingStopped, match="photo.png: reading it was stopped"):
            vision.load_image(path)


def test_a_truncated_video_s_sample_rate_is_that_of_the_frames_it_was_sampled_over(tmp_path):
    """A truncated video's sampling rate (Qwen2.5-VL's seconds per temporal patch come from it) is over the frames
    that decode and were sampled from, not the count its header declares."""
    full = _write_video(tmp_path / "full.mp4", frames=60, container_options={"movflags": "faststart"}).read_bytes()
    path = tmp_path / "cut.mp4"
    for fraction in (0.95, 0.9, 0.85, 0.8, 0.7, 0.6):
        path.write_bytes(full[: int(len(full) * fraction)])
        decodable = _decodable_frame_count(path)
        if 8 <= decodable < 50:
            break
    assert 8 <= decodable < 50
    qwen = sampling.sample_video_qwen(path)
    assert qwen.indices[-1] == decodable - 1
    assert qwen.sample_fps == pytest.approx(len(qwen.indices) / decodable * CLIP_FPS)
    uniform = sampling.sample_video_uniform(path, 8)
    assert uniform.sample_fps == pytest.approx(8 / decodable * CLIP_FPS)


def test_a_matroska_file_cut_at_three_quarters_says_so(tmp_path):
    """A Matroska file (no frame count in its header) cut at three quarters says what it lacks (only a cut at half
    was tried)."""
    whole = _write_video(tmp_path / "whole.mkv", frames=60, fps=10, gop=10)
    data = whole.read_bytes()
    (tmp_path / "cut.mkv").write_bytes(data[: int(len(data) * 0.75)])
    decoded = _decodable_frame_count(tmp_path / "cut.mkv")
    assert decoded < 50
    shortfall = sampling.sample_video_uniform(tmp_path / "cut.mkv", 8).shortfall
    assert shortfall is not None and shortfall[0] == decoded and 55 <= shortfall[1] <= 65


def test_check_media_refuses_an_oversized_picture_before_any_model_loads(tmp_path):
    """``check_media``, what `glimpse ask`, bench and eval run before a model loads, refuses a picture over the pixel
    limit or too long and thin from its header."""
    path = tmp_path / "huge.png"
    path.write_bytes(_png_header_only(9000, 9000))
    with pytest.raises(vision.MediaError, match=r"huge\.png: image too large \(9000x9000 = 81 MP"):
        vision.check_media(path, "image")
    path.write_bytes(_png_header_only(30_000, 100))
    with pytest.raises(vision.MediaError, match="too long and thin"):
        vision.check_media(path, "image")


@pytest.mark.parametrize("suffix", [".ts", ".avi"])
def test_seeking_in_a_container_whose_seek_lands_late_still_gives_the_frames_asked_for(tmp_path, suffix):
    """A seek that lands past its target (MPEG-TS and AVI as PyAV writes them do) is not taken for the target: the
    frames asked for are the frames given (taken so, frames 106, 186, 234 stood for 100, 180, 230 of a .ts)."""
    path = _write_video(tmp_path / f"recording{suffix}", frames=240, gop=10)
    wanted = [0, 100, 101, 180, 230, 239]
    frames = media_module._decode_pyav(path, wanted, seek_min_gap=8).frames
    assert [_frame_index(frame) for frame in frames] == wanted


# ------------------------------------------------------------------------ mutation pass "vis" (survivors)


def test_a_picture_of_exactly_the_pixel_limit_is_read_and_one_pixel_more_is_not():
    """The limit is the most pixels a picture may have: at it, the picture is read."""
    assert vision.load_image(Image.new("RGB", (100, 100), (9, 9, 9)), max_pixels=10_000).size == (100, 100)
    with pytest.raises(vision.MediaError, match=r"image too large \(100x101"):
        vision.load_image(Image.new("RGB", (100, 101)), max_pixels=10_000)


def test_a_32_bit_integer_picture_whose_values_fit_in_8_bits_keeps_them():
    """``_to_8bit``: integer pictures whose values fit in 0..255 are kept as they are (not divided by 257 into
    black), as 32-bit integer TIFFs holding 8-bit data are."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((4, 4), 200, dtype=np.int32)).save(buffer, "TIFF")
    assert Image.open(io.BytesIO(buffer.getvalue())).mode == "I"
    assert np.asarray(vision.load_image(buffer.getvalue()))[0, 0].tolist() == [200, 200, 200]


def test_a_palette_picture_with_an_alpha_band_is_white_where_transparent():
    """Mode PA (a palette and an alpha band) is a picture with alpha like RGBA and LA: transparent becomes white."""
    picture = Image.new("P", (2, 1))
    picture.putpalette([255, 0, 0] + [0] * 765)
    with_alpha = picture.convert("PA")
    with_alpha.putalpha(0)
    assert with_alpha.mode == "PA"
    assert np.asarray(vision.load_image(with_alpha)).tolist() == [[[255, 255, 255], [255, 255, 255]]]


def test_a_file_with_only_audio_given_as_a_video_says_it_has_no_video_stream(tmp_path):
    """`glimpse ask --video song.m4a`: one clear line, not an internal error."""
    path = tmp_path / "song.m4a"
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=44100)
        for index in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 44100, index * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    for read in (vision.probe_video, vision.sample_video_qwen, vision.sample_video_uniform,
                 lambda p: vision.check_media(p, "video")):
        with pytest.raises(vision.MediaError, match=r"^song\.m4a: the file has no video stream$"):
            read(path)


def test_a_video_with_a_stream_but_no_frames_is_said_to_hold_none(tmp_path):
    path = tmp_path / "empty.avi"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    for read in (vision.probe_video, vision.sample_video_qwen, vision.sample_video_uniform):
        with pytest.raises(vision.MediaError, match=r"^empty\.avi: the video is corrupt or truncated: it contains no "
                                                    r"frames"):
            read(path)


def test_a_picture_given_as_a_video_is_said_to_be_a_picture(tmp_path):
    """PyAV reads a picture as a one-frame clip: given as a video, it is refused in words, not sampled as a clip
    (eight copies of it) nor called too short."""
    path = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(path)
    for read in (vision.probe_video, vision.sample_video_qwen, vision.sample_video_uniform):
        with pytest.raises(vision.MediaError, match=r"^photo\.png: this is an image, not a video"):
            read(path)


def test_a_variable_frame_rate_mp4_s_rate_is_its_frames_average_not_its_declared_base_rate(tmp_path):
    """qwen-vl-utils (decord's get_avg_fps, torchvision's video_fps) take a video's average frame rate: 90 frames
    40 ms apart in a stream declared at 30 fps are 25 fps, 3.6 s, and their times are those."""
    import fractions

    path = _write_video(tmp_path / "vfr.mp4", frames=90, fps=30, size=(32, 32), pts=[40 * i for i in range(90)],
                        time_base=fractions.Fraction(1, 1000))
    info = vision.probe_video(path)
    # (FFmpeg's average over the stream's packets: within a few percent of 25, far from the declared 30)
    assert info.fps == pytest.approx(25, rel=0.03) and info.duration_s == pytest.approx(3.6, rel=0.03)
    assert vision.sample_video_qwen(path).timestamps_s[-1] == pytest.approx(89 * 0.04, rel=0.03)


def test_a_matroska_file_cut_short_says_so_to_the_qwen_sampler_too(tmp_path):
    """The Qwen sampler, as the uniform one, says what a cut Matroska file (no frame count, only a duration) lacks."""
    whole = _write_video(tmp_path / "whole.mkv", frames=60, fps=10, gop=10)
    data = whole.read_bytes()
    (tmp_path / "cut.mkv").write_bytes(data[: len(data) // 2])
    shortfall = sampling.sample_video_qwen(tmp_path / "cut.mkv").shortfall
    assert shortfall is not None and shortfall[0] == _decodable_frame_count(tmp_path / "cut.mkv")
    assert 50 <= shortfall[1] <= 65


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"fps": 0.1, "min_frames": 5}, 6),  # min_frames rounded up to even (qwen-vl-utils' ceil_by_factor)
        ({"max_frames": 5}, 4),  # max_frames rounded down to even: never above it
        ({"nframes": 7}, 8),  # an explicit count rounded to the nearest even (round(3.5) = 4 pairs)
    ],
)
def test_smart_nframes_rounds_odd_bounds_as_qwen_vl_utils(kwargs, expected):
    assert vision.smart_nframes(300, 30, **kwargs) == expected


def test_a_densely_sampled_video_shares_its_pixel_budget_among_its_frames(tmp_path):
    """qwen-vl-utils' total_pixels is the whole video's budget: each frame gets at most total_pixels / frames * 2
    (two frames make one temporal patch), so a densely sampled video gets smaller frames."""
    path = _write_video(tmp_path / "vga.mp4", frames=8, size=(640, 480))
    total = 8 // 2 * 110_000
    sampled = vision.sample_video_qwen(path, nframes=8, total_pixels=total)
    height, width = sampled.frames.shape[1:3]
    assert vision.VIDEO_MIN_PIXELS <= height * width <= total / 8 * 2


def test_video_inputs_default_to_the_video_processor_s_per_frame_budget():
    """Qwen2VLVideoProcessor's size: at most 768 tokens' worth of pixels per frame (not the image processor's 16384)."""
    frames = np.zeros((2, 1080, 1920, 3), dtype=np.uint8)
    _, grid_h, grid_w = vision.qwen2vl_video_inputs(frames)["video_grid_thw"][0].tolist()
    assert grid_h * grid_w * 14 * 14 <= vision.VIDEO_MAX_PIXELS


def test_normalizing_patches_that_are_not_bytes_is_refused():
    """Float patches are normalized already: normalizing them again (in place) would silently give garbage."""
    patches = vision.qwen2vl_video_inputs(np.zeros((2, 56, 56, 3), dtype=np.uint8), resize=False)["pixel_values_videos"]
    with pytest.raises(ValueError, match="uint8"):
        vision.qwen_video.normalize_video_patches(patches)


@pytest.mark.parametrize("mode, key", [("RGB", (255, 0, 0)), ("L", 0)])
def test_a_png_s_transparent_colour_key_becomes_white_as_a_palette_s_does(tmp_path, mode, key):
    """A PNG's tRNS chunk marks one colour of a greyscale or RGB picture transparent, as it marks palette entries:
    transparent pixels become white for every mode (load_image's promise), not only for palette pictures."""
    picture = Image.new(mode, (2, 1), key)
    picture.putpixel((1, 0), (0, 0, 255) if mode == "RGB" else 100)
    path = tmp_path / "keyed.png"
    picture.save(path, transparency=key)
    expected_other = [0, 0, 255] if mode == "RGB" else [100, 100, 100]
    assert np.asarray(vision.load_image(path)).tolist() == [[[255, 255, 255], expected_other]]


def test_a_16_bit_greyscale_png_s_transparent_colour_key_becomes_white(tmp_path):
    """The key of a 16-bit picture is a 16-bit value: matched before the values are scaled to 8 bits, where other
    values would round onto it."""
    values = np.array([[1000, 1001, 60000]], dtype=np.uint16)
    path = tmp_path / "keyed16.png"
    Image.fromarray(values).save(path, transparency=1000)
    assert Image.open(path).info["transparency"] == 1000  # (the file holds the key)
    grey = [round(v / 257) for v in (1001, 60000)]
    assert np.asarray(vision.load_image(path)).tolist() == [[[255] * 3, [grey[0]] * 3, [grey[1]] * 3]]


def _png(width: int, height: int, colour_type: int, depth: int, rows: list[bytes], trns: bytes | None = None) -> bytes:
    """A PNG written by hand (PIL writes no 16-bit RGB): IHDR, an optional tRNS, the rows unfiltered."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0))
    return (b"\x89PNG\r\n\x1a\n" + header + (chunk(b"tRNS", trns) if trns is not None else b"")
            + chunk(b"IDAT", zlib.compress(b"".join(b"\0" + row for row in rows))) + chunk(b"IEND", b""))


def test_a_16_bit_rgb_png_s_colour_key_whitens_no_opaque_pixel():
    """PIL keeps 8 bits a sample of a 16-bit RGB picture but its 16-bit key, which it then matches against the 8 bits
    left: opaque pixels turned white and the transparent one stayed dark (a review of the key's first version). Such a
    key is not applied; every pixel is its colour."""
    values = [0x1234, 0x3434, 0xFF34, 0x34FF]
    data = _png(4, 1, 2, 16, [b"".join(struct.pack(">3H", v, v, v) for v in values)], struct.pack(">3H", *[0x1234] * 3))
    assert np.asarray(vision.load_image(data))[0, :, 0].tolist() == [v >> 8 for v in values]


@pytest.mark.filterwarnings("ignore:Palette images with Transparency expressed in bytes")  # (PIL's, for one key)
def test_a_picture_handed_in_decoded_keeps_its_colours_whatever_its_transparency_info_says():
    """The Python API takes PIL images: a palette picture its owner converted to RGB keeps the palette's key in its
    info, and its pixels of that colour are opaque (the key was taken out of use); so are those of a picture whose key
    is malformed (a TypeError from inside PIL for RGB ones, after the key's first version)."""
    picture = Image.new("P", (3, 1))
    picture.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 0] + [0] * 759)
    picture.putdata([0, 1, 2])
    picture.info["transparency"] = 0
    converted = picture.convert("RGB")
    assert np.asarray(vision.load_image(converted)).tolist() == [[[0, 0, 0], [255, 0, 0], [0, 0, 0]]]
    for mode, key in (("RGB", 5), ("RGB", (1, 2)), ("RGB", (1, 2, 3, 4)), ("RGB", 3.5), ("L", b"\x00\x05")):
        image = Image.new(mode, (2, 1))
        image.info["transparency"] = key
        assert np.asarray(vision.load_image(image)).tolist() == [[[0, 0, 0], [0, 0, 0]]], (mode, key)
