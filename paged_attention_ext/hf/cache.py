"""A transformers ``Cache`` that keeps keys and values in paged pools.

:class:`PagedCache` owns the pools (:class:`~paged_attention_ext.kv_cache.PagedKVCache`),
a :class:`~paged_attention_ext.block_manager.BlockSpaceManager` with prefix caching, and
one block table (a sequence of the manager) per batch row.

* ``update`` (called by every attention layer with the new tokens' K/V) stores them with
  ``paged.write_kv``. Layer 0's call also places the forward's new tokens: slots,
  copy-on-write copies, prefix hits, and the forward's :class:`PagedBatch`.
* Two hand-offs go through context variables because transformers passes neither the
  attention mask to the cache nor the cache to the attention function:
  the registered mask function publishes the forward's 2D padding mask for layer 0's
  ``update``; each ``update`` publishes the batch with the key tensor it returns, and the
  attention function takes it only for that same tensor (and clears it).
* Left padding: padding tokens get no slot (never stored) and no query row.
* Prefix caching: ``generate`` repeats each prompt per returned sequence or beam. The cache
  never sees token ids, so it names each prompt token by a 63-bit fingerprint of its
  layer-0 key and value (which depend only on the token and its position, RoPE included)
  and lets the block manager's prefix cache match full blocks: a repeated row takes the
  blocks the first row registered in the same forward and skips writing them.
* Beam search: ``reorder_cache`` forks the chosen rows' block tables and frees the old
  ones; a shared partial block is copied on the next append (copy-on-write).
* Sliding-window layers attend with the op's ``sliding_window`` and sit in KV groups of
  their own (:mod:`paged_attention_ext.kv_groups`): a row has one block table per group,
  and a sliding group frees the blocks its window has left.
* Compile mode (``max_cache_len``): a fixed pool and fixed-size metadata tensors
  (:class:`~paged_attention_ext.hf.batch.StepBuffers`); the bookkeeping above runs eagerly
  *before* each forward (``prepare``, called by the mask function when generate builds the
  masks eagerly), so a compiled forward only writes K/V at the prepared slots and attends.
"""

import hashlib
from contextvars import ContextVar
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..block_allocator import NoFreeBlocksError
from ..block_manager import BlockSpaceManager
from ..cascade import DEFAULT_MIN_SAVED_TOKENS
from ..kv_cache import LayerScales, PagedKVCache, check_int
from ..kv_groups import KVGroupLayout
from ..quantization import kv_cache_dtype as resolve_kv_cache_dtype
from .batch import PagedBatch, StepBuffers, flat_tokens
from .masks import check_mask_function
from .support import check_config, layer_windows, mla_head_sizes

ATTN_IMPLEMENTATION = "paged_attention_ext"
_POOL_GROWTH = 1.25  # a growing pool copies itself rarely and leaves at most a fifth unused


class _LayerCall(NamedTuple):
    cache: "PagedCache"
    layer_idx: int
    # What update() returned: identifies the attention call the batch is for. None for MLA
    # models, whose attention gets keys expanded from what update() returned.
    key: Optional[torch.Tensor]
    batch: PagedBatch


_padding_mask: ContextVar[Optional[torch.Tensor]] = ContextVar("paged_padding_mask", default=None)
_layer_call: ContextVar[Optional[_LayerCall]] = ContextVar("paged_layer_call", default=None)
# A compiled PagedCache whose get_mask_sizes just ran eagerly: the mask function that
# transformers calls next with the 2D padding mask prepares that cache's next forward.
_mask_sizes_from: ContextVar[Optional["PagedCache"]] = ContextVar("paged_mask_sizes", default=None)


class _TracedHandoff:
    """The update -> attention hand-off inside a torch.compile trace, where dynamo cannot
    trace ContextVar.set; an attribute of a plain object it can (and replays it after the
    graph, so it ends each call as None)."""
    call: Optional[_LayerCall] = None


_traced = _TracedHandoff()

def publish_padding_mask(attention_mask: Optional[torch.Tensor] = None, mask_function=None,
                         **kwargs) -> None:
    """The mask function of ``paged_attention_ext``: builds no mask, records the padding.

    Attention masks come from block tables and sequence lengths. The 2D mask
    (``[batch, past + new]``, 0 = padding) is kept for the next PagedCache forward. A mask
    function that is not (packed, sliding-window) causal on this forward's positions raises
    ``NotImplementedError`` (masks.py). transformers builds
    the masks before the first layer, so this also drops a batch that a forward stopped by
    an exception left published.
    """
    if torch.compiler.is_compiling():
        # A compiled forward: its PagedCache was prepared eagerly before it (prepare(), or
        # this function's eager call from generate's mask creation).
        return None
    if mask_function is not None:
        check_mask_function(mask_function, attention_mask, kwargs, ATTN_IMPLEMENTATION)
    _layer_call.set(None)
    cache = _mask_sizes_from.get()
    _mask_sizes_from.set(None)
    if cache is not None:
        cache._prepare_from_mask(attention_mask, kwargs)
        return None
    _padding_mask.set(attention_mask)
    return None


