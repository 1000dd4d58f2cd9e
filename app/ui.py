"""The web chat `glimpse serve` shows: ``gr.ChatInterface`` on the server's scheduler.

Chat in the messages format with a multimodal input (several images/videos per turn, multi-turn
history, uploads shown as thumbnails and players), streamed answers, Stop / Retry / Undo / Clear (Clear
and Stop end the request at once), examples from ``assets/``; the speed slider, the policy selector and
a max-tokens control, with an advanced panel showing the parameters the slider chose and taking
overrides; the queue position while a turn waits; a metrics panel per answer (optionally beside an
unpruned run of the same question) with that request's own peak memory; the keep map over the image
(or a strip of sampled frames) showing how deep each patch went. Errors appear in the chat; a file that
cannot be decoded leaves the conversation, anything else keeps it; the server keeps serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from PIL import Image

from glimpse.assets import ASSETS
from glimpse.common import UserError
from glimpse.connections import CHAT_SESSIONS, refuse, with_headers
from glimpse.pipeline.prompt import ContextOverflow
from glimpse.pruning import PRUNING_NAMES, parse_params
from glimpse.vision.media import (IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError, check_reading, detect_kind,
                                  load_image, probe_video)

POLICIES = ["auto", *PRUNING_NAMES, "none"]  # the dropdown: the default first, no pruning last


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
             row("answer tokens", lambda m: m["new_tokens"], str),
             row("time to first token", lambda m: m["ttft_s"], lambda v: f"{v:.2f} s"),
             row("of which reading the files", lambda m: m.get("prompt_s", 0.0), lambda v: f"{v:.2f} s"),
             row("of which queued", lambda m: m["queue_s"], lambda v: f"{v:.2f} s"),
             row("prefill", lambda m: m["prefill_s"], lambda v: f"{v:.2f} s"),
             row("decode", lambda m: m["decode_tokens_per_s"], lambda v: f"{v:.1f} tok/s" if v else "—"),
             row("prompt tokens", lambda m: (m["prompt_tokens"], m.get("prefix_reused_tokens", 0)),
                 lambda v: ", ".join(f"{k} {n}" for k, n in v[0].items() if n)
                 + (f" ({v[1]} taken from the prefix cache)" if v[1] else "")),
             row("KV cache", lambda m: m["kv_bytes"], mib),
             row("peak memory (this request)", lambda m: m["peak_memory_bytes"], mib),
             # Pruning's saving apart from the prefix cache's: a question asked again computed almost nothing,
             # and "341x fewer" beside "exact: no pruning" read as what pruning bought.
             row("prefill FLOPs", lambda m: (m["prefill_flops_unpruned"] / m["prefill_flops"],
                                             m["prefill_flops_baseline"] / m["prefill_flops_unpruned"]),
                 lambda v: f"{_times(v[0])} fewer by pruning" + (f", {_times(v[1])} fewer by the prefix cache"
                                                                 if v[1] > 1.0 else ""))]
    if baseline is not None:  # what the comparison is for: did pruning change the answer?
        lines.insert(4, f"| answer | {_table_cell(result.text)} | {_table_cell(baseline.text)} |")
    observed = telemetry_text(result.metrics.get("policy_telemetry") or {})
    if observed:
        lines += ["", f"observed: {observed}"]
    if baseline is not None:
        same = result.text.strip() == baseline.text.strip()
        # Past reading the files: the unpruned run takes the prompt this answer built, and its clock starts once it
        # is built (the ratio of whole times said pruning was 57x slower about a large picture: an outside pass).
        def computing(m):
            return max(m["ttft_s"] - m.get("prompt_s", 0.0), 1e-9)

        speedup = computing(baseline.metrics) / computing(result.metrics)
        lines += ["", ("the same answer as unpruned" if same else "**a different answer** from unpruned")
                  + (f"; time to first token past reading the files **{speedup:.2f}x faster**" if speedup >= 1.0
                     else f"; time to first token past reading the files **{1 / speedup:.2f}x slower** (one run "
                          "each: timings move with what else the machine does)")]
    return "\n".join(lines)


def _times(ratio: float) -> str:
    """A ratio as the panel shows it: two decimals where they mean something, none past 100 ("294x")."""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _table_cell(text: str, limit: int = 200) -> str:
    """An answer as one markdown table cell: on one line, its pipes escaped, cut at ``limit`` characters."""
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|") or "—"


def telemetry_text(telemetry: dict, prefix: str = "") -> str:
    """What the policy observed, one short phrase per value: ``dash num_halted 83``; a list per layer
    as its range (``zipvl important_per_layer 12-294 over 30 layers``)."""
    parts = []
    for name, value in telemetry.items():
        label = f"{prefix}{name}"
        if isinstance(value, dict):  # a composed policy: each member's under its name
            parts.append(telemetry_text(value, f"{label} "))
        elif isinstance(value, (list, tuple)) and value:
            parts.append(f"{label} {min(value)}-{max(value)} over {len(value)} layers")
        elif not isinstance(value, (list, tuple)):
            parts.append(f"{label} {value}")
    return "; ".join(p for p in parts if p)


def saved_image(image: Image.Image | None) -> str | None:
    """``image`` as a PNG file in Gradio's upload folder (named by its content; the upload quota expires it), for
    an output that leaves as it is: Gradio's "/chat" endpoint sends its outputs unprocessed, and a PIL image
    cannot be sent as JSON (its `/call/chat` route failed after every answer about a picture). The page's
    image component shows the file as it would the image."""
    if image is None:
        return None
    import io
    import os

    from gradio.utils import get_upload_folder

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    path = Path(get_upload_folder()) / "keep_maps" / f"{hashlib.sha256(data).hexdigest()[:24]}.png"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)  # whole, even with two answers writing the same map at once
        except OSError as error:  # a full disk: the turn goes on without its map (it failed, after its answer had
            # streamed, losing its notes and metrics, and left the part written: an outside pass)
            tmp.unlink(missing_ok=True)
            print(f"glimpse: the keep map was not saved: {error}", file=sys.stderr, flush=True)
            return None
    return str(path)


def keep_map_image(media: list, keep_map: dict, cell: int = 24) -> Image.Image | None:
    """The depth each visual token reached, as a heatmap laid over the prompt's last image or video: the one the
    latest question came with, or the latest before it (for a video: one tile per frame group of the grid, over
    the frames the model was given). ``media`` is the prompt's (``Prompt.media``); without it the heatmap is drawn
    alone. None when the prompt has no media grid."""
    spans = keep_map.get("media") or []
    if not spans or spans[-1].get("grid") is None:
        return None
    span = spans[-1]
    t, h, w = span["grid"]
    first = span["start"] + span.get("grid_start", 0)  # (LLaVA: after its CLS token)
    if first + t * h * w > span["start"] + span["count"]:
        return None
    depth = np.array(keep_map["depth"][first:first + t * h * w], dtype=np.float32).reshape(t, h, w)
    if span.get("tiles") and t == 1:
        # A LLaVA-NeXT picture: its anyres tiles after its overview, seen in more detail (most of its tokens; the map
        # showed the overview's only): drawn in its place, each row's newline token left out.
        rows, columns = span["tiles"]
        start = first + h * w
        if start + rows * (columns + 1) <= span["start"] + span["count"]:
            tiles = np.array(keep_map["depth"][start:start + rows * (columns + 1)], dtype=np.float32)
            depth = tiles.reshape(1, rows, columns + 1)[:, :, :columns]
            cell, t, h, w = max(1, round(cell * w / columns)), 1, rows, columns
    share = depth / max(keep_map["num_layers"], 1)
    strip = np.concatenate(list(share), axis=1)  # frames side by side
    heat = np.stack([1 - strip, strip, np.zeros_like(strip)], axis=-1)  # red: dropped early, green: kept
    overlay = Image.fromarray((heat * 255).astype("uint8")).resize((strip.shape[1] * cell, strip.shape[0] * cell),
                                                                   Image.NEAREST)
    frames = media[-1].frames if len(media) == len(spans) else []
    if not frames:
        return overlay
    picture = _frame_strip(frames, t, h * cell, w * cell) if span["kind"] == "video" else frames[0]
    if span["kind"] == "image":
        # Drawn at the picture's own proportions: the model may have squeezed it into its grid (the embedded
        # model's 16x16, LLaVA's 24x24), and a large one was squeezed as it was decoded (its "source_size":
        # vision.load_image), but a tall photo should still look tall.
        width, height = picture.info.get("source_size", picture.size)
        size = (overlay.width, max(1, round(overlay.width * height / width)))
        overlay = overlay.resize(size, Image.NEAREST)
    return Image.blend(picture.convert("RGB").resize(overlay.size), overlay, 0.45)


def _frame_strip(frames: list[Image.Image], groups: int, height: int, width: int) -> Image.Image:
    """One of the sampled frames per temporal group of the video's token grid, side by side: the background the
    per-group heatmap tiles are laid over (the frames the model saw, not the file decoded again)."""
    tiles = [frames[min(len(frames) - 1, g * len(frames) // groups)].convert("RGB").resize((width, height))
             for g in range(groups)]
    strip = Image.new("RGB", (width * groups, height))
    for g, tile in enumerate(tiles):
        strip.paste(tile, (g * width, 0))
    return strip


EMBEDDED_NOTE = ("**About this model:** the embedded demo model (135M parameters) answers short questions about "
                 "simple synthetic scenes — up to four flat shapes (circle, square, triangle, star) in six colours, and "
                 "short clips in which one moves, appears or changes colour; the examples below are such scenes. On "
                 "photos it answers in the same words (a colour, a shape, a count), rarely rightly. Start the server "
                 "with `--model` and a Qwen2-VL or LLaVA checkpoint for real pictures.")
# README's questions, which the embedded model answers right at every speed ("Red.", "Right."). An outside pass
# clicked the earlier ones first: "the biggest shape" (a circle of 8,005 pixels beside a square of 6,400) got
# "Blue.", and "What moves?" got a direction.
EXAMPLES = [("sample.png", "What colour is the circle?"), ("sample.mp4", "Which way does the blue square move?")]


class NoRemoteMedia:
    """ASGI middleware: the chat's pages load images and media from this server only (a Content-Security-Policy).

    The chat renders Markdown and the HTML Gradio's sanitiser lets through: an answer holding
    ``<img src="https://elsewhere/?q=...">`` or ``![](https://elsewhere/...)`` (a prompt injection in a picture
    can ask a model for one) would have the browser send what it likes to another server, and a style's
    ``url(...)`` too. ``img-src`` covers all three; the chat's own pictures, uploads, previews and keep maps come
    from this server, ``data:`` or ``blob:`` URLs."""

    # form-action too: a form in a message (the sanitiser keeps <form> and <button>) sent its fields elsewhere when
    # clicked (an outside pass).
    POLICY = b"img-src 'self' data: blob:; media-src 'self' data: blob:; form-action 'self'"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        await self.app(scope, receive, with_headers(send, lambda _: [(b"content-security-policy", self.POLICY)]))


class NoFetchingForClients:
    """ASGI middleware: Gradio's file route fetches an http(s) URL named in it (``/gradio_api/file=https://...``) and
    relays its bytes, and its proxy route (``/gradio_api/proxy=...``) those of another Gradio app: to anyone who can
    reach the chat, an open proxy with no size cap or deadline (an outside pass relayed 63 MB, and a trickle held a
    connection for a minute). The chat has no use for either (its files are uploads, served by path), so both are
    refused with 403 before Gradio sees them."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _names_a_url(scope["path"]):
            return await refuse(send, 403, "this server serves its own files only, never another address's")
        await self.app(scope, receive, send)


