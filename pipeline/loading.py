"""load_engine: a hub id or a local checkpoint folder (or 'embedded') -> a ready Engine."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from glimpse.common import UserError
from glimpse.pipeline.adapters import ADAPTERS, IMAGE
from glimpse.pipeline.calibrate_slider import SHIPPED_FRONTIER
from glimpse.pipeline.cpu_linear import use_cpu_linears
from glimpse.pipeline.profiles import (checkpoint_identity, load_profile, profile_matches, warn_file_once,
                                       warn_unusable)
from glimpse.pipeline.prompt import Prompt, PromptError, build_prompt, render
from glimpse.pruning.frontier import Frontier, uncalibrated_frontier

if TYPE_CHECKING:
    from glimpse.pipeline.engine import Engine


class ModelLoadError(UserError):
    """The model could not be found, is not a supported architecture, or failed to load."""


HUB_PROBE_TIMEOUT_S = 3.0
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def checkpoint_depth(model: str) -> int | None:
    """The decoder's depth from a local checkpoint's config.json, read before any weight loads, so that a layer
    number past the last one is refused before a 7B model takes its minute to load. None where it cannot be told
    that cheaply (the embedded model, a hub id, a config without it): the engine checks again with the model."""
    config = Path(model).expanduser() / "config.json"
    try:
        data = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    text = data.get("text_config")
    for part in ((text if isinstance(text, dict) else {}), data):
        depth = part.get("num_hidden_layers")
        if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0:
            return depth
    return None


def expected_frontier(model: str) -> Frontier | None:
    """The frontier ``load_engine`` will give ``auto`` on ``model``, told before any weight loads, so that a
    command can check ``auto``'s member overrides against the members this model's slider really picks (checked
    against the uncalibrated default, the documented ``divprune.keep`` was refused on the embedded model). None
    where it cannot be told cheaply (a hub id): the engine checks them once loaded."""
    if model == "embedded":
        from glimpse.pipeline import embedded

        source = embedded.checkpoint_dir()  # not there before the first use: then no calibration of it either
    else:
        source = Path(model).expanduser()
        if not source.is_dir():
            return None
    converted = source.is_dir()
    depth = checkpoint_depth(str(source)) if converted else None
    return slider_frontier(str(model), depth or -1, checkpoint_identity(str(source)) if converted else "")


def resolve_device(device: str = "auto") -> torch.device:
    """'auto': the GPU when there is one, else the CPU. A device this machine cannot compute on is the user's
    error, said before anything loads (torch would fail later, deep in the load, with an assertion)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelLoadError(f"--device {device}: this machine has no CUDA GPU that torch can use "
                                 "(use --device cpu, or auto)")
        if resolved.index is not None and resolved.index >= count:
            raise ModelLoadError(f"--device {device}: this machine has {count} CUDA GPU(s), numbered from 0")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"--device {device}: Apple's MPS is not available here (use --device cpu, or auto)")
    elif resolved.type not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"--device {device}: Glimpse runs on cpu, cuda or mps")
    return resolved


