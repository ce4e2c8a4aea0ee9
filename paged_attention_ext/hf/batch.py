"""What one model forward needs to run attention on the paged cache.

The engine packs all tokens of a step into one row (``input_ids`` ``[1, num_tokens]``,
sequences one after another) and passes a :class:`PagedBatch` to the model as the
keyword argument ``paged_batch``; transformers forwards extra keyword arguments down
to every attention call, where :func:`paged_attention_ext.hf.attention.paged_attention_forward`
reads it.
"""

from dataclasses import dataclass
from typing import List, Sequence

import torch

from ..kv_cache import PagedKVCache


@dataclass
class PagedBatch:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor     # int64 [num_tokens]: where each token's K/V goes; -1 = skip
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor         # int32 [num_seqs]: KV length including this pass's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: packed rows of each sequence
    # False when something else (a transformers Cache.update) already wrote this pass's K/V.
    write_kv: bool = True

    @classmethod
    def build(cls, kv_cache: PagedKVCache, block_tables: Sequence[Sequence[int]],
              seq_lens: Sequence[int], query_lens: Sequence[int], slots: Sequence[int],
              write_kv: bool = True) -> "PagedBatch":
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
                   write_kv=write_kv)