def _names_a_url(path: str) -> bool:
    """Whether a request path is Gradio's file route given a URL, or its proxy route."""
    rest = path.partition("/file=")[2]
    return "/proxy=" in path or bool(rest and _is_url(rest))


def _is_url(value) -> bool:
    # Gradio's own test is a case-sensitive "http://" or "https://" prefix; any spelling is refused here.
    return isinstance(value, str) and value[:8].lower().startswith(("http://", "https://"))


def _uploads_only(component):
    """``component`` (one that takes files: the chat's input box, its history) taking files uploaded to this server
    only. Gradio downloads a file part whose path is an http(s) URL into its upload folder before the chat sees it,
    whatever its size and for as long as it takes (an outside pass had 27 MB fetched past --max-upload-mb, and a
    trickle held the request a minute), and the copy then passed the chat's own check as an upload. The API fetches
    media URLs within its limits (glimpse.fetch); the chat refuses them before anything is fetched.

    Gradio moves a component's files through its two ``move_resource_to_block_cache`` methods; this component's
    are wrapped. (Not a subclass: Gradio writes a type stub, ``ui.pyi``, beside the module of every component class
    it sees defined.)"""
    import gradio as gr

    def refuse_urls(url_or_file_path):
        if _is_url(url_or_file_path):
            raise gr.Error("the chat takes files uploaded to it, not URLs: upload the file instead (the API, "
                           "/v1/chat/completions, takes image and video URLs)",
                           print_exception=False)  # the client's mistake: no traceback in the server's log

    move, move_async = component.move_resource_to_block_cache, component.async_move_resource_to_block_cache

    def move_upload(url_or_file_path):
        refuse_urls(url_or_file_path)
        return move(url_or_file_path)

    async def move_upload_async(url_or_file_path):
        refuse_urls(url_or_file_path)
        return await move_async(url_or_file_path)

    component.move_resource_to_block_cache = move_upload
    component.async_move_resource_to_block_cache = move_upload_async
    return component