def resolve_attn(attn: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """'auto': flash_attention_2 when installed on CUDA and the weights are half precision, else sdpa. (flash-attention
    computes in half precision only: given float32 weights, transformers casts its inputs down with a warning, and
    the float32 the user asked for was not float32; an outside reading.)"""
    if attn == "auto":
        half = dtype in (torch.float16, torch.bfloat16)
        if device.type == "cuda" and half and importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return "sdpa"
    if attn not in ("sdpa", "eager", "flash_attention_2"):
        raise ModelLoadError(f"unknown attention backend {attn!r}: use auto, sdpa, eager or flash_attention_2")
    return attn


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, {', '.join(names)} or a torch.dtype")
    return names[dtype]


def load_engine(model: str = "embedded", device: str = "auto", attn: str = "auto",
                dtype: str | torch.dtype = "auto") -> Engine:
    """Load a checkpoint as an Engine: ``model`` is ``"embedded"`` (the default: the small model that ships with
    Glimpse and works offline), a hub id (``Qwen/Qwen2-VL-7B-Instruct``) or a folder, of Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL, LLaVA-1.5, LLaVA-NeXT or LongVA (converted: docs/models.md). ``device``: ``"auto"`` (the GPU when there
    is one), ``"cpu"``, ``"cuda"``, ``"cuda:N"``. ``attn``: ``"auto"`` (flash_attention_2 when installed on CUDA in
    half precision, else sdpa), ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``. ``dtype``: ``"auto"`` (bfloat16
    on a GPU, float32 on the CPU), ``"float32"``, ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``.
    Mistakes (a model that is not there, a device this machine lacks) raise ``ModelLoadError``, a ``UserError``."""
    # Imported here, with the model: the engine brings transformers' modeling code (seconds of imports), which the
    # checks a command makes before loading (``checkpoint_depth``, ``expected_frontier``) never need.
    from glimpse.pipeline.engine import Engine

    source, grounded, config = _checkpoint(model)
    chat_template = _chat_template(source, model)  # a damaged one is refused before the weights load
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    attn_implementation = resolve_attn(attn, torch_device, torch_dtype)

    def build(model_class):
        # Sizes that do not match are reported with the rest (``_check_weights``), not raised from deep inside.
        vlm, loading = model_class.from_pretrained(source, dtype=torch_dtype, attn_implementation=attn_implementation,
                                                   ignore_mismatched_sizes=True, output_loading_info=True)
        _check_weights(loading)
        return vlm.to(torch_device).eval()

    adapter = _adapter(model, source, config, build)
    if torch_device.type == "cpu":
        use_cpu_linears(adapter.model)  # decode 1.7-2.4x, prefill 1.8x faster on a CPU (pipeline/cpu_linear.py)
    engine = Engine(adapter, model_id=str(model), chat_template=chat_template, grounded=grounded)
    _check_chat_template(engine, model)
    engine.checkpoint = checkpoint_identity(source)
    profile = load_profile(str(model))
    if profile_matches(profile, engine.checkpoint, len(adapter.layers)):
        layers = profile.get("filter_layers")
        # Checked here, not at the first request: a profile edited by hand (no filter_layers, null, "5", 99) failed
        # every command for the model, --policy none included, as "a bug in Glimpse" (an outside pass).
        if (isinstance(layers, list) and layers
                and all(type(layer) is int and 0 <= layer < len(adapter.layers) for layer in layers)):
            engine.profiles["hidivdrop"] = {"filter_layers": tuple(layers)}
        else:
            warn_unusable(str(model), "hidivdrop", profile, len(adapter.layers),
                          damaged=f"filter_layers {layers!r}: not layer numbers of this {len(adapter.layers)}-layer "
                                  "model")
    elif profile is not None:
        warn_unusable(str(model), "hidivdrop", profile, len(adapter.layers))
    engine.frontier = slider_frontier(str(model), len(adapter.layers), engine.checkpoint)
    return engine


class Preprocessor:
    """The half of an engine that turns messages into a ``Prompt`` — tokenizer, chat template, image
    processor, frame sampling — with the model's modules on the meta device: no weights are read and no
    memory is taken. Batch captioning runs it in CPU tasks, apart from the model actors, and the actors'
    engines take the prompts as they are (``Engine.start`` accepts a ``Prompt``)."""

    def __init__(self, model: str = "embedded"):
        source, _, config = _checkpoint(model)

        def on_meta(cls):
            with torch.device("meta"):
                return cls._from_config(config).eval()

        self.adapter = _adapter(model, source, config, on_meta)
        self.chat_template = _chat_template(source, model)
        self.max_length = self.adapter.max_length

    def prepare(self, messages) -> Prompt:
        return build_prompt(self.adapter, messages, self.chat_template, self.max_length)


def _checkpoint(model: str):
    """(the checkpoint's folder or hub id, whether its answers are grounded, its config); the embedded model
    is converted into the cache on first use."""
    from transformers import AutoConfig

    grounded = True
    source = str(model)
    if source == "embedded":
        from glimpse.pipeline import embedded

        # Progress goes to stderr: stdout may carry `glimpse ask --json`'s one JSON object.
        source = str(embedded.embedded_checkpoint(progress=lambda line: print(line, file=sys.stderr, flush=True)))
        grounded = embedded.EMBEDDED_GROUNDED
    elif Path(source).expanduser().exists():  # a local folder: "~/llava" as the user wrote it
        source = str(Path(source).expanduser())
    if Path(source).is_file():
        raise ModelLoadError(f"model {model!r} is a file: give the checkpoint's folder (config.json, weights, "
                             "tokenizer) or a hub id")
    elif not Path(source).exists() and not _is_hub_id(source):  # "/data/llava", "./llava": a folder misnamed
        raise ModelLoadError(f"model {model!r}: no such folder (and not a hub id, organisation/name)")
    elif not Path(source).exists() and _is_hub_id(source) and not _hub_offline():
        if (unreachable := _hub_unreachable()) is not None:
            source = _cached_snapshot(source, unreachable)
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, StrictDataclassError) as error:  # (the last: a field of the wrong type)
        hint = "" if Path(source).exists() else " (not a local folder, and the model hub could not provide it)"
        raise ModelLoadError(f"cannot load model {model!r}{hint}: {_first_line(error)}") from None
    if config.model_type not in ADAPTERS:
        raise ModelLoadError(f"model {model!r} is a {config.model_type!r} checkpoint; Glimpse supports "
                             f"{', '.join(sorted(ADAPTERS))} (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-1.5, LLaVA-NeXT, LongVA)")
    if (why := ADAPTERS[config.model_type].unservable(config)) is not None:
        raise ModelLoadError(f"cannot load model {model!r}: {why}")
    return source, grounded, config


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as the hub client reads it ("1", "true", ...): then it looks only in its cache itself."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_unreachable() -> str | None:
    """Why the model hub cannot be reached from here, found in a few seconds (None: it can be, or a proxy
    decides): the hub client retries a host it cannot even resolve five times, 23 s, before saying so."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(f"{host}: {error.strerror or error}")

    # A thread, because name resolution itself takes no timeout and can hang on a broken resolver.
    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(HUB_PROBE_TIMEOUT_S + 1)
    return outcome[0] if outcome else f"{host}: no answer in {HUB_PROBE_TIMEOUT_S + 1:.0f} s"


def _cached_snapshot(repo_id: str, unreachable: str) -> str:
    """The local copy of hub model ``repo_id``, when the hub cannot be reached: its snapshot in the hub cache."""
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError) as error:  # LocalEntryNotFoundError is an OSError
        raise ModelLoadError(
            f"cannot load model {repo_id!r}: it is not a local folder, the model hub cannot be reached ({unreachable}) "
            f"and the hub cache ({constants.HF_HUB_CACHE}) has no copy of it: download it where the hub can be "
            f"reached (`hf download {repo_id}`) and pass its folder as --model, or set HF_HOME to a cache that has "
            "it") from error


def _adapter(model: str, source: str, config, build):
    """The architecture's adapter around ``build(model class)``, with the checkpoint's tokenizer and image
    processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    from safetensors import SafetensorError

    try:
        vlm = build(getattr(transformers, ADAPTERS[config.model_type].model_class))
        tokenizer = AutoTokenizer.from_pretrained(source)
        # PIL image processors everywhere: the reference behaviour, and torchvision-free.
        image_processor = AutoImageProcessor.from_pretrained(source, backend="pil")
    except (OSError, ValueError, ImportError, SafetensorError, pickle.UnpicklingError) as error:  # damaged files too
        raise ModelLoadError(f"cannot load model {model!r}: {_first_line(error)}") from None
    if len(tokenizer) < 2:  # a folder without tokenizer files loads an empty one, which fails at the first prompt
        raise ModelLoadError(f"cannot load model {model!r}: it has no tokenizer (tokenizer.json or the files of its "
                             "tokenizer are missing)")
    return ADAPTERS[config.model_type](vlm, tokenizer, image_processor)


