"""Model loading, prompt building, the layer-by-layer prefill/decode engine, metrics."""

from pipeline.engine import Engine, GenerationResult, StreamChunk
from pipeline.loading import ModelLoadError, Preprocessor, load_engine
from pipeline.prompt import PromptError

__all__ = ["Engine", "GenerationResult", "ModelLoadError", "Preprocessor", "PromptError", "StreamChunk", "load_engine"]
