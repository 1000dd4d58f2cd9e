"""Media that take long to decode, sent to a running `glimpse serve`: does the rest of the server wait for them?

The video is small and cheap to send but expensive to read: N black 1080p frames behind a single keyframe (x264 with
no further keyframes), so that every frame the sampler wants can only be reached by decoding all the frames before
it, and no seek helps. 20,000 frames are 600 KB and about 18 s of decoding on a 2-core CPU; the API's 64 MiB body holds
a hundred times that. Three measurements:

1. a text question sent 2 s after the video request: how long its answer takes (alone, about 0.3 s on the embedded
   model), and what the video request got and when (a 400 past ``--media-timeout``, or its answer);
2. the video sent again (remuxed into Matroska, so that the media cache does not know it) by a client that leaves
   after 3 s: the server's CPU seconds in the 5 s after it left (near 0
   once the decoding stops; two cores' worth while it goes on). ``--pid`` is the server's process id.

    glimpse serve --port 7911 &
    python benchmarks/slow_media.py --url http://127.0.0.1:7911 --pid $(pgrep -f "glimpse serve") --frames 20000

The video is written once to ``--video`` (about 100 s for 20,000 frames) and reused.
"""

from __future__ import annotations

import argparse
import base64
import os
import threading
import time
from pathlib import Path

import httpx
from flags import check_flags


def write_video(path: Path, frames: int, width: int = 1920, height: int = 1080) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # One keyframe, at the start: nothing to seek to.
        stream.options = {"preset": "ultrafast", "x264-params": "keyint=1000000:min-keyint=1000000:scenecut=0"}
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), "rgb24")
        for index in range(frames):
            black.pts = index
            container.mux(stream.encode(black))
        container.mux(stream.encode())


def remux(source: Path, target: Path) -> None:
    """The same packets in Matroska: other bytes, so that the server's media cache does not hold it."""
    import av

    with av.open(str(source)) as inp, av.open(str(target), "w", format="matroska") as out:
        stream = out.add_stream_from_template(inp.streams.video[0])
        for packet in inp.demux(inp.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                out.mux(packet)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7911")
    parser.add_argument("--pid", type=int, required=True, help="the server's process id (for its CPU time)")
    parser.add_argument("--frames", type=int, default=20000)
    parser.add_argument("--video", default="/tmp/glimpse-slow-media.mp4")
    args = parser.parse_args()
    check_flags(parser, args, counts=("frames",))
    video = Path(args.video)
    if not video.exists():
        print(f"writing {video} ({args.frames} frames) ...", flush=True)
        write_video(video, args.frames)
    print(f"video: {video.stat().st_size / 1e3:.0f} KB, {args.frames} frames behind one keyframe")
    endpoint = args.url + "/v1/chat/completions"
    data_url = "data:video/mp4;base64," + base64.b64encode(video.read_bytes()).decode()
    about_video = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What happens?"},
                                                             {"type": "video_url", "video_url": {"url": data_url}}]}],
                   "max_tokens": 4}
    question = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 4}

    got = {}

    def timed(name, body, delay=0.0):
        time.sleep(delay)
        start = time.perf_counter()
        reply = httpx.post(endpoint, json=body, timeout=3600)
        got[name] = (reply.status_code, time.perf_counter() - start, reply.text[:120])

    start = time.perf_counter()
    httpx.post(endpoint, json=question, timeout=600)
    print(f"the text question alone: {time.perf_counter() - start:.2f} s")
    threads = [threading.Thread(target=timed, args=("video", about_video)),
               threading.Thread(target=timed, args=("text", question, 2.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ("text", "video"):
        status, seconds, text = got[name]
        print(f"{name:5s} request: {status} after {seconds:.1f} s  {text!r}")

    again = video.with_suffix(".mkv")  # not decoded before: the media cache cannot answer it
    if not again.exists():
        remux(video, again)
    about_video["messages"][0]["content"][1]["video_url"]["url"] = (
        "data:video/x-matroska;base64," + base64.b64encode(again.read_bytes()).decode())
    try:
        httpx.post(endpoint, json=about_video, timeout=3.0)
        print("the leaving client was answered within 3 s")
    except httpx.TimeoutException:
        pass
    time.sleep(1.0)
    before = cpu_seconds(args.pid)
    time.sleep(5.0)
    print(f"server CPU seconds in the 5 s from 1 s after a client left mid-decoding: {cpu_seconds(args.pid) - before:.2f}")


if __name__ == "__main__":
    main()