def _check_weights(loading: dict) -> None:
    """Refuse (ValueError, which ``_adapter`` says as a ``ModelLoadError``) weights that do not fill the model
    ``config.json`` describes: transformers fills what is missing with random values and says so in a log line, and
    the model answered gibberish with exit status 0 (an outside pass: a checkpoint in the original LLaVA code's
    layout, another architecture's weights, a config with more layers or wider ones than its weights)."""
    missing, mismatched = list(loading.get("missing_keys") or ()), list(loading.get("mismatched_keys") or ())
    if not (missing or mismatched):
        return
    said = []
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        said.append(f"{len(missing)} weights are missing ({', '.join(sorted(missing)[:3])}{more})")
    if mismatched:
        names = sorted(str(entry[0] if isinstance(entry, tuple) else entry) for entry in mismatched)
        said.append(f"{len(mismatched)} have other shapes than config.json says ({', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''})")
    raise ValueError(f"its weights do not fit its config.json: {'; '.join(said)}. A checkpoint of the original LLaVA "
                     "code base is laid out otherwise: use its llava-hf/ conversion (docs/models.md)")


def local_frontier(model: str, num_layers: int, checkpoint: str) -> Frontier | None:
    """The frontier ``glimpse calibrate slider`` stored for this model, if it was measured on these weights
    (complete or not); None if there is none, or it is damaged."""
    profile = load_profile(model, "slider")
    if profile is None:
        return None
    if not profile_matches(profile, checkpoint, num_layers):
        warn_unusable(model, "slider", profile, num_layers)
        return None
    try:
        return stored_frontier(profile)
    except ValueError as error:  # damaged: as if there were none, and said
        warn_unusable(model, "slider", profile, num_layers, damaged=f"not a whole frontier: {error}")
        return None


