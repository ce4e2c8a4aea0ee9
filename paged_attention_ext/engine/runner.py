"""One packed model forward per engine step.

Every scheduled sequence contributes the tokens whose K/V is not cached yet (a whole
prompt, the part of it the prefix cache missed, a recomputation, or one decode token),
packed sequence after sequence into a single row. The ``paged_attention_ext`` attention
writes each token's K/V to its slot and attends with the multi-token form of
``paged.attention``; only the last position of each sequence goes through the LM head.

A step in which every sequence computes one token (a decode step) goes through the
:class:`~paged_attention_ext.engine.compiled.CompiledDecode` forward when the engine has
one; prefills and mixed steps run eager (docs/engine.md says why).
"""

from typing import List, Optional, Tuple

import torch

from ..hf import PagedBatch
from ..kv_cache import PagedKVCache
from .compiled import CompiledDecode
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache,
                 decode: Optional[CompiledDecode] = None,
                 cascade_min_saved_tokens: Optional[int] = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.decode = decode
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        self.cascade_steps = 0          # steps that ran cascade attention
        self.cascade_saved_tokens = 0   # key reads (per layer and KV head) their prefixes saved

    @torch.no_grad()
    def forward(self, step: SchedulerOutput) -> List[torch.Tensor]:
        """Per scheduled group, fp32 logits ``[live sequences, vocab]`` of each live
        sequence's last token, its uncomputed tokens written at the step's slots and read
        through the step's block tables."""
        num_kv_groups = len(self.kv_cache.kv_groups.groups)
        ids: List[int] = []
        positions: List[int] = []
        slots: List[List[int]] = [[] for _ in range(num_kv_groups)]
        tables: List[List[List[int]]] = [[] for _ in range(num_kv_groups)]
        seq_lens: List[int] = []
        query_lens: List[int] = []
        for group in step.groups:
            for seq in group.live_seqs:
                start, end = seq.num_computed, len(seq.token_ids)
                placed = step.slots[seq.seq_id]
                if len(placed) != num_kv_groups or any(len(p) != end - start for p in placed):
                    raise RuntimeError(f"sequence {seq.seq_id}: {end - start} tokens to compute in "
                                       f"{num_kv_groups} KV group(s), slots placed for "
                                       f"{[len(p) for p in placed]}")
                ids += seq.token_ids[start:end]
                positions += range(start, end)
                for g in range(num_kv_groups):
                    slots[g] += placed[g]
                    tables[g].append(step.tables[seq.seq_id][g])
                seq_lens.append(end)
                query_lens.append(end - start)
        width = max(len(t) for t in tables[0])
        if self.decode is not None and len(ids) == len(seq_lens) and self.decode.fits(len(ids), width):
            logits = self.decode.run(ids, positions, slots, tables, seq_lens)
        else:
            logits = self._packed(ids, positions, slots, tables, seq_lens, query_lens)
        return list(logits.float().split([len(g.live_seqs) for g in step.groups]))

    def _packed(self, ids: List[int], positions: List[int], slots: List[List[int]],
                tables: List[List[List[int]]], seq_lens: List[int],
                query_lens: List[int]) -> torch.Tensor:
        """The eager packed forward: logits of each sequence's last token."""
        batch, last_rows = self._packed_batch(slots, tables, seq_lens, query_lens)
        device = self.kv_cache.device
        return self.model(input_ids=torch.tensor([ids]).to(device),
                          position_ids=torch.tensor([positions]).to(device),
                          paged_batch=batch, use_cache=False, logits_to_keep=last_rows).logits[0]

    def _packed_batch(self, slots: List[List[int]], tables: List[List[List[int]]],
                      seq_lens: List[int], query_lens: List[int]) -> Tuple[PagedBatch, torch.Tensor]:
        """The batch's tensors from the lists, and the rows of each sequence's last token."""
        batch = PagedBatch.build(self.kv_cache, tables, seq_lens, query_lens, slots,
                                 cascade_min_saved_tokens=self.cascade_min_saved_tokens)
        self._count_cascade([plan.saved_tokens for plan in batch.cascades if plan is not None])
        return batch, (batch.query_start_loc[1:] - 1).long()

    def _count_cascade(self, saved: List[int]) -> None:
        if saved:
            self.cascade_steps += 1
            self.cascade_saved_tokens += sum(saved)
