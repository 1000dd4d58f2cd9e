"""RLT (pruning/rlt.py) on a Qwen2-VL vision tower of real width: how many video tokens it leaves out, and
what that saves in the encoder and to the first token, against no pruning, side by side in one run.

    python benchmarks/rlt.py                      # CPU: a 4-block tower, ~1.3K-token videos (a few minutes)
    python benchmarks/rlt.py --vision-depth 32 --video-tokens 16000 --device cuda --dtype bfloat16

Two synthesized clips, both 2 fps at the same size: ``scene``, a still camera on a smooth textured scene in
which a few shapes move, with sensor noise and H.264 compression (x264's default quality), i.e. what RLT is
for; and ``noise``, ``glimpse bench``'s clip of new random cells in every frame, where nothing repeats (its
worst case: the decision's cost and nothing saved). Timings alternate the configurations, median of
``--rounds``; the encoder is timed alone (``Engine.encode_media``, no cache) and within the time to first token
(``generate``, one token). Random weights: the token counts and times are real, the answers are not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glimpse.bench import video_plan, write_still_scene, write_video  # noqa: E402
from glimpse.pipeline import load_engine  # noqa: E402
from glimpse.pipeline.metrics import synchronize  # noqa: E402
from glimpse.pipeline.random_checkpoint import build_random_qwen2_vl  # noqa: E402
from glimpse.pruning import make_policy  # noqa: E402
from glimpse.pruning.rlt import repeated_tokens  # noqa: E402
from flags import check_flags  # noqa: E402  (beside this script)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2-vl-2b", help="the decoder's shapes (random_checkpoint.PRESETS)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (the encoder is what is measured)")
    parser.add_argument("--vision-depth", type=int, default=4, help="vision tower blocks at real width (Qwen2-VL: 32)")
    parser.add_argument("--video-tokens", type=int, default=1300)
    parser.add_argument("--speeds", default="0.25,0.5,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    check_flags(parser, args, counts=("layers", "vision_depth", "video_tokens", "rounds"), device=True)
    speeds = [float(s) for s in args.speeds.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"building a random {args.preset} ({args.layers} decoder layers, {args.vision_depth}-block tower) ...",
              file=sys.stderr)
        model = build_random_qwen2_vl(tmp / "model", preset=args.preset, layers=args.layers,
                                      vision_depth=args.vision_depth, max_visual_tokens=args.video_tokens * 2,
                                      dtype=args.dtype)
        engine = load_engine(str(model), device=args.device, attn="sdpa")
        frames, rows, cols = video_plan(args.video_tokens)
        clips = {"scene": write_still_scene(tmp / "scene.mp4", frames, (cols * 28, rows * 28)),
                 "noise": write_video(tmp / "noise.mp4", frames, 2, (cols * 28, rows * 28))}
        results = []
        for clip, path in clips.items():
            messages = [{"role": "user", "content": [{"type": "video", "video": str(path)},
                                                     {"type": "text", "text": "What happens in this video?"}]}]
            prompt = engine.prepare(messages, caches=False)
            (item, rows), = prompt.media_rows()
            configs = [("none", 0.0)] + [("rlt", s) for s in speeds]
            times = {c: {"encoder": [], "ttft": [], "decide": []} for c in configs}
            left_out = {}
            for round_ in range(args.rounds + 1):  # the first round warms up and is not counted
                for name, speed in configs:
                    tau = make_policy(name, speed).tau if name == "rlt" else 0.0
                    repeats = []
                    decide = timed(lambda: repeats.append(repeated_tokens(engine.adapter.token_pixels(item), tau)),
                                   engine.device) if tau > 0 else 0.0
                    encoded = torch.ones(len(prompt), dtype=torch.bool)
                    if repeats:
                        encoded[rows[repeats[0].flatten()]] = False
                    with torch.inference_mode():
                        encoder = timed(lambda: engine.encode_media(prompt, caches=False, encoded=encoded), engine.device)
                    result = engine.generate(messages, policy=make_policy(name, speed), max_new_tokens=1)
                    left_out[(name, speed)] = int((~encoded).sum())
                    assert left_out[(name, speed)] == result.metrics["policy_telemetry"].get("not_encoded", 0)
                    if round_:
                        times[(name, speed)]["encoder"].append(encoder)
                        times[(name, speed)]["ttft"].append(result.metrics["ttft_s"])
                        times[(name, speed)]["decide"].append(decide)
            video_tokens = prompt.token_counts()["video"]
            base = {k: statistics.median(v) for k, v in times[("none", 0.0)].items()}
            for name, speed in configs:
                median = {k: statistics.median(v) for k, v in times[(name, speed)].items()}
                row = {"clip": clip, "config": f"{name}@{speed:g}", "video_tokens": video_tokens,
                       "left_out": left_out[(name, speed)] / video_tokens,
                       "encoder_s": median["encoder"], "encoder_speedup": base["encoder"] / median["encoder"],
                       "ttft_s": median["ttft"], "ttft_speedup": base["ttft"] / median["ttft"],
                       "decide_s": median["decide"]}
                results.append(row)
                print(f"{clip:5} {row['config']:8} {video_tokens} video tokens, {row['left_out']:.0%} left out: "
                      f"encoder {row['encoder_s']:.3f} s ({row['encoder_speedup']:.2f}x), first token "
                      f"{row['ttft_s']:.3f} s ({row['ttft_speedup']:.2f}x), RLT's decision {row['decide_s'] * 1e3:.1f} ms",
                      file=sys.stderr)
    report = {"device": args.device, "dtype": args.dtype, "preset": args.preset, "layers": args.layers,
              "vision_depth": args.vision_depth, "rounds": args.rounds, "rows": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
