"""A reference serving engine: continuous batching over the block manager and the paged ops.

See docs/engine.md.
"""

from .engine import EngineConfig, LLMEngine, RequestOutput
from .params import Request, SamplingParams
from .transformers_oracle import generate_reference

__all__ = ["EngineConfig", "LLMEngine", "Request", "RequestOutput", "SamplingParams",
           "generate_reference"]