def take_batch(module: torch.nn.Module, key: torch.Tensor) -> Optional[PagedBatch]:
    """The batch a PagedCache published for the attention call of ``module`` with ``key``."""
    compiling = torch.compiler.is_compiling()
    call = _traced.call if compiling else _layer_call.get()
    if call is None:
        return None
    layer_idx = getattr(module, "layer_idx", None)
    if call.key is None:
        if layer_idx != call.layer_idx:
            return None
    elif call.key is not key or (layer_idx is not None and layer_idx != call.layer_idx):
        return None
    if compiling:
        _traced.call = None
    else:
        _layer_call.set(None)  # taken; so the pools are not kept alive after the forward
    return call.batch


def _fingerprints(keys: torch.Tensor, values: torch.Tensor) -> List[int]:
    """A 63-bit name per token from its K and V (``[kv_heads, tokens, head_size]`` each)."""
    data = torch.cat([keys, values], dim=-1).transpose(0, 1).contiguous()
    raw = data.view(data.shape[0], -1).view(torch.uint8).cpu().numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1
            for row in raw]


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
        enable_prefix_caching: share the full blocks of identical prompt prefixes.
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
        max_cache_len: compile mode (``is_compileable``): the most tokens (prompt and
            generated) a row may hold. The pool (``num_blocks``, default
            ``max_batch_size * ceil(max_cache_len / block_size)`` per KV group) and fixed-size block tables
            and metadata tensors are allocated once and rewritten in place before every
            forward, so ``torch.compile(model.forward, fullgraph=True)`` and generate's
            ``compile_config`` run the decode steps without graph breaks or recompiles
            (docs/huggingface.md, "Compiled decoding"). Excludes ``max_seq_len``.
        max_batch_size: compile mode: the most batch rows (default: the first forward's).
        cascade_min_saved_tokens: rows that share prompt blocks (``num_return_sequences``,
            beams, repeated prompts) read them once per decode step (cascade attention,
            :mod:`paged_attention_ext.cascade`) where that saves at least this many key
            reads per step; ``None``: plain attention only. The tokens are the same.

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
                 max_cache_len: Optional[int] = None, max_batch_size: Optional[int] = None,
                 cascade_min_saved_tokens: Optional[int] = DEFAULT_MIN_SAVED_TOKENS) -> None:
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"PagedCache: config must be a transformers PretrainedConfig (the "
                            f"model's config), got {type(config).__name__}")
        check_int("PagedCache: block_size", block_size, 1)
        check_int("PagedCache: num_blocks", num_blocks, 1, optional=True)
        check_int("PagedCache: max_seq_len", max_seq_len, 1, optional=True)
        check_int("PagedCache: max_cache_len", max_cache_len, 1, optional=True)
        check_int("PagedCache: max_batch_size", max_batch_size, 1, optional=True)
        check_int("PagedCache: cascade_min_saved_tokens", cascade_min_saved_tokens, 1, optional=True)
        if max_cache_len is None and max_batch_size is not None:
            raise ValueError("PagedCache: max_batch_size sizes the compile mode, which max_cache_len "
                             "turns on; pass max_cache_len too")
        if max_cache_len is not None and max_seq_len is not None:
            raise ValueError("PagedCache: pass max_cache_len (compile mode) or max_seq_len, not both")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"PagedCache: enable_prefix_caching must be a bool, got "
                            f"{type(enable_prefix_caching).__name__}")
        text_config = config.get_text_config(decoder=True)
        layer_types = check_config(config, text_config)
        super().__init__(layers=[])  # one set of block tables serves every layer
        self._config = text_config
        self._check_attn_implementation(ValueError)
        self.layer_types: List[str] = layer_types
        self.kv_groups = KVGroupLayout.from_windows(layer_windows(text_config, layer_types))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_positions: Optional[int] = getattr(text_config, "max_position_embeddings", None)
        self.max_seq_len = max_seq_len
        self._max_cache_len = max_cache_len
        self._max_batch_size = max_batch_size
        self._cascade_min_saved_tokens = cascade_min_saved_tokens
        # MLA (DeepSeek-V2/V3): update() gets compressed latents; the attention function
        # stores the keys and values transformers expands from them (these head sizes).
        self._mla: Optional[Tuple[int, int]] = mla_head_sizes(text_config)
        self._kv_options = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale,
                                calibration=kv_scale_calibration)
        # Tensor parallel (transformers' tp_plan): each rank's attention gets its share of the
        # heads, and its pools hold that share (as transformers' StaticCache sizes itself).
        self._tp_size: int = getattr(getattr(config, "distributed_config", None), "tp_size", None) or 1
        # Bad fp8 options (format, scale shapes, calibration) raise here: a one-block pool.
        kv_heads = self._config_pool_spec(torch.float32, torch.device("cpu"))[0]
        self._new_pool(1, (kv_heads, 1, 1, torch.float32, torch.device("cpu")))
        # Compile mode: (pool spec, pools, metadata buffers), kept across reset() so that a
        # compiled forward keeps reading the same tensors.
        self._static: Optional[Tuple[tuple, PagedKVCache, StepBuffers]] = None
        self._clear()

    def _clear(self) -> None:
        self.manager: Optional[BlockSpaceManager] = None  # created by the first forward
        self.kv: Optional[PagedKVCache] = None
        self.rows: List[Optional[int]] = []  # each batch row's sequence id; None: no token yet
        self._length = 0  # columns seen per row, padding included (transformers' seq length)
        self._next_seq_id = 0
        self._batch: Optional[PagedBatch] = None
        self._pool_spec: Optional[Tuple[int, int, int, torch.dtype, torch.device]] = None
        self._layers_stored = 0  # update() calls of the current forward
        self._forwards_done = 0  # forwards whose every layer stored its K/V
        self._broken: Optional[str] = None  # why the cache must be reset before more use
        self.cascade_forwards = 0  # forwards whose shared prompt blocks were read once (cascade)
        # Compile mode: the prepared forward (per-row new-token counts, q_len, slots), whether
        # no eager update has consumed it yet, and the rows it started without prefix
        # fingerprints (an eager first forward redoes them with fingerprints).
        self._step: Optional[Tuple[List[int], int, List[int]]] = None
        self._step_open = False
        self._unfingerprinted: List[int] = []
        if self._max_cache_len is not None:
            self._layers_stored = len(self.layer_types)  # no forward in flight
            # A tensor for get_seq_length inside a compiled forward (an int would recompile).
            self._length_tensor = torch.zeros((), dtype=torch.int64)
            # Set by a compiled forward (it runs no Python): the prepared step was consumed.
            self._consumed = torch.zeros((), dtype=torch.bool)
        if _layer_call.get() is not None and _layer_call.get().cache is self:
            _layer_call.set(None)

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
        if self._max_cache_len is not None:
            return self._update_static(key_states, value_states, layer_idx)
        self._check_call(layer_idx)
        plan = self._plan_forward(key_states, value_states) if layer_idx == 0 else None
        try:
            if plan is not None:
                self._place(key_states, value_states, *plan)
            self._write_layer(layer_idx, key_states, value_states)
        except BaseException as error:
            self._fail(f"layer {layer_idx}'s update raised {type(error).__name__}: {error}")
            raise
        self._finish_layer(layer_idx, key_states)
        return key_states, value_states

    def _write_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's new K/V at the prepared slots (MLA: the attention function does)."""
        if self._mla is None:
            self._check_layer_shapes(layer_idx, keys, values)
            self.kv.write(layer_idx, flat_tokens(keys), flat_tokens(values),
                          self._batch.tables_of(layer_idx)[0])

    def _finish_layer(self, layer_idx: int, keys: torch.Tensor) -> None:
        """Count the layer stored and hand the attention function its call."""
        if self._mla is None:
            self._count_stored(layer_idx)
        _layer_call.set(_LayerCall(self, layer_idx, None if self._mla else keys, self._batch))

    def _count_stored(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` of this forward holds its K/V (MLA: said by the attention
        function after it wrote the expanded K/V, so a failure before that is seen)."""
        self._layers_stored += 1
        if self._layers_stored == len(self.layer_types):
            self._forwards_done += 1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._max_cache_len is not None and torch.compiler.is_compiling():
            return self._length_tensor  # set before the forward; an int would recompile
        return self._length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, int]:
        if self._max_cache_len is None:
            return self._length + query_length, 0
        if not torch.compiler.is_compiling():
            _mask_sizes_from.set(self)  # the mask function called next prepares the forward
        return self._max_cache_len, 0  # constant: the mask function ignores it

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1 if self._max_cache_len is None else self._max_cache_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues old row ``beam_idx[i]`` (table forks, no copy)."""
        self._select_rows(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self.rows)) for _ in range(repeats)])

    def reset(self) -> None:
        """Free every row's blocks and drop the pools: the cache is as new (always works)."""
        if self.manager is not None:
            for seq_id in self.rows:
                if seq_id is not None and self.manager.has_seq(seq_id):
                    self.manager.free_seq(seq_id)
        if self._static is not None:  # the fixed pool is kept: its calibrated scales are not
            self._static[1].recalibrate()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every row (assisted and prompt-lookup decoding discard the
        candidates the model rejected): blocks past the new end are freed, the partial one
        is kept. ``tokens_to_remove <= 0`` removes that many; a positive value is
        transformers' older form, the length to keep."""
        if self._broken is not None:
            raise RuntimeError(f"PagedCache cannot crop: {self._broken}. Call reset()")
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"PagedCache.crop: tokens_to_remove must be an int, got "
                            f"{tokens_to_remove!r}")
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(0, self._length - tokens_to_remove)
        if remove > self._length:
            raise ValueError(f"PagedCache.crop: cannot remove {remove} tokens, rows hold "
                             f"{self._length} columns")
        if remove == 0:
            return
        self._step_open = False  # a crop comes between forwards
        # Padding is on the left, so the last columns of every row that has tokens are real.
        keep = {seq_id: max(0, self.manager.num_tokens(seq_id) - remove)
                for seq_id in self.rows if seq_id is not None}
        for seq_id, num_tokens in keep.items():  # every row checked before any changes
            for table in self.manager.group_tables(seq_id):
                table.check_truncate(num_tokens)
        for seq_id, num_tokens in keep.items():
            self.manager.truncate(seq_id, num_tokens)
        self._length -= remove

    def early_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError("PagedCache allocates its pools on the first forward")

    def __len__(self) -> int:
        return len(self.layer_types)

    @property
    def is_compileable(self) -> bool:
        return self._max_cache_len is not None

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return self.manager is not None

    @property
    def is_sliding(self) -> List[bool]:
        return [t == "sliding_attention" for t in self.layer_types]

    # Every layer is attention over K/V (generate skips the eager mask creation, the compile
    # mode's preparation, for a cache whose layers are all linear or dummy).
    @property
    def is_linear(self) -> List[bool]:
        return [False] * len(self.layer_types)

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
        if self.manager is None:
            return {"pool_bytes": 0, "used_bytes": 0, "blocks_used": 0, "block_references": 0}
        used = self.manager.num_used_device_blocks
        block_bytes = self.kv.block_bytes if self.kv is not None else 0
        return {
            "pool_bytes": self.kv.num_blocks * block_bytes if self.kv is not None else 0,
            "used_bytes": used * block_bytes,
            "blocks_used": used,
            "block_references": sum(len(t.live_blocks) for s in self.rows
                                    if s is not None and self.manager.has_seq(s)
                                    for t in self.manager.group_tables(s)),
        }

    # ---- consistency -----------------------------------------------------------------------
    def _check_call(self, layer_idx: int) -> None:
        """Refuse an update that would store K/V next to an inconsistent history."""
        if self._broken is not None:
            raise RuntimeError(f"PagedCache cannot continue: {self._broken}. Call reset() (or use a "
                               "new PagedCache) and start the generation again.")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not (
                0 <= layer_idx < len(self.layer_types)):
            raise ValueError(f"PagedCache: layer_idx {layer_idx!r} is not a layer of this config "
                             f"({len(self.layer_types)} layers)")
        if layer_idx == 0 and self._batch is not None and self._layers_stored != len(self.layer_types):
            self._refuse(f"the previous forward stopped after {self._layers_stored} of "
                         f"{len(self.layer_types)} layers stored their K/V (an exception "
                         "interrupted it), so its tokens are only partly stored")
        call = _layer_call.get()
        if call is not None and call.cache is self:
            self._refuse(f"the attention of layer {call.layer_idx} did not read the paged cache: the "
                         f"model does not run attn_implementation={ATTN_IMPLEMENTATION!r} (it would "
                         "attend only to the new tokens and generate different tokens). Load or build "
                         f"the model with attn_implementation={ATTN_IMPLEMENTATION!r}")
        if layer_idx == 0:
            self._check_attn_implementation(RuntimeError)
        elif self._batch is None or layer_idx != self._layers_stored:
            raise RuntimeError(f"PagedCache: layer {layer_idx} stored K/V out of order (after "
                               f"{self._layers_stored} layers of this forward; layer 0 comes first)")

    def _refuse(self, reason: str) -> None:
        self._fail(reason)
        raise RuntimeError(f"PagedCache cannot continue: {reason}. Call reset() (or use a new "
                           "PagedCache) and start the generation again.")

    def _fail(self, reason: str) -> None:
        """After an exception: as new if no forward finished yet, otherwise unusable until reset."""
        if self._forwards_done == 0:
            self.reset()
        else:
            self._broken = reason

    def _check_layer_shapes(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        kv_heads, head_size, head_size_v = self._pool_spec[:3]
        if (keys.dim() != 4 or values.dim() != 4 or keys.shape[1] != kv_heads
                or values.shape[1] != kv_heads or keys.shape[3] != head_size
                or values.shape[3] != head_size_v or keys.shape[:3] != values.shape[:3]):
            raise ValueError(f"PagedCache: layer {layer_idx} stores keys {tuple(keys.shape)} and "
                             f"values {tuple(values.shape)}; the pools hold {kv_heads} KV heads of "
                             f"key size {head_size} and value size {head_size_v} (set by layer 0: "
                             "one pool shape serves every layer)")

    # ---- placement -------------------------------------------------------------------------
    def _plan_forward(self, keys: torch.Tensor, values: torch.Tensor):
        """Check this forward's new tokens against the cache; no state changes.

        Returns the new-token count of each row and the pool spec.
        """
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"PagedCache: keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                             "must be [batch, kv_heads, q_len, head_size] with equal leading sizes")
        rows, kv_heads, q_len, head_size = keys.shape
        if self.rows and rows != len(self.rows):
            raise ValueError(f"PagedCache holds {len(self.rows)} rows, the forward has {rows}")
        counts = self._new_token_counts(rows, q_len)
        for row, count in enumerate(counts):
            if self.rows and self.rows[row] is not None and 0 < count < q_len:
                raise ValueError(f"PagedCache: row {row} has padding after its first token "
                                 "(only left padding is supported)")
        if self._mla is not None:
            # Pools for the expanded per-head K/V the attention function will store.
            spec = (self._config.num_attention_heads,) + self._mla
        else:
            spec = (kv_heads, head_size, values.shape[3])
        spec += (keys.dtype, keys.device)
        if self._pool_spec is not None and spec != self._pool_spec:
            raise ValueError(f"PagedCache: this forward's K/V (heads, key size, value size, dtype, "
                             f"device) {spec} differ from the pools' {self._pool_spec}")
        if self.rows:
            self._check_room(counts)
        return counts, spec

    def _place(self, keys: torch.Tensor, values: torch.Tensor, counts: List[int], spec) -> None:
        """Place this forward's new tokens and build its PagedBatch."""
        rows, _, q_len, _ = keys.shape
        if not self.rows:
            self._start(rows, spec)
            self._check_room(counts)
        self._length += q_len
        self._layers_stored = 0
        self._batch = None
        slots, copies, _ = self._allocate(counts, q_len, keys, values)
        tables = [[self.manager.block_ids(s, g) if s is not None else [] for s in self.rows]
                  for g in range(self.manager.num_kv_groups)]
        self._reserve(1 + max((b for group in tables for t in group for b in t), default=0))
        self.kv.apply_copies(copies)  # before any layer writes this step's tokens
        query_rows = None
        if sum(counts) != rows * q_len:
            query_rows = [row * q_len + i for row, count in enumerate(counts)
                          for i in range(q_len - count, q_len)]
        self._batch = PagedBatch.build(
            self.kv, tables,
            [self.manager.num_tokens(s) if s is not None else 0 for s in self.rows], counts, slots,
            write_kv=self._mla is not None, query_rows=query_rows,
            on_stored=self._count_stored if self._mla is not None else None,
            cascade_min_saved_tokens=self._cascade_min_saved_tokens)
        self.cascade_forwards += bool(self._batch.cascades)

    def _allocate(self, counts: Sequence[int], q_len: int, keys: Optional[torch.Tensor],
                  values: Optional[torch.Tensor]) -> Tuple[List[int], List, List[int]]:
        """Give each row's new tokens slots (new rows: a sequence, with prefix hits when
        ``keys`` and ``values`` are given to fingerprint; others: an append).

        Returns per KV group the ``rows * q_len`` slots (-1: padding or a prefix hit), the
        copy-on-write copies to apply before any layer writes, and the rows that started a
        sequence.
        """
        slots = [[-1] * (len(counts) * q_len) for _ in range(self.manager.num_kv_groups)]
        copies: List = []
        started: List[int] = []
        for row, count in enumerate(counts):
            if count == 0:
                continue
            pad = q_len - count
            seq_id = self.rows[row]
            if seq_id is None:
                seq_id = self._new_seq_id()
                prompt = (_fingerprints(keys[row, :, pad:], values[row, :, pad:])
                          if self.enable_prefix_caching and keys is not None else count)
                # The forward computes every prompt token's query, prefix hits included.
                placed, num_cached = self.manager.allocate(seq_id, seq_id, prompt,
                                                           queries_from_start=True)
                self.rows[row] = seq_id  # only once the manager knows it
                started.append(row)
                pad += num_cached  # prefix hits: already stored, not written again
            else:
                placed = self.manager.append(seq_id, count)
                copies.extend(placed.copies)
            for group_slots, placed_slots in zip(slots, placed.group_slots):
                group_slots[row * q_len + pad:(row + 1) * q_len] = placed_slots
        return slots, copies, started

    def _new_token_counts(self, rows: int, q_len: int) -> List[int]:
        """Real (non-padding) new tokens per row, from the published 2D attention mask."""
        mask = _padding_mask.get()
        _padding_mask.set(None)  # one forward's mask
        return self._counts_from_mask(mask, rows, q_len)

    def _counts_from_mask(self, mask: Optional[torch.Tensor], rows: int, q_len: int) -> List[int]:
        if mask is None:
            return [q_len] * rows
        if tuple(mask.shape) != (rows, self._length + q_len):
            raise ValueError(f"PagedCache: attention_mask has shape {tuple(mask.shape)}, expected "
                             f"{(rows, self._length + q_len)} (past and new tokens)")
        valid = mask[:, -q_len:].to("cpu", torch.bool)
        counts = valid.sum(dim=1)
        left_padded = torch.arange(q_len) >= (q_len - counts)[:, None]
        if not torch.equal(valid, left_padded):
            raise ValueError("PagedCache supports left padding only")
        return counts.tolist()

    def _row_limit(self) -> Optional[int]:
        return self.max_seq_len if self.max_seq_len is not None else self.max_positions

    def _check_room(self, counts: Sequence[int]) -> None:
        """Refuse a forward the pool cannot take, before any state changes."""
        if self.num_blocks is None:
            limit = self._row_limit()
            for row, (seq, count) in enumerate(zip(self.rows, counts)):
                total = (self.manager.num_tokens(seq) if seq is not None else 0) + count
                if total > limit:
                    source = ("max_seq_len" if self.max_seq_len is not None else
                              "the config's max_position_embeddings")
                    raise ValueError(
                        f"PagedCache: row {row} would hold {total} tokens, more than {limit} "
                        f"({source}), which sizes the default pool (num_blocks=None). To generate "
                        f"longer, pass PagedCache(config, max_seq_len=...) or a fixed num_blocks.")
            return
        needed = sum(self.manager.seq_append_cost(s, c) if s is not None
                     else -(-c // self.block_size) * self.manager.num_kv_groups
                     for s, c in zip(self.rows, counts))
        free = self.manager.num_free_device_blocks
        if needed > free and all(s is not None or c == 0 for s, c in zip(self.rows, counts)):
            # Exact for appends (new rows may need fewer blocks after prefix hits).
            raise NoFreeBlocksError(
                f"PagedCache: this forward needs {needed} more blocks, the fixed pool "
                f"(num_blocks={self.num_blocks}) has {free} free; pass a larger num_blocks, or "
                "num_blocks=None to grow the pool as needed")

    def _start(self, rows: int, pool_spec: Tuple[int, int, int, torch.dtype, torch.device]) -> None:
        if self.num_blocks is not None:
            capacity = self.num_blocks
        elif self._row_limit():
            # Without sharing, no row holds more blocks than its longest allowed sequence.
            capacity = rows * -(-self._row_limit() // self.block_size) * len(self.kv_groups.groups)
        else:
            raise ValueError("PagedCache: the config has no max_position_embeddings; pass "
                             "max_seq_len or num_blocks")
        self.manager = BlockSpaceManager(capacity, 0, self.block_size,
                                         enable_prefix_caching=self.enable_prefix_caching,
                                         watermark=0.0, kv_group_windows=self.kv_groups.windows)
        self.rows = [None] * rows
        self._pool_spec = pool_spec
        if self.num_blocks is not None:
            self.kv = self._new_pool(self.num_blocks, pool_spec)

    def _new_pool(self, num_blocks: int, pool_spec) -> PagedKVCache:
        kv_heads, head_size, head_size_v, dtype, device = pool_spec
        options = dict(self._kv_options)
        dtype = resolve_kv_cache_dtype(options.pop("kv_cache_dtype"), dtype)
        return PagedKVCache(len(self.layer_types), kv_heads, head_size, self.block_size, dtype,
                            device, num_blocks=num_blocks, head_size_v=head_size_v,
                            kv_groups=self.kv_groups, **options)

    def _reserve(self, num_blocks: int) -> None:
        """Grow the pools to hold block ids below ``num_blocks`` (only without a fixed size).

        The allocator reuses freed blocks before it hands out a new id (in ascending order
        from 0), so the highest id in use tracks the peak number of blocks in use.
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
        if self.manager is None:
            return  # nothing stored yet
        bad = [i for i in indices if not 0 <= i < len(self.rows)]
        if bad:
            raise IndexError(f"PagedCache: rows {bad} do not exist (the cache holds "
                             f"{len(self.rows)} rows)")
        new_rows: List[Optional[int]] = []
        for index in indices:
            parent = self.rows[index]
            child = None
            if parent is not None:
                child = self._new_seq_id()
                self.manager.fork(parent, child)
            new_rows.append(child)
        for seq_id in self.rows:  # after the forks, so shared blocks never drop to zero
            if seq_id is not None:
                self.manager.free_seq(seq_id)
        self.rows = new_rows
        self._batch = None if self._layers_stored == len(self.layer_types) else self._batch

    # ---- compile mode ----------------------------------------------------------------------
    def prepare(self, batch_size: int, num_new_tokens: int,
                attention_mask: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device] = None) -> None:
        """Compile mode: place the next forward's tokens and fill the metadata it reads.

        ``generate`` needs no call: it builds the masks eagerly before every forward of a
        compileable cache, and the mask function prepares the forward then (an eager forward
        prepares itself too). A loop of your own that calls a *compiled* forward calls this
        before each call, with the forward's batch size, new-token count and 2D
        ``attention_mask`` (``[batch, past + new]``, 0 = left padding; None = no padding).
        ``dtype`` and ``device`` (the model's) allocate the pools on the first call.
        """
        if self._max_cache_len is None:
            raise RuntimeError("PagedCache.prepare is for the compile mode: "
                               "PagedCache(config, max_cache_len=...)")
        check_int("PagedCache.prepare: batch_size", batch_size, 1)
        check_int("PagedCache.prepare: num_new_tokens", num_new_tokens, 1)
        self._prepare_step(batch_size, num_new_tokens, attention_mask, dtype, device)

    def _prepare_from_mask(self, mask: Optional[torch.Tensor], kwargs: dict) -> None:
        """The eager mask-function call before a forward: prepare it, once.

        generate may build two masks (full and sliding layers) per forward, and an eager
        forward builds its own again; those find the step already placed: a 2D mask as wide
        as the tokens placed, or no mask while a placed step awaits its eager forward.
        """
        q_len = kwargs["q_length"]
        if self._step_open and self._step is not None and self._step[1] == q_len and (
                mask.shape[-1] == self._length if mask is not None else not self._consumed.item()):
            return
        self._prepare_step(kwargs["batch_size"], q_len, mask, kwargs.get("dtype"), kwargs.get("device"))

    def _prepare_step(self, rows: int, q_len: int, mask: Optional[torch.Tensor],
                      dtype: Optional[torch.dtype], device: Optional[torch.device]) -> None:
        if self._broken is not None:
            raise RuntimeError(f"PagedCache cannot continue: {self._broken}. Call reset() (or use a "
                               "new PagedCache) and start the generation again.")
        if self._layers_stored != len(self.layer_types):
            self._refuse(f"the previous forward stopped after {self._layers_stored} of "
                         f"{len(self.layer_types)} layers stored their K/V (an exception "
                         "interrupted it), so its tokens are only partly stored")
        if self.rows and rows != len(self.rows):
            raise ValueError(f"PagedCache holds {len(self.rows)} rows, the forward has {rows}")
        counts = self._counts_from_mask(mask, rows, q_len)
        for row, count in enumerate(counts):
            if self.rows and self.rows[row] is not None and 0 < count < q_len:
                raise ValueError(f"PagedCache: row {row} has padding after its first token "
                                 "(only left padding is supported)")
        first = self.manager is None
        try:
            if first:
                self._start_static(rows, dtype, device)
            self._check_static_room(counts)
            slots, copies, started = self._allocate(counts, q_len, None, None)
        except BaseException:
            if first:
                self.reset()
            raise
        self.kv.apply_copies(copies)  # before any layer writes this step's tokens
        self._length += q_len
        self._length_tensor.fill_(self._length)
        self._step = (counts, q_len, slots)
        self._unfingerprinted = started
        self._step_open = True
        self._consumed.fill_(False)
        self._fill_buffers()

    def _start_static(self, rows: int, dtype: Optional[torch.dtype],
                      device: Optional[torch.device]) -> None:
        max_rows = self._max_batch_size or rows
        if rows > max_rows:
            raise ValueError(f"PagedCache: the forward has {rows} rows, more than max_batch_size="
                             f"{max_rows}")
        if dtype is None or device is None:
            raise ValueError("PagedCache.prepare: the first call allocates the pools; pass the "
                             "model's dtype and device")
        width = -(-self._max_cache_len // self.block_size)
        capacity = (self.num_blocks if self.num_blocks is not None
                    else max_rows * width * len(self.kv_groups.groups))
        spec = self._config_pool_spec(dtype, torch.device(device))
        if self._static is None or self._static[0] != spec or self._static[2].max_rows < max_rows \
                or self._static[1].num_blocks != capacity + 1:
            pool = self._new_pool(capacity + 1, spec)  # the last block: the scratch block
            buffers = StepBuffers(pool, max_rows, width, max_rows * self._max_cache_len,
                                  scratch_block=capacity, write_kv=self._mla is not None,
                                  on_stored=self._count_stored if self._mla is not None else None,
                                  cascade_min_saved_tokens=self._cascade_min_saved_tokens)
            self._static = (spec, pool, buffers)
        self.manager = BlockSpaceManager(capacity, 0, self.block_size,
                                         enable_prefix_caching=self.enable_prefix_caching,
                                         watermark=0.0, kv_group_windows=self.kv_groups.windows)
        self.rows = [None] * rows
        self._pool_spec = spec
        self.kv = self._static[1]
        # On the pools' device, so the compiled graph touches no host tensor.
        self._length_tensor = self._length_tensor.to(spec[4])
        self._consumed = self._consumed.to(spec[4])
        # Fixed addresses, as StaticCache marks its tensors: CUDA graph replay (mode=
        # "reduce-overhead") may then read and write them in place instead of copying them.
        buffers = self._static[2]
        for tensor in (*self.kv.key_caches, *self.kv.value_caches, *buffers.group_block_tables,
                       buffers.seq_lens, buffers.query_start_loc, *buffers.group_slot_mappings,
                       *buffers.cascade_tensors(), self._length_tensor, self._consumed):
            torch._dynamo.mark_static_address(tensor)

    def _config_pool_spec(self, dtype: torch.dtype, device: torch.device) -> tuple:
        """(kv heads, key size, value size, dtype, device) from the config: the compile mode
        allocates its pools before the first forward (update checks the real K/V shapes)."""
        config = self._config
        if self._mla is not None:
            return (config.num_attention_heads // self._tp_size,) + self._mla + (dtype, device)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return (heads // self._tp_size, size, size, dtype, device)

    def _check_static_room(self, counts: Sequence[int]) -> None:
        """Refuse a forward past max_cache_len or the pool, before any state changes."""
        for row, (seq, count) in enumerate(zip(self.rows, counts)):
            total = (self.manager.num_tokens(seq) if seq is not None else 0) + count
            if total > self._max_cache_len:
                raise ValueError(f"PagedCache: row {row} would hold {total} tokens, more than "
                                 f"max_cache_len={self._max_cache_len}")
        needed = sum(self.manager.seq_append_cost(s, c) if s is not None
                     else -(-c // self.block_size) * self.manager.num_kv_groups
                     for s, c in zip(self.rows, counts))
        free = self.manager.num_free_device_blocks
        if needed > free:
            raise NoFreeBlocksError(
                f"PagedCache: this forward needs {needed} more blocks, the fixed pool "
                f"(num_blocks={self.manager.num_device_blocks}) has {free} free; pass a larger "
                "num_blocks")

    def _fill_buffers(self) -> None:
        counts, q_len, slots = self._step
        tables = [[self.manager.block_ids(s, g) if s is not None else [] for s in self.rows]
                  for g in range(self.manager.num_kv_groups)]
        lens = [self.manager.num_tokens(s) if s is not None else 0 for s in self.rows]
        self._batch = self._static[2].fill(tables, lens, counts, q_len, slots)
        self.cascade_forwards += bool(self._batch.cascades)

    def _fingerprint_started_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """An eager first forward: place the rows the step started again, now with prefix
        fingerprints of their K/V (nothing is written yet), so repeated prompts share."""
        counts, q_len, slots = self._step
        started = self._unfingerprinted
        for row in started:
            self.manager.free_seq(self.rows[row])
            self.rows[row] = None
        only = [count if row in started else 0 for row, count in enumerate(counts)]
        placed, _, _ = self._allocate(only, q_len, keys, values)
        for group_slots, group_placed in zip(slots, placed):
            for row in started:
                group_slots[row * q_len:(row + 1) * q_len] = group_placed[row * q_len:(row + 1) * q_len]
        self._unfingerprinted = []
        self._fill_buffers()

    def _update_static(self, keys: torch.Tensor, values: torch.Tensor,
                       layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """update() in compile mode: the forward was prepared before it ran."""
        if torch.compiler.is_compiling():
            # Traced once per shape: only tensor work on the prepared buffers (Python state
            # changes here would happen at trace time only).
            batch = self._batch
            if batch is None or batch.slot_mapping.shape[0] != keys.shape[0] * keys.shape[2]:
                raise RuntimeError("PagedCache: this compiled forward was not prepared; call "
                                   "cache.prepare(batch_size, num_new_tokens, attention_mask, dtype, "
                                   "device) before each compiled forward of your own loop")
            if layer_idx == 0:
                # Run twice on one preparation (a loop that forgot prepare()), it would write
                # over the last step's slots: refuse at run time instead.
                torch._assert_async(~self._consumed, "PagedCache: a compiled forward ran without "
                                    "cache.prepare(...) since the previous one")
                self._consumed.fill_(True)
            self._write_layer(layer_idx, keys, values)
            _traced.call = _LayerCall(self, layer_idx, None if self._mla else keys, batch)
            return keys, values
        if _mask_sizes_from.get() is self:  # left by a mask function that is not ours
            _mask_sizes_from.set(None)
        self._check_call(layer_idx)
        try:
            if layer_idx == 0:
                rows, _, q_len, _ = keys.shape
                if not self._step_open:  # a forward whose masks were not built through ours
                    self._prepare_step(rows, q_len, _padding_mask.get(), keys.dtype, keys.device)
                if self._step[1] != q_len or len(self.rows) != rows:
                    raise ValueError(f"PagedCache: the forward has {rows} rows x {q_len} tokens, "
                                     f"prepared were {len(self.rows)} x {self._step[1]}")
                if self._unfingerprinted and self.enable_prefix_caching:
                    self._fingerprint_started_rows(keys, values)
                self._step_open = False
                self._layers_stored = 0
            self._write_layer(layer_idx, keys, values)
        except BaseException as error:
            self._fail(f"layer {layer_idx}'s update raised {type(error).__name__}: {error}")
            raise
        self._finish_layer(layer_idx, keys)
        return keys, values

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1
