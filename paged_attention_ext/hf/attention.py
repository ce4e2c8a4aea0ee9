"""The ``paged_attention_ext`` attention implementation for transformers models.

transformers calls an attention function per layer with the layer's new queries,
keys and values (``[batch, heads, tokens, head_size]``). This one stores the keys
and values into the layer's paged pools with ``paged.write_kv`` and attends with
``paged.attention`` over the block tables of the current :class:`PagedBatch`.
"""

from typing import Optional, Tuple

import torch

from .. import ops
from .batch import PagedBatch


def _flat_tokens(states: torch.Tensor) -> torch.Tensor:
    """``[1, heads, tokens, head_size]`` -> ``[tokens, heads, head_size]`` (a view)."""
    if states.shape[0] != 1:
        raise ValueError("the packed paged forward takes one row of packed tokens, "
                         f"got a batch of {states.shape[0]}")
    return states[0].transpose(0, 1)


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
    if paged_batch is None:
        raise ValueError("attn_implementation='paged_attention_ext' needs a PagedBatch: pass "
                         "paged_batch=... to the model forward")
    batch = paged_batch
    key_cache, value_cache = batch.kv_cache.layer(module.layer_idx)
    if batch.write_kv:
        ops.write_kv(_flat_tokens(key).to(key_cache.dtype), _flat_tokens(value).to(key_cache.dtype),
                     key_cache, value_cache, batch.slot_mapping)
    q = _flat_tokens(query).to(key_cache.dtype)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ops.attention(q, key_cache, value_cache, batch.block_tables, batch.seq_lens, scale,
                        batch.query_start_loc, None, sliding_window or -1, softcap or 0.0)
    # transformers expects [batch, tokens, heads, head_size].
    return out.to(query.dtype).unsqueeze(0), None
