"""The compile mode of the paged cache: fixed pools and metadata for ``torch.compile``.

``CompiledPagedCache(config, max_cache_len=...)`` allocates a fixed pool
and fixed-size metadata tensors (:class:`~paged_attention_ext.step_buffers.StepBuffers`); the
bookkeeping of :class:`~paged_attention_ext.hf.PagedCache` runs eagerly *before* each
forward (``prepare``, called by the mask function when generate builds the masks eagerly),
so a compiled forward only writes K/V at the prepared slots and attends.
"""

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..block_table import blocks_needed
from ..cascade import DEFAULT_MIN_SAVED_TOKENS
from ..kv_cache import LayerScales, PagedKVCache, check_int
from ..step_buffers import StepBuffers
from ..step_inputs import StepInputs, StepPlan
from .batch import PagedBatch, real_query_rows, rows_as_sequences
from .cache import PagedCache, PoolSpec
from .handoff import (LayerCall, begin_traced_forward, cancel_preparation, publish_layer_call,
                      publish_source_call, request_preparation, take_padding_mask)
from .placement import RowLimit, RowPlacement


class _Static(NamedTuple):
    """What a compiled forward reads, kept across ``reset()`` so that it keeps reading the
    same tensors: the pools, the step buffers (two sequences per batch row:
    :func:`~.batch.rows_as_sequences`; tables padded with the scratch block) and one batch
    per shape of the buffers' inputs."""
    spec: PoolSpec
    pool: PagedKVCache
    buffers: StepBuffers
    batches: Dict[int, PagedBatch]  # by id() of the buffers' StepInputs, which live as long