def _text_and_files_only(chatbot):
    """``chatbot`` refusing a history that holds a component message, before Gradio reads it. Every route that takes
    the chat's history (the question, Stop, Undo, Retry, the history's own sync) runs the Chatbot's ``preprocess``,
    which builds a component message's component with the value sent (``{"path": ...}``): a ``gr.File`` copied any
    file under the server's working folder or /tmp into the upload folder, past the upload quota, and one naming a
    FIFO blocked a worker thread for good (an outside pass stopped the server's answering with forty). The chat's
    history is text and files (whose paths Gradio checks were uploaded): a component is refused, nothing opened."""
    import gradio as gr

    preprocess = chatbot.preprocess

    def text_and_files_only(payload):
        parts = (part for message in (payload.root if payload is not None else ()) for part in message.content)
        if any(part.type == "component" for part in parts):
            raise gr.Error("the chat's history holds only text and files uploaded to this chat, not components",
                           print_exception=False)  # the client's doing: no traceback in the server's log
        return preprocess(payload)

    chatbot.preprocess = text_and_files_only
    return chatbot


def build_ui(engine, model_name: str, max_new_tokens: int = 256, allowed_root: str | None = None, scheduler=None,
             refused=lambda outcome: None):
    """The chat, on ``gr.ChatInterface`` (multimodal input, streaming, Stop, Retry, Undo, Clear, examples);
    the slider, policy, max-tokens and overrides are its additional inputs, the metrics panel and the keep
    map its additional outputs. Every turn goes to ``scheduler`` (the server's, shared with the API); one refused
    before it gets there is counted by ``refused(outcome)`` ("rejected": the queue is full; "bad_request"), as the
    API counts its own (``Telemetry.refused``)."""
    import gradio as gr
    from gradio.utils import get_upload_folder

    from glimpse.pipeline.scheduler import QueueFull, Scheduler, ServerStopping

    scheduler = scheduler or Scheduler(engine)
    # The only files a chat turn may name: what was uploaded to this chat, and --allowed-root.
    allowed = tuple(Path(p).resolve() for p in (get_upload_folder(), allowed_root) if p)
    assets = ASSETS

    def chosen_params(policy, speed, overrides):
        try:
            return _rounded(engine.make_policy(policy, speed, parse_overrides(overrides)).params())
        except (UserError, TypeError, KeyError) as error:
            return {"error": str(error)}

    def promise_markdown(policy, speed, overrides):
        """Under the slider, before anything is asked: what this speed selects and what it was measured to keep —
        or why the question would be refused (an override out of range)."""
        try:
            parsed = parse_overrides(overrides)
            engine.make_policy(policy, speed, parsed)
            promise = engine.promise(policy, speed, parsed)
        except (UserError, TypeError, KeyError) as error:
            return f"{ERROR_NOTE}{error}"
        configuration = promise.get("configuration") or ""
        exact = configuration == "none"  # nothing pruned: there is nothing to calibrate
        said = promise["text"]
        if "@" in configuration:  # as code: Markdown showed "divprune@0.25" as an e-mail link, "[keep=0.25]" as a link
            said = said.replace(configuration, f"`{configuration}`")
        text = f"**speed {speed:g}** → {said}" + ("" if promise["calibrated"] or exact else " *(uncalibrated)*")
        if promise["calibrated"] and not exact:  # what the numbers are of, in a new user's words
            text += ("\n\n*Measured on single questions about one picture or clip: the share of answers "
                     "word for word the unpruned model's, and the compute before the first word (prefill FLOPs). "
                     "Later turns of a conversation carry it as context, unpruned: they save less.*")
        return text

    tabs: dict[str, set] = {}  # per browser session, the tickets it is waiting on: closing the tab cancels them
    cleared_sessions: dict = {}  # browser sessions whose next question starts a new conversation (Clear): True
    stopped_sessions: dict = {}  # browser session -> the last question when Stop ended its turn (re-marked next turn)
    comparing: dict = {}  # browser session -> its finished answer's metrics while the compare box's run goes on
    tabs_lock = threading.Lock()

    def respond(message, history, policy, speed, max_tokens, overrides, compare, request=None):
        """One turn: check this turn's files, queue the conversation, show the queue position while it
        waits, stream the answer, then the metrics (beside an unpruned run if asked) and the keep map."""
        received = time.perf_counter()  # its time to first token starts here: its files are read first
        session = getattr(request, "session_hash", None)
        with tabs_lock:
            comparing.pop(session, None)  # what a closed comparison left here: the new turn is the answer now
        files = [f if isinstance(f, str) else f.get("path") for f in (message.get("files") or [])]
        if not files and not (message.get("text") or "").strip():  # Enter in an empty box: nothing to answer
            yield f"{ERROR_NOTE}type a question, or attach a picture or a video", NO_METRICS, None
            return
        turn = [{"role": "user", "content": [{"type": "file", "file": {"path": p}} for p in files]
                 + ([{"type": "text", "text": message["text"]}] if message.get("text") else [])}]
        try:
            # Compared, both answers compute everything (no media, encoder or prefix cache): the unpruned run
            # comes second, and the caches would otherwise hand it what the first one computed.
            overridden = parse_overrides(overrides)
            options = dict(policy=engine.make_policy(policy, speed, overridden),
                           max_new_tokens=_token_limit(max_tokens, max_new_tokens), caches=not compare)
            scheduler.check_room()  # a full queue is refused before any work, its files' decoding included
            # In one of the server's media-reader places, as a prompt's reading is, and under its time limit for media
            # (a turn may bring a thousand pictures, and a Matroska file is demuxed whole to count its frames); each
            # file once. Checked in the chat's own worker, sixteen turns naming one 16 MP upload a hundred times each
            # kept every core decoding: a text question took 60 s, not 0.7 (an outside pass, 2026-12-07).
            with scheduler.reading_turn() if files else contextlib.nullcontext():  # (a question in words needs none)
                misnamed = []
                for path in dict.fromkeys(files):
                    check_reading(path)
                    misnamed.append(_check_upload(path, allowed))
            limit = options["max_new_tokens"]

            def room(prompt):  # for the answer, in the model's context and in the server's KV budget
                context = engine.max_length
                return (context is None or len(prompt) + limit <= context) and scheduler.fits_budget(prompt, limit)

            prompt, left_out = _fitting_prompt(
                _usable(history), turn,
                lambda conversation: scheduler.prepare(history_to_messages(conversation, allowed), not compare), room)
            ticket = scheduler.submit(prompt, received=received, **options)
            with tabs_lock:
                tabs.setdefault(session, set()).add(ticket)
        except (QueueFull, ServerStopping) as full:
            refused("rejected")
            yield f"{ERROR_NOTE}{full}", NO_METRICS, None
            return
        except Exception as error:  # shown in the chat; the server keeps serving (a file the error names, one that
            # does not decode or took past --media-timeout, is left out of later turns: _usable)
            refused("bad_request" if isinstance(error, UserError) else "error")
            yield _error_text(error), NO_METRICS, None
            return
        answer, result = "", None
        try:
            for chunk in ticket.chunks(heartbeat=0.5):
                if chunk is None:  # still waiting for the model: say where it stands
                    position = scheduler.position(ticket)
                    if position and not answer:
                        yield (f"{WAIT_NOTE}waiting for the model: number {position} in the queue, about "
                               f"{scheduler.wait_estimate(position):.0f} s"), gr.skip(), gr.skip()
                    else:  # Gradio ends a generator only at a yield: a cancel (an API client's) waited out the
                        # whole prefill, holding Gradio's lock, and the prefill ran on (an outside pass)
                        yield _shown(answer) if answer else f"{WAIT_NOTE}reading the question", gr.skip(), gr.skip()
                    continue
                answer += chunk.text
                result = chunk.result or result
                yield _shown(answer), gr.skip(), gr.skip()
        except Exception as error:  # after some of the answer: what was said stays, the error under it as a note
            yield (_shown(answer) + _note(f"the answer broke off: {_error_text(error).removeprefix(ERROR_NOTE)}") if answer
                   else _error_text(error)), NO_METRICS, None
            return
        finally:
            _ended(session, ticket)
        if result is None:
            return
        answer = _shown(answer)
        count = len(result.token_ids)
        if result.finish_reason == "length" and count < options["max_new_tokens"]:  # the engine's cap: no room left
            answer += _note(f"cut at {count} token{'s' if count != 1 else ''}: this question fills the model's "
                            "context, so the answer had no more room; ask a shorter question or send less media")
        elif result.finish_reason == "length":
            answer += _note(f"cut at {count} token{'s' if count != 1 else ''}: raise max answer tokens for more")
        for warning in result.warnings:  # e.g. a damaged video: the answer is about the frames that decoded
            answer += _note(f"{WARNING_NOTE}{_literal(warning)}")
        for note in filter(None, misnamed):
            answer += _note(_literal(note))
        if left_out:
            answer += _note(f"the conversation no longer fits with room for the answer (the model's context, the "
                            f"server's KV budget): its {left_out} oldest "
                            f"turn{'s were' if left_out > 1 else ' was'} left out of this answer")
        keep_map = saved_image(keep_map_image(prompt.media, result.metrics["keep_map"]))
        metrics = metrics_markdown(result)
        # With no pruning (policy none, or speed 0 as the slider sets it) the two runs are one configuration.
        if compare and policy != "none" and (speed > 0 or overridden):
            # The answer is whole, with its notes and metrics, before the unpruned run starts: Stop then ends only
            # the comparison (mark_stopped reads what it leaves in the panel here). It lost them, and marked the
            # finished answer "(stopped)".
            with tabs_lock:
                _remember(comparing, session, metrics)
            said = "\n\n*running the unpruned answer to compare ...*"
            yield answer, metrics + said, keep_map
            baseline, not_compared = yield from unpruned_answer(session, prompt, answer, metrics + said,
                                                                options["max_new_tokens"])
            with tabs_lock:
                comparing.pop(session, None)
            metrics = metrics_markdown(result, baseline) + not_compared
        yield answer, metrics, keep_map

    def unpruned_answer(session, prompt, answer: str, said: str, max_new_tokens: int):
        """The compare box's unpruned run of the same prompt: (its result, or None and why there is none, for the
        metrics panel, which shows ``said`` meanwhile, with the tokens so far). A request of the session as the answer
        was: Stop, Clear and closing the tab end it at once (it was waited for in one blocking call, which nothing
        could end: Stop waited its 10 s, and a second user's two-token question waited 36 s behind it). Its failure,
        a full queue included, leaves the answer as it is, with its metrics (an outside pass saw the finished answer
        marked "broke off: internal error ... QueueFull" and its metrics gone)."""
        try:
            ticket = scheduler.submit(prompt, policy="none", max_new_tokens=max_new_tokens, caches=False)
        except (QueueFull, ServerStopping) as busy:
            return None, _not_compared(_literal(str(busy)))
        except Exception as error:
            return None, _not_compared(_error_text(error).removeprefix(ERROR_NOTE))
        with tabs_lock:
            tabs.setdefault(session, set()).add(ticket)
        tokens = 0
        try:
            for chunk in ticket.chunks(heartbeat=0.5):  # each step yields: Gradio ends a generator only at a yield
                if chunk is not None and chunk.result is not None:  # one ended part-way compares with nothing
                    return (None, _not_compared("it was cancelled")) if chunk.result.finish_reason == "cancelled" \
                        else (chunk.result, "")
                tokens += chunk is not None
                yield answer, f"{said[:-5]}: {tokens} token{'s' * (tokens != 1)} ...*" if tokens else said, gr.skip()
            return None, _not_compared("it was cancelled")
        except Exception as error:
            return None, _not_compared(_error_text(error).removeprefix(ERROR_NOTE))
        finally:
            _ended(session, ticket)

    def _ended(session, ticket) -> None:
        """The ticket's stream ended or was left (Stop and Clear close the chat's generator): its request ends at
        once, and the session is no longer waiting on it. A session waiting on nothing is dropped (API clients'
        sessions never close: each left an entry behind)."""
        ticket.cancel.set()
        with tabs_lock:
            waiting = tabs.get(session, set())
            waiting.discard(ticket)
            if not waiting:
                tabs.pop(session, None)

    def tab_closed(request):
        """The tab was closed or reloaded (Gradio does not cancel its running event): end its requests."""
        with tabs_lock:
            tickets = tabs.pop(getattr(request, "session_hash", None), set())
            cleared_sessions.pop(getattr(request, "session_hash", None), None)
            stopped_sessions.pop(getattr(request, "session_hash", None), None)
            comparing.pop(getattr(request, "session_hash", None), None)
        for ticket in tickets:
            ticket.cancel.set()

    def wait_for_answers_to_end(request, limit: float = 10.0) -> None:
        """End this tab's answer and wait until its stream has ended (its ``finally`` drops the ticket). Its
        last update is then already on the session's stream, so what is sent after this reaches the page after
        it instead of being overwritten by it."""
        session = getattr(request, "session_hash", None)
        with tabs_lock:
            for ticket in tabs.get(session, ()):
                ticket.cancel.set()  # Gradio cancels the event too; this ends the request at the scheduler at once
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            with tabs_lock:
                if not tabs.get(session):
                    return
            time.sleep(0.05)

    def mark_stopped(history, request=None):
        """Stop: an answer that had begun keeps what was said, marked; a question stopped before its answer
        began (still queued, or not yet sent) is marked as failed turns are, so that the next turn leaves its
        text out (it was sent merged into the next question) and keeps its files."""
        session = getattr(request, "session_hash", None)
        with tabs_lock:  # read before the comparison ends: then the turn forgets it
            finished = comparing.get(session)
        wait_for_answers_to_end(request)
        if finished is not None:  # the answer was whole: Stop ended the comparison only
            return gr.skip(), finished + _not_compared("it was stopped")
        if session is not None:
            with tabs_lock:
                # Gradio copies the page's conversation into the chat's state when the stopped event ends, and that
                # copy can be taken before this mark is shown: the next question then re-applies it (_stream_fn).
                _remember(stopped_sessions, session, _last_question(history))
        return _marked_stopped(history), STOPPED_METRICS  # the chat, the metrics panel

    def cleared(request=None):
        """After Clear: an empty chat and chat state (a streamed update that was on its way when Clear was
        pressed would otherwise bring the old conversation back, and the next question would carry it). The
        next question also starts afresh whatever the state says by then (``ClearCancelsChat._stream_fn``)."""
        session = getattr(request, "session_hash", None)
        if session is not None:
            with tabs_lock:
                _remember(cleared_sessions, session, True)
                stopped_sessions.pop(session, None)
                comparing.pop(session, None)
        wait_for_answers_to_end(request)
        return [], [], "metrics appear after an answer", None

    # Gradio injects the browser session into parameters annotated gr.Request (set here: gradio loads lazily).
    for fn in (respond, tab_closed, mark_stopped, cleared):
        fn.__annotations__["request"] = gr.Request

    # No telemetry: Gradio's default posts to api.gradio.app as a chat is built and checks its own version there,
    # from a server whose users' pictures and questions are meant to stay on it (and often has no way out).
    with gr.Blocks(title="Glimpse", analytics_enabled=False) as demo:
        note = EMBEDDED_NOTE if model_name == "embedded" else (
            "" if engine.grounded else "*This model's vision projector is not trained: its answers about images "
                                      "and videos are not grounded in them.*")
        gr.Markdown(f"## Glimpse — {model_name}\nAsk about images and videos; move the slider for speed.")
        if note:
            gr.Markdown(note, elem_id="model-note")
        speed = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="speed (0 = exact)", elem_id="speed", render=False)
        policy = gr.Dropdown(POLICIES, value="auto", label="policy", elem_id="policy", render=False)
        max_tokens = gr.Slider(1, max_new_tokens, value=min(256, max_new_tokens), step=1, label="max answer tokens",
                               elem_id="max-tokens", render=False)
        overrides = gr.Textbox(label="overrides, name=value per line (auto: member.param, e.g. divprune.keep=0.3)", lines=2,
                               elem_id="overrides", render=False)
        compare = gr.Checkbox(False, label="also run unpruned, to compare (both computed whole: no caches)",
                              elem_id="compare", render=False)
        metrics = gr.Markdown("metrics appear after an answer", elem_id="metrics", render=False)
        # A fixed height: drawn at the picture's proportions, a 1080x12000 screenshot's map made the page 5,486 pixels
        # tall (an outside pass); the map is shown whole within it.
        keep = gr.Image(label="keep map (green: reached the last layer)", type="pil", elem_id="keepmap", render=False,
                        height=400)
        with gr.Row():
            left = gr.Column(scale=3)  # filled below: the chat's additional inputs must be rendered first
            with gr.Column(scale=2):
                speed.render()
                promise = gr.Markdown(promise_markdown("auto", 0.0, ""), elem_id="promise")
                policy.render()
                max_tokens.render()
                compare.render()
                with gr.Accordion("advanced: parameters", open=False):
                    params = gr.JSON(chosen_params("auto", 0.0, ""), label="chosen by the slider", elem_id="params")
                    overrides.render()
                metrics.render()
                keep.render()
            with left:
                question = gr.MultimodalTextbox(file_types=["image", "video"], file_count="multiple",
                                                label="your question", placeholder="Ask about an image or a video…",
                                                submit_btn=True, stop_btn=True, elem_id="input")
                chat = _clear_cancels_chat(cleared_sessions, stopped_sessions, tabs_lock)(
                    respond, multimodal=True, api_name="chat", fill_height=False, analytics_enabled=False,
                    chatbot=_text_and_files_only(_uploads_only(gr.Chatbot(label="chat", height=480, elem_id="chat"))),
                    textbox=_uploads_only(question),
                    additional_inputs=[policy, speed, max_tokens, overrides, compare],
                    additional_outputs=[metrics, keep],
                    examples=[[{"text": text, "files": [str(assets / name)]}] for name, text in EXAMPLES
                              if (assets / name).is_file()] or None)

        for control in (speed, policy, overrides):
            control.change(chosen_params, [policy, speed, overrides], params, api_name=False)
            control.change(promise_markdown, [policy, speed, overrides], promise, api_name=False)
        chat.textbox.stop(mark_stopped, chat.chatbot, [chat.chatbot, metrics], api_name=False)
        chat.chatbot.clear(cleared, None, [chat.chatbot, chat.chatbot_state, metrics, keep], api_name=False)
        # Undo takes the last answer away: its metrics and keep map go with it (they stayed, describing an answer no
        # longer there; an outside pass).
        chat.chatbot.undo(lambda: ("metrics appear after an answer", None), None, [metrics, keep], api_name=False)
        # A speed typed past the slider's range (1.5) was refused by the promise's handlers, which kept saying the
        # earlier speed, while the question ran at the speed the page clamped it to (an outside pass): clamped in
        # the page first, the promise then says the speed the question runs at.
        speed.change(None, speed, speed, js="(value) => Math.min(1, Math.max(0, Number(value) || 0))",
                     api_name=False)
        demo.unload(tab_closed)
    demo.chat_interface = chat  # the chat's own handlers, for tests that drive them without a browser
    return demo


