"""A large picture resized to what the model's processor takes as it is decoded (``Adapter.image_fit``, since
2026-12-06), against decoding it whole and letting the processor resize it (what Glimpse did before), side by side.

Photo-like pictures (smooth colour and sharp edges) at a phone's 12 MP and 48 MP, as JPEG (decoded at a reduced
scale) and PNG (reduced by a box filter after decoding): the seconds from the file to the model's input
(``load_image`` and the adapter's ``prepare_image``), medians of ``--runs`` alternating rounds after a warm-up, and the
time to first token of a one-token answer (media and encoder caches off). And how far the model's input moved: the
mean and largest difference of its pixels, as a share of their range, with the same token count.

    python benchmarks/image_fit.py                      # the embedded model, on this machine (docs/benchmarks.md)
    python benchmarks/image_fit.py --model random-llava-next   # LLaVA-NeXT's anyres processor (below)
    python benchmarks/image_fit.py --model Qwen/Qwen2-VL-7B-Instruct --device cuda

``random-llava-next`` is llava-v1.6's image processor (336-pixel tiles, its five tilings) before the test suite's tiny
random LLaVA-NeXT (tests/tiny_models.py) built for it: the seconds to the model's input are that processor's, and its
time to first token differs from the unfitted one's by them alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from glimpse import vision
from glimpse.bench import device_name
from glimpse.pipeline import load_engine
from glimpse.pipeline.random_checkpoint import photo_like

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test suite's tiny checkpoints
from tiny_models import build_llava_next  # noqa: E402
from flags import check_flags  # noqa: E402  (beside this script)

LLAVA_V16_TILINGS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # its image_grid_pinpoints

PICTURES = [("12 MP photo", (4032, 3024), "JPEG"), ("12 MP photo", (4032, 3024), "PNG"),
            ("48 MP photo", (8064, 6048), "JPEG")]


def to_input(engine, path: Path, fit) -> tuple[float, object]:
    start = time.perf_counter()
    item = engine.adapter.prepare_image(vision.load_image(path, fit=fit))
    return time.perf_counter() - start, item


def first_token_s(engine, path: Path, fitted: bool) -> float:
    messages = [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    with mock.patch.object(type(engine.adapter), "image_fit", engine.adapter.image_fit if fitted else None):
        result = engine.generate(messages, policy="none", max_new_tokens=1)
    return result.metrics["ttft_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    check_flags(parser, args, counts=("runs",), device=True)
    checkpoint = tempfile.TemporaryDirectory()
    model = (str(build_llava_next(Path(checkpoint.name), image_size=336, pinpoints=LLAVA_V16_TILINGS))
             if args.model == "random-llava-next" else args.model)
    engine = load_engine(model, device=args.device)
    fit = engine.adapter.image_fit
    if fit is None:
        raise SystemExit(f"{args.model}: its processor's resizing is not known to Glimpse (image_fit is None)")
    print(f"{args.model} on {device_name(engine)}; FIT_GAP {vision.FIT_GAP:g}; medians of {args.runs} runs\n")
    print("| picture | to the model's input: whole | fitted | speed-up | TTFT: whole | fitted | input tokens | "
          "pixel difference: mean | largest |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name, size, form in PICTURES:
            path = Path(folder) / f"photo-{size[0]}.{form.lower()}"
            photo_like(*size).save(path, form, **({"quality": 90} if form == "JPEG" else {}))
            to_input(engine, path, fit), to_input(engine, path, None)  # warm-up
            first_token_s(engine, path, True), first_token_s(engine, path, False)
            seconds = {True: [], False: []}
            ttft = {True: [], False: []}
            for _ in range(args.runs):
                for fitted in (False, True):
                    elapsed, item = to_input(engine, path, fit if fitted else None)
                    seconds[fitted].append(elapsed)
                    ttft[fitted].append(first_token_s(engine, path, fitted))
                    if fitted:
                        fitted_item = item
                    else:
                        whole_item = item
            whole, fitted = (whole_item.tensors["pixel_values"].float(), fitted_item.tensors["pixel_values"].float())
            tokens = f"{whole_item.num_tokens} / {fitted_item.num_tokens}"
            difference = (fitted - whole).abs() / (whole.max() - whole.min())
            media = {k: statistics.median(v) for k, v in seconds.items()}
            first = {k: statistics.median(v) for k, v in ttft.items()}
            print(f"| {name}, {form} {size[0]}x{size[1]} | {media[False]:.3f} s | {media[True]:.3f} s | "
                  f"{media[False] / media[True]:.1f}x | {first[False]:.3f} s | {first[True]:.3f} s | {tokens} | "
                  f"{float(difference.mean()):.5f} | {float(difference.max()):.4f} |", flush=True)


if __name__ == "__main__":
    main()
