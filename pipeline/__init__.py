"""Model loading, prompt building, the layer-by-layer prefill/decode engine, metrics.

The names below are imported when first used (PEP 562), not with the package: the engine brings transformers'
modeling code, about 5 s of imports on a 2-core CPU, and a command that only parses its arguments, or refuses a
file before loading a model (``glimpse --help``, ``glimpse ask`` with a missing image), never needs it.
``from glimpse.pipeline import load_engine`` works as before."""

import importlib

_HOMES = {
    "Engine": "engine", "GenerationResult": "engine", "StreamChunk": "engine",
    "ModelLoadError": "loading", "Preprocessor": "loading", "load_engine": "loading",
    "OutOfMemory": "out_of_memory", "PromptError": "prompt",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # glimpse's module, also when this folder is imported as SPEC's top-level `pipeline` from a checkout's root:
    # one engine class, not a second copy
    value = getattr(importlib.import_module(f"glimpse.pipeline.{home}"), name)
    globals()[name] = value  # found once: later lookups do not come here
    return value
