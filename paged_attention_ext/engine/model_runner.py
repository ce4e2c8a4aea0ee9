"""What the engine needs from a model: the KV layout to allocate, and one forward per step.

The engine sizes the paged KV cache from the runner's :class:`ModelSpec`, creates it, and
hands it to :meth:`ModelRunner.bind`; each step it passes the scheduler's placement
(:class:`~paged_attention_ext.engine.scheduler.SchedulerOutput`) to
:meth:`ModelRunner.forward` and samples from the logits that come back. The runner never
calls back into the engine or the scheduler. The transformers implementation is
:class:`~paged_attention_ext.engine.hf_runner.HFModelRunner`.
"""

import abc
from dataclasses import dataclass, fields
from typing import Hashable, List, Optional, Tuple

import torch

from ..kv_cache import PagedKVCache
from ..kv_groups import Window
from ..state_cache import StatePools
from .config import EngineConfig
from .scheduler import SchedulerOutput

# EngineConfig's settings of the compiled decode: without compile_decode no runner reads them.
COMPILED_DECODE_SETTINGS = ("compile_backend", "compile_options", "max_decode_batch",
                            "decode_batch_sizes")


@dataclass(frozen=True)
class ModelSpec:
    """The model's facts the engine allocates and validates by."""

    # Per layer: its sliding window, a kv_groups.Chunked span (chunked local attention) or
    # None (full attention).
    layer_windows: Tuple[Window, ...]
    num_kv_heads: int
    head_size: int                   # of the keys
    head_size_v: Optional[int]       # of the values; None: head_size (MLA's differ)
    dtype: torch.dtype               # the activations': the cache's unless kv_cache_dtype quantizes
    device: torch.device
    vocab_size: int                  # prompts' tokens must be below it
    # Per layer (kv heads, key size, value size) where layers differ (Gemma-4); None: the
    # three fields above serve every layer.
    layer_shapes: Optional[Tuple[Tuple[int, int, int], ...]] = None
    # (layer, source layer): layers that store no K/V and attend over their source's.
    kv_readers: Tuple[Tuple[int, int], ...] = ()
    # MLA latent rows: one KV head whose first head_size_v columns are the values
    # (PagedKVCache(values_in_keys=True)), so a block holds each token's row once.
    values_in_keys: bool = False
    # Layers that keep no K/V but a fixed-size state per sequence (a hybrid model's linear
    # attention), and the states one sequence keeps in them: (key, shape, dtype) each, one
    # row of a StatePools tensor per state slot.
    linear_layers: Tuple[int, ...] = ()
    linear_states: Tuple[Tuple[Hashable, Tuple[int, ...], torch.dtype], ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)


@dataclass(frozen=True)
class RunnerStats:
    """The runner's counters in :meth:`LLMEngine.report`."""

    cascade_steps: int = 0            # steps that read shared prefixes once (cascade attention)
    cascade_saved_key_reads: int = 0  # key reads (per layer and KV head) that saved
    compiled_decode_steps: Optional[int] = None  # None: the runner has no compiled decode
    compile_and_warmup_s: Optional[float] = None


class ModelRunner(abc.ABC):
    """A model the engine can serve.

    Subclasses pass their :class:`ModelSpec` to ``__init__``; the engine then calls
    :meth:`bind` once, before any :meth:`forward`.
    """

    # Whether bind() applies EngineConfig.compile_decode (a runner that does not refuses it).
    compiles_decode = False

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.kv_cache: Optional[PagedKVCache] = None
        self.states: Optional[StatePools] = None

    def bind(self, kv_cache: PagedKVCache, config: EngineConfig,
             states: Optional[StatePools] = None) -> None:
        """Take the pools the forwards write and read, built from :attr:`spec` (``states``:
        the linear layers' state pools, for a spec with ``linear_layers``); ``config``
        carries the settings of how to run the model (compiled decode, cascade attention),
        of which a runner applies those it implements: the base class refuses
        ``compile_decode`` for a runner without one (``compiles_decode``), and the compiled
        decode's settings without ``compile_decode`` (they would be ignored)."""
        if not config.compile_decode:
            changed = [f.name for f in fields(config)
                       if f.name in COMPILED_DECODE_SETTINGS and getattr(config, f.name) != f.default]
            if changed:
                raise ValueError(f"{', '.join(changed)}: settings of the compiled decode, which "
                                 "is off; set compile_decode=True or leave them at their defaults")
        if config.compile_decode and not self.compiles_decode:
            raise NotImplementedError(f"{type(self).__name__} has no compiled decode; "
                                      "compile_decode=True needs a runner that has one "
                                      "(engine/hf_runner.py)")
        self.kv_cache = kv_cache
        self.states = states

    @abc.abstractmethod
    def forward(self, step: SchedulerOutput) -> List[torch.Tensor]:
        """Per scheduled group, fp32 logits ``[live sequences, vocab]`` of each live
        sequence's last token, its uncomputed tokens (``token_ids[num_computed:]``)
        written at ``step.slots`` and its context read through ``step.tables`` (both per
        KV group); a spec with ``linear_layers`` runs them from ``step.state_slots``.
        Nothing it computes for the linear layers may reach the state pools before
        :meth:`commit`."""

    def commit(self) -> None:
        """The engine adopted the last forward's step: store what cannot be computed twice
        (the linear layers' new states). A step that fails before this call leaves every
        state as it was, and the engine runs it again."""

    def stats(self) -> RunnerStats:
        return RunnerStats()
