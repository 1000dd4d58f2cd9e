"""The `glimpse` command.

    glimpse ask [--model M] [--image P | --video P] [--policy P] [--speed S] [--max-new-tokens N] [--json] QUESTION
    glimpse bench serve [--url URL | --model M] [--clients K] [--requests N] [--max-tokens N] [--burst N] [--json]
    glimpse bench [--model M | --random-model PRESET] [--layers N] [--image P] [--video P] [--image-tokens N]
                  [--video-tokens N] [--policies P,Q] [--speeds S,T] [--runs N] [--warmup N] [--json] [--out FILE]
    glimpse calibrate slider --model M [--images DIR] [--videos DIR] [--prompts FILE] [--budget-minutes N]
                             [--leave-out P,Q] [--out FILE]
    glimpse calibrate hidivdrop --model M --images DIR [--window N] [--top-k K] [--max-images N] [--out FILE]
    glimpse eval agreement|passkey|visual [--model M] [--policies P,Q] [--speeds S,T] [--json] [--plot FILE.png]
    glimpse serve [--model M] [--host 127.0.0.1] [--port 7860] [--allowed-root DIR] [--max-upload-mb N]
                  [--max-uploads-gb G] [--max-batch N] [--queue-size N] [--kv-budget-mb N] [--encoder-cache-mb N]
                  [--media-cache-mb N] [--prefix-cache-mb N]
                  [--api-key KEY | --no-api-key] [--shutdown-grace S] [--root-path /PATH]
    glimpse caption INPUT... [--out FILE.jsonl | --format txt] [--overwrite] [--policy P] [--speed S] [--prompt P]
                    [--batch-size N] [--max-new-tokens N]

Errors a user can cause (bad media, unknown model, prompt too long) print one line and exit 1.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from glimpse.common import UserError
from glimpse.common.jsonable import finite, one_line, utf8_text
from glimpse.launcher import kept_stop_status, stop_on_sigterm, stopped
from glimpse.pipeline.prompt import check_text, check_text_length, user_message
from glimpse.pipeline.random_checkpoint import REAL_PRESETS
from glimpse.pruning import NAMES, PRUNING_NAMES, TEXT_PRUNING_NAMES, parse_params
from glimpse.pruning.base import check_speed
from glimpse.vision import MEDIA_TIMEOUT_S
from glimpse.vision.media import check_video_backend

MAX_UPLOADS_GB = 1_000_000  # a petabyte: past it the byte count overflowed (1e300 crashed the server as it started)
DEFAULT_BENCH_IMAGE_TOKENS = 2000
PASSKEY_MIN_TOKENS = 128
# glimpse serve on SIGTERM: answers under way get this long to finish. docker stop kills 10 s after its SIGTERM; the
# connections still open are closed a second after the answers end, and the process takes about a second to exit.
SHUTDOWN_GRACE_S = 8.0
MAX_BENCH_TOKENS = 262_144  # past every supported model's context; the synthesized pictures' pixels grow with it
NOT_GROUNDED = ("note: the embedded model's vision projector is not trained yet, so its answers about "
                "images and videos are not grounded in them; text answers come from SmolLM2-135M-Instruct. "
                "Use --model with a Qwen2-VL or LLaVA checkpoint for real answers.")


def _add_device_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    command.add_argument("--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"])


def _version() -> str:
    """The installed distribution's version (it is named glimpse-vl on PyPI's terms: `pip show glimpse-vl`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{version('glimpse-vl')} (pip: glimpse-vl)"
    except PackageNotFoundError:  # run from a checkout without installing
        return "(not installed)"


