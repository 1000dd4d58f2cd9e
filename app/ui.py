"""The web chat `glimpse serve` shows: Gradio Blocks around one engine.

Chat in the messages format with a multimodal input (several images/videos per turn, multi-turn
history), streamed answers, Stop / Regenerate / Clear; the speed slider and the policy selector,
with an advanced panel showing the parameters the slider chose and taking overrides; a metrics panel
per answer (optionally beside an unpruned run of the same question); the keep map over the image
(or a strip of sampled frames) showing how deep each patch went. Errors appear in the chat; the
server keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from common import UserError
from pruning import NAMES, parse_params
from vision.media import MediaError, detect_kind, load_image, probe_video, read_frames

POLICIES = ["auto", *[n for n in NAMES if n != "none"], "none"]


def history_to_messages(history: list[dict], allowed: tuple[Path, ...]) -> list[dict]:
    """Gradio chat history (messages format, files as parts) -> the engine's messages.

    A file part names a path on the server; only files under ``allowed`` (Gradio's upload folder, and
    ``--allowed-root`` if given) are used. A client that calls the chat endpoint directly with any other
    path gets a refusal that says nothing about whether the file exists."""
    messages = []
    for message in history:
        parts = message["content"] if isinstance(message["content"], list) else [message["content"]]
        content = []
        for part in parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            elif part.get("type") == "text":
                content.append({"type": "text", "text": part["text"]})
            elif part.get("type") == "file" or "path" in part:
                path = (part.get("file") or part)["path"]
                if not _inside(path, allowed):
                    raise MediaError(f"{Path(str(path)).name}: only files uploaded to this chat can be used")
                kind = detect_kind(path)
                content.append({"type": kind, kind: path})
        if messages and messages[-1]["role"] == message["role"]:
            messages[-1]["content"] += content  # Gradio splits one turn into a message per part
        else:
            messages.append({"role": message["role"], "content": content})
    return messages


def _inside(path, roots: tuple[Path, ...]) -> bool:
    try:
        resolved = Path(str(path)).resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    return any(resolved.is_relative_to(root) for root in roots)


def parse_overrides(text: str) -> dict:
    """The overrides box: ``name=value`` lines (blank lines and ``#`` comments skipped), parsed as the
    CLI's ``--param`` is (``pruning.parse_params``)."""
    lines = [line.strip() for line in (text or "").splitlines()]
    return parse_params(line for line in lines if line and not line.startswith("#"))


def metrics_markdown(result, baseline=None) -> str:
    def row(label, fn, fmt):
        cells = [fmt(fn(r.metrics)) for r in (result, baseline) if r is not None]
        return f"| {label} | " + " | ".join(cells) + " |"

    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    head = "| | this answer |" + (" unpruned |" if baseline else "")
    lines = [f"**{result.policy}**: {result.summary}", "", head, "|---|---|" + ("---|" if baseline else ""),
             row("time to first token", lambda m: m["ttft_s"], lambda v: f"{v:.2f} s"),
             row("prefill", lambda m: m["prefill_s"], lambda v: f"{v:.2f} s"),
             row("decode", lambda m: m["decode_tokens_per_s"], lambda v: f"{v:.1f} tok/s" if v else "—"),
             row("prompt tokens", lambda m: m["prompt_tokens"],
                 lambda v: ", ".join(f"{k} {n}" for k, n in v.items() if n)),
             row("KV cache", lambda m: m["kv_bytes"], mib),
             row("peak memory", lambda m: m["peak_memory_bytes"], mib),
             row("prefill FLOPs", lambda m: m["prefill_flops_baseline"] / m["prefill_flops"],
                 lambda v: f"{v:.2f}x fewer")]
    if baseline is not None:
        lines += ["", f"TTFT speedup **{baseline.metrics['ttft_s'] / result.metrics['ttft_s']:.2f}x**"]
    return "\n".join(lines)


def keep_map_image(messages: list[dict], keep_map: dict, cell: int = 24) -> Image.Image | None:
    """The depth each visual token reached, as a heatmap laid over the first image of the prompt
    (for a video: one tile per frame group of the grid). None when the prompt has no media grid."""
    media = keep_map.get("media") or []
    if not media or media[0].get("grid") is None:
        return None
    span = media[0]
    t, h, w = span["grid"]
    depth = np.array(keep_map["depth"][span["start"]:span["start"] + span["count"]], dtype=np.float32)
    if depth.size != t * h * w:
        return None
    share = (depth / max(keep_map["num_layers"], 1)).reshape(t, h, w)
    strip = np.concatenate(list(share), axis=1)  # frames side by side
    heat = np.stack([1 - strip, strip, np.zeros_like(strip)], axis=-1)  # red: dropped early, green: kept
    overlay = Image.fromarray((heat * 255).astype("uint8")).resize((strip.shape[1] * cell, strip.shape[0] * cell),
                                                                   Image.NEAREST)
    picture = _frame_strip(_first_media(messages, "video"), t, h * cell, w * cell) if span["kind"] == "video" \
        else _first_image(messages)
    if picture is None:
        return overlay
    return Image.blend(picture.convert("RGB").resize(overlay.size), overlay, 0.45)


def _first_media(messages, kind):
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part.get("type") == kind:
                return part[kind]
    return None


def _first_image(messages):
    source = _first_media(messages, "image")
    try:
        return load_image(source) if source is not None else None
    except MediaError:
        return None


def _frame_strip(path, groups: int, height: int, width: int) -> Image.Image | None:
    """One frame per temporal group of the video's token grid, evenly spaced over the clip, side by
    side: the background the per-group heatmap tiles are laid over."""
    if path is None:
        return None
    try:
        total = probe_video(path).num_frames
        indices = [min(total - 1, int((g + 0.5) * total / groups)) for g in range(groups)]
        frames = read_frames(path, indices)
    except (MediaError, OSError, ValueError):
        return None
    tiles = [Image.fromarray(frame).resize((width, height)) for frame in frames]
    strip = Image.new("RGB", (width * groups, height))
    for g, tile in enumerate(tiles):
        strip.paste(tile, (g * width, 0))
    return strip


def build_ui(engine, model_name: str, max_new_tokens: int = 256, allowed_root: str | None = None):
    import gradio as gr

    from gradio.utils import get_upload_folder

    # The only files a chat turn may name: what was uploaded to this chat, and --allowed-root.
    allowed = tuple(Path(p).resolve() for p in (get_upload_folder(), allowed_root) if p)

    def chosen_params(policy, speed, overrides):
        try:
            return engine.make_policy(policy, speed, parse_overrides(overrides)).params()
        except (UserError, TypeError, KeyError) as error:
            return {"error": str(error)}

    def promise_markdown(policy, speed, overrides):
        """Under the slider, before anything is asked: what this speed selects and what it was measured to keep."""
        try:
            promise = engine.promise(policy, speed, parse_overrides(overrides))
        except (UserError, TypeError, KeyError) as error:
            return f"⚠️ {error}"
        return f"**speed {speed:g}** → {promise['text']}" + ("" if promise["calibrated"] else " *(uncalibrated)*")

    def add_turn(message, history):
        history = list(history or [])
        for path in message.get("files", []):
            history.append({"role": "user", "content": [{"type": "file", "file": {"path": path}}]})
        if message.get("text"):
            history.append({"role": "user", "content": message["text"]})
        return gr.MultimodalTextbox(value=None, interactive=False), history

    def answer(history, policy, speed, overrides, compare):
        history = list(history or [])
        if not history or history[-1]["role"] != "user":
            yield history, gr.skip(), gr.skip()
            return
        history.append({"role": "assistant", "content": ""})
        try:
            messages = history_to_messages(history[:-1], allowed)
            options = dict(policy=engine.make_policy(policy, speed, parse_overrides(overrides)),
                           max_new_tokens=max_new_tokens)
            result = None
            for chunk in engine.stream(messages, **options):
                history[-1]["content"] += chunk.text
                result = chunk.result or result
                yield history, gr.skip(), gr.skip()
            baseline = engine.generate(messages, policy="none", max_new_tokens=max_new_tokens) if compare else None
            yield history, metrics_markdown(result, baseline), keep_map_image(messages, result.metrics["keep_map"])
        except Exception as error:  # shown in the chat; the server keeps serving
            if isinstance(error, UserError):
                history[-1]["content"] = f"⚠️ {error}"
            else:  # Glimpse's bug, not the user's input
                history[-1]["content"] = f"⚠️ internal error (a bug in Glimpse, not your input): {type(error).__name__}: {error}"
            if isinstance(error, MediaError):  # only a file that cannot be used leaves the prompt
                history = _drop_bad_files(history)
            yield history, gr.skip(), gr.skip()

    def regenerate(history):
        history = list(history or [])
        while history and history[-1]["role"] == "assistant":
            history.pop()
        return history

    with gr.Blocks(title="Glimpse") as demo:
        note = ("" if engine.grounded else "\n\n*The embedded model's vision projector is not trained yet: its answers "
                "about images and videos are not grounded in them. Start with `--model` and a Qwen2-VL or LLaVA "
                "checkpoint for real answers.*")
        gr.Markdown(f"## Glimpse — {model_name}\nAsk about images and videos; move the slider for speed.{note}")
        with gr.Row():
            with gr.Column(scale=3):
                chat = gr.Chatbot(label="chat", height=480, elem_id="chat")
                box = gr.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                           placeholder="Ask about an image or a video…", elem_id="input")
                with gr.Row():
                    stop = gr.Button("Stop", elem_id="stop")
                    again = gr.Button("Regenerate", elem_id="regenerate")
                    clear = gr.ClearButton([chat], value="Clear", elem_id="clear")
            with gr.Column(scale=2):
                speed = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="speed (0 = exact)", elem_id="speed")
                promise = gr.Markdown(promise_markdown("auto", 0.0, ""), elem_id="promise")
                policy = gr.Dropdown(POLICIES, value="auto", label="policy", elem_id="policy")
                compare = gr.Checkbox(False, label="also run unpruned, to compare", elem_id="compare")
                with gr.Accordion("advanced: parameters", open=False):
                    params = gr.JSON(chosen_params("auto", 0.0, ""), label="chosen by the slider", elem_id="params")
                    overrides = gr.Textbox(label="overrides, name=value per line (auto: dash.rho=0.6)", lines=2,
                                           elem_id="overrides")
                metrics = gr.Markdown("metrics appear after an answer", elem_id="metrics")
                keep = gr.Image(label="keep map (green: reached the last layer)", type="pil", elem_id="keepmap")

        for control in (speed, policy, overrides):
            control.change(chosen_params, [policy, speed, overrides], params, api_name=False)
            control.change(promise_markdown, [policy, speed, overrides], promise, api_name=False)
        submitted = box.submit(add_turn, [box, chat], [box, chat], api_name=False).then(
            answer, [chat, policy, speed, overrides, compare], [chat, metrics, keep], api_name="chat")
        submitted.then(lambda: gr.MultimodalTextbox(interactive=True), None, box)
        regenerated = again.click(regenerate, chat, chat, api_name=False).then(
            answer, [chat, policy, speed, overrides, compare], [chat, metrics, keep], api_name=False)
        stop.click(None, None, None, cancels=[submitted, regenerated])
        clear.click(lambda: ("metrics appear after an answer", None), None, [metrics, keep])
    return demo


def _drop_bad_files(history: list[dict]) -> list[dict]:
    """After a media error, the files of the turn that caused it leave the prompt of later turns (earlier
    turns were answered, so their files are fine); the chat shows a note in their place. Any other
    error (a typo in the overrides box) keeps them, so Regenerate answers with them."""
    last_answer = max((i for i, m in enumerate(history[:-1]) if m["role"] == "assistant"), default=-1)
    cleaned = history[:last_answer + 1]
    for message in history[last_answer + 1:-1]:
        parts = message["content"] if isinstance(message["content"], list) else [message["content"]]
        kept = [p if isinstance(p, str) or p.get("type") == "text" else
                {"type": "text", "text": "[file not used]"} for p in parts]
        cleaned.append({**message, "content": kept})
    return cleaned + history[-1:]
