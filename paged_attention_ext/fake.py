"""Fake (meta) implementations: output shapes and dtypes without running a kernel.

They let the ops trace under ``torch.compile`` and ``FakeTensorMode``. Shape
checks live in the real kernels; here only what the output metadata needs.
"""

from typing import Optional

import torch


def _out_shape(query: torch.Tensor, value_cache: torch.Tensor):
    """``[num_tokens, num_heads, head_size_v]``: the value cache's head size."""
    return (query.shape[0], query.shape[1], value_cache.shape[-1])


@torch.library.register_fake("paged::attention")
def _attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                    query_start_loc=None, alibi_slopes=None, sliding_window=-1, soft_cap=0.0,
                    sinks=None):
    return query.new_empty(_out_shape(query, value_cache))


@torch.library.register_fake("paged::attention_with_lse")
def _attention_with_lse_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                             query_start_loc=None, alibi_slopes=None, sliding_window=-1,
                             soft_cap=0.0, sinks=None):
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    return query.new_empty(_out_shape(query, value_cache)), lse


@torch.library.register_fake("paged::attention_out")
def _attention_out_fake(out, lse: Optional[torch.Tensor], query, key_cache, value_cache,
                        block_tables, seq_lens, scale, query_start_loc=None, alibi_slopes=None,
                        sliding_window=-1, soft_cap=0.0, sinks=None):
    return None


@torch.library.register_fake("paged::write_kv")
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping):
    return None


@torch.library.register_fake("paged::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping):
    return None


@torch.library.register_fake("paged::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    return None
