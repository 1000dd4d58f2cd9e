"""Model loading, prompt building, the layer-by-layer prefill/decode engine, metrics."""

from glimpse.pipeline.engine import Engine, GenerationResult, StreamChunk
from glimpse.pipeline.loading import ModelLoadError, Preprocessor, load_engine
from glimpse.pipeline.out_of_memory import OutOfMemory
from glimpse.pipeline.prompt import PromptError

__all__ = ["Engine", "GenerationResult", "ModelLoadError", "OutOfMemory", "Preprocessor", "PromptError", "StreamChunk", "load_engine"]