def _clear_cancels_chat(cleared_sessions: dict, stopped_sessions: dict, lock):
    import gradio as gr  # only when the chat is built

    class ClearCancelsChat(gr.ChatInterface):
        """``gr.ChatInterface`` whose Clear also cancels the answer being streamed. Gradio's cancels it on Stop
        only, so after Clear the stream's next update brought the old conversation back, and the next question
        was sent with it.

        And the first question after a Clear starts a new conversation whatever the chat's state holds: when
        the cancelled answer's event ends, Gradio copies the page's conversation into that state
        (``synchronize_chat_state``), and that copy, taken before the page was cleared, can land after the
        clear (seen in CI: the next question was shown and sent with the cleared turn).

        That same copy can also lose Stop's mark under the stopped answer ("(stopped)", or "stopped before the
        answer began"): the first question after a Stop shows the conversation with the mark again."""

        def _setup_stop_events(self, event_triggers, events_to_cancel, after_success):
            super()._setup_stop_events(event_triggers, events_to_cancel, after_success)
            self.chatbot.clear(None, None, None, cancels=events_to_cancel, api_visibility="undocumented")

        async def _stream_fn(self, message, history, *args):
            request = next((a for a in args if isinstance(a, gr.Request)), None)
            session = getattr(request, "session_hash", None)
            with lock:
                if session is not None and session in cleared_sessions:
                    cleared_sessions.pop(session)
                    history = []
                stopped = stopped_sessions.pop(session, None) if session is not None else None
                if stopped is not None and history and _last_question(history) == stopped:
                    history = _marked_stopped(history)  # the stopped turn is still the last (not a retry of it)
            async for update in super()._stream_fn(message, history, *args):
                yield update

    return ClearCancelsChat


