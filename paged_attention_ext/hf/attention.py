"""The ``paged_attention_ext`` attention implementation for transformers models.

transformers calls an attention function per layer with the layer's new queries,
keys and values (``[batch, heads, tokens, head_size]``). This one attends with
``paged.attention`` over the block tables of the forward's :class:`PagedBatch`, which
comes from one of two places:

* the ``paged_batch`` keyword argument (the engine's packed forward): the function
  also stores the keys and values with ``paged.write_kv``;
* the :class:`~paged_attention_ext.hf.PagedCache` passed as ``past_key_values``: its
  ``update`` has already stored them and published the batch for this layer call.
"""

from typing import Optional, Tuple

import torch

from .. import ops
from .batch import PagedBatch, flat_tokens
from .cache import take_batch


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    paged_batch: Optional[PagedBatch] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    batch = paged_batch if paged_batch is not None else take_batch(key)
    if batch is None:
        raise ValueError("attn_implementation='paged_attention_ext' needs a PagedBatch (pass "
                         "paged_batch=... to the model forward) or a PagedCache as past_key_values")
    key_cache, value_cache = batch.kv_cache.layer(module.layer_idx)
    if batch.write_kv:
        ops.write_kv(flat_tokens(key).to(key_cache.dtype), flat_tokens(value).to(key_cache.dtype),
                     key_cache, value_cache, batch.slot_mapping)
    rows, heads, q_len, head_size = query.shape
    q = flat_tokens(query).to(key_cache.dtype)
    if batch.query_rows is not None:
        q = q.index_select(0, batch.query_rows)
    scale = scaling if scaling is not None else head_size ** -0.5
    out = ops.attention(q, key_cache, value_cache, batch.block_tables, batch.seq_lens, scale,
                        batch.query_start_loc, None, sliding_window or -1, softcap or 0.0)
    if batch.query_rows is not None:
        # Padding positions get zeros; nothing reads them (they are never keys).
        out = out.new_zeros(rows * q_len, heads, head_size).index_copy_(0, batch.query_rows, out)
    # transformers expects [batch, tokens, heads, head_size].
    return out.view(rows, q_len, heads, head_size).to(query.dtype), None