class CompiledPagedCache(PagedCache):
    """:class:`PagedCache` in compile mode (``is_compileable``), the paged counterpart of
    transformers' ``StaticCache(config, max_cache_len=...)``.

    The pool (``num_blocks``, default ``max_batch_size * ceil(max_cache_len / block_size)``
    per KV group) and fixed-size block tables and metadata tensors are allocated once and
    rewritten in place before every forward, so ``torch.compile(model.forward,
    fullgraph=True)`` and generate's ``compile_config`` run the decode steps without graph
    breaks or recompiles (docs/huggingface.md, "Compiled decoding").

    Args:
        config: the model's config.
        max_cache_len: the most tokens (prompt and generated) a row may hold (required).
        max_batch_size: the most batch rows (default: the first forward's).
        block_size, num_blocks, enable_prefix_caching, kv_cache_dtype, k_scale, v_scale,
            kv_scale_calibration, cascade_min_saved_tokens: as :class:`PagedCache`'s
            (``max_seq_len`` has no place here: ``max_cache_len`` is the row limit).
    """

    def __init__(self, config: PretrainedConfig, max_cache_len: Optional[int] = None,
                 max_batch_size: Optional[int] = None, block_size: int = 16,
                 num_blocks: Optional[int] = None, enable_prefix_caching: bool = True,
                 kv_cache_dtype: Optional[str] = "auto", k_scale: Optional[LayerScales] = None,
                 v_scale: Optional[LayerScales] = None, kv_scale_calibration: str = "per_layer",
                 cascade_min_saved_tokens: Optional[int] = DEFAULT_MIN_SAVED_TOKENS,
                 mla_storage: str = "latent") -> None:
        if max_cache_len is None:
            raise TypeError("CompiledPagedCache: pass max_cache_len (the most tokens a row may hold)")
        check_int("CompiledPagedCache: max_cache_len", max_cache_len, 1)
        check_int("CompiledPagedCache: max_batch_size", max_batch_size, 1, optional=True)
        self._max_cache_len = max_cache_len
        self._max_batch_size = max_batch_size
        super().__init__(config, block_size, num_blocks, enable_prefix_caching, None, kv_cache_dtype,
                         k_scale, v_scale, kv_scale_calibration,
                         cascade_min_saved_tokens=cascade_min_saved_tokens, mla_storage=mla_storage)
        self._static: Optional[_Static] = None

    def _clear(self) -> None:
        super()._clear()
        # The prepared forward (per-row new-token counts, q_len, slots), whether no eager
        # update has consumed it yet, and the rows it started without prefix fingerprints
        # (an eager first forward redoes them with fingerprints).
        self._step: Optional[Tuple[List[int], int, List[List[int]]]] = None
        self._step_open = False
        self._unfingerprinted: List[int] = []
        # get_seq_length inside a compiled forward: the columns before the prepared forward,
        # as a tensor (an int would recompile).
        self._past_length = torch.zeros((), dtype=torch.int64)
        # Set by a compiled forward (it runs no Python): the prepared step was consumed.
        self._consumed = torch.zeros((), dtype=torch.bool)

    # ---- the transformers Cache interface ------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V at the slots prepared before the forward."""
        if torch.compiler.is_compiling():
            return self._traced_update(key_states, value_states, layer_idx)
        cancel_preparation(self)  # left by a mask function that is not ours
        self._check_call(layer_idx)
        return self._store_layer(layer_idx, key_states, value_states)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        """A linear-attention layer's last call: eagerly as :class:`PagedCache`'s; traced,
        transformers' layer updates its working tensors in place and the graph copies them
        into the rows' slots (no Python bookkeeping: it would run at trace time only)."""
        if not torch.compiler.is_compiling():
            return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        stored = Cache.update_recurrent_state(self, recurrent_states, layer_idx, state_idx, **kwargs)
        self._linear.store_traced(layer_idx)
        return stored

    def activate_past_recording(self, **kwargs) -> None:
        if self._linear is not None:
            # Recording grows the convolution windows every forward (transformers' layers
            # then stop being compileable).
            raise NotImplementedError(
                "CompiledPagedCache cannot record past states for a model with linear-attention "
                "layers (assisted or prompt-lookup decoding): use PagedCache")
        super().activate_past_recording(**kwargs)

    def _traced_update(self, keys: torch.Tensor, values: torch.Tensor,
                       layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Traced once per shape: only tensor work on the prepared buffers (Python state
        changes here would happen at trace time only)."""
        batch = self._batch
        if batch is None or batch.inputs.num_tokens != keys.shape[0] * keys.shape[2]:
            raise RuntimeError("PagedCache: this compiled forward was not prepared; call "
                               "cache.prepare(batch_size, num_new_tokens, attention_mask, dtype, "
                               "device) before each compiled forward of your own loop")
        if layer_idx == 0:
            # Run twice on one preparation (a loop that forgot prepare()), it would write
            # over the last step's slots: refuse at run time instead.
            torch._assert_async(~self._consumed, "PagedCache: a compiled forward ran without "
                                "cache.prepare(...) since the previous one")
            self._consumed.fill_(True)
            begin_traced_forward()
        self._write_layer(layer_idx, keys, values)
        call = LayerCall(self, layer_idx, self._storage.handoff_key(keys), batch)
        publish_layer_call(call)
        if layer_idx in self._sources:
            publish_source_call(call)  # its readers take the batch with its key tensor
        return keys, values

    def _begin_forward(self, keys: torch.Tensor, values: torch.Tensor, plan: None = None) -> None:
        """An eager forward: takes the step prepared before it (or prepares one now)."""
        rows, _, q_len, _ = keys.shape
        if not self._step_open:  # a forward whose masks were not built through ours
            self._prepare_step(rows, q_len, take_padding_mask(), keys.dtype, keys.device)
        if self._step[1] != q_len or len(self.rows) != rows:
            raise ValueError(f"PagedCache: the forward has {rows} rows x {q_len} tokens, "
                             f"prepared were {len(self.rows)} x {self._step[1]}")
        if self._unfingerprinted and self.enable_prefix_caching:
            self._fingerprint_started_rows(keys, values)
        self._step_open = False
        self._state.begin()
        if self._sources:
            # Readers may run on the last positions of each row alone (transformers 5.25
            # runs them on the kept logits' positions): an eager forward narrows for them.
            counts, _, slots = self._step
            step = StepPlan(self._placement.tables(), slots, self._placement.seq_lens(), counts,
                            real_query_rows(counts, q_len))
            self._batch = dataclasses.replace(self._batch, q_len=q_len,
                                              last_queries=self._last_queries(step))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """As :class:`PagedCache`'s: the columns a layer has stored. The forward's tokens are
        placed before it runs, yet no layer has stored them until its update (Llama-4's NoPE
        layers and a forward without position_ids read their positions from this first); a
        compiled forward reads the columns before it for every layer (it calls this before
        the layer's update)."""
        if torch.compiler.is_compiling():
            return self._past_length
        if self._step_open and not self._consumed.item():  # prepared, not run yet
            return self._length - self._forward_len
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, int]:
        if not torch.compiler.is_compiling():
            request_preparation(self)  # the mask function called next prepares the forward
        return self._max_cache_len, 0  # constant: the mask function ignores it

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        return True

    def reset(self) -> None:
        if self._static is not None:  # the fixed pool is kept: its calibrated scales are not
            self._static.pool.recalibrate()
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if self._tokens_to_crop(tokens_to_remove):
            self._step_open = False  # rows that change between forwards void a prepared step
        super().crop(tokens_to_remove)

    # ---- preparation ----------------------------------------------------------------------
    def prepare(self, batch_size: int, num_new_tokens: int,
                attention_mask: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
                device: Optional[torch.device] = None) -> None:
        """Place the next forward's tokens and fill the metadata it reads.

        ``generate`` needs no call: it builds the masks eagerly before every forward of a
        compileable cache, and the mask function prepares the forward then (an eager forward
        prepares itself too). A loop of your own that calls a *compiled* forward calls this
        before each call, with the forward's batch size, new-token count and 2D
        ``attention_mask`` (``[batch, past + new]``, 0 = left padding; None = no padding).
        ``dtype`` and ``device`` (the model's) allocate the pools on the first call.
        """
        check_int("PagedCache.prepare: batch_size", batch_size, 1)
        check_int("PagedCache.prepare: num_new_tokens", num_new_tokens, 1)
        self._prepare_step(batch_size, num_new_tokens, attention_mask, dtype, device)

    def prepare_from_mask(self, mask: Optional[torch.Tensor], kwargs: dict) -> None:
        """The eager mask-function call before a forward (:mod:`.handoff`): prepare it, once.

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
        self._state.check_usable()
        if self._state.interrupted:
            self._refuse(self._state.interruption())
        counts = self._check_new_tokens(rows, q_len, mask)
        first = self._placement is None
        try:
            if first:
                self._start_static(rows, dtype, device)
            self._placement.check_room(
                counts, RowLimit(self._max_cache_len, f"max_cache_len={self._max_cache_len}"),
                pool_advice="pass a larger num_blocks", new_rows_exact=True)
            slots, copies, started = self._placement.place(counts, q_len)
        except BaseException:
            if first:
                self.reset()
            raise
        self.kv.apply_copies(copies)  # before any layer writes this step's tokens
        self._past_length.fill_(self._length)
        self._length += q_len
        self._forward_len = q_len
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
        width = blocks_needed(self._max_cache_len, self.block_size)
        capacity = (self.num_blocks if self.num_blocks is not None
                    else max_rows * width * len(self.kv_groups.groups))
        spec = self._storage.config_shape + (dtype, torch.device(device))
        static = self._static
        if static is None or static.spec != spec or static.buffers.max_seqs < 2 * max_rows \
                or static.pool.num_blocks != capacity + 1:
            pool = self._new_pool(capacity + 1, spec)  # the last block: the scratch block
            buffers = StepBuffers(pool, 2 * max_rows, max_rows * self._max_cache_len, width,
                                  pad_block=capacity,
                                  cascade_min_saved_tokens=self._cascade_min_saved_tokens)
            self._static = _Static(spec, pool, buffers, {})
        # A beam step forks every row before it frees the old ones: twice the rows' slots.
        state_slots = 2 * rows if self._linear is not None else None
        self._placement = RowPlacement(rows, capacity, self.block_size, self.enable_prefix_caching,
                                       self.kv_groups, state_slots)
        if self._linear is not None:
            self._linear.start(state_slots)
        self._pool_spec = spec
        self.kv = self._static.pool
        # On the pools' device, so the compiled graph touches no host tensor.
        self._past_length = self._past_length.to(spec[4])
        self._consumed = self._consumed.to(spec[4])
        # Fixed addresses, as StaticCache marks its tensors: CUDA graph replay (mode=
        # "reduce-overhead") may then read and write them in place instead of copying them.
        for tensor in (*self.kv.key_caches, *self.kv.value_caches, *self._static.buffers.tensors(),
                       self._past_length, self._consumed):
            torch._dynamo.mark_static_address(tensor)

    def _fill_buffers(self, replaced: bool = False) -> None:
        counts, q_len, slots = self._step
        static = self._static
        plan = rows_as_sequences(self._placement.tables(), self._placement.seq_lens(), counts,
                                 q_len, slots, static.buffers.pad_block)
        inputs = static.buffers.fill(plan)
        self._batch = static.batches.get(id(inputs)) or self._new_batch(inputs)
        if self._linear is not None:  # the rows' slots, before any linear layer runs
            place = self._linear.replaced if replaced else self._linear.placed
            place(self.manager.take_state_moves(), self._placement.state_slots())
        self.cascade_forwards += bool(inputs.cascades)

    def _new_batch(self, inputs: StepInputs) -> PagedBatch:
        """The batch over one shape's inputs, made once: a compiled forward reads the same
        object every step."""
        in_attention = self._storage.in_attention
        rows = inputs.seq_lens.shape[0] // 2  # two sequences per row (rows_as_sequences)
        batch = PagedBatch(self.kv, inputs, write_kv=in_attention,
                           on_stored=self._count_stored if in_attention else None,
                           q_len=inputs.num_tokens // rows)
        self._static.batches[id(inputs)] = batch
        return batch

    def _fingerprint_started_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """An eager first forward: place the rows the step started again, now with prefix
        fingerprints of their K/V (nothing is written yet), so repeated prompts share."""
        counts, q_len, slots = self._step
        self._placement.replace_rows(self._unfingerprinted, counts, q_len, keys, values, slots)
        self._unfingerprinted = []
        self._fill_buffers(replaced=True)