class _UsageError(SystemExit):
    """argparse's usage error (exit status 2), with its message: `ask --json` reports it as its JSON object too."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose usage error keeps its message for ``main``."""

    def error(self, message):
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="glimpse", description="Chat with vision-language models about "
                                     "images and videos, faster, with training-free token pruning.")
    parser.add_argument("--version", action="version", version=f"glimpse {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    ask = commands.add_parser("ask", help="answer one question, optionally about an image or a video")
    ask.add_argument("question", help="the question (text)")
    ask.add_argument("--model", default="embedded",
                     help="hub id or local checkpoint folder of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-1.5, LLaVA-NeXT "
                          "or LongVA; 'embedded' (default) is the small offline model")
    media = ask.add_mutually_exclusive_group()
    media.add_argument("--image", action="append", default=[], metavar="PATH", help="an image (repeatable)")
    media.add_argument("--video", action="append", default=[], metavar="PATH", help="a video file (repeatable)")
    ask.add_argument("--policy", default="auto", choices=NAMES, help="pruning policy (default: auto)")
    ask.add_argument("--speed", type=float, default=0.0, help="speed/quality slider in [0, 1]; 0 is exact")
    ask.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="override one policy parameter (repeatable), e.g. rho=0.6; for auto: member.param, e.g. "
                          "divprune.keep=0.3 (an error lists auto's members at that speed)")
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    # Defaults None: given without --sample they are refused (greedy decoding ignored them without a word).
    ask.add_argument("--temperature", type=float, default=None, help="with --sample (default 0.7)")
    ask.add_argument("--top-p", type=float, default=None, help="with --sample (default 0.9)")
    ask.add_argument("--seed", type=int, default=None, help="with --sample")
    _add_device_options(ask)
    ask.add_argument("--json", action="store_true", help='print one JSON object: text, model, policy, speed, params, summary, promise, '
                          'finish_reason, grounded, warnings and every metric (docs/engine.md); on an error, '
                          '{"error": message} (exit status 1)')
    ask.set_defaults(run=run_ask)

    bench = commands.add_parser(
        "bench", help="speed and memory of pruning policies vs the unpruned baseline, measured side by side",
        description="Run the baseline (policy none) and every policy at every speed on the same prompts, "
                    "alternating baseline and candidate, and report median TTFT, decoder-prefill time, FLOPs-proxy "
                    "speedup, realised fraction, KV bytes and peak memory. By default a random-weights Qwen2-VL "
                    "with the 2B model's text shapes is built in a temporary folder, with a synthesized image and "
                    "video (--random-model picks another size, or LLaVA-1.5-7B). Progress goes to stderr.")
    # Options of one mode given to the other are refused, not ignored: `glimpse bench --clients 8` would
    # otherwise measure policies and say nothing of the clients asked for.
    bench_tasks: dict = {}
    policies_option, serve_option = _task_option(bench_tasks, ("policies",)), _task_option(bench_tasks, ("serve",))

    bench.add_argument("target", nargs="?", choices=["policies", "serve"], default="policies",
                       help="policies (default): each policy against the unpruned baseline; serve: a server under "
                            "concurrent clients against the same requests one at a time (options below)")
    source = bench.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="hub id or local checkpoint folder to benchmark")
    policies_option(source, "--random-model", choices=REAL_PRESETS, default=None,
                    help="build a random-weights model with this model's shapes (default: qwen2-vl-2b; "
                    "llava-1.5-7b takes no video and 576 tokens per image)")
    policies_option(bench, "--layers", type=int, default=None,
                    help="decoder layers of the random model (default 8; the real Qwen2-VL models have 28, "
                    "LLaVA-1.5-7B 32)")
    bench.add_argument("--image", action="append", default=[], metavar="PATH",
                       help="benchmark on this image (repeatable) instead of a synthesized one")
    policies_option(bench, "--video", metavar="PATH", help="benchmark on this video instead of a synthesized one")
    policies_option(bench, "--image-tokens", type=int, default=None,
                    help="visual tokens of the synthesized image (0: no image prompt; default 2000; "
                    "fixed at 576 for llava-1.5-7b)")
    policies_option(bench, "--video-tokens", type=int, default=4000,
                    help="visual tokens of the synthesized video (0: no video prompt; default 4000)")
    policies_option(bench, "--policies", default=",".join(PRUNING_NAMES),
                    help=f"comma-separated policies (default: {','.join(PRUNING_NAMES)})")
    policies_option(bench, "--speeds", default="0.5,0.8", help="comma-separated speeds in [0, 1] (default: 0.5,0.8)")
    policies_option(bench, "--runs", type=int, default=3, help="timed runs per configuration (default 3)")
    policies_option(bench, "--warmup", type=int, default=1, help="untimed warm-up rounds per prompt (default 1)")
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    policies_option(bench, "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on CUDA, float32 on CPU")
    policies_option(bench, "--attn", default="auto", choices=["auto", "sdpa", "eager", "flash_attention_2"])
    policies_option(bench, "--question", default=None, help="the text of every prompt (default: 'Describe the ...')")
    policies_option(bench, "--text-tokens", type=int, default=0,
                    help="also a long text-only prompt of about this many tokens (default 0: none)")
    policies_option(bench, "--new-tokens", type=int, default=1,
                    help="tokens generated per run (EOS ignored); above 1 the table adds decode tokens/s")
    policies_option(bench, "--plot", default=None, metavar="FILE.png", help="TTFT speedup over speed, per policy")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bench.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    served = bench.add_argument_group("bench serve", "a running server (--url) or one started here (--model, "
                                                      "default embedded) under concurrent clients")
    serve_option(served, "--url", default=None, help="the server to measure (default: start glimpse serve here)")
    serve_option(served, "--workload", choices=["images", "text", "mixed"], default="images",
                 help="images (default): questions about an image (--image, default: the sample picture "
                 "shipped with Glimpse); text: requests for stories, long answers; mixed: two of each in turn")
    serve_option(served, "--clients", type=int, default=8, help="concurrent clients (default 8)")
    serve_option(served, "--requests", type=int, default=128,
                 help="requests per phase (default 128: K clients' ramp-up and drain a small share of the run)")
    serve_option(served, "--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    serve_option(served, "--policy", default="auto", help="the policy every request asks for (default auto)")
    serve_option(served, "--speed", type=float, default=0.0, help="the speed every request asks for (default 0)")
    serve_option(served, "--burst", type=int, default=0,
                 help="then send this many requests at once and count admitted and refused (default 0: none)")
    serve_option(served, "--api-key", default=os.environ.get("GLIMPSE_API_KEY") or None,
                 help="the server's key, if any")
    serve_option(served, "--max-batch", type=int, default=8, help="of the server started here (default 8)")
    serve_option(served, "--queue-size", type=int, default=32, help="of the server started here (default 32)")
    serve_option(served, "--kv-budget-mb", type=int, default=None, help="of the server started here")
    serve_option(served, "--prefix-cache-mb", type=int, default=None,
                 help="of the server started here (default: serve's, 1024; 0 measures every prompt "
                 "prefilled whole)")
    serve_option(served, "--media-cache-mb", type=int, default=None,
                 help="of the server started here (default: serve's, 512; 0 decodes every request's picture)")
    serve_option(served, "--encoder-cache-mb", type=int, default=None,
                 help="of the server started here (default: serve's, 256; the image workload asks about one "
                 "picture, so with the cache on the encoder runs once)")
    bench.set_defaults(run=run_bench, task_options=bench_tasks)

    calibrate = commands.add_parser(
        "calibrate", help="calibrate one model: the slider's speed/quality frontier, or HiDivDrop's ILVAS layers",
        description="slider: measure candidate pruning configurations against the unpruned model on label-free "
                    "prompts (answer agreement, first-token KL; prefill FLOPs and end-to-end time) and store the "
                    "Pareto frontier that `auto` reads; interrupt and rerun to resume. hidivdrop: pick HiDivDrop's "
                    "filtering layers by the paper's ILVAS curve.")
    calibrate.add_argument("policy", choices=["slider", "hidivdrop"])
    calibrate_tasks: dict = {}
    slider_option, hidivdrop_option = (_task_option(calibrate_tasks, ("slider",)),
                                       _task_option(calibrate_tasks, ("hidivdrop",)))
    calibrate.add_argument("--model", default="embedded", help="hub id or local checkpoint folder (default: the "
                           "embedded model, as for ask)")
    calibrate.add_argument("--images", metavar="DIR",
                           help="a folder of calibration images (hidivdrop: required; slider: default the set that "
                                "ships with Glimpse)")
    slider_option(calibrate, "--videos", metavar="DIR", help="slider: a folder of calibration videos")
    slider_option(calibrate, "--prompts", metavar="FILE",
                  help="slider: questions, one per line, asked of the images/videos in turn "
                       "(default: a one-sentence description)")
    slider_option(calibrate, "--budget-minutes", type=float, default=None,
                  help="slider: start no new candidate after this long; the frontier of what was measured "
                       "is stored, rerun to measure the rest")
    slider_option(calibrate, "--leave-out", default=None, metavar="POLICY[,POLICY]",
                  help="slider: measure no candidate that runs one of these policies (alone or composed), "
                       "for a kind of prompt the calibration set holds too few of to judge (the embedded "
                       "model's shipped frontier leaves out rlt: docs/slider.md says why)")
    slider_option(calibrate, "--floor", type=float, default=None,
                  help="slider: the answer agreement speed 1 may fall to, less one standard error (default 0.75)")
    calibrate.add_argument("--max-images", type=int, default=None,
                           help="use at most this many images/prompts (hidivdrop default 32, slider: all)")
    hidivdrop_option(calibrate, "--window", type=int, default=4,
                     help="hidivdrop: ILVAS layer distance n (default 4)")
    hidivdrop_option(calibrate, "--top-k", type=int, default=20,
                     help="hidivdrop: ILVAS top-K vision tokens (default 20)")
    hidivdrop_option(calibrate, "--question", default="Describe the image in detail.",
                     help="hidivdrop: the question")
    calibrate.add_argument("--out", metavar="FILE", help="write the profile here instead of the Glimpse cache")
    _add_device_options(calibrate)
    calibrate.set_defaults(run=run_calibrate, task_options=calibrate_tasks)

    evaluate = commands.add_parser(
        "eval", help="answer quality of pruning policies against the unpruned model, on the same inputs",
        description="agreement: greedy-token match rate and first-token KL against the unpruned model on "
                    "synthesized image/video prompts and text questions (any model). passkey: long-context "
                    "pass-key retrieval accuracy with the embedded model's SmolLM2-135M (text). visual: accuracy on the "
                    "held-out split of the generated shapes-and-clips task set the embedded model was trained on.")
    evaluate.add_argument("task", choices=["agreement", "passkey", "visual"])
    eval_tasks: dict = {}
    agreement_option, passkey_option, visual_option, passkey_or_visual_option = (
        _task_option(eval_tasks, tasks) for tasks in (("agreement",), ("passkey",), ("visual",), ("passkey", "visual")))
    evaluate.add_argument("--model", default="embedded", help="as for ask")
    evaluate.add_argument("--policies", default=None,
                          help=f"comma-separated (default: every policy for agreement and visual; {','.join(TEXT_PRUNING_NAMES)} for "
                               "passkey, FastV in its text adaptation)")
    evaluate.add_argument("--speeds", default="0.25,0.5,0.75,1",
                          help="comma-separated speeds in [0, 1] (default: 0.25,0.5,0.75,1)")
    agreement_option(evaluate, "--new-tokens", type=int, default=32, help="agreement: answer length compared")
    agreement_option(evaluate, "--image-tokens", type=int, default=256, help="agreement: synthesized image size")
    agreement_option(evaluate, "--video-tokens", type=int, default=512, help="agreement: synthesized video size")
    passkey_option(evaluate, "--lengths", default="512,1024,2048", help="passkey: prompt lengths in tokens")
    passkey_or_visual_option(evaluate, "--samples", type=int, default=10,
                             help="passkey: keys per length; visual: questions per category")
    passkey_or_visual_option(evaluate, "--seed", type=int, default=None,
                             help="passkey: key draw (default 0); visual: held-out split (default 1; 0 is the "
                                  "training seed and is refused)")
    visual_option(evaluate, "--categories", default=None,
                  help="visual: comma-separated question categories (default: every image category, and every "
                       "clip category when the model takes video), e.g. colour,shape,count,position")
    visual_option(evaluate, "--styled", type=float, default=0.0, metavar="SHARE",
                  help="visual: the share of questions asked about scenes and clips given a look of other "
                       "pictures (dark, graded, textured or striped backgrounds, turned, shadowed or outlined "
                       "shapes, noise, JPEG); 0, the default: the plain look the model was first trained on")
    visual_option(evaluate, "--questions", default=None, metavar="FILE.jsonl",
                  help='visual: ask your own questions instead of the generated set: JSON lines of '
                       '{"image": PATH} or {"video": PATH}, "question", "answer" and optionally "category" '
                       '(else "uncategorised"; paths relative to the file); right when the reply starts with '
                       'the answer\'s words')
    passkey_or_visual_option(evaluate, "--param", action="append", default=[], metavar="NAME=VALUE",
                             help="passkey, visual: a parameter of every policy in --policies, as for ask "
                                  "(e.g. --policies fastv --param layer=6 --param merge=true)")
    evaluate.add_argument("--json", action="store_true", help="print the report as JSON")
    evaluate.add_argument("--plot", default=None, metavar="FILE.png", help="quality vs TTFT speedup plot")
    _add_device_options(evaluate)
    evaluate.set_defaults(run=run_eval, task_options=eval_tasks)

    serve = commands.add_parser("serve", help="the web chat and the OpenAI-compatible HTTP API",
                                description="Gradio chat at /, POST /v1/chat/completions, GET /health, GET /metrics.")
    serve.add_argument("--model", default="embedded", help="as for ask")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=7860)
    serve.add_argument("--allow-private-urls", action="store_true",
                       help="let API requests fetch media from private, loopback and link-local addresses "
                            "(default: refused, so a request cannot make the server probe its own network)")
    serve.add_argument("--allowed-root", default=None, metavar="DIR",
                       help="API requests may name local files under DIR (default: none)")
    serve.add_argument("--max-upload-mb", type=int, default=200, help="largest upload accepted by the chat")
    serve.add_argument("--max-uploads-gb", type=float, default=20.0,
                       help="disk the chat's uploads may take in all (default 20); past it, uploads older than a "
                            "day are deleted, and if that is not enough an upload is refused")
    serve.add_argument("--queue-size", type=int, default=32,
                       help="requests waiting for the model beyond this are refused (the API answers 429)")
    serve.add_argument("--max-batch", type=int, default=8, help="requests decoded together at most")
    serve.add_argument("--kv-budget-mb", type=int, default=None,
                       help="KV cache the running requests may reserve in all (default: half the free GPU "
                            "memory, or a quarter of the RAM on CPU)")
    serve.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens one answer may have")
    serve.add_argument("--encoder-cache-mb", type=int, default=256,
                       help="keep the vision encoder's outputs of recent images and videos, up to this much "
                            "(default 256; 0: off): a chat's follow-up questions do not encode its pictures again")
    serve.add_argument("--media-cache-mb", type=int, default=512,
                       help="keep recent images and videos decoded and preprocessed, up to this much (default 512; "
                            "0: off): a chat sends its pictures again every turn; they are not decoded again")
    serve.add_argument("--prefix-cache-mb", type=int, default=1024,
                       help="keep the keys and values of recent unpruned prompts, up to this much (default 1024; "
                            "0: off): a prompt that starts like one of them (a chat's next turn, another question "
                            "about the same picture) computes only the rest; docs/serving.md")
    serve.add_argument("--api-key", default=os.environ.get("GLIMPSE_API_KEY") or None,
                       help="require 'Authorization: Bearer KEY' on /v1/* and a login (password KEY) for the "
                            "chat (default: $GLIMPSE_API_KEY); required with a non-loopback --host")
    serve.add_argument("--no-api-key", action="store_true",
                       help="serve a non-loopback --host without a key (anyone who reaches it can use the model)")
    serve.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="S",
                       help="on SIGTERM (docker stop, systemd, Kubernetes) answers under way get S seconds to finish "
                            f"before they are cut (default {SHUTDOWN_GRACE_S:g}: docker stop kills after 10); new "
                            "requests are refused at once")
    serve.add_argument("--root-path", default=None, metavar="/PATH",
                       help="the path a reverse proxy serves Glimpse under (e.g. /glimpse, for https://host/glimpse/, "
                            "the proxy stripping it): the chat's page asks for its routes there; docs/serving.md")
    serve.add_argument("--media-timeout", type=float, default=MEDIA_TIMEOUT_S, metavar="S",
                       help="the longest one request's images and videos may take to decode, all together "
                            f"(default {MEDIA_TIMEOUT_S:g}); past it the request is refused (400)")
    _add_device_options(serve)
    serve.set_defaults(run=run_serve)

    caption = commands.add_parser(
        "caption", help="caption images and videos in batch (files, folders, list files), resumable",
        description="Caption every image and video given (files; folders, recursively; .txt/.lst list files "
                    "of paths, one per line or NUL-separated; # comments). Results go to a JSONL file (one object "
                    "per input, flushed per line) or to .txt sidecars. Inputs already captioned are skipped unless "
                    "--overwrite, so a killed run resumes where it stopped; unreadable inputs are logged, skipped and "
                    "summarised.")
    caption.add_argument("inputs", nargs="+", metavar="INPUT",
                         help="image/video files, folders or list files (with --ray also .parquet/.jsonl manifests)")
    caption.add_argument("--out", default=None, metavar="FILE.jsonl | DIR",
                         help="JSONL output (default: captions.jsonl); with --ray, a folder of Parquet shards "
                              "(default: captions/)")
    caption.add_argument("--format", choices=["jsonl", "txt"], default=None,
                         help="txt: a <name>.txt sidecar next to each input instead of JSONL; with --ray, jsonl "
                              "also writes DIR/_captions.jsonl beside the shards")
    caption.add_argument("--overwrite", action="store_true",
                         help="caption the inputs given again, replacing their captions; the output's captions of "
                              "other inputs are kept (not with --ray: give a new --out)")
    caption.add_argument("--model", default="embedded", help="as for ask")
    caption.add_argument("--policy", default="auto", choices=NAMES)
    caption.add_argument("--speed", type=float, default=0.0)
    caption.add_argument("--prompt", default=None,
                         help="the instruction (default: 'Describe this image/video in one or two sentences.'; "
                              "on the embedded model, the wording it learnt: 'Describe the image/video.')")
    caption.add_argument("--max-new-tokens", type=int, default=64)
    caption.add_argument("--batch-size", type=int, default=8, help="inputs decoded together (default 8)")
    caption.add_argument("--media-timeout", type=float, default=None, metavar="S",
                         help="the longest one input may take to read (default: no limit); an input past it fails "
                              "(a video whose frames can only be reached by decoding all of them, in a scraped "
                              "dataset) and the others go on")
    _add_device_options(caption)
    spread = caption.add_argument_group("on Ray (docs/scale.md)")
    spread.add_argument("--ray", action="store_true", help="run as a Ray Data pipeline: decode tasks and a pool of "
                                                          "model actors (pip install 'glimpse-vl[ray]')")
    ray_options: dict = {}  # given without --ray, refused: the local captioner would run without a word of them
    ray_option = _task_option(ray_options, ("ray",))

    ray_option(spread, "--ray-address", default=None, metavar="ADDRESS",
               help="the cluster to join (e.g. ray://head:10001 or auto); default: start a local one")
    ray_option(spread, "--actors", type=int, default=1, help="model actors, one Engine each (default 1)")
    ray_option(spread, "--gpus-per-actor", type=float, default=None,
               help="GPUs per actor (default: 1 on a cluster with GPUs, else 0: CPU actors)")
    ray_option(spread, "--column", default="path", help="the manifest column of paths, URLs or URIs (default: path)")
    spread.add_argument("--retry-errors", action="store_true",
                        help="caption again the inputs that are error rows in --out (fixed files, reads that "
                             "timed out); their error rows are removed first")
    ray_option(spread, "--tries", type=int, default=3,
               help="tries of a batch whose model actor dies (out of memory, a crash; default 3); a batch "
                    "that kills its actor every time is set aside and its inputs tried alone as often")
    ray_option(spread, "--shard-rows", type=int, default=512,
               help="rows per Parquet shard (default 512; a shard is also written every 30 s)")
    caption.set_defaults(run=run_caption, task_options=ray_options)
    return parser


