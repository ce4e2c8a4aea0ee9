"""What one model forward needs to run attention on the paged cache.

Two producers build a :class:`PagedBatch` around the step's
:class:`~paged_attention_ext.step_inputs.StepInputs`:

* the engine packs all tokens of a step into one row (``input_ids`` ``[1, num_tokens]``,
  sequences one after another) and passes the batch to the model as the keyword argument
  ``paged_batch``; transformers forwards extra keyword arguments down to every attention
  call, where :func:`paged_attention_ext.hf.attention.paged_attention_forward` reads it and
  also writes the K/V (an MLA model's latent rows are written by the forward's
  :class:`~paged_attention_ext.hf.packed_latents.PackedLatentCache`, ``write_kv=False``);
* :class:`paged_attention_ext.hf.PagedCache` builds one per ``generate`` forward (rows of a
  ``[batch, q_len]`` input, possibly left-padded), writes the K/V itself in ``update`` and
  hands the batch to the attention function with ``write_kv=False``.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import torch

from ..attention_metadata import AttentionMetadata
from ..kv_cache import PagedKVCache
from ..step_inputs import StepInputs, StepPlan
from .linear_step import LinearStep

if TYPE_CHECKING:
    from .latent_prefill import LatentRuns


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
    inputs: StepInputs  # slots, tables and attention metadata of every KV group
    # False when something else (a transformers Cache.update) already wrote this pass's K/V.
    write_kv: bool = True
    # Called with the layer index once the attention function has stored a layer's K/V
    # (a PagedCache of an MLA model, whose update() only sees the latents, counts on it).
    on_stored: Optional[Callable[[int], None]] = None
    # A PagedCache forward's row width, and this batch for queries of only the last positions
    # of each row: transformers' Gemma-4 runs its KV-shared layers on the positions whose
    # logits it keeps (the others' K/V are stored already).
    q_len: Optional[int] = None
    last_queries: Optional[Callable[[int], "PagedBatch"]] = None
    # The engine's forward of a hybrid model: how its linear-attention layers run the packed
    # row, sequence by sequence from their state slots (hf/hooks/packed_linear_attention.py).
    linear: Optional[LinearStep] = None
    # An MLA model's step: which sequences attend expanded, decided by its first latent
    # layer for all (hf/latent_prefill.step_runs).
    latent_runs: Optional["LatentRuns"] = field(default=None, init=False, repr=False)

    def _group(self, layer: int) -> int:
        """The layer's KV group, which this batch must have tables for."""
        group = self.kv_cache.kv_group(layer)
        if group >= self.inputs.num_kv_groups:
            raise ValueError(f"layer {layer} is in KV group {group}, but this batch has tables for "
                             f"{self.inputs.num_kv_groups} group(s)")
        return group

    def attention_of(self, layer: int) -> AttentionMetadata:
        """The attention metadata of the layer's KV group."""
        return self.inputs.attention[self._group(layer)]

    def slots_of(self, layer: int) -> torch.Tensor:
        """The slot mapping of the layer's KV group (its tables are in :meth:`attention_of`)."""
        return self.inputs.slot_mappings[self._group(layer)]


def real_query_rows(counts: Sequence[int], q_len: int) -> Optional[List[int]]:
    """The flattened ``[rows, q_len]`` query rows that are real tokens (row ``r``'s last
    ``counts[r]``), None when every row is."""
    if sum(counts) == len(counts) * q_len:
        return None
    return [row * q_len + i for row, count in enumerate(counts) for i in range(q_len - count, q_len)]


def rows_as_sequences(tables: Sequence[Sequence[Sequence[int]]], seq_lens: Sequence[int],
                      counts: Sequence[int], q_len: int, slots: Sequence[Sequence[int]],
                      scratch_block: int) -> StepPlan:
    """A left-padded ``[rows, q_len]`` forward as a plan without data-dependent shapes.

    Batch row ``r`` is two sequences of the attention op: sequence ``2r`` owns the row's
    padding queries and attends over ``scratch_block`` (never allocated, all zeros), so
    padding positions output zeros as in the eager path; sequence ``2r + 1`` owns the row's
    ``counts[r]`` real tokens and attends over its blocks (``tables[g][r]`` per KV group).
    """
    lens: List[int] = []
    query_lens: List[int] = []
    for kv_len, count in zip(seq_lens, counts):
        lens += [q_len - count, kv_len]
        query_lens += [q_len - count, count]
    sequences = [[table for row in group for table in ([scratch_block], list(row))]
                 for group in tables]
    return StepPlan(sequences, slots, lens, query_lens)
