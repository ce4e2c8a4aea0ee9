"""The engine's settings: pool sizes, scheduling, the cache's format, and how the runner runs the model."""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence as Seq, Tuple, Union

from ..cascade import DEFAULT_MIN_SAVED_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_device_blocks: int = 512
    num_host_blocks: int = 512
    enable_prefix_caching: bool = True
    # A model with linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear):
    # the most sequences whose fixed-size states the device holds at once (one state slot
    # each, beside their blocks: docs/linear_attention.md), and the host swap pool's; None
    # for the host: as many as the device. Required for such a model, refused for others.
    num_state_slots: Optional[int] = None
    num_host_state_slots: Optional[int] = None
    # "swap" or "recompute"; swap had the higher throughput over bench/bench_engine.py's
    # preemption workloads (docs/engine.md).
    preemption_mode: str = "swap"
    max_num_batched_tokens: int = 4096  # tokens per step; prefills beyond decodes queue up
    watermark: float = 0.01             # pool share kept free at admission for decoding
    # Keep a token-level shadow of every block for check_invariants(deep=True): a
    # debugging aid that costs Python work per token, so off by default.
    record_block_contents: bool = False
    # The fields from here to decode_batch_sizes, and cascade_min_saved_tokens, say how the
    # runner runs the model: the transformers runner (engine/hf_runner.py) applies them; a
    # runner of another kind reads those it implements (docs/engine.md, "Model runners").
    # Decode steps (one token per sequence) through a compiled forward: torch.compile with
    # `compile_backend` on CPU, plus CUDA graphs per padded batch size on CUDA. Compiled
    # at engine creation; prefill and mixed steps stay eager (docs/engine.md).
    compile_decode: bool = False
    compile_backend: str = "inductor"
    # Inductor config set while the compiled decode compiles and runs (torch._inductor.config
    # names). On CPU {"freezing": True} is the fastest at small batches (weights folded in and
    # prepacked for oneDNN/MKL): it keeps a second, packed copy of the linear weights, and
    # refuses steps once the model's weights have changed (docs/engine.md).
    compile_options: Optional[Dict[str, Any]] = None
    max_decode_batch: int = 256  # larger decode batches run eager
    # Padded batch sizes; None: every size on CPU (dynamic shapes), vLLM's 1, 2, 4, 8, 16,
    # ... (multiples of 8) up to max_decode_batch on CUDA, one CUDA graph each.
    decode_batch_sizes: Optional[Tuple[int, ...]] = None
    # "auto" (the model's dtype), "fp8_e4m3" (or "fp8") or "fp8_e5m2" (docs/fp8.md), or a
    # per-token format, "int8_per_token_head" or "int4_per_token_head" (scales per token,
    # computed as each token is written: no k_scale, v_scale or calibration).
    kv_cache_dtype: str = "auto"
    # fp8: fixed scales (numbers: one for every layer, or one entry per layer, each a number
    # or a list of one per KV head). None: calibrated from the first forward's absolute maxima,
    # per layer or, with kv_scale_calibration="per_head", per KV head.
    k_scale: Optional[Union[float, Seq]] = None
    v_scale: Optional[Union[float, Seq]] = None
    kv_scale_calibration: str = "per_layer"
    # Sliding-window layers in KV groups of their own, which free the blocks that leave the
    # window (docs/kv_groups.md). False: one block table for every layer, each keeping every block
    # (as vLLM's disable_hybrid_kv_cache_manager; the baseline of bench/bench_kv_groups.py);
    # layers of different K/V shapes (Gemma-4) still get a group per shape.
    hybrid_kv_groups: bool = True
    # Cascade attention (docs/cascade.md): running sequences that share prefix
    # blocks (samples, beams, requests on one cached prompt) read them once per step where
    # that saves at least this many key reads ((sharers - 1) * prefix tokens); None: plain
    # attention only (the baseline of bench/bench_cascade.py).
    cascade_min_saved_tokens: Optional[int] = DEFAULT_MIN_SAVED_TOKENS

    @property
    def host_state_slots(self) -> Optional[int]:
        """The host swap pool's state slots (``num_host_state_slots``, or the device's)."""
        return self.num_state_slots if self.num_host_state_slots is None else self.num_host_state_slots
