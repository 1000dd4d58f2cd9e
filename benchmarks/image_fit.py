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

``random-llava-next`` is llava-v1.6's image processor (336-pixel tiles, its five tilings) before a small random
LLaVA-NeXT (a one-layer CLIP-L/14-336-input tower 64 wide, a two-layer decoder): the seconds to the model's input are
that processor's, and its time to first token differs from the unfitted one's by them alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from glimpse import vision
from glimpse.bench import device_name
from glimpse.pipeline import load_engine
from glimpse.pipeline.random_checkpoint import photo_like

PICTURES = [("12 MP photo", (4032, 3024), "JPEG"), ("12 MP photo", (4032, 3024), "PNG"),
            ("48 MP photo", (8064, 6048), "JPEG")]


def build_random_llava_next(folder: Path) -> Path:
    """A small random LLaVA-NeXT checkpoint with llava-v1.6's image processor (see the module's docstring)."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil

    from glimpse.pipeline.random_checkpoint import LLAVA_SPECIAL_TOKENS, LLAVA_TEMPLATE, make_tokenizer

    tok = make_tokenizer(LLAVA_SPECIAL_TOKENS, eos="</s>", bos="<s>")
    tilings = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # llava-v1.6's image_grid_pinpoints
    config = LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, image_size=336, patch_size=14, projection_dim=64),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096),
        image_token_id=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=tilings,
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                               image_grid_pinpoints=tilings).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(LLAVA_TEMPLATE)
    return folder


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
    checkpoint = tempfile.TemporaryDirectory()
    model = (str(build_random_llava_next(Path(checkpoint.name))) if args.model == "random-llava-next"
             else args.model)
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
