"""A reference serving engine: continuous batching over the block manager and the paged ops.

See docs/engine.md.
"""

from .config import EngineConfig
from .engine import LLMEngine, RequestOutput
from .model_runner import ModelRunner, ModelSpec, RunnerStats
from .params import Request, SamplingParams
from .transformers_oracle import generate_reference

__all__ = ["EngineConfig", "LLMEngine", "ModelRunner", "ModelSpec", "Request", "RequestOutput",
           "RunnerStats", "SamplingParams", "generate_reference"]
