"""What one model forward needs to run attention on the paged cache.

Two producers build a :class:`PagedBatch`:

* the engine packs all tokens of a step into one row (``input_ids`` ``[1, num_tokens]``,
  sequences one after another) and passes the batch to the model as the keyword argument
  ``paged_batch``; transformers forwards extra keyword arguments down to every attention
  call, where :func:`paged_attention_ext.hf.attention.paged_attention_forward` reads it and
  also writes the K/V;
* :class:`paged_attention_ext.hf.PagedCache` builds one per ``generate`` forward (rows of a
  ``[batch, q_len]`` input, possibly left-padded), writes the K/V itself in ``update`` and
  hands the batch to the attention function with ``write_kv=False``.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..kv_cache import PagedKVCache


def flat_tokens(states: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, q_len, head_size]`` -> ``[batch * q_len, heads, head_size]``.

    A view when ``batch`` or ``q_len`` is 1 (the packed forward, decode steps); the ops
    only need the last dimension contiguous.
    """
    batch, heads, q_len, head_size = states.shape
    return states.transpose(1, 2).reshape(batch * q_len, heads, head_size)


@dataclass
class PagedBatch:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor     # int64 [num_tokens]: where each token's K/V goes; -1 = skip
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor         # int32 [num_seqs]: KV length including this pass's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: packed rows of each sequence
    # False when something else (a transformers Cache.update) already wrote this pass's K/V.
    write_kv: bool = True
    # int64 [num_query_tokens]: the rows of the flattened [batch * q_len] query that are real
    # tokens, in packed order; None = all of them. Left padding leaves the others out (their
    # attention output is zero).
    query_rows: Optional[torch.Tensor] = None
    # Called with the layer index once the attention function has stored a layer's K/V
    # (a PagedCache of an MLA model, whose update() only sees the latents, counts on it).
    on_stored: Optional[Callable[[int], None]] = None

    @classmethod
    def build(cls, kv_cache: PagedKVCache, block_tables: Sequence[Sequence[int]],
              seq_lens: Sequence[int], query_lens: Sequence[int], slots: Sequence[int],
              write_kv: bool = True, query_rows: Optional[Sequence[int]] = None,
              on_stored: Optional[Callable[[int], None]] = None) -> "PagedBatch":
        """From plain lists: each sequence's blocks, KV length, new-token count and slots."""
        device = kv_cache.device
        width = max([1] + [len(t) for t in block_tables])
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        starts: List[int] = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(kv_cache=kv_cache,
                   slot_mapping=torch.tensor(list(slots), dtype=torch.int64, device=device),
                   block_tables=tables.to(device),
                   seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                   write_kv=write_kv,
                   query_rows=(None if query_rows is None else
                               torch.tensor(list(query_rows), dtype=torch.int64, device=device)),
                   on_stored=on_stored)