def stored_frontier(profile) -> Frontier:
    """A frontier read from a file, checked (``Point.check``, and that it runs only policies Glimpse has): a
    ValueError, whatever is wrong, where the data cannot be what a calibration wrote."""
    from glimpse.pruning import POLICIES

    try:
        frontier = Frontier.from_json(profile, calibrated=True)
    except (KeyError, TypeError, AttributeError) as error:  # a key missing, a value or the whole of another type
        raise ValueError(str(error)) from None
    unknown = {member.policy for point in frontier.points + frontier.measured for member in point.members}
    if unknown - set(POLICIES):
        raise ValueError(f"no policy named {', '.join(sorted(unknown - set(POLICIES)))}")
    return frontier


def slider_frontier(model: str, num_layers: int, checkpoint: str) -> Frontier:
    """What ``auto`` runs on this model: its own calibrated frontier (``glimpse calibrate slider``) when
    it was measured on these weights (``checkpoint``, see ``profiles.checkpoint_identity``), else for the
    embedded model the frontier that ships with Glimpse when it was measured on the trained files that
    ship beside it, else the uncalibrated default. A calibration cut short by its budget (``unmeasured``) does not
    replace the complete one that ships: it would run cheaper candidates it never got to compare (an 8-of-71 run
    made speed 1 a 1.7x LazyLLM that answered "Green." for a purple circle, where the shipped frontier runs 3.5x
    DivPrune and says "Purple."); it is used where nothing complete is there."""
    local = local_frontier(model, num_layers, checkpoint)
    if local is not None and not local.unmeasured:
        return local
    if model == "embedded" and SHIPPED_FRONTIER.exists():
        from glimpse.pipeline import embedded

        try:
            shipped = json.loads(SHIPPED_FRONTIER.read_text())
            if not isinstance(shipped, dict) or shipped.get("weights") == embedded.checkpoint_name():
                return stored_frontier(shipped)
        except (OSError, ValueError) as error:
            # A damaged install (or a maintainer's --out over it gone wrong) leaves auto uncalibrated, and says so.
            warn_file_once(SHIPPED_FRONTIER, f"ignoring the frontier that ships, {SHIPPED_FRONTIER} ({error}): auto "
                                             "runs the uncalibrated default")
    return local or uncalibrated_frontier()


def _chat_template(source: str, model: str = "") -> str | None:
    """The processor-level chat template if the checkpoint has one, else None (the tokenizer's). The embedded
    model's is Glimpse's own (``embedded.CHAT_TEMPLATE``), whatever a conversion cached before it changed."""
    from transformers.utils import cached_file

    if model == "embedded":
        from glimpse.pipeline import embedded

        return embedded.CHAT_TEMPLATE

    # In transformers' order: its processor takes the legacy chat_template.json whenever there is one, so a checkpoint
    # holding both is prompted as transformers prompts it (the .jinja came first here; an outside pass).
    for name in ("chat_template.json", "chat_template.jinja"):
        try:
            path = cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
        except OSError:
            path = None
        if path and os.path.exists(path):
            text = Path(path).read_text()
            if name.endswith(".jinja"):
                return text
            try:
                template = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError) as error:  # (it was "a bug in Glimpse", after the weights loaded)
                raise ModelLoadError(f"cannot load model {model or source!r}: its {name} holds no chat template "
                                     f"({type(error).__name__}: {_first_line(error)})") from None
            if not isinstance(template, str):
                raise ModelLoadError(f"cannot load model {model or source!r}: the chat_template of its {name} is "
                                     f"not text")
            return template
    return None


def _check_chat_template(engine, model: str) -> None:
    """Render a question about a picture with the checkpoint's chat template, as every request will: a template
    that cannot (a Jinja syntax error, an undefined name) or that writes nothing is refused as the model loads
    (every request failed, as "a bug in Glimpse", or with an IndexError; an outside pass)."""
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    placeholders = {"image": engine.adapter.placeholder(IMAGE)}
    try:
        text = render(engine.tokenizer, engine.chat_template, question, placeholders)
    except PromptError as error:  # (``render`` says a Jinja error as one)
        raise ModelLoadError(f"cannot load model {model!r}: its chat template cannot write a question: {error}") \
            from None
    if not text.strip():
        raise ModelLoadError(f"cannot load model {model!r}: its chat template writes nothing for a question")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
