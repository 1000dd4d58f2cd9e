"""Engine overhead: Glimpse's layer-by-layer prefill vs transformers' own forward, same model and prompt.

A random Qwen2-VL with the 2B model's text width (hidden 1536, FFN 8960, 12 heads, 2 KV heads) and
N decoder layers, an image prompt of about 2,000 tokens. Both sides run the vision encoder; the
transformers side computes logits for the last position only (``logits_to_keep=1``), as the engine
does. Runs alternate (transformers, engine, transformers, ...) after a warm-up; we report medians.

    python benchmarks/engine_overhead.py --layers 8 --image-tokens 2000 --runs 5 [--device cuda --dtype bfloat16]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import QWEN_TEMPLATE, make_tokenizer, reference_inputs  # noqa: E402


def build(folder: Path, layers: int, vision_depth: int, image_tokens: int) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|image_pad|>", "<|video_pad|>"]
    tok = make_tokenizer(special, eos="<|im_end|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=vision_depth, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    pixels = image_tokens * 28 * 28
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": pixels, "longest_edge": pixels})
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--image-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from pipeline import load_engine
    from pipeline.metrics import synchronize
    from pruning import NoPruning

    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "model", args.layers, args.vision_depth, args.image_tokens)
        engine = load_engine(str(folder), device=args.device, attn=args.attn, dtype=args.dtype)
    side = int(round((args.image_tokens * 4) ** 0.5)) * 14
    image = Image.fromarray((np.random.RandomState(0).rand(side, side, 3) * 255).astype("uint8"))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Describe the image in detail."}]}]
    prompt = engine.prepare(messages)
    inputs = {k: v.to(engine.device) for k, v in reference_inputs(engine, prompt).items()}

    def run_transformers():
        engine.model(**inputs, logits_to_keep=1, use_cache=True)

    def run_engine():
        engine.prefill(prompt, NoPruning())

    times = {"transformers": [], "engine": []}
    with torch.inference_mode():
        run_transformers(), run_engine()  # warm-up
        for _ in range(args.runs):
            for name, fn in (("transformers", run_transformers), ("engine", run_engine)):
                synchronize(engine.device)
                start = time.perf_counter()
                fn()
                synchronize(engine.device)
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    device = torch.cuda.get_device_name() if engine.device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    report = {"device": device, "dtype": str(engine.dtype), "attn": engine.attn_implementation,
              "prompt_tokens": prompt.token_counts(), "layers": args.layers, "runs": args.runs,
              "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
              "max_s": {k: max(v) for k, v in times.items()}, "engine_over_transformers": med["engine"] / med["transformers"]}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{device}, {report['dtype']}, {report['attn']}, prompt {report['prompt_tokens']}, {args.layers} layers")
        for name in times:
            print(f"  {name:13s} median {med[name]:.3f}s  min {report['min_s'][name]:.3f}s  max {report['max_s'][name]:.3f}s")
        print(f"  engine / transformers = {report['engine_over_transformers']:.3f}")


if __name__ == "__main__":
    main()
