"""The `glimpse` command.

    glimpse ask [--model M] [--image P | --video P] [--policy P] [--speed S] [--max-new-tokens N] [--json] QUESTION

Errors a user can cause (bad media, unknown model, prompt too long) print one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

POLICY_CHOICES = ["auto", "none", "dash", "zipvl", "hidivdrop", "st3", "lazyllm", "fastv"]
NOT_GROUNDED = ("note: the embedded model's vision projector is not trained yet, so its answers about "
                "images and videos are not grounded in them; text answers come from SmolLM2-135M-Instruct. "
                "Use --model with a Qwen2-VL or LLaVA checkpoint for real answers.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glimpse", description="Chat with vision-language models about "
                                     "images and videos, faster, with training-free token pruning.")
    commands = parser.add_subparsers(dest="command", required=True)

    ask = commands.add_parser("ask", help="answer one question, optionally about an image or a video")
    ask.add_argument("question", help="the question (text)")
    ask.add_argument("--model", default="embedded",
                     help="hub id or local checkpoint folder of Qwen2-VL, LLaVA-1.5, LLaVA-NeXT or LongVA; "
                          "'embedded' (default) is the small offline model")
    media = ask.add_mutually_exclusive_group()
    media.add_argument("--image", action="append", default=[], metavar="PATH", help="an image (repeatable)")
    media.add_argument("--video", metavar="PATH", help="a video file")
    ask.add_argument("--policy", default="auto", choices=POLICY_CHOICES, help="pruning policy (default: auto)")
    ask.add_argument("--speed", type=float, default=0.0, help="speed/quality slider in [0, 1]; 0 is exact")
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    ask.add_argument("--temperature", type=float, default=0.7)
    ask.add_argument("--top-p", type=float, default=0.9)
    ask.add_argument("--seed", type=int, default=None)
    ask.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    ask.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"])
    ask.add_argument("--json", action="store_true", help='print one JSON object {"text", "policy", "params", "metrics"}')
    ask.set_defaults(run=run_ask)
    return parser


def run_ask(args) -> int:
    from pipeline import load_engine

    if not 0.0 <= args.speed <= 1.0:
        raise UserError(f"--speed must be between 0 and 1, got {args.speed}")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    content = [{"type": "image", "image": path} for path in args.image]
    if args.video:
        content.append({"type": "video", "video": args.video})
    content.append({"type": "text", "text": args.question})
    messages = [{"role": "user", "content": content}]

    _log(f"loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    if not engine.grounded and (args.image or args.video):
        _log(NOT_GROUNDED)
    options = dict(policy=args.policy, speed=args.speed, max_new_tokens=args.max_new_tokens,
                   do_sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.json:
        result = engine.generate(messages, **options)
        out = {"text": result.text, "policy": result.policy, "params": result.params, "metrics": result.metrics,
               "model": args.model, "grounded": engine.grounded, "finish_reason": result.finish_reason}
        print(json.dumps(out))
        return 0
    result = None
    for chunk in engine.stream(messages, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    m = result.metrics
    _log(f"[{result.policy} speed={args.speed}] TTFT {m['ttft_s']:.2f}s, prefill {m['prefill_s']:.2f}s, "
         f"{m['new_tokens']} tokens" + (f" at {m['decode_tokens_per_s']:.1f}/s" if m["decode_tokens_per_s"] else "")
         + f", prompt {m['prompt_tokens']}")
    return 0


class UserError(Exception):
    """A mistake in the command line itself."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    from pipeline import ModelLoadError, PromptError
    from pipeline.embedded import EmbeddedModelError
    from vision import MediaError

    expected = (UserError, MediaError, PromptError, ModelLoadError, EmbeddedModelError, ValueError)
    try:
        return args.run(args)
    except expected as error:
        print(f"glimpse: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("glimpse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
