"""A Qwen2-VL image's or video's patches kept as uint8 bytes until the encoder (since 2026-12-02) against float32
patches normalized on the host (the code before, kept here as the "before" side).

What a request with a long video or a large photo pays before its encoder starts, on the path ``glimpse serve``
takes (its encoder and prefix caches are on by default, so every new item is hashed): building the prompt
(``engine.prepare``: decoding the file, sampling and resizing, cutting the patches), hashing the patches
(``encoder_cache.item_key``), and giving the encoder its input on its device (``Qwen2VLAdapter._pixels``: the
transfer, and now the normalization there). The model is the test suite's tiny Qwen2-VL: none of this depends on
the model's width, and the media are processed at their real size (qwen-vl-utils' rules for video, the image
processor's default pixel budget for images). The videos are noise written as H.264 at 2 fps, sized for about
``--tokens`` visual tokens each (the GPU suite's videos); the photo is a 4000x3000 JPEG of noise (a phone camera's
12 MP), which the processor resizes to about 15,000 tokens. The sides alternate; medians of ``--runs``.

    python benchmarks/qwen_patches.py                    # this CPU (docs/benchmarks.md)
    python benchmarks/qwen_patches.py --device cuda      # on a lent GPU (docs/gpu.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from glimpse import vision
from glimpse.bench import device_name, video_plan, write_video
from glimpse.pipeline import load_engine
from glimpse.pipeline.adapters import IMAGE, MediaInput, Qwen2VLAdapter, _joined
from glimpse.pipeline.encoder_cache import item_key

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import build_qwen2_vl  # noqa: E402
from flags import check_flags  # noqa: E402  (beside this script)


class FloatPatchesAdapter(Qwen2VLAdapter):
    """The code before: the patches normalized to float32 on the host when the prompt is built, moved as they are."""

    def prepare_image(self, image):
        out = self.image_processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"]
        t, h, w = (int(x) for x in grid[0])
        m = self.merge_size
        return MediaInput(IMAGE, t * h * w // m**2, {"pixel_values": out["pixel_values"], "image_grid_thw": grid},
                          frames=[image], grid=(t, h // m, w // m))

    def _video_input(self, sampled):
        item = super()._video_input(sampled)
        ip = self.image_processor
        item.tensors["pixel_values_videos"] = vision.qwen2vl_video_inputs(
            sampled.frames, patch_size=ip.patch_size, temporal_patch_size=ip.temporal_patch_size,
            merge_size=ip.merge_size, image_mean=ip.image_mean, image_std=ip.image_std,
            resize=False)["pixel_values_videos"]
        return item

    def _pixels(self, items, kind, device=None, rows=None):
        pixels = _joined([m.tensors["pixel_values" if kind == IMAGE else "pixel_values_videos"] for m in items])
        return (pixels if rows is None else pixels[rows]).to(device)


SIDES = ("uint8 until the encoder", "float32 on the host (before)")


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="the videos' visual tokens")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    check_flags(parser, args, counts=("tokens", "runs"), device=True)
    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="glimpse-qwen-patches-"))
    engine = load_engine(str(build_qwen2_vl(tmp / "qwen2_vl")), device=args.device)
    engine.max_length = 32768  # Qwen2-VL-7B's context: the tiny model's 4,096 would refuse these prompts
    ip = engine.adapter.image_processor
    ip.size = {"shortest_edge": 3136, "longest_edge": 12845056}  # Qwen2-VL's pixel budget: the tiny model's is 112x112
    adapters = {SIDES[0]: engine.adapter,
                SIDES[1]: FloatPatchesAdapter(engine.adapter.model, engine.adapter.tokenizer, ip)}
    print(f"device: {device_name(engine)}; torch threads: {torch.get_num_threads()}")
    photo = tmp / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)).save(photo, quality=90)
    requests = {"a 4000x3000 JPEG photo": [{"type": "image", "image": str(photo)}]}
    for tokens in args.tokens:
        frames, rows, cols = video_plan(tokens)
        clip = write_video(tmp / f"video-{tokens}.mp4", frames, 2, (cols * 28, rows * 28))
        requests[f"a video of {frames} frames, {cols * 28}x{rows * 28}"] = [{"type": "video", "video": str(clip)}]
    results = []
    for name, media in requests.items():
        messages = [{"role": "user", "content": [*media, {"type": "text", "text": "What is this?"}]}]
        times = {side: {"build": [], "hash": [], "to encoder": []} for side in SIDES}
        inputs, sizes = {}, {}
        for run in range(args.runs + 1):  # the first round warms up
            for side in SIDES if run % 2 else reversed(SIDES):
                engine.adapter = adapters[side]
                build, prompt = timed(lambda: engine.prepare(messages), device)
                item = prompt.media[0]
                hashing, _ = timed(lambda: item_key(item), device)
                moving, pixels = timed(lambda: engine.adapter._pixels([item], item.kind, device), device)
                if run:
                    for part, seconds in (("build", build), ("hash", hashing), ("to encoder", moving)):
                        times[side][part].append(seconds)
                inputs[side] = pixels.cpu()
                sizes[side] = sum(t.nbytes for t in item.tensors.values())
        engine.adapter = adapters[SIDES[0]]
        same = torch.equal(inputs[SIDES[0]], inputs[SIDES[1]])
        print(f"\n{name}: {item.num_tokens:,} visual tokens, {inputs[SIDES[0]].shape[0]:,} patches; "
              f"the encoder's inputs bit-identical: {same}")
        print("| side | patches kept (MiB) | build (s) | hash (s) | to encoder (s) | total (s) |\n|---|---|---|---|---|---|")
        row = {"media": name, "tokens": item.num_tokens, "same_encoder_input": same, "sides": {}}
        for side in SIDES:
            medians = {part: statistics.median(values) for part, values in times[side].items()}
            total = sum(medians.values())
            row["sides"][side] = {**medians, "total": total, "bytes": sizes[side]}
            print(f"| {side} | {sizes[side] / 2**20:.0f} | {medians['build']:.3f} | {medians['hash']:.3f} | "
                  f"{medians['to encoder']:.3f} | {total:.3f} |")
        before, after = row["sides"][SIDES[1]]["total"], row["sides"][SIDES[0]]["total"]
        print(f"before / now: {before / after:.2f}x ({before - after:.3f} s less)")
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name(engine), "results": results}, indent=2))


if __name__ == "__main__":
    main()