class SessionMessages(OrderedDict):
    """What Gradio's queue holds for each browser session to send it (``Queue.pending_messages_per_session``), which
    ``build_server`` puts in place of Gradio's own map. That one (an LRUCache of 2,000) drops the session set longest
    ago once full, even one whose answer is under way: a client joining the queue under 2,300 made-up sessions, never
    reading, ended a real user's answer with "session not found" (an outside pass, 2026-12-07). This one drops, past
    ``limit``, the least recently used sessions with no event queued or running and nothing sent them in the last
    ``read_grace_s`` left unread (their clients never came for what was sent, or have it all; an answer's last
    messages are sent after its event ends, and its client reads them a moment later), and with each the event ids
    Gradio keeps until they are delivered (``Queue.pending_event_ids_session``, which a client that never reads grew
    without end)."""

    def __init__(self, queue, limit: int | None = None, read_grace_s: float = 60.0):
        super().__init__()
        self.queue, self.limit = queue, 2 * CHAT_SESSIONS if limit is None else limit
        self.read_grace_s = read_grace_s
        self.used_at: dict = {}  # session -> when it was last set or sent a message

    def __getitem__(self, session):
        messages = super().__getitem__(session)  # (sending it a message: in use)
        self.move_to_end(session)
        self.used_at[session] = time.monotonic()
        return messages

    def __setitem__(self, session, messages) -> None:
        super().__setitem__(session, messages)
        self.move_to_end(session)
        self.used_at[session] = now = time.monotonic()
        if len(self) > self.limit:
            live = {event.session_hash for event in list(self.queue.event_ids_to_events.values())}
            idle = [other for other in self if other not in live and other != session
                    and (OrderedDict.__getitem__(self, other).empty()  # (not self[other]: that is a use)
                         or now - self.used_at.get(other, 0.0) > self.read_grace_s)]
            for other in idle[:len(self) - self.limit]:
                del self[other]
                self.queue.pending_event_ids_session.pop(other, None)

    def __delitem__(self, session) -> None:
        super().__delitem__(session)
        self.used_at.pop(session, None)


