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

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..attention_metadata import AttentionMetadata
from ..cascade import CascadeBuffers, CascadePlan, padded_rows, plan_cascade, stage_split
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
    # A hybrid model's KV groups 1, 2, ... (kv_cache.kv_groups): their (slot_mapping,
    # block_tables), shaped as the fields above, which are group 0's.
    other_groups: Tuple[Tuple[torch.Tensor, torch.Tensor], ...] = ()
    # Per KV group, the step's cascade split (shared prefixes read once), or None: the
    # plain op. Empty: none for any group.
    cascades: Tuple[Optional[CascadePlan], ...] = ()
    # Per KV group, its attention metadata (tables, lengths, query rows, cascade split),
    # built and checked once here and read by each of the group's layers.
    attention: Tuple[AttentionMetadata, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tables = (self.block_tables, *(group_tables for _, group_tables in self.other_groups))
        self.attention = tuple(
            AttentionMetadata(group_tables, self.seq_lens, self.query_start_loc,
                              self.cascades[group] if group < len(self.cascades) else None)
            for group, group_tables in enumerate(tables))

    def _group(self, layer: int) -> int:
        """The layer's KV group, which this batch must have tables for."""
        group = self.kv_cache.kv_group(layer)
        if group > len(self.other_groups):
            raise ValueError(f"layer {layer} is in KV group {group}, but this batch has tables for "
                             f"{1 + len(self.other_groups)} group(s)")
        return group

    def attention_of(self, layer: int) -> AttentionMetadata:
        """The attention metadata of the layer's KV group."""
        return self.attention[self._group(layer)]

    def slots_of(self, layer: int) -> torch.Tensor:
        """The slot mapping of the layer's KV group (its tables are in :meth:`attention_of`)."""
        group = self._group(layer)
        return self.slot_mapping if group == 0 else self.other_groups[group - 1][0]

    @classmethod
    def build(cls, kv_cache: PagedKVCache, block_tables: Sequence[Sequence[Sequence[int]]],
              seq_lens: Sequence[int], query_lens: Sequence[int], slots: Sequence[Sequence[int]],
              write_kv: bool = True, query_rows: Optional[Sequence[int]] = None,
              on_stored: Optional[Callable[[int], None]] = None,
              cascade_min_saved_tokens: Optional[int] = None) -> "PagedBatch":
        """From plain lists, per KV group (``block_tables[g]``, ``slots[g]``): each sequence's
        blocks and its new tokens' slots; and each sequence's KV length and new-token count.

        ``cascade_min_saved_tokens``: plan cascade attention for the groups without a
        sliding window (:func:`~paged_attention_ext.cascade.plan_cascade`, where it saves at
        least that many key reads); None: the plain op only."""
        device = kv_cache.device
        width = max([1] + [len(t) for t in block_tables[0]])
        per_group = []
        for group_tables, group_slots in zip(block_tables, slots):
            per_group.append((torch.tensor(list(group_slots), dtype=torch.int64, device=device),
                              padded_rows(group_tables, width).to(device)))
        starts: List[int] = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(kv_cache=kv_cache, slot_mapping=per_group[0][0], block_tables=per_group[0][1],
                   seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                   write_kv=write_kv,
                   query_rows=(None if query_rows is None else
                               torch.tensor(list(query_rows), dtype=torch.int64, device=device)),
                   on_stored=on_stored, other_groups=tuple(per_group[1:]),
                   cascades=cls._plan_cascades(kv_cache, block_tables, seq_lens, query_lens,
                                               cascade_min_saved_tokens))

    @staticmethod
    def _plan_cascades(kv_cache: PagedKVCache, block_tables: Sequence[Sequence[Sequence[int]]],
                       seq_lens: Sequence[int], query_lens: Sequence[int],
                       min_saved_tokens: Optional[int]) -> Tuple[Optional[CascadePlan], ...]:
        if min_saved_tokens is None:
            return ()
        plans = tuple(
            None if group.sliding_window is not None else
            plan_cascade(tables, seq_lens, query_lens, kv_cache.block_size, kv_cache.device,
                         min_saved_tokens)
            for group, tables in zip(kv_cache.kv_groups.groups, block_tables))
        return plans if any(plan is not None for plan in plans) else ()


class StepBuffers:
    """The metadata tensors of a compiled :class:`~paged_attention_ext.hf.PagedCache`.

    Allocated once at fixed sizes and rewritten in place before every forward, so a forward
    compiled with ``torch.compile`` reads the same tensors (same shapes, same storage) each
    step and never recompiles for new values. Python bookkeeping (block allocation, forks,
    copy-on-write) runs before the forward and only fills these tensors. A hybrid model's
    KV groups each have their own block tables and slot mapping (``group_block_tables``,
    ``group_slot_mappings``; group 0's are ``block_tables`` and ``slot_mapping``).

    Left padding without data-dependent shapes: batch row ``r`` of a ``[rows, q_len]``
    forward is two sequences of the attention op. Sequence ``2r`` owns the row's padding
    queries and attends over ``scratch_block`` (never allocated, all zeros), so padding
    positions output zeros as in the eager path; sequence ``2r + 1`` owns its real tokens
    and attends over the row's blocks. Unused table entries are never read (``seq_lens``
    bounds them).

    With ``cascade_min_saved_tokens``, a forward whose rows share prompt blocks gets the
    cascade split (:mod:`paged_attention_ext.cascade`) in fixed buffers too (one group per
    sequence at most): its batch is a second object per shape, so a compiled forward has
    one graph for each.
    """

    def __init__(self, kv_cache: PagedKVCache, max_rows: int, max_blocks_per_row: int,
                 max_tokens: int, scratch_block: int, write_kv: bool,
                 on_stored: Optional[Callable[[int], None]] = None,
                 cascade_min_saved_tokens: Optional[int] = None) -> None:
        device = kv_cache.device
        groups = range(len(kv_cache.kv_groups.groups))
        self.kv_cache = kv_cache
        self.scratch_block = scratch_block
        self.group_block_tables = [torch.full((2 * max_rows, max_blocks_per_row), scratch_block,
                                              dtype=torch.int32, device=device) for _ in groups]
        self.group_slot_mappings = [torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
                                    for _ in groups]
        self.block_tables, self.slot_mapping = self.group_block_tables[0], self.group_slot_mappings[0]
        self.seq_lens = torch.zeros(2 * max_rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(2 * max_rows + 1, dtype=torch.int32, device=device)
        self.max_rows = max_rows
        # What each row's table holds now, per group.
        self._tables: List[List[Optional[List[int]]]] = [[None] * max_rows for _ in groups]
        self._write_kv = write_kv
        self._on_stored = on_stored
        self._batches: dict = {}  # (rows, q_len, cascade) -> PagedBatch of views, one per shape
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        self._cascade = ([None if group.sliding_window is not None else
                          CascadeBuffers(2 * max_rows, 2 * max_rows, max_blocks_per_row, device)
                          for group in kv_cache.kv_groups.groups]
                         if cascade_min_saved_tokens is not None else [])
        self.cascade_forwards = 0  # forwards that took the split

    def cascade_tensors(self) -> List[torch.Tensor]:
        """The cascade buffers (fixed addresses, like the others)."""
        return [t for b in self._cascade if b is not None for t in b.tensors()]

    def fill(self, tables: Sequence[Sequence[Sequence[int]]], seq_lens: Sequence[int],
             query_lens: Sequence[int], q_len: int, slots: Sequence[Sequence[int]]) -> PagedBatch:
        """Write one forward's metadata (per KV group: each row's blocks and the
        ``rows * q_len`` slots; per row: KV length, real new tokens) and return the batch
        of views the forward reads."""
        rows = len(seq_lens)
        width = self.block_tables.shape[1]
        if rows * 2 > self.seq_lens.shape[0] or rows * q_len > self.slot_mapping.shape[0]:
            raise ValueError(f"StepBuffers: a forward of {rows} rows x {q_len} tokens exceeds the "
                             f"buffers ({self.seq_lens.shape[0] // 2} rows, "
                             f"{self.slot_mapping.shape[0]} tokens)")
        lens: List[int] = []
        starts: List[int] = [0]
        for row, (kv_len, count) in enumerate(zip(seq_lens, query_lens)):
            lens += [q_len - count, kv_len]
            starts += [row * q_len + q_len - count, (row + 1) * q_len]
        for group, group_tables in enumerate(tables):
            self._fill_tables(group, group_tables, width)
        # One host tensor per buffer, copied into the fixed storage.
        self.seq_lens[:2 * rows].copy_(torch.tensor(lens, dtype=torch.int32))
        self.query_start_loc[:2 * rows + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        for buffer, group_slots in zip(self.group_slot_mappings, slots):
            buffer[:rows * q_len].copy_(torch.tensor(list(group_slots), dtype=torch.int64))
        return self.batch(rows, q_len, self._stage_cascade(tables, lens, starts))

    def _stage_cascade(self, tables: Sequence[Sequence[Sequence[int]]], lens: List[int],
                       starts: List[int]) -> bool:
        """Plan and stage the forward's split over its 2 * rows sequences (each row's
        padding sequence, then its real one); whether it runs."""
        if not self._cascade:
            return False
        sequences = [[table for t in group for table in ([self.scratch_block], list(t))]
                     for group in tables]
        saved = stage_split(self._cascade, sequences, lens,
                            [b - a for a, b in zip(starts, starts[1:])], self.kv_cache.block_size,
                            self.cascade_min_saved_tokens)
        self.cascade_forwards += saved is not None
        return saved is not None

    def _fill_tables(self, group: int, tables: Sequence[Sequence[int]], width: int) -> None:
        """Only the rows whose blocks changed (most decode steps change none); the padding
        sequences' tables (even rows) hold the scratch block from the start and never change."""
        held = self._tables[group]
        changed = [row for row, table in enumerate(tables) if held[row] != table]
        if not changed:
            return
        for row in changed:
            held[row] = list(tables[row])
        padded = [held[r] + [self.scratch_block] * (width - len(held[r])) for r in changed]
        new_rows = torch.tensor(padded, dtype=torch.int32)
        index = torch.tensor([2 * r + 1 for r in changed])
        buffer = self.group_block_tables[group]
        buffer.index_copy_(0, index.to(buffer.device), new_rows.to(buffer.device))

    def batch(self, rows: int, q_len: int, cascade: bool = False) -> PagedBatch:
        """The views for a ``[rows, q_len]`` forward (the same object every time), with the
        staged cascade split or without."""
        key = (rows, q_len, cascade)
        if key not in self._batches:
            others = tuple((slots[:rows * q_len], tables[:2 * rows]) for slots, tables in
                           zip(self.group_slot_mappings[1:], self.group_block_tables[1:]))
            starts = self.query_start_loc[:2 * rows + 1]
            plans = tuple(None if b is None else b.plan(2 * rows, 2 * rows, starts)
                          for b in self._cascade) if cascade else ()
            self._batches[key] = PagedBatch(
                kv_cache=self.kv_cache, slot_mapping=self.slot_mapping[:rows * q_len],
                block_tables=self.block_tables[:2 * rows], seq_lens=self.seq_lens[:2 * rows],
                query_start_loc=starts, write_kv=self._write_kv,
                on_stored=self._on_stored, other_groups=others, cascades=plans)
        return self._batches[key]