def _check_before_loading(model: str, policies: list[tuple[str, float]], overrides: dict | None) -> None:
    """Bad policy names, speeds or parameters fail before the model loads (a 7B model takes minutes): ``auto``'s
    member overrides against the members this model's slider picks at each speed (its calibrated frontier, read
    without loading it), layer numbers against a local checkpoint's depth (its config.json). What cannot be told
    without the model (a hub id's frontier and depth) is checked once it is loaded."""
    from glimpse.pipeline.loading import checkpoint_depth, expected_frontier
    from glimpse.pruning import make_policy

    frontier, depth = expected_frontier(model), checkpoint_depth(model)  # read once for every (policy, speed)
    for name, speed in policies:
        if name == "auto" and frontier is None and overrides:
            make_policy(name, speed)  # its members are the loaded model's to say
        else:
            make_policy(name, speed, overrides, frontier=frontier).check(depth)


def run_ask(args) -> int:
    from glimpse import vision
    from glimpse.pipeline import load_engine
    from glimpse.pipeline.sampling import Sampling

    check_speed(args.speed)
    if not args.question.strip():  # an unset shell variable, most likely: the model would answer nothing at all
        raise UserError("the question is empty: ask something, e.g. glimpse ask --image photo.jpg "
                        "\"What is in this picture?\"")
    try:
        check_text(args.question)  # (a byte that is not UTF-8: refused only once the model had loaded)
    except UserError as error:
        raise UserError(f"the question: {error}") from None
    overrides = parse_params(args.param)
    _check_before_loading(args.model, [(args.policy, args.speed)], overrides)
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    given = [flag for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p),
                                      ("--seed", args.seed)) if value is not None]
    if given and not args.sample:
        raise UserError(f"{', '.join(given)} take{'s' if len(given) == 1 else ''} effect only when sampling: add "
                        "--sample (without it the answer is greedy)")
    args.temperature = 0.7 if args.temperature is None else args.temperature
    args.top_p = 0.9 if args.top_p is None else args.top_p
    Sampling(args.sample, args.temperature, args.top_p, args.seed)  # so does a bad --temperature, --top-p, --seed
    media = [("image", path) for path in args.image] + [("video", path) for path in args.video]
    for kind, path in media:  # what the files' first bytes and headers tell, before the model loads
        vision.check_media(path, kind)
    messages = user_message(args.question, media)

    _log(f"loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    if not engine.grounded and (args.image or args.video):
        _log(NOT_GROUNDED)
    policy = engine.make_policy(args.policy, args.speed, overrides)  # with the model's calibration profile
    promise = engine.promise(args.policy, args.speed, overrides)  # what this speed was measured to keep
    _log(f"[{args.policy} speed={args.speed:g}] {promise['text']}")
    options = dict(policy=policy, max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        options.update(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.json:
        result = engine.generate(messages, **options)
        out = {"text": result.text, "policy": result.policy, "speed": args.speed, "params": result.params,
               "summary": result.summary, "promise": promise, "metrics": result.metrics, "model": args.model,
               "grounded": engine.grounded, "finish_reason": result.finish_reason, "warnings": result.warnings}
        print(json.dumps(finite(out), allow_nan=False))
        return 0
    result = None
    for chunk in engine.stream(messages, **options):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    for warning in result.warnings:  # e.g. a damaged video: the answer is about the frames that decoded
        _log(f"warning: {warning}")
    m = result.metrics
    flops_cut = m["prefill_flops_baseline"] / m["prefill_flops"]
    _log(f"[{result.policy} speed={args.speed}: {result.summary}] TTFT {m['ttft_s']:.2f}s, "
         f"prefill {m['prefill_s']:.2f}s ({flops_cut:.2f}x fewer prefill FLOPs), "
         f"{m['new_tokens']} tokens" + (f" at {m['decode_tokens_per_s']:.1f}/s" if m["decode_tokens_per_s"] else "")
         + f", prompt {m['prompt_tokens']}")
    return 0


def run_eval(args) -> int:
    from glimpse import eval as evaluation
    from glimpse.pipeline import load_engine

    _refuse_options_of_other_tasks(args, "eval", args.task)
    try:  # each measured once, in the order given
        speeds = list(dict.fromkeys(float(x) + 0.0 for x in args.speeds.split(",") if x.strip()))  # -0 is 0
        lengths = list(dict.fromkeys(int(x) for x in args.lengths.split(",") if x.strip()))
    except ValueError:
        raise UserError("--speeds and --lengths must be comma-separated numbers") from None
    if not speeds:
        raise UserError("--speeds needs at least one speed in [0, 1]")
    if args.task == "passkey" and any(not PASSKEY_MIN_TOKENS <= length <= MAX_BENCH_TOKENS for length in lengths):
        # Below it every length makes the same prompt (its instructions, the key, one filler and the question take
        # about 110 tokens), so a table of "10 tokens" would be about a prompt of 114 (an outside pass).
        raise UserError(f"--lengths are prompt lengths in tokens: from {PASSKEY_MIN_TOKENS} (a pass-key prompt's "
                        f"instructions, key and question alone take about 110) to {MAX_BENCH_TOKENS:,}")
    if args.task == "agreement" and not (0 <= args.image_tokens <= MAX_BENCH_TOKENS
                                         and 0 <= args.video_tokens <= MAX_BENCH_TOKENS):
        raise UserError(f"--image-tokens and --video-tokens must be from 0 to {MAX_BENCH_TOKENS:,}")
    if args.plot:
        _check_plot_file(Path(args.plot))
    default = TEXT_PRUNING_NAMES if args.task == "passkey" else [n for n in NAMES if n != "none"]
    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(","))) if args.policies else default
    overrides = parse_params(args.param) or None
    _check_before_loading(args.model, [(name, speed) for name in policies for speed in speeds], overrides)
    # the unpruned model is always run, as the reference: `--policies none` runs it alone
    policies = [p for p in policies if p != "none"]
    if args.samples < 1 or args.new_tokens < 1 or not lengths:
        raise UserError("--samples and --new-tokens must be at least 1, --lengths non-empty")
    if not 0.0 <= args.styled <= 1.0:
        raise UserError(f"--styled is a share from 0 to 1, got {args.styled:g}")
    if args.questions and (args.styled or args.seed is not None or args.categories or "samples" in args.given):
        raise UserError("--questions asks the file's questions: --samples, --seed, --styled and --categories choose "
                        "among the generated ones")
    if args.questions:
        evaluation.read_questions(args.questions)  # a bad file is refused before the model loads
    if args.task == "visual" and args.seed == evaluation.tasks.TRAIN_SEED:
        raise UserError(f"--seed {args.seed} is the seed the projector was trained on; pick another for a held-out set")
    categories = tuple(c.strip() for c in args.categories.split(",")) if args.categories else None
    known = evaluation.tasks.IMAGE_CATEGORIES + evaluation.tasks.VIDEO_CATEGORIES
    if categories is not None and any(c not in known for c in categories):
        raise UserError(f"--categories takes a comma-separated list of {', '.join(known)}")
    _log(f"loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    if categories and not engine.adapter.supports_video and set(categories) & set(evaluation.tasks.VIDEO_CATEGORIES):
        raise UserError(f"{args.model} takes no video: leave out {', '.join(evaluation.tasks.VIDEO_CATEGORIES)}")
    if args.task == "agreement":
        report = evaluation.agreement_with_synthesized_media(engine, policies, speeds, args.new_tokens,
                                                             args.image_tokens, args.video_tokens, _log)
    elif args.task == "visual":
        seed = evaluation.tasks.HELDOUT_SEED if args.seed is None else args.seed
        report = evaluation.run_visual(engine, args.samples, policies, speeds, seed, progress=_log,
                                       categories=categories, overrides=overrides, styled=args.styled,
                                       questions=args.questions)
    else:
        report = evaluation.run_passkey(engine, lengths, args.samples, policies, speeds, args.seed or 0,
                                        progress=_log, overrides=overrides)
    report["model"] = args.model
    print(json.dumps(report) if args.json else evaluation.format_table(report), flush=True)  # first: never lost
    if args.plot and report["rows"]:
        evaluation.plot(report, args.plot)
        _log(f"plot written to {args.plot}")
    if report["interrupted"]:  # Ctrl-C or SIGTERM: what was measured by then is above (it printed nothing)
        _log(f"interrupted: the {len(report['rows'])} rows above are the configurations measured by then")
        return kept_stop_status()
    return 0


def build_server(engine, model_name: str, *, allowed_root=None, max_upload_mb=200, max_uploads_gb=20.0, queue_size=32,
                 max_new_tokens=256, allow_private_urls=False, max_batch=8, kv_budget_bytes=None, api_key=None,
                 media_timeout_s=MEDIA_TIMEOUT_S, scheduler_thread=True, root_path=None):
    """The FastAPI app `glimpse serve` runs: one scheduler owning the engine, the API routes on it, and the
    Gradio chat on it, mounted at /. ``scheduler_thread=False``: the caller runs ``app.state.scheduler.run()``.
    ``root_path``: the path a reverse proxy serves it under (``/glimpse``), which the chat's page must put in front
    of its own routes; the proxy strips it from what it passes on."""
    import hmac

    import gradio as gr
    from gradio.utils import get_upload_folder

    from glimpse.api import create_api
    from glimpse.connections import CHAT_SESSIONS
    from glimpse.telemetry import Telemetry
    from glimpse.uploads import UploadQuota, malformed_upload
    from glimpse.ui import NoFetchingForClients, NoRemoteMedia, SessionMessages, build_ui
    from glimpse.pipeline.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=max_batch, queue_size=queue_size, kv_budget_bytes=kv_budget_bytes,
                          media_timeout_s=media_timeout_s, start=scheduler_thread)
    telemetry = Telemetry(scheduler, model_name)
    app = create_api(engine, model_name=model_name, scheduler=scheduler, telemetry=telemetry, allowed_root=allowed_root,
                     allow_private_urls=allow_private_urls, max_new_tokens=max_new_tokens, api_key=api_key)
    # Every chat turn goes straight to the scheduler, which batches them and shows each its queue position;
    # Gradio's own queue only bounds how many event handlers run at once, and holds as many more waiting to start.
    # (Its max_size was --queue-size: Gradio is full at max_size waiting, so --queue-size 0 refused every event of
    # the chat, its page showing "Error" everywhere on an idle server; an outside pass.)
    demo = build_ui(engine, model_name, max_new_tokens, allowed_root=allowed_root, scheduler=scheduler,
                    refused=telemetry.refused).queue(
        default_concurrency_limit=max_batch + queue_size, max_size=max_batch + queue_size)
    demo.state_session_capacity = CHAT_SESSIONS  # read as it is mounted: what clients can make it hold (connections)
    # Made-up sessions never drop a session whose answer is under way (glimpse.ui.SessionMessages)
    demo._queue.pending_messages_per_session = SessionMessages(demo._queue)
    # Compared in constant time, as the API compares its bearer token.
    auth = (lambda _user, password: hmac.compare_digest(password.encode(), api_key.encode())) if api_key else None
    # The chat's app publishes no OpenAPI schema either (it was open under --api-key, at /openapi.json).
    # A malformed upload is a 400 (glimpse.uploads.malformed_upload), not a 500 and a traceback.
    # show_error=False: an exception inside Gradio's own handling reaches the client as an error without its text (the
    # chat's own refusals, gr.Error, keep theirs). Its text named server paths: a file part "x.png" was refused as
    # "Cannot move /app/x.png ...", the server's working folder (an outside pass).
    app = gr.mount_gradio_app(app, demo, path="/", max_file_size=f"{max_upload_mb}mb", auth=auth, show_error=False,
                              root_path=root_path or None,
                              app_kwargs={"openapi_url": None, "exception_handlers": {Exception: malformed_upload}},
                              auth_message="Log in with any user name and the server's API key as the password.")
    # Gradio checks that a file its routes are given by path was uploaded (and refuses it before opening it)
    # only once the app "has launched", which `launch()` records and `mount_gradio_app` does not: mounted, every
    # such path was copied into the upload folder first (any file on the server, a FIFO blocking the event loop),
    # where it then passed the chat's own check. Mounted is launched: the check is on.
    demo.has_launched = True
    app.add_middleware(UploadQuota, folder=get_upload_folder(), quota_bytes=int(max_uploads_gb * 2**30))
    app.add_middleware(NoRemoteMedia)
    app.add_middleware(NoFetchingForClients)
    return app


def _api_key(key: str | None) -> str | None:
    """The server's key as clients can send it: without the whitespace around it (a key file written by `echo` ends
    in a newline, which no HTTP header carries: every request got 401), and refused if it is then empty or holds
    what a header cannot carry as typed (a header is read as Latin-1: "clé" sent as UTF-8 never matched)."""
    if not key:  # (an empty one is none, as GLIMPSE_API_KEY= in compose.yaml)
        return None
    stripped = key.strip()
    if not stripped:
        raise UserError("--api-key (or GLIMPSE_API_KEY) is only whitespace: nobody could send it")
    if not (stripped.isascii() and stripped.isprintable()):
        raise UserError("--api-key (or GLIMPSE_API_KEY) may hold printable ASCII only: clients send it in an HTTP "
                        "header (Authorization: Bearer KEY)")
    return stripped


def _root_path(value: str | None) -> str | None:
    """``--root-path`` as Gradio takes it: a path (``/glimpse``, no trailing slash) or a whole URL; None for /."""
    if value is None:
        return None
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(value)
    whole_url = parts.scheme in ("http", "https") and bool(parts.netloc)
    # (//host/path is another server's, to a browser: the chat's page would load its scripts from there)
    if (not (value.startswith("/") or whole_url) or value.startswith("//") or parts.query or "#" in value
            or any(c.isspace() or not c.isprintable() for c in value)):
        raise UserError(f"--root-path {value!r}: give the path a reverse proxy serves Glimpse under, starting with / "
                        "(e.g. /glimpse), or the whole URL (https://example.com/glimpse)")
    if whole_url:  # Gradio takes a URL only in lower case (HTTPS://... was a path, and every page of the chat a 500)
        value = urlunsplit(parts)  # (urlsplit lowers the scheme)
    return value.rstrip("/") or None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port_free(host: str, port: int) -> None:
    """A port another server holds is said before the model loads (it was said after, under uvicorn's traceback).
    The port is bound and let go at once; the server binds it again once the model is loaded."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, port), family=family):
            pass
    except OSError as error:
        import errno

        # The hint fits the failure: "another server?" followed a host name that does not resolve too.
        hint = {errno.EADDRINUSE: " (is another server using the port? choose another with --port)",
                errno.EADDRNOTAVAIL: " (--host must be an address of this machine, or 0.0.0.0 for all of them)",
                errno.EACCES: " (ports below 1024 need privileges: choose another with --port)"}.get(error.errno, "")
        if error.errno is not None and error.errno < 0:  # getaddrinfo's EAI_* (create_server re-raises an OSError)
            hint = " (--host names no address: give an address of this machine, or 0.0.0.0 for all of them)"
        raise UserError(f"cannot serve on {host}:{port}: {error.strerror or error}{hint}") from None


def http_server(app, host: str, port: int, shutdown_s: float | None = None):
    """The HTTP server of ``glimpse serve``: uvicorn, closing connections that never send a whole request head
    (glimpse.connections). Once told to stop, it waits at most ``shutdown_s`` for open connections; ``run_serve``
    closes those still open (a chat tab's event stream) once the answers have ended. It first raises the limit on
    open files, which bounds how many connections it can hold (glimpse.connections.raise_open_file_limit)."""
    import uvicorn

    from glimpse.connections import ClosingServer, RequestHeadDeadline, raise_open_file_limit

    raise_open_file_limit(log=_log)
    return ClosingServer(uvicorn.Config(app, host=host, port=port, log_level="warning", http=RequestHeadDeadline,
                                        timeout_graceful_shutdown=shutdown_s))


def _check_server_sizes(args) -> None:
    """The sizes of ``glimpse serve`` (and ``bench serve``, which starts one), before the model loads: a negative KV
    budget started a server that refused every request, blaming the client; a negative cache size was taken as
    0 without a word (an outside pass)."""
    if args.kv_budget_mb is not None and args.kv_budget_mb < 1:
        raise UserError("--kv-budget-mb must be at least 1 (leave it out for the default)")
    for flag in ("--encoder-cache-mb", "--media-cache-mb", "--prefix-cache-mb"):
        if (size := getattr(args, flag[2:].replace("-", "_"))) is not None and size < 0:
            raise UserError(f"{flag} must be at least 0 (0: off)")


def run_serve(args) -> int:
    from glimpse.connections import CappedWrites
    from glimpse.pipeline import load_engine

    # Before anything logs (uvicorn's handlers take the stream they are given at their start): what one request makes
    # a library log is bounded, so that clients cannot fill the disk through the log (glimpse.connections).
    sys.stderr = CappedWrites(sys.stderr)

    if args.max_batch < 1 or args.queue_size < 0 or args.max_new_tokens < 1:
        raise UserError("--max-batch and --max-new-tokens must be at least 1, --queue-size at least 0")
    if not 0 <= args.shutdown_grace <= 3600:  # NaN fails this too
        raise UserError("--shutdown-grace must be between 0 and 3600 seconds")
    if not 0 < args.media_timeout <= 86400:
        raise UserError("--media-timeout must be more than 0 and at most 86400 seconds")
    _check_server_sizes(args)
    if not 0 <= args.port <= 65535:
        raise UserError("--port must be between 0 and 65535")
    if args.max_upload_mb < 1 or not 0 < args.max_uploads_gb <= MAX_UPLOADS_GB:  # (NaN fails this too)
        raise UserError(f"--max-upload-mb must be at least 1 and --max-uploads-gb more than 0 and at most "
                        f"{MAX_UPLOADS_GB:,}: they crashed the server as it started, or it refused every upload")
    root_path = _root_path(args.root_path)
    if args.allowed_root is not None and not Path(args.allowed_root).is_dir():  # every path named would fail later
        raise UserError(f"--allowed-root {args.allowed_root}: no such folder")
    check_video_backend()
    args.api_key = _api_key(args.api_key)
    if not _loopback(args.host) and not args.api_key and not args.no_api_key:
        raise UserError(f"--host {args.host} is reachable from other machines: give --api-key KEY (or set "
                        "GLIMPSE_API_KEY), or --no-api-key to serve it open")
    _check_port_free(args.host, args.port)
    _log(f"loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    if not engine.grounded:
        _log(NOT_GROUNDED)
    engine.encoder_cache.max_bytes = args.encoder_cache_mb * 2**20
    engine.prefix_cache.max_bytes = args.prefix_cache_mb * 2**20
    engine.media_cache.max_bytes = args.media_cache_mb * 2**20
    budget = args.kv_budget_mb * 2**20 if args.kv_budget_mb is not None else None
    app = build_server(engine, args.model, allowed_root=args.allowed_root, max_upload_mb=args.max_upload_mb,
                       max_uploads_gb=args.max_uploads_gb,
                       queue_size=args.queue_size, max_new_tokens=args.max_new_tokens,
                       allow_private_urls=args.allow_private_urls, max_batch=args.max_batch,
                       kv_budget_bytes=budget, api_key=args.api_key, media_timeout_s=args.media_timeout,
                       scheduler_thread=False, root_path=root_path)
    # The HTTP server in a thread, the scheduler (all model compute) in the main thread, which loaded the
    # model: on CPU, torch runs about 1.5x slower in any other thread (Scheduler.run).
    server = http_server(app, args.host, args.port, args.shutdown_grace + 2)  # a backstop: see the finally
    http = threading.Thread(target=server.run, name="glimpse-http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not http.is_alive():
        raise UserError(f"could not serve on {args.host}:{args.port} (is the port in use?)")
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port  # --port 0: the one taken
    _log(f"serving on http://{args.host}:{port} (chat at /, API at /v1/chat/completions)"
         + (f"; the chat's page expects to be at {root_path}/ behind a proxy" if root_path else ""))
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, _on_sigterm(terminated))
    threading.Thread(target=_shut_down_when, args=(terminated, server, app.state.scheduler, args.shutdown_grace),
                     name="glimpse-shutdown", daemon=True).start()
    threading.Thread(target=_stop_scheduler_with, args=(http, app.state.scheduler), daemon=True).start()
    try:
        app.state.scheduler.run()
        # After SIGTERM the loop ends with the last answer. A request still building its prompt is refused once its
        # decoding stops (at the next packet of a video, Scheduler.prepare): it is given until the grace ends to be
        # told so (503), rather than have its connection closed under it.
        app.state.scheduler.wait_for_submitters()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=1.0)  # the answers' last chunks go out; then what is still open is closed (a chat tab's)
        server.close_connections()
        http.join(timeout=30)
    # Served and closed: nothing is left to write. Python's own exit would now take 1.5-3 s more, taking torch's,
    # transformers' and Gradio's modules apart, which with the default grace of 8 s ran past docker stop's 10 s and
    # ended in its SIGKILL (an outside pass measured 11 s from SIGTERM to exit with an answer under way).
    _exit_at_once(0)


def _exit_at_once(status: int) -> None:
    """End the process now, what it printed and logged written out first, without Python's teardown."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more reaches it anyway
            pass
    os._exit(status)


def _on_sigterm(terminated: threading.Event):
    """SIGTERM's handler for ``glimpse serve``: the first one starts the shutdown (``_shut_down_when``), a second one
    stops at once, as Ctrl-C does. Without a handler, SIGTERM killed the server mid-answer, and in a container, where
    it runs as process 1 and the kernel ignores signals it has no handler for, it did nothing: ``docker stop`` waited
    its 10 s and killed it."""

    def handle(_signum, _frame) -> None:
        if terminated.is_set():
            raise KeyboardInterrupt
        terminated.set()  # the rest is done by another thread: a signal handler may interrupt the scheduler's loop

    return handle


def _shut_down_when(terminated: threading.Event, server, scheduler, grace_s: float) -> None:
    """Once SIGTERM came: refuse new connections and requests (503), end the waiting ones with a 503, and let the
    running ones finish within ``grace_s`` seconds before they are cut; the scheduler's loop then returns, and
    ``run_serve`` with it, with exit status 0."""
    terminated.wait()
    state = scheduler.state()
    _log(f"stopping: {state['running'] + state['prefilling']} answers under way get up to {grace_s:g} s to finish; "
         f"{state['waiting']} waiting requests are turned away")
    server.should_exit = True
    scheduler.close(grace_s=grace_s, wait=False)


def _stop_scheduler_with(http: "threading.Thread", scheduler) -> None:
    """When the HTTP server stops (SIGINT, or its own failure), stop the scheduler too, so that the process exits."""
    http.join()
    scheduler.close()


def run_caption(args) -> int:
    from glimpse.caption import (LIST_EXTENSIONS, CaptionOutput, CaptionReport, all_captioned, check_sidecars,
                                 collect_inputs, record_key, records_in_jsonl, refuse_other_settings,
                                 sidecars_skipped, unlisted_failures, without_this_runs_output)
    from glimpse.pruning import make_policy

    check_speed(args.speed)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise UserError("--batch-size and --max-new-tokens must be at least 1")
    if args.media_timeout is not None and not 0 < args.media_timeout <= 86400:
        raise UserError("--media-timeout must be more than 0 and at most 86400 seconds")
    make_policy(args.policy, args.speed)
    check_video_backend()
    if args.prompt is not None:  # one instruction for every input: refused once, not once per input
        if not args.prompt.strip():
            raise UserError("--prompt is empty: leave it out for the default instruction")
        try:
            check_text(args.prompt)
        except UserError as error:
            raise UserError(f"--prompt: {error}") from None
    if args.ray:
        return run_caption_on_ray(args)
    if args.retry_errors:
        raise UserError("--retry-errors is for --ray: the local captioner writes no row for an input that failed, "
                        "so every rerun tries it again")
    # given: it captioned in this process, exit 0, without a word of the cluster it was told to use
    if given := [flag for dest, (flag, _, _) in args.task_options.items() if dest in args.given]:
        many = len(given) > 1
        raise UserError(f"{', '.join(given)} {'are options' if many else 'is an option'} of --ray (docs/scale.md), "
                        f"which this run does not use: add --ray, or leave {'them' if many else 'it'} out")
    from glimpse.caption_ray import is_manifest

    args.format = args.format or "jsonl"
    args.inputs = without_this_runs_output(args.inputs, args.format, Path(args.out or "captions.jsonl"), _log)
    manifests = [i for i in args.inputs if is_manifest(i)]
    if manifests:  # it loaded the model, then called the manifest "not an image (unsupported type .jsonl)"
        raise UserError(f"{manifests[0]}: a manifest; manifests (a column of paths or URLs) are read by --ray "
                        "(pip install -e \".[ray]\"), the local captioner takes files, folders and .txt lists")
    if args.format == "txt" and args.out:
        raise UserError("--format txt writes sidecars next to the inputs: leave out --out")
    unreadable: list[tuple[str, str]] = []
    keys: dict[Path, str] = {}  # each input's (resolved once: a million took minutes each time)
    try:
        inputs = collect_inputs(args.inputs, unreadable, log=_log, keys=keys)
    except FileNotFoundError as error:
        raise UserError(str(error)) from None
    unlisted = unlisted_failures(unreadable, _log)
    if not inputs:
        raise UserError("no image or video files found in the inputs")
    if args.format == "txt":
        check_sidecars(inputs, [Path(i) for i in args.inputs if i.lower().endswith(LIST_EXTENSIONS)])
    out = Path(args.out or "captions.jsonl")
    # Opened and locked before the model loads: an unwritable output or a second writer is refused at once.
    output = CaptionOutput(out) if args.format == "jsonl" else None
    try:
        if output is not None:
            # --overwrite replaces this run's inputs' captions: the others it keeps must be of these settings too
            again = set(keys.values()) if args.overwrite else set()
            refuse_other_settings((r for r in records_in_jsonl(out) if record_key(r) not in again), out, args.policy,
                                  args.speed, args.prompt, "--overwrite with every input it holds to caption them "
                                  "again (it replaces the captions of the inputs given, and keeps the others)",
                                  model=args.model, others_kept=args.overwrite)
        if not args.overwrite and all_captioned(inputs, output, keys):  # nothing to do: no model to load
            report = CaptionReport(skipped=len(inputs))
            if output is None:
                _log(sidecars_skipped(len(inputs)))
        else:
            report = _caption_with_model(args, inputs, output, keys)
    finally:
        if output is not None:
            output.close()
    report.failed += unlisted
    where = out if args.format == "jsonl" else ".txt sidecars"
    _log(f"captioned {report.captioned}, already done {report.skipped}, failed {len(report.failed)} -> {where}")
    for path, reason in report.failed:
        _log(one_line(f"  failed: {path}: {reason}"))
    return 1 if report.failed else 0


def _caption_with_model(args, inputs, output, keys):
    from glimpse.caption import ProgressBar, caption_inputs
    from glimpse.pipeline import load_engine

    _log(f"{len(inputs)} inputs; loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    if not engine.grounded:
        _log(NOT_GROUNDED)
    if args.prompt is not None:
        try:
            check_text_length(len(args.prompt), engine.max_length)
        except UserError as error:
            raise UserError(f"--prompt: {error}") from None
    progress = ProgressBar()
    try:
        return caption_inputs(engine, inputs, out=output, fmt=args.format, overwrite=args.overwrite,
                              policy=args.policy, speed=args.speed, prompt=args.prompt,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                              media_timeout_s=args.media_timeout, progress=progress, log=progress.log, keys=keys)
    finally:
        progress.close()


def run_caption_on_ray(args) -> int:
    from glimpse.caption_ray import caption_on_ray

    if args.format == "txt":
        raise UserError("--ray writes Parquet shards (and JSONL with --format jsonl), not sidecars")
    if (args.actors < 1 or args.shard_rows < 1 or args.tries < 1
            or (args.gpus_per_actor is not None and args.gpus_per_actor < 0)):
        raise UserError("--actors, --shard-rows and --tries must be at least 1, --gpus-per-actor at least 0")
    if args.overwrite:
        raise UserError("--ray resumes from the shards in --out; to start afresh, give a new --out")
    out = Path(args.out or "captions")
    gpus = 0.0 if args.device == "cpu" else args.gpus_per_actor  # None: 1 if the cluster has GPUs
    report = caption_on_ray(args.inputs, out=out, model=args.model, policy=args.policy, speed=args.speed,
                            prompt=args.prompt, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            actors=args.actors, gpus_per_actor=gpus, address=args.ray_address, column=args.column,
                            jsonl=args.format == "jsonl", device=args.device, shard_rows=args.shard_rows,
                            retry_errors=args.retry_errors, media_timeout_s=args.media_timeout, tries=args.tries,
                            log=_log)
    rate = (f"{report.captioned / report.seconds:.2f} inputs/s, {report.answer_tokens / report.seconds:.1f} answer "
            f"tokens/s" if report.seconds else "nothing to do")
    earlier = (f" ({report.earlier_errors} skipped as error rows of earlier runs: --retry-errors tries them again)"
               if report.earlier_errors else "")
    _log(f"done {report.captioned}, skipped {report.skipped}, failed {len(report.failed)}{earlier} -> {out} ({rate})"
         + (f"; Ray dashboard: {report.dashboard}" if report.dashboard else ""))
    for key, reason in report.failed:  # (a downloaded input's error names its URL for the row: not said twice here)
        _log(one_line(f"  failed: {key}: {reason.replace(f'{key}: ', '', 1)}"))
    # Error rows in the output, this run's or an earlier one's, mean inputs without a caption: a script sees it.
    return 1 if report.failed or report.earlier_errors else 0


def run_bench_serve(args) -> int:
    from glimpse import bench_serve
    from glimpse.pruning import make_policy

    if args.clients < 1 or args.requests < args.clients or args.max_tokens < 1 or args.burst < 0:
        raise UserError("--clients and --max-tokens must be at least 1, --requests at least --clients, --burst >= 0")
    if args.max_batch < 1 or args.queue_size < 0:  # (the server started here refused them: a traceback, exit 2)
        raise UserError("--max-batch must be at least 1, --queue-size at least 0")
    check_speed(args.speed)
    make_policy(args.policy, args.speed)  # an unknown policy was every request's 400, then a traceback, exit 2
    _check_server_sizes(args)
    if args.url is not None:  # measured as it runs: options of the server started here would be ignored unsaid
        started_here = ("max_batch", "queue_size", "kv_budget_mb", "prefix_cache_mb", "media_cache_mb",
                        "encoder_cache_mb")
        server_options = [flag for flag, given in (("--model", args.model is not None),
                                                   ("--device", args.device != "auto")) if given]
        server_options += [args.task_options[dest][0] for dest in started_here if dest in args.given]
        if server_options:
            raise UserError(f"{', '.join(server_options)} set{'s' if len(server_options) == 1 else ''} the server "
                            "started here: with --url the server at that address is measured as it runs")
    if len(args.image) > 1 or (args.image and args.workload == "text"):
        raise UserError("bench serve asks about one --image, with --workload images or mixed")
    if args.image and not Path(args.image[0]).is_file():
        raise UserError(f"{args.image[0]}: no such file")
    report = bench_serve.run(args, _log)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else bench_serve.format_report(report))
    return 0


def _task_option(task_options: dict, tasks: tuple[str, ...]):
    """``add(group, *flags, **options)``: ``group.add_argument(*flags, **options)``, recording in ``task_options``
    that only ``tasks`` (of the command's first argument: bench's mode, eval's task, calibrate's policy) use it, for
    ``_refuse_options_of_other_tasks``."""
    def add(group, *flags, **options):
        action = group.add_argument(*flags, **options)
        task_options[action.dest] = (flags[0], action.default, tasks)
        action.default = argparse.SUPPRESS  # so that main can tell it given, even abbreviated or at its default
    return add


def _restore_defaults(args) -> set[str]:
    """The dests of ``args.task_options`` given on the command line; the others get their defaults back.

    Their argparse default is ``SUPPRESS``: argparse sets them only when given, however typed (``--actors 1``,
    ``--act 1``, ``--actors=1``). Comparing with the default missed ``--act 1``, typed as the default and
    abbreviated: the local captioner ran without a word of the cluster it was told to use."""
    options = getattr(args, "task_options", {})
    given = {dest for dest in options if hasattr(args, dest)}
    for dest in options.keys() - given:
        setattr(args, dest, options[dest][1])
    return given


def _refuse_options_of_other_tasks(args, command: str, task: str) -> None:
    """An option given that ``task`` does not use is refused, naming the tasks that do: ignored, it looked applied
    (``glimpse eval agreement --samples 6`` was published as the command behind numbers ``--samples`` never changed,
    ``calibrate hidivdrop --floor 0.3`` took no floor; an outside pass). Given: on the command line, however typed."""
    given: dict[tuple[str, ...], list[str]] = {}  # the tasks that take them: the options given
    for dest, (flag, _, tasks) in args.task_options.items():
        if task not in tasks and dest in args.given:
            given.setdefault(tasks, []).append(flag)
    if given:
        said = "; ".join(f"{', '.join(flags)} {'is an option' if len(flags) == 1 else 'are options'} of `glimpse "
                         f"{command} {' / '.join(tasks)}`" for tasks, flags in given.items())
        raise UserError(f"{said}, not of `glimpse {command} {task}`")


def run_bench(args) -> int:
    _refuse_options_of_other_tasks(args, "bench", args.target)
    if args.target == "serve":
        return run_bench_serve(args)
    from glimpse import bench
    from glimpse.pipeline import load_engine

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        speeds = [float(s) + 0.0 for s in args.speeds.split(",") if s.strip()]  # + 0.0: -0 is 0 ("dash@-0")
    except ValueError:
        raise UserError(f"--speeds must be comma-separated numbers in [0, 1], got {args.speeds!r}") from None
    if args.runs < 1:
        raise UserError("--runs must be at least 1")
    if args.warmup < 0:
        raise UserError("--warmup must be at least 0")
    image_tokens = DEFAULT_BENCH_IMAGE_TOKENS if args.image_tokens is None else args.image_tokens
    if image_tokens < 0 or args.video_tokens < 0:
        raise UserError("--image-tokens and --video-tokens must be at least 0")
    if max(image_tokens, args.video_tokens, args.text_tokens) > MAX_BENCH_TOKENS:  # pictures of that many tokens
        raise UserError(f"--image-tokens, --video-tokens and --text-tokens are at most {MAX_BENCH_TOKENS:,} (longer "
                        "than any supported model's context)")
    if args.plot:
        _check_plot_file(Path(args.plot))
    if args.out:
        check_writable_file(Path(args.out), "--out")
    if args.model and args.layers is not None:
        raise UserError("--layers only applies to --random-model")
    if args.layers is not None and args.layers < 1:
        raise UserError("--layers must be at least 1")
    if args.text_tokens < 0 or args.new_tokens < 1:
        raise UserError("--text-tokens must be at least 0 and --new-tokens at least 1")
    if not (args.image or args.video) and image_tokens == 0 and args.video_tokens == 0 and not args.text_tokens:
        raise UserError("nothing to benchmark: --image-tokens, --video-tokens and --text-tokens are all 0 "
                        "and no --image/--video")
    bench.check_policies(policies, speeds)  # before minutes of model building
    media = [(path, "image") for path in args.image] + ([(args.video, "video")] if args.video else [])
    if media:
        from glimpse.vision import check_media

        sizes = {"--image-tokens": args.image_tokens, "--video-tokens": args.video_tokens}
        typed = {flag for flag in sizes if flag[2:].replace("-", "_") in args.given}
        if given := [flag for flag, tokens in sizes.items() if flag in typed and tokens]:  # (0: none, as it is)
            raise UserError(f"{' and '.join(given)} size{'s' * (len(given) == 1)} the synthesized media, and "
                            "--image/--video benchmarks your own files instead: give one or the other")
        for path, kind in media:  # missing, empty or corrupt: said before minutes of model building, not after
            check_media(path, kind)
        inputs = {Path(path).resolve() for path, _ in media}
        for flag, out in (("--out", args.out), ("--plot", args.plot)):
            if out and Path(out).resolve() in inputs:  # it replaced the user's picture without a word
                raise UserError(f"{flag} {out} is one of the benchmark's own inputs: give another file name")
    questions = {"image": args.question, "video": args.question} if args.question else None

    with tempfile.TemporaryDirectory(prefix="glimpse-bench-") as tmp:
        if args.model:
            _log(f"loading {args.model} ...")
            engine = load_engine(args.model, device=args.device, attn=args.attn, dtype=args.dtype)
            label = args.model
        else:
            from glimpse.pipeline.loading import resolve_device, resolve_dtype
            from glimpse.pipeline.random_checkpoint import (DEFAULT_MAX_VISUAL_TOKENS, LLAVA_PRESETS, build_random,
                                                    preset_family)

            preset, layers = args.random_model or "qwen2-vl-2b", args.layers or 8
            device = resolve_device(args.device)
            dtype = resolve_dtype(args.dtype, device)
            if preset_family(preset) == "llava":
                shape = LLAVA_PRESETS[preset]
                fixed = (shape["vision_image_size"] // shape["vision_patch_size"]) ** 2
                if args.image_tokens not in (None, 0, fixed) and not args.image:
                    _log(f"note: {preset} gives every image {fixed} visual tokens ({shape['vision_image_size']}"
                         f"x{shape['vision_image_size']} pixels); --image-tokens {args.image_tokens} does not apply")
                if image_tokens:
                    image_tokens = fixed
            _log(f"building a random-weights {preset} ({layers} decoder layers, 1-layer vision tower, "
                 f"{str(dtype).replace('torch.', '')}) in {tmp} ...")
            folder = build_random(Path(tmp) / "model", preset=preset, layers=layers, dtype=dtype,
                                  max_visual_tokens=max(DEFAULT_MAX_VISUAL_TOKENS, image_tokens),
                                  init_device=device if device.type == "cuda" else None)
            _log("loading it ...")
            engine = load_engine(str(folder), device=args.device, attn=args.attn, dtype=dtype)
            label = f"random-weights {preset}"
        asked = [args.text_tokens] + ([] if args.image or args.video else [image_tokens, args.video_tokens])
        if engine.max_length and max(asked) >= engine.max_length:  # before pictures of that many tokens are drawn
            raise UserError(f"a prompt of {max(asked):,} tokens does not fit this model's context "
                            f"({engine.max_length:,} tokens)")
        if args.image or args.video:
            prompts = bench.media_prompts(args.image, args.video, questions)
        else:
            _log("synthesizing media ...")
            prompts = bench.synthesize_prompts(engine, Path(tmp) / "media", image_tokens, args.video_tokens,
                                               questions, progress=_log)
        if args.text_tokens:
            prompts["text"] = bench.text_prompt(engine.tokenizer, args.text_tokens)
        if not prompts:
            raise UserError("nothing to benchmark on this model (it takes no video, and --image-tokens is 0)")
        report = bench.run_bench(engine, prompts, policies, speeds, runs=args.runs, warmup=args.warmup,
                                 progress=_log, model=label, new_tokens=args.new_tokens, keep_on_interrupt=True)
    print(json.dumps(report) if args.json else bench.format_markdown(report), flush=True)  # first: never lost
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        _log(f"wrote {args.out}")
    if args.plot and report["rows"]:
        bench.plot(report, args.plot)
        _log(f"wrote {args.plot}")
    if report["interrupted"]:
        _log(f"interrupted: {len(report['rows'])} rows from the {len(report['log'])} runs done"
             + (f" are in {args.out}" if args.out else ""))
        return kept_stop_status()
    return 0


def run_calibrate(args) -> int:
    from glimpse.pipeline import load_engine
    from glimpse.pipeline.calibrate import calibrate_hidivdrop
    from glimpse.pipeline.profiles import profile_path, save_profile
    from glimpse.vision.media import IMAGE_EXTENSIONS

    _refuse_options_of_other_tasks(args, "calibrate", args.policy)
    if args.policy == "slider":
        return run_calibrate_slider(args)
    if args.images is None:
        raise UserError("calibrate hidivdrop needs --images DIR")
    # Refused before the model loads: --top-k 0 saved a profile of NaN whose empty filter list HiDivDrop then read as
    # "the paper's layers", --window 0 one of 1.0 everywhere, --max-images -1 left out the last image (an outside pass).
    if args.window < 1 or args.top_k < 1 or (args.max_images is not None and args.max_images < 1):
        raise UserError("--window, --top-k and --max-images must be at least 1")
    folder = Path(args.images)
    if not folder.is_dir():
        raise UserError(f"--images must be a folder of images, got {args.images}")
    images = sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)[: args.max_images or 32]
    if not images:
        raise UserError(f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) in {folder}")
    out = Path(args.out) if args.out else profile_path(args.model, "hidivdrop")
    check_writable_file(out, "--out")  # before the model loads, not after the whole calibration
    _log(f"loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    profile = calibrate_hidivdrop(engine, images, question=args.question, window=args.window, top_k=args.top_k,
                                  progress=_log)
    profile["checkpoint"] = engine.checkpoint  # applies to these weights only (profiles.checkpoint_identity)
    path = save_profile(args.model, profile, path=out)
    curve = ", ".join(f"{layer}: {value:.3f}" for layer, value in profile["ilvas"].items())
    _log(f"ILVAS (n={args.window}, K={args.top_k}) over layers {curve}")
    _log(f"filtering layers {profile['filter_layers']} -> {path}")
    print(json.dumps(finite(profile)))
    return 0


def run_calibrate_slider(args) -> int:
    from glimpse.pipeline import load_engine
    from glimpse.pipeline.calibrate_slider import STEADY_PROMPTS, calibrate_slider, folder_prompts, shipped_prompts
    from glimpse.pipeline.loading import local_frontier, slider_frontier
    from glimpse.pipeline.profiles import profile_path, save_profile
    from glimpse.pruning.frontier import DEFAULT_FLOOR, candidates

    floor = DEFAULT_FLOOR if args.floor is None else args.floor
    if not 0.0 < floor <= 1.0:
        raise UserError(f"--floor must be in (0, 1], got {floor}")
    if args.budget_minutes is not None and not 0 < args.budget_minutes < float("inf"):  # NaN too
        raise UserError("--budget-minutes must be a positive number of minutes (leave it out for no limit)")
    if args.max_images is not None and args.max_images < 1:
        raise UserError("--max-images must be at least 1")
    if args.prompts and not Path(args.prompts).is_file():
        raise UserError(f"--prompts must be a text file of questions, got {args.prompts}")
    left_out = sorted({name.strip() for name in args.leave_out.split(",")}) if args.leave_out is not None else []
    if any(name not in PRUNING_NAMES for name in left_out):
        raise UserError(f"--leave-out takes policies of {', '.join(PRUNING_NAMES)}, comma-separated; got "
                        f"{args.leave_out!r}")
    chosen = [c for c in candidates() if not any(member.policy in left_out for member in c)]
    path = Path(args.out) if args.out else profile_path(args.model, "slider")
    check_writable_file(path, "--out")  # before the model loads, not after hours of measuring
    # One calibration per profile at a time: two at once measured the same candidates, appended both to one state
    # file, and the last to finish replaced the other's profile (an outside pass). Held until this command ends.
    lock = open(path.with_name(path.name + ".lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"another glimpse calibrate slider is writing {path}; wait for it to finish (a rerun then "
                        "resumes where it stopped) or give another --out") from None
    user_prompts = None
    if args.images or args.videos or args.prompts:  # the model's video support is checked once it is loaded
        user_prompts = folder_prompts(args.images, args.videos, args.prompts, None, args.max_images)
    _log(f"loading {args.model} ...")
    engine = load_engine(args.model, device=args.device, attn=args.attn)
    video = engine.adapter.supports_video
    if args.videos and not video:
        raise UserError("this model takes no video: leave out --videos")
    if user_prompts is not None:
        prompts = user_prompts
    else:
        prompts = shipped_prompts(video)[: args.max_images]
        _log(f"no --images/--videos/--prompts: the {len(prompts)} calibration prompts that ship with Glimpse")
    if len(prompts) < STEADY_PROMPTS:  # a 12-prompt run promised 100% of a setting that kept 87.5% on 40
        _log(f"only {len(prompts)} calibration prompts: one answer that changes moves a candidate's agreement by "
             f"{100 / len(prompts):.0f} points; {STEADY_PROMPTS} or more make a steadier frontier (more images or "
             "videos: each is one prompt)")
    if args.budget_minutes:
        _log(f"--budget-minutes {args.budget_minutes:g}: no candidate starts after that; the one under way finishes")
    state = path.with_name(path.name + ".partial.jsonl")
    if left_out:
        _log(f"--leave-out {','.join(left_out)}: {len(candidates()) - len(chosen)} candidates not measured")
    frontier = calibrate_slider(engine, prompts, chosen, state_path=state, floor=floor, progress=_log,
                                budget_s=args.budget_minutes * 60 if args.budget_minutes else None)
    if left_out:  # said in every promise's provenance: the frontier was chosen among fewer candidates
        frontier.source += f", those running {' or '.join(left_out)} left out (--leave-out)"
    profile = {**frontier.to_json(), "model": args.model, "num_layers": len(engine.adapter.layers),
               "checkpoint": engine.checkpoint}
    if args.model == "embedded":  # which trained files it was measured on, the same on every machine
        from glimpse.pipeline import embedded

        profile["weights"] = embedded.checkpoint_name()
    # A complete calibration in use is replaced only by a complete one: a run cut short (by its budget, or a run
    # with other prompts, whose state starts over) goes beside it until a rerun completes it. Found from outside:
    # a 10-second run with the default prompts replaced a complete calibration on the tester's images.
    # The same holds for any --out that holds a complete frontier: a budget-limited rerun of the maintainer's command
    # with --out assets/embedded_frontier.json replaced the complete frontier that ships with an empty one, and auto
    # then pruned nothing at any speed (an outside pass).
    held, kept, in_place = None, None, path.resolve() == profile_path(args.model, "slider").resolve()
    incomplete_path = path.with_name(path.stem + ".incomplete" + path.suffix)
    if in_place and frontier.unmeasured:
        held = local_frontier(args.model, len(engine.adapter.layers), engine.checkpoint)
        if held is not None and not held.unmeasured:
            path = incomplete_path
        else:
            held = None
    elif frontier.unmeasured and (kept := _complete_frontier_in(path)) is not None:
        path = incomplete_path
    save_profile(args.model, profile, path=path)
    if not frontier.unmeasured:
        incomplete_path.unlink(missing_ok=True)  # completed: what an earlier partial run set beside it is done
    _log(f"frontier ({len(frontier.points)} points) -> {path}")
    if frontier.unmeasured:
        _log(f"incomplete: {frontier.unmeasured} of {len(frontier.measured) + frontier.unmeasured} candidates not "
             "measured. The frontier stored holds only what was measured, and every promise made from it says so "
             "(at a speed nothing measured so far keeps the answers, auto prunes nothing): rerun the same command "
             "to measure the rest")
    # What auto runs from now on, which is not always what was just stored: --out elsewhere, or a partial run
    # beside the complete frontier that ships (calibrate said "speed 1: lazyllm@0.75" and ask ran divprune@1).
    in_use = slider_frontier(args.model, len(engine.adapter.layers), engine.checkpoint)
    used = in_use.to_json() == frontier.to_json()
    if used:
        _log("auto now runs this frontier:")
    elif held is not None:
        _log(f"auto keeps running the complete calibration it ran before ({held.source}): this incomplete one does "
             f"not replace it, and is kept in {path} until a rerun of the same command completes it. It would run:")
    elif kept is not None:
        _log(f"{args.out} holds a complete calibration ({kept.source}): this incomplete one does not replace it, and "
             f"is kept in {path} until a rerun of the same command completes it. It would run:")
    elif not in_place:
        _log(f"auto reads {profile_path(args.model, 'slider')}, not --out: it keeps running the frontier it ran "
             f"before ({in_use.source}). This one would run:")
    else:
        _log(f"auto keeps running the frontier it ran before ({in_use.source}) until this calibration is complete "
             "(rerun the same command). This partial one would run:")
    for speed in (0.0, 0.25, 0.5, 0.75, 1.0):
        _log(f"  auto at speed {speed:g}: {frontier.promise(speed)['text']}")
    # stdout: a summary a script can read (the whole profile, 14 KB of every measured candidate, is in the file)
    print(json.dumps({"profile": str(path), "in_use": used, "complete": not frontier.unmeasured,
                      "measured": len(frontier.measured), "unmeasured": frontier.unmeasured,
                      "auto": {f"{speed:g}": frontier.promise(speed)["configuration"]
                               for speed in (0.0, 0.25, 0.5, 0.75, 1.0)}}))
    return 0


def _complete_frontier_in(path: Path):
    """The complete frontier stored at ``path`` (every candidate measured), or None: no file, not a frontier, or
    an incomplete one."""
    from glimpse.pipeline.loading import stored_frontier

    try:
        frontier = stored_frontier(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return None if frontier.unmeasured else frontier


def _check_plot_file(path: Path) -> None:
    from glimpse.plot import SUFFIXES

    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"--plot {path}: a chart is written as {', '.join(SUFFIXES)} (by the name's suffix)")
    check_writable_file(path, "--plot")


def check_writable_file(path: Path, flag: str) -> None:
    """Refuse, before any work, an output path that is a folder or whose folder cannot be made or written."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name")
    blocking = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # mkdir says only "File exists"
        raise UserError(f"{flag} {path}: {blocking} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot make its folder ({error.strerror or error})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path}: cannot write there")
    # Tried, not only asked: access() tells root yes everywhere, /proc included, where no file can be made.
    trial = path.with_name(f".{path.name}.{os.getpid()}.check")
    try:
        trial.touch(exist_ok=False)
        trial.unlink()
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot write there ({error.strerror or error})") from None


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # PIL warns of images of 89-179 MP above Glimpse's own error, which refuses them (over 64 MP) in words. Set for
    # the command's process only (a filter is process-wide; a program importing Glimpse keeps its own).
    import warnings

    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as error:  # `ask --speed abc --json`: its one JSON object on stdout is the error too
        # (argparse takes "--js" for --json: a script that abbreviates it got its answers as JSON and nothing on a
        # refusal, an outside pass found)
        if argv[:1] == ["ask"] and any(len(a) >= 3 and "--json".startswith(a) for a in argv):
            _print_json_error(error.message)
        raise
    args.given = _restore_defaults(args)
    _quiet_libraries()
    try:
        _refuse_a_closed_stdout(args)
        return args.run(args)
    except UserError as error:  # bad input, media, prompt or model (common.errors): the user can fix it
        _error(args, str(error))
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (glimpse.launcher)
        return stopped(stop)
    except BrokenPipeError:  # `glimpse ask ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python exits
        return 1
    except OSError as error:  # the machine's, not Glimpse's: a file it may not read, a full disk, a bad name
        where = f"{error.filename}: " if error.filename else ""
        _error(args, f"{where}{error.strerror or error}")
        return 1
    except Exception:  # anything else is Glimpse's bug, never blamed on the input
        traceback.print_exc()
        print("glimpse: internal error: this is a bug in Glimpse, not a problem with your input; "
              "please report it with the traceback above", file=sys.stderr)
        if _answers_in_json(args):
            _print_json_error("internal error: a bug in Glimpse (the traceback is on stderr)")
        return 2


def _refuse_a_closed_stdout(args) -> None:
    """A command whose result is what it prints, started with standard output closed (``glimpse ask ... >&-``),
    is refused before any work: Python then has no ``sys.stdout``, and the answer was lost after the model's work
    (``ask`` failed on it as an internal error, ``ask --json`` and ``eval`` exited 0 having printed nothing)."""
    prints_its_result = args.run in (run_ask, run_eval) or (args.run is run_bench and not args.out)
    if sys.stdout is None and prints_its_result:
        raise UserError("standard output is closed: there is nowhere to write the answer (redirect it to a file, or "
                        "to /dev/null)")


def _answers_in_json(args) -> bool:
    """`glimpse ask --json`: its one object on stdout is the answer, or the error. (bench and eval print their
    report first and may fail after it, writing --out: an error object there would be a second one.)"""
    return getattr(args, "run", None) is run_ask and args.json


def _error(args, message: str) -> None:
    """One line on stderr; for `ask --json` also ``{"error": message}`` on stdout, so that a script reading its
    one JSON object gets one on failure too (it got nothing to parse)."""
    print(f"glimpse: error: {utf8_text(message)}", file=sys.stderr)
    if _answers_in_json(args):
        _print_json_error(message)


def _print_json_error(message: str) -> None:
    """``{"error": message}`` on stdout, for ``ask --json``. A stdout that cannot take it (its reader gone, a full
    disk: often why the command failed) leaves the error said on stderr alone: writing it there again raised inside
    the handler, and the user got two tracebacks (and exit 1 for a refused argument, not 2; an outside pass)."""
    if sys.stdout is None:
        return
    try:
        print(json.dumps({"error": utf8_text(message)}), flush=True)
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor a third when Python exits


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