def _remember(sessions: dict, session, value) -> None:
    """``sessions[session] = value``, the least recently set entry dropped past ``CHAT_SESSIONS`` (as many as Gradio
    keeps the state of): a client making up a session for each request cannot grow it for ever."""
    sessions.pop(session, None)
    sessions[session] = value
    while len(sessions) > CHAT_SESSIONS:
        del sessions[next(iter(sessions))]


def _last_question(history: list[dict] | None) -> tuple[int, str] | None:
    """The conversation's last user message (a turn's text comes after its files): where it is, and a digest of its
    text (what Stop keeps of it, per session: the question itself can be megabytes). Its place tells a stopped turn
    from an earlier one with the same question: by text alone, Retry after Stop marked the answer before it
    "(stopped)" when that question had been asked twice (a natural use: the same question at another speed)."""
    return next(((i, hashlib.sha256(_text_of(m).encode(errors="replace")).hexdigest())
                 for i, m in reversed(list(enumerate(history or []))) if m.get("role") == "user"), None)


def _marked_stopped(history: list[dict] | None) -> list[dict]:
    """The conversation with Stop's mark on its last turn, once: an answer that had begun keeps what was said,
    marked; a question stopped before its answer began (still queued, or not yet sent) gets the note failed turns
    get, so that the next turn leaves its text out (it was sent merged into the next question) and keeps its
    files. A turn already marked, or that failed, is left as it is."""
    history = list(history or [])
    if not history:
        return history
    last = history[-1]
    answered = last["role"] == "assistant"
    if answered and (_text_of(last).endswith(_note("stopped")) or _text_of(last).startswith(ERROR_NOTE)):
        return history  # marked already, or a failed turn (its note says so; "stopped before ..." is one of them)
    if answered and not _is_chat_note(last):
        history[-1] = {**last, "content": _text_of(last) + _note("stopped")}
    else:
        if answered:  # the queue position shown while it waited
            history.pop()
        history.append({"role": "assistant", "content": STOPPED_BEFORE_ANSWER})
    return history


