"""A transformers ``Cache`` that keeps keys and values in paged pools.

:class:`PagedCache` (eager forwards) and :class:`~paged_attention_ext.hf.compiled_cache.CompiledPagedCache`
(``max_cache_len``: fixed pools and metadata for ``torch.compile``) are two classes over
shared parts, each in its own module:

* :mod:`.placement`: the rows' sequences in a block manager (slots, copy-on-write, prefix
  hits by K/V fingerprints, beam forks, the room checks);
* :mod:`.forward_state`: whether the stored history is whole (the layers of each forward);
* :mod:`.handoff`: the mask function's and ``update``'s hand-offs to the next hook;
* :class:`.batch.PagedBatch`: what the attention function reads for one forward (its
  :class:`~paged_attention_ext.step_inputs.StepInputs`, built once per forward).

``update`` (called by every attention layer with the new tokens' K/V) stores them with
``paged.write_kv``; layer 0's call also places the forward's new tokens. Left padding:
padding tokens get no slot (never stored) and no query row. Beam search: ``reorder_cache``
forks the chosen rows' block tables and frees the old ones; a shared partial block is
copied on the next append (copy-on-write). Sliding-window layers sit in KV groups of their
own (:mod:`paged_attention_ext.kv_groups`): a row has one block table per group, and a
sliding group frees the blocks its window has left. MLA models (DeepSeek-V2/V3): ``update``
gets compressed latents and stores them as they are, one row per token; the attention
function absorbs ``kv_b_proj`` (:class:`LayerStorage`, :mod:`.latent_attention`). Hybrid
models with linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear): those
layers store no K/V; their states sit in state pools, one slot per row (:mod:`.linear_states`).
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import transformers
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..block_table import blocks_needed, check_window
from ..cascade import DEFAULT_MIN_SAVED_TOKENS
from ..kv_cache import LayerScales, PagedKVCache, check_int
from ..kv_groups import KVGroupLayout
from ..quantization import kv_cache_dtype as resolve_kv_cache_dtype
from ..step_inputs import StepInputs, StepPlan
from .batch import PagedBatch, flat_tokens, real_query_rows
from .forward_state import ForwardState
from .handoff import (ATTN_IMPLEMENTATION, LayerCall, drop_calls_of, pending_call, publish_layer_call,
                      publish_source_call, take_padding_mask)
from .latent_attention import write_latent_rows
from .linear_states import LINEAR_ATTENTION, LinearStates, state_pool_summary
from .placement import RowLimit, RowPlacement, new_token_counts
from .support import (check_config, check_mla_storage, kv_head_shape, kv_readers, layer_shapes,
                      layer_windows, mla_latent_shape)
from .transformers_behaviour import LINEAR_LAYERS_ROLL_BACK

_POOL_GROWTH = 1.25  # a growing pool copies itself rarely and leaves at most a fifth unused

# (kv heads, key size, value size, dtype, device): the shape of every layer's pools.
PoolSpec = Tuple[int, int, int, torch.dtype, torch.device]


class LayerStorage(NamedTuple):
    """Who stores a layer's K/V, in what form, and the pools' head shape the config gives.

    MLA models hand ``update`` their compressed latents (the normalised ``kv_lora_rank``
    latent and the rotated key part). ``"latent"`` stores those: one row per token, the
    latent then the rotary key, read by the attention function with ``kv_b_proj``
    absorbed (:mod:`.latent_attention`). ``"expanded"`` lets the attention function store
    the per-head keys and values transformers expands from them.
    """
    in_attention: bool  # the attention function stores the expanded K/V
    latent: bool  # the pools hold latent rows (values in the keys' rows)
    config_shape: Tuple[int, int, int]  # kv heads (this rank's share), key size, value size

    @classmethod
    def of(cls, text_config, tp_size: int, mla_storage: str) -> "LayerStorage":
        check_mla_storage("PagedCache", mla_storage)
        latent = mla_latent_shape(text_config)
        if latent is not None and mla_storage == "latent":
            return cls(False, True, tuple(latent))
        shapes = layer_shapes(text_config, tp_size)  # layers of several shapes: layer 0's
        shape = shapes[0] if shapes is not None else kv_head_shape(text_config, tp_size)
        return cls(latent is not None, False, tuple(shape))

    def pool_shape(self, keys: torch.Tensor, values: torch.Tensor) -> Tuple[int, int, int]:
        """The pools' head shape for what update() got (MLA: the config's)."""
        if self.in_attention or self.latent:
            return self.config_shape
        return (keys.shape[1], keys.shape[3], values.shape[3])

    def handoff_key(self, keys: torch.Tensor) -> Optional[torch.Tensor]:
        """What identifies the attention call (MLA: the layer alone; its keys are new)."""
        return None if self.in_attention or self.latent else keys


class PagedCache(Cache):
    """A transformers ``Cache`` storing K/V in paged blocks with sharing and copy-on-write.

    Use with a model loaded or built with ``attn_implementation="paged_attention_ext"``::

        model.generate(input_ids, past_key_values=PagedCache(model.config), ...)

    Args:
        config: the model's config (layer count and layer types).
        block_size: tokens per block (>= 1).
        num_blocks: a fixed pool size in blocks (``NoFreeBlocksError`` when exhausted). A
            model with sliding-window layers has several KV groups (``kv_groups``): a block
            then holds one group's layers, and each row takes blocks in every group.
            ``None`` sizes the pool to what is in use, growing it by a quarter when needed, up
            to ``batch * ceil(max_seq_len / block_size)`` blocks per KV group.
        enable_prefix_caching: share the full blocks of identical prompt prefixes (the forward
            still computes every prompt token, so a hybrid model's linear-attention states are
            right: docs/linear_attention.md).
        max_seq_len: with ``num_blocks=None``, the most tokens (prompt and generated) a row
            may hold; ``None`` takes the config's ``max_position_embeddings``. A forward past
            it raises ``ValueError`` before anything changes.
        kv_cache_dtype: ``"auto"`` (the model's dtype), ``"fp8_e4m3"`` (also ``"fp8"``) or
            ``"fp8_e5m2"``: store K/V in 8 bits (docs/fp8.md).
        k_scale, v_scale: fp8 only: fixed scales (stored = K / k_scale), for every layer one
            number or float tensor of 1 or ``num_kv_heads`` elements, or a sequence of one per
            layer. None (both): calibrated from the first forward, per layer, as the absolute
            maximum of the keys (values) that layer stores divided by the format's largest
            value (``kv_scale_calibration="per_head"``: one per KV head). Later values beyond
            that range saturate; pass fixed scales for generations whose prompt is not
            representative.
        mla_storage: for multi-head latent attention models (DeepSeek-V2/V3, Kimi, ...):
            ``"latent"`` stores each token's compressed latent once (``kv_lora_rank +
            qk_rope_head_dim`` values, shared by every head: DeepSeek-V3 keeps 71x fewer
            bytes than its expanded K/V) and attends with ``kv_b_proj`` absorbed into the
            query and the output; ``"expanded"`` stores the per-head K/V transformers
            expands (for a ``kv_b_proj`` that is not a plain ``nn.Linear``, such as a
            quantized one). Other models ignore it.
        cascade_min_saved_tokens: rows that share prompt blocks (``num_return_sequences``,
            beams, repeated prompts) read them once per decode step (cascade attention,
            :mod:`paged_attention_ext.cascade`) where that saves at least this many key
            reads per step; ``None``: plain attention only. The tokens are the same.

    For ``torch.compile`` (fixed pools and metadata) use :class:`CompiledPagedCache`
    instead (``CompiledPagedCache(config, max_cache_len=...)``).

    The pools take the dtype, device and head shapes (key and value head sizes may differ)
    of the first keys and values stored. One instance serves one ``generate`` call (or
    ``reset()`` it).

    Errors: an unsupported architecture raises ``NotImplementedError`` here; a model whose
    attention is not ``paged_attention_ext`` raises ``ValueError`` here or ``RuntimeError``
    at its next ``update``. An exception during the first forward leaves the cache as new
    (one that struck between layers is reported once more by the next ``update``); one
    during a later forward (or a forward stopped by an exception elsewhere in the model)
    makes every later ``update`` raise until ``reset()``, which always works, as do
    ``memory_usage()`` and ``get_seq_length()``.
    """

    def __init__(self, config: PretrainedConfig, block_size: int = 16, num_blocks: Optional[int] = None,
                 enable_prefix_caching: bool = True, max_seq_len: Optional[int] = None,
                 kv_cache_dtype: Optional[str] = "auto", k_scale: Optional[LayerScales] = None,
                 v_scale: Optional[LayerScales] = None, kv_scale_calibration: str = "per_layer",
                 *, cascade_min_saved_tokens: Optional[int] = DEFAULT_MIN_SAVED_TOKENS,
                 mla_storage: str = "latent", **unknown) -> None:
        _refuse_unknown(unknown)
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"PagedCache: config must be a transformers PretrainedConfig (the "
                            f"model's config), got {type(config).__name__}")
        check_int("PagedCache: block_size", block_size, 1)
        check_int("PagedCache: num_blocks", num_blocks, 1, optional=True)
        check_int("PagedCache: max_seq_len", max_seq_len, 1, optional=True)
        check_int("PagedCache: cascade_min_saved_tokens", cascade_min_saved_tokens, 1, optional=True)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"PagedCache: enable_prefix_caching must be a bool, got "
                            f"{type(enable_prefix_caching).__name__}")
        text_config = config.get_text_config(decoder=True)
        layer_types = check_config(config, text_config)
        super().__init__(layers=[])  # one set of block tables serves every layer
        self._config = text_config
        self._check_attn_implementation(ValueError)
        self.layer_types: List[str] = layer_types
        # Tensor parallel (transformers' tp_plan): each rank's attention gets its share of the
        # heads, and its pools hold that share (as transformers' StaticCache sizes itself).
        tp_size: int = getattr(getattr(config, "distributed_config", None), "tp_size", None) or 1
        readers = kv_readers(text_config, layer_types)
        linear = [i for i, kind in enumerate(layer_types) if kind == LINEAR_ATTENTION]
        # The layers that call update(), in order: a hybrid model's linear layers keep states
        # instead, and KV-shared layers read their source's K/V.
        self._kv_layers = [i for i in range(len(layer_types)) if i not in readers and i not in linear]
        self.is_hybrid_linear = bool(linear)
        self.kv_groups = KVGroupLayout.from_windows(layer_windows(text_config, layer_types),
                                                    layer_shapes(text_config, tp_size), readers,
                                                    without_kv=linear)
        for window in self.kv_groups.windows:  # a chunk must be whole blocks
            check_window(window, block_size)
        self._sources = frozenset(readers.values())
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_positions: Optional[int] = getattr(text_config, "max_position_embeddings", None)
        self.max_seq_len = max_seq_len
        self._cascade_min_saved_tokens = cascade_min_saved_tokens
        self._kv_options = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                                calibration=kv_scale_calibration)
        self._storage = LayerStorage.of(text_config, tp_size, mla_storage)
        # Bad cache options (format, scale shapes, calibration, an int4 cache of odd head
        # size) raise here: a one-block pool.
        self._new_pool(1, self._storage.config_shape + (torch.float32, torch.device("cpu")))
        self._clear()

    def _clear(self) -> None:
        self._placement: Optional[RowPlacement] = None  # created by the first forward
        self.kv: Optional[PagedKVCache] = None
        self._length = 0  # columns seen per row, padding included (transformers' seq length)
        self._forward_len = 0  # columns the forward in flight adds
        self._batch: Optional[PagedBatch] = None
        self._pool_spec: Optional[PoolSpec] = None
        self._state = ForwardState(len(self._kv_layers))
        self._linear = LinearStates(self.layer_types) if self.is_hybrid_linear else None
        self.layers = self._linear.layers if self._linear is not None else []
        self.cascade_forwards = 0  # forwards whose shared prompt blocks were read once (cascade)
        drop_calls_of(self)

    @property
    def manager(self):
        """The rows' :class:`~paged_attention_ext.block_manager.BlockSpaceManager` (None
        before the first forward)."""
        return self._placement.manager if self._placement is not None else None

    @property
    def rows(self) -> List[Optional[int]]:
        """Each batch row's sequence id in :attr:`manager` (None: no token yet)."""
        return self._placement.rows if self._placement is not None else []

    def _check_attn_implementation(self, error: type) -> None:
        implementation = getattr(self._config, "_attn_implementation", None)
        if implementation is not None and implementation != ATTN_IMPLEMENTATION:
            raise error(
                f"PagedCache needs a model that runs attn_implementation={ATTN_IMPLEMENTATION!r}; "
                f"this config says {implementation!r}, with which the model would attend only to "
                "the new tokens (different output, no error). Load or build the model with "
                f"attn_implementation={ATTN_IMPLEMENTATION!r} (note: from_config writes "
                "attn_implementation into the config object it is given, so building another "
                "model from the same config object switches this one too).")

    # ---- the transformers Cache interface ------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V (``[batch, kv_heads, q_len, head_size]``) in the pools.

        Returns its inputs unchanged: attention reads the history from the pools.
        """
        self._check_call(layer_idx)
        first = layer_idx == self._kv_layers[0]
        plan = self._plan_forward(key_states, value_states) if first else None
        return self._store_layer(layer_idx, key_states, value_states, plan)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        """A linear-attention layer's last call of a forward: its states go to the rows' slots."""
        self._state.check_usable()
        stored = super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        self._linear.stored(layer_idx)
        return stored

    def _store_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                     plan: Optional[Tuple[List[int], PoolSpec]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first K/V layer begins the forward; every layer stores its K/V and hands its
        call on. A failure from here on leaves the history partly written (:meth:`_fail`)."""
        try:
            if layer_idx == self._kv_layers[0]:
                self._begin_forward(keys, values, plan)
            self._write_layer(layer_idx, keys, values)
        except BaseException as error:
            self._fail(f"layer {layer_idx}'s update raised {type(error).__name__}: {error}")
            raise
        self._finish_layer(layer_idx, keys)
        return keys, values

    def _write_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's new K/V at the prepared slots (MLA latent rows: the latent and
        the rotary key; MLA expanded: the attention function does)."""
        if self._storage.latent:
            write_latent_rows(self.kv, layer_idx, keys, values, self._batch.slots_of(layer_idx))
        elif not self._storage.in_attention:
            self._check_layer_shapes(layer_idx, keys, values)
            self.kv.write(layer_idx, flat_tokens(keys), flat_tokens(values),
                          self._batch.slots_of(layer_idx))

    def _finish_layer(self, layer_idx: int, keys: torch.Tensor) -> None:
        """Count the layer stored and hand the attention function its call."""
        if not self._storage.in_attention:
            self._state.layer_stored()
        call = LayerCall(self, layer_idx, self._storage.handoff_key(keys), self._batch)
        publish_layer_call(call)
        if layer_idx in self._sources:
            publish_source_call(call)  # the layers that read its K/V take the batch with it

    def _count_stored(self, layer_idx: int) -> None:
        """MLA: the attention function stored layer ``layer_idx``'s expanded K/V (so a
        failure before that is seen)."""
        self._state.layer_stored()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns per row that ``layer_idx`` has stored: during a forward, a layer not yet
        updated has not seen its tokens (Llama-4's NoPE layers read their query positions
        from this before their update, as from a DynamicCache)."""
        if self._state.interrupted and layer_idx >= self._state.layers_stored:
            return self._length - self._forward_len
        return self._length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, int]:
        return self._length + query_length, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues old row ``beam_idx[i]`` (table forks, no copy)."""
        self._select_rows(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self.rows)) for _ in range(repeats)])

    def reset(self) -> None:
        """Free every row's blocks and drop the pools: the cache is as new (always works)."""
        if self._placement is not None:
            self._placement.free_all()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every row (assisted and prompt-lookup decoding discard the
        candidates the model rejected): blocks past the new end are freed, the partial one
        is kept. ``tokens_to_remove <= 0`` removes that many; a positive value is
        transformers' older form, the length to keep. A hybrid model's linear-attention
        layers restore the states they recorded (:meth:`activate_past_recording`)."""
        if self._linear is not None:
            self._check_linear_recording("crop")
        remove = self._tokens_to_crop(tokens_to_remove)
        if self._linear is not None:
            self._linear.cropped(remove)  # crop(0) too: a recording window shrinks back
        if remove == 0:
            return
        self._placement.remove_last(remove)
        self._length -= remove

    def _tokens_to_crop(self, tokens_to_remove: int) -> int:
        """How many tokens :meth:`crop` removes from every row (checked; nothing changes)."""
        self._state.check_usable("crop")
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"PagedCache.crop: tokens_to_remove must be an int, got "
                            f"{tokens_to_remove!r}")
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self._length - tokens_to_remove)
        if remove > self._length:
            raise ValueError(f"PagedCache.crop: cannot remove {remove} tokens, rows hold "
                             f"{self._length} columns")
        return remove

    # Assisted and multi-token-prediction decoding ask a cache to record past states so that
    # crop() can restore them; paged K/V crops at any time. A hybrid model's linear layers
    # (transformers' own) record their states' past themselves.
    def activate_past_recording(self, **kwargs) -> None:
        """K/V need nothing recorded (:meth:`crop` frees or keeps blocks at any time); a
        hybrid model's linear-attention layers record their states' past (transformers >=
        5.25, whose layers can restore a recurrent state)."""
        if self._linear is None:
            return
        self._check_linear_recording("record past states (assisted or multi-token-prediction "
                                     "decoding)")
        for layer_idx in self._linear.layer_ids:
            self.layers[layer_idx].activate_past_recording(**kwargs)

    def _check_linear_recording(self, action: str) -> None:
        if not LINEAR_LAYERS_ROLL_BACK:
            raise NotImplementedError(
                f"PagedCache cannot {action} for a model with linear-attention layers on "
                f"transformers {transformers.__version__}: its linear-attention layers keep no "
                "past recurrent states, so rejected candidate tokens cannot be undone (its own "
                "generate refuses assisted decoding for these models). Use transformers >= 5.25, "
                "or generate without an assistant model or prompt lookup.")

    def is_recording_past(self, layer_idx: int) -> bool:
        """Whether linear-attention layer ``layer_idx`` records its states' past."""
        layer = self.layers[layer_idx] if self._linear is not None else None
        return bool(getattr(layer, "record_past", False))

    def get_recurrent_states_to_keep(self, layer_idx: Optional[int] = None) -> int:
        """Recurrent states of a forward's last positions a recording layer keeps (the most
        of any layer for None), as transformers' caches answer it."""
        if self._linear is None:
            return 0
        layers = self._linear.layer_ids if layer_idx is None else [layer_idx]
        return max([getattr(self.layers[i], "recurrent_states_to_keep", 0) or 0
                    for i in layers if self.is_recording_past(i)], default=0)

    def early_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError("PagedCache allocates its pools on the first forward")

    def __len__(self) -> int:
        return len(self.layer_types)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` restores every layer: K/V always; linear-attention states
        where transformers' layers restore them (they are asked to record first)."""
        return not self.is_hybrid_linear or LINEAR_LAYERS_ROLL_BACK

    @property
    def is_initialized(self) -> bool:
        return self._placement is not None

    @property
    def is_sliding(self) -> List[bool]:
        return [t == "sliding_attention" for t in self.layer_types]

    # Every layer is attention over K/V (generate skips the eager mask creation, the compile
    # mode's preparation, for a cache whose layers are all linear or dummy).
    @property
    def is_linear(self) -> List[bool]:
        return [kind == LINEAR_ATTENTION for kind in self.layer_types]

    @property
    def is_dummy(self) -> List[bool]:
        return [False] * len(self.layer_types)

    @property
    def batch_size(self) -> int:
        return len(self.rows) if self.rows else -1

    # ---- reporting -----------------------------------------------------------------------
    def memory_usage(self) -> Dict[str, int]:
        """Bytes the pools hold and bytes in used blocks, and the block counts behind them.

        ``block_references`` counts every row's blocks; the difference to ``blocks_used``
        is what sharing (prefix hits, beam forks) saves.
        """
        states = {} if self._linear is None else state_pool_summary(
            self._linear.pools, self.manager.states.num_used if self._placement is not None else 0)
        if self._placement is None:
            return {"pool_bytes": 0, "used_bytes": 0, "blocks_used": 0, "block_references": 0, **states}
        used = self.manager.num_used_device_blocks
        block_bytes = self.kv.block_bytes if self.kv is not None else 0
        return {
            "pool_bytes": self.kv.num_blocks * block_bytes if self.kv is not None else 0,
            "used_bytes": used * block_bytes,
            "blocks_used": used,
            "block_references": self._placement.block_references(),
            **states,
        }

    # ---- consistency -----------------------------------------------------------------------
    def _check_call(self, layer_idx: int) -> None:
        """Refuse an update that would store K/V next to an inconsistent history."""
        self._state.check_usable()
        readers = dict(self.kv_groups.readers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not (
                0 <= layer_idx < len(self.layer_types)) or (
                    layer_idx not in self._kv_layers and layer_idx not in readers):
            raise ValueError(f"PagedCache: layer_idx {layer_idx!r} is not a K/V layer of this config "
                             f"({len(self.layer_types)} layers, K/V layers {self._kv_layers})")
        first = layer_idx == self._kv_layers[0]
        if first and self._batch is not None and self._state.interrupted:
            self._refuse(self._state.interruption())
        if first and self._linear is not None and not self._linear.whole(
                self._state.forwards_done, self._kv_layers[0]):
            self._refuse("a previous forward stopped before every linear-attention layer stored "
                         "its states (an exception interrupted it), so the rows' states are only "
                         "partly updated")
        call = pending_call(self)
        if call is not None:
            self._refuse(f"the attention of layer {call.layer_idx} did not read the paged cache: the "
                         f"model does not run attn_implementation={ATTN_IMPLEMENTATION!r} (it would "
                         "attend only to the new tokens and generate different tokens). Load or build "
                         f"the model with attn_implementation={ATTN_IMPLEMENTATION!r}")
        if layer_idx not in self._kv_layers:  # a KV-shared layer (the check above let it by)
            raise RuntimeError(f"PagedCache: layer {layer_idx} reads layer {readers[layer_idx]}'s "
                               "K/V (num_kv_shared_layers) and stores none of its own")
        if first:
            self._check_attn_implementation(RuntimeError)
        elif self._batch is None or self._state.layers_stored >= len(self._kv_layers) or (
                layer_idx != self._kv_layers[self._state.layers_stored]):
            raise RuntimeError(f"PagedCache: layer {layer_idx} stored K/V out of order (after "
                               f"{self._state.layers_stored} layers of this forward; layer "
                               f"{self._kv_layers[0]} comes first)")

    def _refuse(self, reason: str) -> None:
        self._fail(reason)
        raise ForwardState.cannot("continue", reason)

    def _fail(self, reason: str) -> None:
        """After an exception: as new if no forward finished yet, otherwise unusable until reset."""
        if self._state.fail(reason):
            self.reset()

    def _check_layer_shapes(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        kv_heads, head_size, head_size_v = self.kv.layer_shape(layer_idx)
        if (keys.dim() != 4 or values.dim() != 4 or keys.shape[1] != kv_heads
                or values.shape[1] != kv_heads or keys.shape[3] != head_size
                or values.shape[3] != head_size_v or keys.shape[:3] != values.shape[:3]):
            raise ValueError(f"PagedCache: layer {layer_idx} stores keys {tuple(keys.shape)} and "
                             f"values {tuple(values.shape)}; the pools hold {kv_heads} KV heads of "
                             f"key size {head_size} and value size {head_size_v} (set by layer 0 "
                             "and, where layers differ, the config's per-layer shapes)")

    # ---- placement -------------------------------------------------------------------------
    def _plan_forward(self, keys: torch.Tensor, values: torch.Tensor) -> Tuple[List[int], PoolSpec]:
        """Check this forward's new tokens against the cache; no state changes.

        Returns the new-token count of each row and the pool spec.
        """
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"PagedCache: keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                             "must be [batch, kv_heads, q_len, head_size] with equal leading sizes")
        rows, _, q_len, _ = keys.shape
        counts = self._check_new_tokens(rows, q_len, take_padding_mask())
        if self.is_hybrid_linear and any(c == 0 for c in counts) and (
                self._placement is None or None in self.rows):
            raise ValueError("PagedCache: a row without tokens (all padding) in the first forward "
                             "of a model with linear-attention layers; every row needs a state from "
                             "its first forward on (drop the empty row)")
        spec = self._storage.pool_shape(keys, values) + (keys.dtype, keys.device)
        if self._pool_spec is not None and spec != self._pool_spec:
            raise ValueError(f"PagedCache: this forward's K/V (heads, key size, value size, dtype, "
                             f"device) {spec} differ from the pools' {self._pool_spec}")
        if self._placement is not None:
            self._check_room(counts)
        return counts, spec

    def _check_new_tokens(self, rows: int, q_len: int, mask: Optional[torch.Tensor]) -> List[int]:
        """Each row's new-token count from the 2D padding mask, checked against the rows."""
        if self._placement is not None:
            self._placement.check_rows(rows)
        counts = new_token_counts(mask, rows, q_len, self._length)
        if self._placement is not None:
            self._placement.check_left_padding(counts, q_len)
        return counts

    def _begin_forward(self, keys: torch.Tensor, values: torch.Tensor,
                       plan: Tuple[List[int], PoolSpec]) -> None:
        """Place this forward's new tokens and build its PagedBatch."""
        counts, spec = plan
        rows, _, q_len, _ = keys.shape
        if self._placement is None:
            self._start(rows, spec)
            self._check_room(counts)
        self._length += q_len
        self._forward_len = q_len
        self._state.begin()
        self._batch = None
        placed = self._placement.place(counts, q_len, keys, values)
        if self._linear is not None:  # new rows' slots zeroed, earlier layers' states stored
            self._linear.placed(self.manager.take_state_moves(), self._placement.state_slots())
        tables = self._placement.tables()
        self._reserve(max(1, self.manager.device_high_water_mark))
        self.kv.apply_copies(placed.copies)  # before any layer writes this step's tokens
        step = StepPlan(tables, placed.slots, self._placement.seq_lens(), counts,
                        real_query_rows(counts, q_len))
        inputs = StepInputs.from_plan(step, self.kv, self._cascade_min_saved_tokens)
        in_attention = self._storage.in_attention
        self._batch = PagedBatch(self.kv, inputs, write_kv=in_attention,
                                 on_stored=self._count_stored if in_attention else None,
                                 q_len=q_len, last_queries=self._last_queries(step))
        self.cascade_forwards += bool(self._batch.inputs.cascades)

    def _last_queries(self, step: StepPlan) -> Callable[[int], PagedBatch]:
        """The forward's batch for queries of the last ``keep`` positions of each row (built
        once per ``keep``; these queries write nothing)."""
        built: Dict[int, PagedBatch] = {}

        def narrowed(keep: int) -> PagedBatch:
            if keep not in built:
                counts = [min(n, keep) for n in step.query_lens]
                rows = [row * keep + i for row, n in enumerate(counts) for i in range(keep - n, keep)]
                plan = StepPlan(step.tables, step.slots, step.seq_lens, counts,
                                None if len(rows) == len(counts) * keep else rows)
                built[keep] = PagedBatch(self.kv, StepInputs.from_plan(
                    plan, self.kv, self._cascade_min_saved_tokens), write_kv=False)
            return built[keep]
        return narrowed

    def _check_room(self, counts: Sequence[int]) -> None:
        """Refuse a forward the pool cannot take, before any state changes."""
        if self.num_blocks is None:
            self._placement.check_room(counts, self._row_limit(), pool_advice=None,
                                       new_rows_exact=False)
        else:
            # Exact for appends (new rows may need fewer blocks after prefix hits).
            self._placement.check_room(
                counts, None, new_rows_exact=False,
                pool_advice="pass a larger num_blocks, or num_blocks=None to grow the pool as needed")

    def _row_limit(self) -> Optional[RowLimit]:
        limit = self.max_seq_len if self.max_seq_len is not None else self.max_positions
        if not limit:
            return None
        source = "max_seq_len" if self.max_seq_len is not None else "the config's max_position_embeddings"
        return RowLimit(limit, f"{limit} ({source}), which sizes the default pool (num_blocks=None). "
                               "To generate longer, pass PagedCache(config, max_seq_len=...) or a "
                               "fixed num_blocks.")

    def _start(self, rows: int, pool_spec: PoolSpec) -> None:
        if self.num_blocks is not None:
            capacity = self.num_blocks
        elif self._row_limit() is not None:
            # Without sharing, no row holds more blocks than its longest allowed sequence.
            capacity = rows * blocks_needed(self._row_limit().tokens, self.block_size) * len(self.kv_groups.groups)
        else:
            raise ValueError("PagedCache: the config has no max_position_embeddings; pass "
                             "max_seq_len or num_blocks")
        # A beam step forks every row before it frees the old ones: twice the rows' slots.
        state_slots = 2 * rows if self.is_hybrid_linear else None
        self._placement = RowPlacement(rows, capacity, self.block_size, self.enable_prefix_caching,
                                       self.kv_groups, state_slots)
        if self._linear is not None:
            self._linear.start(state_slots)
        self._pool_spec = pool_spec
        if self.num_blocks is not None:
            self.kv = self._new_pool(self.num_blocks, pool_spec)

    def _new_pool(self, num_blocks: int, pool_spec: PoolSpec) -> PagedKVCache:
        kv_heads, head_size, head_size_v, dtype, device = pool_spec
        options = dict(self._kv_options)
        dtype = resolve_kv_cache_dtype(options.pop("kv_cache_dtype"), dtype)
        return PagedKVCache(len(self.layer_types), kv_heads, head_size, self.block_size, dtype,
                            device, num_blocks=num_blocks, head_size_v=head_size_v,
                            kv_groups=self.kv_groups, values_in_keys=self._storage.latent, **options)

    def _reserve(self, num_blocks: int) -> None:
        """Grow the pools to hold block ids below ``num_blocks`` (only without a fixed size):
        the block manager's high-water mark, whatever order its allocator hands out ids in
        (it reuses freed blocks first, so the mark is also the peak number held at once).
        """
        if self.kv is not None and num_blocks <= self.kv.num_blocks:
            return
        if self.kv is None:
            self.kv = self._new_pool(num_blocks, self._pool_spec)
            return
        num_blocks = min(self.manager.num_device_blocks,
                         max(num_blocks, int(self.kv.num_blocks * _POOL_GROWTH)))
        self.kv = self.kv.with_blocks(num_blocks)  # contents and (calibrated) scales

    def _select_rows(self, indices: Sequence[int]) -> None:
        """Row i becomes a fork of old row ``indices[i]``; the old rows are freed."""
        if self._placement is None:
            return  # nothing stored yet
        if self._linear is not None and len(indices) > len(self.rows):
            raise NotImplementedError(
                f"PagedCache: {len(indices)} rows from {len(self.rows)}: a model with "
                "linear-attention layers keeps state slots for its first forward's rows only")
        self._placement.select_rows(indices)
        if self._linear is not None:  # one state copy per forked row
            self._linear.reselect(self.manager.take_state_moves(), self._placement.state_slots())
        self._batch = self._batch if self._state.interrupted else None


def _refuse_unknown(unknown: Dict) -> None:
    """Refuse unknown keyword arguments; the compile mode's are told which class takes them."""
    if {"max_cache_len", "max_batch_size"} & unknown.keys():
        raise TypeError("PagedCache: max_cache_len and max_batch_size are the compile mode's "
                        "arguments: use CompiledPagedCache(config, max_cache_len=...)")
    if unknown:
        raise TypeError(f"PagedCache.__init__() got an unexpected keyword argument "
                        f"{next(iter(unknown))!r}")
