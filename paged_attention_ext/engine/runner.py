"""One packed model forward per engine step.

Every scheduled sequence contributes the tokens whose K/V is not cached yet (a whole
prompt, the part of it the prefix cache missed, a recomputation, or one decode token),
packed sequence after sequence into a single row. The ``paged_attention_ext`` attention
writes each token's K/V to its slot and attends with the multi-token form of
``paged.attention``; only the last position of each sequence goes through the LM head.
"""

from typing import List, Mapping, Sequence

import torch

from ..block_manager import BlockSpaceManager
from ..hf import PagedBatch
from ..kv_cache import PagedKVCache
from .sequence import SequenceGroup


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    @torch.no_grad()
    def forward(self, groups: Sequence[SequenceGroup], slots_of: Mapping[int, List[int]],
                manager: BlockSpaceManager) -> List[torch.Tensor]:
        """Per group, fp32 logits ``[live sequences, vocab]`` of each live sequence's last token.

        ``slots_of``: per sequence, the slots the block manager placed its uncomputed
        tokens in.
        """
        ids: List[int] = []
        positions: List[int] = []
        slots: List[int] = []
        tables, seq_lens, query_lens, last_rows = [], [], [], []
        for group in groups:
            for seq in group.live_seqs:
                start, end = seq.num_computed, len(seq.token_ids)
                if len(slots_of[seq.seq_id]) != end - start:
                    raise RuntimeError(f"sequence {seq.seq_id}: {end - start} tokens to compute, "
                                       f"{len(slots_of[seq.seq_id])} slots placed")
                ids += seq.token_ids[start:end]
                positions += range(start, end)
                slots += slots_of[seq.seq_id]
                tables.append(manager.block_ids(seq.seq_id))
                seq_lens.append(end)
                query_lens.append(end - start)
                last_rows.append(len(ids) - 1)
        batch = PagedBatch.build(self.kv_cache, tables, seq_lens, query_lens, slots)
        device = self.kv_cache.device
        logits = self.model(input_ids=torch.tensor([ids], device=device),
                            position_ids=torch.tensor([positions], device=device),
                            paged_batch=batch, use_cache=False,
                            logits_to_keep=torch.tensor(last_rows, device=device)).logits[0]
        return list(logits.float().split([len(g.live_seqs) for g in groups]))