def _check_upload(path, allowed: tuple[Path, ...]) -> str | None:
    """This turn's file: under ``allowed`` and decodable (an image opens, a video has frames). Returns a note for
    the answer when its content is not what its name says: the model reads it by its content, but the chat shows it
    by its name (a picture named .mp4 as a video player that never plays; an outside pass)."""
    if not _inside(path, allowed):
        raise MediaError(f"{Path(str(path)).name}: only files uploaded to this chat can be used")
    kind = detect_kind(path)
    load_image(path) if kind == "image" else probe_video(path)
    suffix = Path(str(path)).suffix.lower()
    named = "video" if suffix in VIDEO_EXTENSIONS else "image" if suffix in IMAGE_EXTENSIONS else None
    if named is not None and named != kind:
        shown = "a video" if named == "video" else "a picture"
        return (f"read by its content: {Path(str(path)).name} holds {'a video' if kind == 'video' else 'a picture'}, "
                f"and the model read it as one; the chat shows it as {shown}, by its name")
    return None


def _usable(history: list[dict]) -> list[dict]:
    """The earlier turns as the model should see them: the files a failed turn's error named (they did not decode,
    or took past --media-timeout: ``_named_by_its_error``), files no longer on disk (old uploads the upload quota
    deleted, ``glimpse.uploads``), the error notes the chat showed for failed turns and the notes it adds under
    answers (cut, stopped, turns left out) left out. A failed turn's question is left out too (the model never
    answered it; sent again, it would run into the next question, and one too long for the context would push out
    the turns before it), but its other files stay: the user uploaded them, and the next question may be about
    them."""
    kept = []
    for i, message in enumerate(history):
        content = message.get("content")
        if _is_chat_note(message):
            # Not an answer: the error note of a failed turn, or the queue position shown while a question waited
            # (Stop pressed then). The question before it is then unanswered: _without_unanswered leaves its
            # text out and keeps its files.
            continue
        if message.get("role") == "assistant":
            content = _without_notes_in(content)  # the chat's own notes under an answer are not the model's words
        parts = content if isinstance(content, list) else [content]
        parts = [p for p in parts if not (isinstance(p, dict) and _path_of(p) is not None
                                          and (_named_by_its_error(history, i, _path_of(p))
                                               or not Path(_path_of(p)).is_file()))]
        if parts:
            kept.append({**message, "content": parts if isinstance(content, list) else parts[0]})
    return _without_unanswered(kept)


def _named_by_its_error(history: list[dict], index: int, path: str) -> bool:
    """Whether the turn of ``history[index]`` failed on the file at ``path``: its answer is the chat's error note,
    and the error names the file first, as a file's errors do ("photo.png: the file is empty"; a video past
    --media-timeout). Read from the conversation itself, not remembered by the server: a file that took too long
    on a busy server once was then left out of every later turn of every user who sent the same picture (uploads
    are stored by content), even after it was sent again and read. The same file sent again in a later turn is
    that turn's, and kept if that turn did not fail on it."""
    answer = next((m for m in history[index + 1:] if m.get("role") == "assistant"), None)
    if answer is None or not _is_chat_note(answer):
        return False
    return _text_of(answer).removeprefix(ERROR_NOTE).startswith(f"{_literal(Path(path).name)}: ")


def _without_unanswered(history: list[dict]) -> list[dict]:
    """``history`` without the text of questions that got no answer (Stop pressed while one was queued, a tab
    reloaded then): Gradio gives a turn as one user message per part, its files first and its text last, so a
    text followed by another user message, or ending the history, was never answered. Sent again, it ran into
    the next question. Their files stay, as a failed turn's do."""
    kept = []
    for i, message in enumerate(history):
        answered = i + 1 < len(history) and history[i + 1].get("role") == "assistant"
        if message.get("role") == "user" and not answered and _text_of(message):
            message = _files_only(message)
            if message is None:
                continue
        kept.append(message)
    return kept


def _files_only(message: dict) -> dict | None:
    """A user message without its text (None if nothing else is left)."""
    content = message.get("content")
    parts = content if isinstance(content, list) else [content]
    files = [p for p in parts if isinstance(p, dict) and p.get("type") != "text" and _path_of(p) is not None]
    if not files:
        return None
    return {**message, "content": files if isinstance(content, list) else files[0]}


def _note(text: str) -> str:
    """What the chat adds under an answer (cut, stopped, turns left out): shown, never sent back to the model."""
    return f"{NOTE_START}{text}{NOTE_END}"


# What the chat writes in the assistant's place — a failed turn's error, the queue position while a question waits —
# starts with its sign and a word joiner (U+2060, invisible): a model's own answer may start with "⚠️" too, and
# such an answer must stay in the conversation.
ERROR_NOTE, WAIT_NOTE = "⚠️\u2060 ", "⏳\u2060 "
NO_METRICS = "*no answer: no metrics for this turn*"
STOPPED_METRICS = "*stopped: no metrics for this answer*"
STOPPED_BEFORE_ANSWER = f"{ERROR_NOTE}stopped before the answer began: this question is left out of the conversation"
NOTE_START, NOTE_END = "\n\n*(", ")*"
WARNING_NOTE = "warning: "  # what the engine warns of (a damaged video): it names the user's file
# Only these: a model may end on "*(...)*" too.
NOTE_KINDS = ("cut at ", "stopped", "the conversation no longer fits", "the answer broke off", WARNING_NOTE,
              "read by its content: ")
