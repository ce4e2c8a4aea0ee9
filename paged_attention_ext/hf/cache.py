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
* Sliding-window layers attend with the op's ``sliding_window``; their out-of-window
  blocks are kept (all layers share one block table per row).
"""

import hashlib
from contextvars import ContextVar
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import transformers
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .. import ops
from ..block_manager import BlockSpaceManager
from ..kv_cache import PagedKVCache
from .batch import PagedBatch, flat_tokens

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
_POOL_GROWTH = 1.25  # a growing pool copies itself rarely and leaves at most a fifth unused


class _LayerCall(NamedTuple):
    key: torch.Tensor  # what update() returned: identifies the attention call the batch is for
    batch: PagedBatch


_padding_mask: ContextVar[Optional[torch.Tensor]] = ContextVar("paged_padding_mask", default=None)
_layer_call: ContextVar[Optional[_LayerCall]] = ContextVar("paged_layer_call", default=None)


def publish_padding_mask(attention_mask: Optional[torch.Tensor] = None, **kwargs) -> None:
    """The mask function of ``paged_attention_ext``: builds no mask, records the padding.

    Attention masks come from block tables and sequence lengths. The 2D mask
    (``[batch, past + new]``, 0 = padding) is kept for the next PagedCache forward.
    """
    _padding_mask.set(attention_mask)
    return None


def take_batch(key: torch.Tensor) -> Optional[PagedBatch]:
    """The batch a PagedCache published for the attention call that received ``key``."""
    call = _layer_call.get()
    if call is None or call.key is not key:
        return None
    _layer_call.set(None)  # so the pools are not kept alive after the forward
    return call.batch


def _fingerprints(keys: torch.Tensor, values: torch.Tensor) -> List[int]:
    """A 63-bit name per token from its K and V (``[kv_heads, tokens, head_size]`` each)."""
    data = torch.cat([keys, values], dim=-1).transpose(0, 1).contiguous()
    raw = data.view(data.shape[0], -1).view(torch.uint8).cpu().numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1
            for row in raw]


def _layer_types(config: PretrainedConfig) -> List[str]:
    """Each layer's attention type, inferred as transformers' DynamicCache does."""
    if getattr(config, "num_kv_shared_layers", None):
        raise NotImplementedError("PagedCache does not support layers that share another layer's K/V")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        layer_types = [kind] * config.num_hidden_layers
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise NotImplementedError(f"PagedCache supports {SUPPORTED_LAYER_TYPES} layers, not {unsupported}")
    return list(layer_types)


class PagedCache(Cache):
    """A transformers ``Cache`` storing K/V in paged blocks with sharing and copy-on-write.

    Use with a model loaded or built with ``attn_implementation="paged_attention_ext"``::

        model.generate(input_ids, past_key_values=PagedCache(model.config), ...)

    Args:
        config: the model's config (layer count and layer types).
        block_size: tokens per block.
        num_blocks: a fixed pool size in blocks (``NoFreeBlocksError`` when exhausted).
            ``None`` sizes the pool to what is in use, growing it by a quarter when needed, up
            to ``batch * ceil(max_position_embeddings / block_size)`` blocks.
        enable_prefix_caching: share the full blocks of identical prompt prefixes.

    The pools take the dtype, device and head shape of the first keys stored. One
    instance serves one ``generate`` call (or ``reset()`` it).
    """

    def __init__(self, config: PretrainedConfig, block_size: int = 16, num_blocks: Optional[int] = None,
                 enable_prefix_caching: bool = True) -> None:
        if int(transformers.__version__.split(".")[0]) < 5:
            raise RuntimeError(f"PagedCache needs transformers 5.x, found {transformers.__version__}")
        super().__init__(layers=[])  # one set of block tables serves every layer
        text_config = config.get_text_config(decoder=True)
        self.layer_types: List[str] = _layer_types(text_config)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_positions: Optional[int] = getattr(text_config, "max_position_embeddings", None)
        self._clear()

    def _clear(self) -> None:
        self.manager: Optional[BlockSpaceManager] = None  # created by the first forward
        self.kv: Optional[PagedKVCache] = None
        self.rows: List[Optional[int]] = []  # each batch row's sequence id; None: no token yet
        self._length = 0  # columns seen per row, padding included (transformers' seq length)
        self._next_seq_id = 0
        self._batch: Optional[PagedBatch] = None
        self._pool_spec: Optional[Tuple[int, int, torch.dtype, torch.device]] = None

    # ---- the transformers Cache interface ------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V (``[batch, kv_heads, q_len, head_size]``) in the pools.

        Returns its inputs unchanged: attention reads the history from the pools.
        """
        if layer_idx == 0:
            self._begin_forward(key_states, value_states)
        elif self._batch is None:
            raise RuntimeError("PagedCache: layer 0 must store its keys first in each forward")
        key_cache, value_cache = self.kv.layer(layer_idx)
        ops.write_kv(flat_tokens(key_states).to(key_cache.dtype),
                     flat_tokens(value_states).to(key_cache.dtype),
                     key_cache, value_cache, self._batch.slot_mapping)
        _layer_call.set(_LayerCall(key_states, self._batch))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
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
        """Free every row's blocks and drop the pools: the cache is as new."""
        for seq_id in self.rows:
            if seq_id is not None:
                self.manager.free_seq(seq_id)
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PagedCache cannot crop (assisted or speculative generation)")

    def early_initialization(self, *args, **kwargs) -> None:
        raise NotImplementedError("PagedCache allocates its pools on the first forward")

    def __len__(self) -> int:
        return len(self.layer_types)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.manager is not None

    @property
    def is_sliding(self) -> List[bool]:
        return [t == "sliding_attention" for t in self.layer_types]

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
        used = self.manager.device.num_used_blocks
        return {
            "pool_bytes": self.kv.num_blocks * self.kv.block_bytes,
            "used_bytes": used * self.kv.block_bytes,
            "blocks_used": used,
            "block_references": sum(len(self.manager.tables[s].blocks) for s in self.rows
                                    if s is not None),
        }

    # ---- placement -------------------------------------------------------------------------
    def _begin_forward(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Place this forward's new tokens and build its PagedBatch."""
        rows, kv_heads, q_len, head_size = keys.shape
        if not self.rows:
            self._start(rows, (kv_heads, head_size, keys.dtype, keys.device))
        if rows != len(self.rows):
            raise ValueError(f"PagedCache holds {len(self.rows)} rows, the forward has {rows}")
        counts = self._new_token_counts(rows, q_len)
        slots = [-1] * (rows * q_len)
        copies = []
        for row, count in enumerate(counts):
            if count == 0:
                continue
            pad = q_len - count
            seq_id = self.rows[row]
            if seq_id is None:
                seq_id = self.rows[row] = self._new_seq_id()
                prompt = (_fingerprints(keys[row, :, pad:], values[row, :, pad:])
                          if self.enable_prefix_caching else count)
                placed, num_cached = self.manager.allocate(seq_id, seq_id, prompt)
                pad += num_cached  # prefix hits: already stored, not written again
            elif pad:
                raise ValueError(f"PagedCache: row {row} has padding after its first token "
                                 "(only left padding is supported)")
            else:
                placed = self.manager.append(seq_id, count)
                copies.extend(placed.copies)
            slots[row * q_len + pad:(row + 1) * q_len] = placed.slots
        self._length += q_len
        tables = [self.manager.tables[s] if s is not None else None for s in self.rows]
        self._reserve(1 + max((max(t.blocks) for t in tables if t is not None and t.blocks),
                              default=0))
        self.kv.apply_copies(copies)  # before any layer writes this step's tokens
        query_rows = None
        if sum(counts) != rows * q_len:
            query_rows = [row * q_len + i for row, count in enumerate(counts)
                          for i in range(q_len - count, q_len)]
        self._batch = PagedBatch.build(
            self.kv, [t.blocks if t is not None else [] for t in tables],
            [t.num_tokens if t is not None else 0 for t in tables], counts, slots,
            write_kv=False, query_rows=query_rows)

    def _new_token_counts(self, rows: int, q_len: int) -> List[int]:
        """Real (non-padding) new tokens per row, from the published 2D attention mask."""
        mask = _padding_mask.get()
        _padding_mask.set(None)  # one forward's mask
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

    def _start(self, rows: int, pool_spec: Tuple[int, int, torch.dtype, torch.device]) -> None:
        self.rows = [None] * rows
        self._pool_spec = pool_spec
        if self.num_blocks is not None:
            capacity = self.num_blocks
        elif self.max_positions:
            # Without sharing, no row holds more blocks than the model's longest sequence.
            capacity = rows * -(-self.max_positions // self.block_size)
        else:
            raise ValueError("PagedCache: the config has no max_position_embeddings; pass num_blocks")
        self.manager = BlockSpaceManager(capacity, 0, self.block_size,
                                         enable_prefix_caching=self.enable_prefix_caching,
                                         watermark=0.0)
        if self.num_blocks is not None:
            self.kv = self._new_pool(self.num_blocks)

    def _new_pool(self, num_blocks: int) -> PagedKVCache:
        kv_heads, head_size, dtype, device = self._pool_spec
        return PagedKVCache(len(self.layer_types), kv_heads, head_size, self.block_size, dtype,
                            device, num_blocks=num_blocks)

    def _reserve(self, num_blocks: int) -> None:
        """Grow the pools to hold block ids below ``num_blocks`` (only without a fixed size).

        The allocator reuses freed blocks before it hands out a new id (in ascending order
        from 0), so the highest id in use tracks the peak number of blocks in use.
        """
        if self.kv is not None and num_blocks <= self.kv.num_blocks:
            return
        if self.kv is not None:
            num_blocks = min(self.manager.device.num_blocks,
                             max(num_blocks, int(self.kv.num_blocks * _POOL_GROWTH)))
        pool = self._new_pool(num_blocks)
        if self.kv is not None:
            for old, new in zip(self.kv.key_caches + self.kv.value_caches,
                                pool.key_caches + pool.value_caches):
                new[:old.shape[0]].copy_(old)
        self.kv = pool

    def _select_rows(self, indices: Sequence[int]) -> None:
        """Row i becomes a fork of old row ``indices[i]``; the old rows are freed."""
        if self.manager is None:
            return  # nothing stored yet
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
        self._batch = None

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1