# Characters Markdown (and the chat's LaTeX and HTML rendering) would read as markup in a user's file name.
MARKUP = re.compile(r"([\\`*_\[\]<>~$&|#])")


def _literal(text: str) -> str:
    """``text`` shown as written inside the chat's Markdown: a file named "_draft_ [v1] ~old~.png" showed as
    "draft [v1] old.png", "draft" in italics and "old" struck through."""
    return MARKUP.sub(r"\\\1", text)


def _is_chat_note(message: dict) -> bool:
    """Whether an assistant message is the chat's own note (an error, the queue position), not an answer."""
    return message.get("role") == "assistant" and _text_of(message).startswith((ERROR_NOTE, WAIT_NOTE))


def _without_notes(text: str) -> str:
    while text.endswith(NOTE_END) and NOTE_START in text:
        start = text.rindex(NOTE_START)
        if not text[start + len(NOTE_START):].startswith(NOTE_KINDS):
            break
        text = text[:start]
    return text


# A line that is only a number and a dot ("12.", "3)") is an empty ordered-list item in Markdown: the chat drew the
# embedded model's counts as a list marker with no text (nothing to select or copy). Shown with a word joiner
# (U+2060, invisible) before the dot, which makes it no list marker — a backslash escape showed in what the copy
# button copied ("3\.") and what screen readers read — and taken back out when the conversation goes to the model.
EMPTY_LIST_ITEM = re.compile(r"^( {0,3}\d{1,9})([.)])([ \t]*)$", re.MULTILINE)
JOINED_LIST_ITEM = re.compile(r"^( {0,3}\d{1,9})\u2060([.)])([ \t]*)$", re.MULTILINE)


def _shown(answer: str) -> str:
    """An answer as the chat shows it: the model's words, literally where Markdown would swallow them."""
    return EMPTY_LIST_ITEM.sub("\\1\u2060\\2\\3", answer)


def _as_written(shown: str) -> str:
    return JOINED_LIST_ITEM.sub(r"\1\2\3", shown)


def _without_notes_in(content):
    """A message's content (a string, or Gradio's list of parts) with the chat's notes taken off its text, as the
    model wrote it."""
    words = lambda text: _as_written(_without_notes(text))  # noqa: E731
    if isinstance(content, str):
        return words(content)
    if isinstance(content, list):
        return [words(p) if isinstance(p, str) else
                {**p, "text": words(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                for p in content]
    return content


def _turn_starts(history: list[dict]) -> list[int]:
    """Where each question turn of ``history`` starts (a question is its user messages — Gradio gives its files
    and its text as separate messages — and the answers after them), then ``len(history)``: leaving out the
    ``k`` oldest turns keeps ``history[starts[k]:]``."""
    starts, at = [], 0
    while at < len(history):
        starts.append(at)
        while at < len(history) and history[at].get("role") == "user":
            at += 1
        while at < len(history) and history[at].get("role") != "user":
            at += 1
    return starts + [len(history)]


def _fitting_prompt(earlier: list[dict], turn: list[dict], prepare, room=lambda prompt: True) -> tuple[object, int]:
    """The prompt of ``turn`` after the most recent ``earlier`` turns that fit, and how many of the oldest turns were
    left out. Fitting: ``prepare`` (which builds a prompt) does not raise ``ContextOverflow``, and ``room(prompt)``
    says it leaves room for the answer (in the model's context and the server's KV budget: a chat past the budget
    failed every later turn with the budget's error, an outside pass found). ``turn`` alone is returned whether
    it has room or not (its error, or its answer cut at the context's end, is the chat's to say); its
    ``ContextOverflow`` is raised.

    Searched by halves over how many to leave out: each try builds the whole prompt, and leaving out one turn at
    a time took 166 s of a core on a history of 1,000 turns (an outside pass), holding every other request's
    prompt building behind it."""
    def fitting(conversation):  # its prompt, or None
        try:
            prompt = prepare(conversation)
        except ContextOverflow:
            return None
        return prompt if room(prompt) else None

    if earlier and (prompt := fitting(earlier + turn)) is not None:
        return prompt, 0  # the common case: it all fits
    starts = _turn_starts(earlier)
    overflows, fits, prompt = 0, len(starts) - 1, None  # leaving out `overflows` turns does not fit
    while fits - overflows > 1:
        middle = (overflows + fits) // 2
        if (tried := fitting(earlier[starts[middle]:] + turn)) is not None:
            prompt, fits = tried, middle
        else:
            overflows = middle
    if prompt is None:  # only leaving out every earlier turn is left to try
        prompt = prepare(turn)
    return prompt, fits


def _rounded(value):
    """Parameters as shown: floats to 6 decimals (``1.0 - 0.8 * 1.0`` is 0.19999999999999996)."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _path_of(part: dict) -> str | None:
    file = part.get("file") if isinstance(part.get("file"), dict) else part
    return str(file.get("path")) if file.get("path") else None


def _text_of(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p if isinstance(p, str) else p.get("text", "") for p in parts if isinstance(p, (str, dict)))


def _token_limit(value, ceiling: int) -> int:
    if isinstance(value, bool):  # JSON's true was int(True), one token (an outside pass)
        raise UserError(f"max answer tokens must be a whole number, got {value}")
    try:
        limit = int(value)
    except (TypeError, ValueError, OverflowError):  # None, "ten", NaN, Infinity
        raise UserError("max answer tokens must be a whole number") from None
    if limit != value and not (isinstance(value, str) and value.strip().isdigit()):  # 2.5 was used as 2
        raise UserError(f"max answer tokens must be a whole number, got {value}")
    if not 1 <= limit <= ceiling:
        raise UserError(f"max answer tokens must be between 1 and {ceiling} on this server")
    return limit


def _not_compared(why: str) -> str:
    """Under the metrics, why the compare box's unpruned run gave nothing to compare with (``why``: Markdown)."""
    return f"\n\n*not compared with the unpruned answer: {why}*"


def _error_text(error: Exception) -> str:
    if isinstance(error, UserError):  # its words may quote the user's file name or override
        return f"{ERROR_NOTE}{_literal(str(error))}"
    return (f"{ERROR_NOTE}internal error (a bug in Glimpse, not your input): {type(error).__name__}: "
            f"{_literal(str(error))}")
