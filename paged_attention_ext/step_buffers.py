"""A step's inputs in persistent buffers, for forwards that are compiled or graph-captured.

A compiled forward (``torch.compile``) recompiles when its inputs' shapes change, and a CUDA
graph replays fixed addresses. :class:`StepBuffers` allocates every tensor of a
:class:`~paged_attention_ext.step_inputs.StepInputs` once, at the most sequences and tokens
a step may have and a fixed table width, and :meth:`StepBuffers.fill` writes each step's
:class:`~paged_attention_ext.step_inputs.StepPlan` into it in place, as vLLM's input batch
does. The inputs a step reads are views of the buffers' leading rows, one object per shape,
so the forward sees the same tensors every step. Table entries past a sequence's blocks
are never read (its length bounds them).

An eager forward (the engine's prefills and mixed steps) fills the same buffers with
:meth:`StepBuffers.fill_sized`, whose views have the step's own shapes, so a step writes
into storage that lives across steps rather than allocating its inputs anew.

With ``cascade_min_saved_tokens`` a step whose sequences share leading blocks also gets the
cascade split (:mod:`paged_attention_ext.cascade`) in fixed buffers, one group per
sequence at most: its inputs are a second object per shape, so a compiled forward has a
graph for each.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .cascade import CascadeBuffers, CascadePlan, query_starts, stage_split, unsplit_layout
from .chunked import ChunkLocalMetadata, chunk_pieces, max_chunk_pieces
from .kv_cache import PagedKVCache
from .step_inputs import StepInputs, StepPlan, host_tensor


class StepBuffers:
    """Persistent :class:`StepInputs` of up to ``max_seqs`` sequences and ``max_tokens``
    tokens, tables ``width`` blocks wide (unused entries hold ``pad_block``).

    ``decode``: every sequence has one query row (the decode form of the op: no
    ``query_start_loc``)."""

    def __init__(self, kv_cache: PagedKVCache, max_seqs: int, max_tokens: int, width: int, *,
                 pad_block: int = 0, decode: bool = False,
                 cascade_min_saved_tokens: Optional[int] = None) -> None:
        device = kv_cache.device
        groups = kv_cache.kv_groups.groups
        self.block_size = kv_cache.block_size
        self.pad_block = pad_block
        self.block_tables = [torch.full((max_seqs, width), pad_block, dtype=torch.int32, device=device)
                             for _ in groups]
        self.slot_mappings = [torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
                              for _ in groups]
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = (None if decode else
                                torch.zeros(max_seqs + 1, dtype=torch.int32, device=device))
        # What each table row holds now, per group: a row is written only when it changes
        # (most decode steps change none). [] is a row of pad_block only.
        self._held: List[List[List[int]]] = [[[] for _ in range(max_seqs)] for _ in groups]
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        # Groups with a sliding window attend plainly (the split ignores windows).
        self._cascade = ([None if group.sliding_window is not None else
                          CascadeBuffers(max_seqs, max_seqs, width, device) for group in groups]
                         if cascade_min_saved_tokens is not None else [])
        # A chunked group's chunk-local metadata (chunk_local's rewrite), in buffers of its own.
        self._chunks = [None if group.chunk_size is None else
                        _ChunkBuffers(group.chunk_size, max_seqs, max_tokens, width, pad_block,
                                      device, decode) for group in groups]
        self._inputs: Dict[Tuple[int, int, bool], StepInputs] = {}
        self.cascade_steps = 0         # steps that took the split
        self.cascade_saved_tokens = 0  # key reads (per layer and KV head) it saved

    @property
    def max_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_tokens(self) -> int:
        return self.slot_mappings[0].shape[0]

    @property
    def width(self) -> int:
        return self.block_tables[0].shape[1]

    @property
    def plans_cascade(self) -> bool:
        """Whether steps may take the cascade split (``cascade_min_saved_tokens`` given)."""
        return bool(self._cascade)

    def tensors(self) -> List[torch.Tensor]:
        """Every buffer (fixed addresses: a compiled forward may mark them static)."""
        cascade = [t for b in self._cascade if b is not None for t in b.tensors()]
        chunks = [t for b in self._chunks if b is not None for t in b.tensors()]
        starts = [] if self.query_start_loc is None else [self.query_start_loc]
        return [*self.block_tables, *self.slot_mappings, self.seq_lens, *starts, *cascade, *chunks]

    def fits(self, plan: StepPlan) -> bool:
        """Whether the step's sequences, tokens and tables fit the buffers."""
        return (len(plan.seq_lens) <= self.max_seqs and plan.num_tokens <= self.max_tokens
                and plan.width() <= self.width)

    def fill(self, plan: StepPlan) -> StepInputs:
        """Write the step into the buffers and return the inputs it reads: the same object
        for every step of its shape (a compiled forward's or a graph's fixed inputs)."""
        self._write(plan)
        num_seqs, num_tokens = len(plan.seq_lens), plan.num_tokens
        for group, chunks in enumerate(self._chunks):
            if chunks is not None:
                chunks.fill(plan, group, self.block_size, chunks.num_pieces(num_seqs, num_tokens))
        inputs = self.inputs(num_seqs, num_tokens, self._stage_cascade(plan))
        inputs.plan = plan  # the same object every step of its shape: this step's lists
        return inputs

    def fill_sized(self, plan: StepPlan,
                   cascades: Tuple[Optional[CascadePlan], ...] = ()) -> StepInputs:
        """Write the step into the buffers and return views of its own shapes (tables as
        wide as its longest), as :meth:`StepInputs.from_plan` would build them: an eager
        forward's, whose shapes change every step. ``cascades``: the step's split as
        :func:`~paged_attention_ext.step_inputs.plan_cascades` plans it (any number of
        groups, so not staged here)."""
        self._write(plan)
        num_seqs, num_tokens, width = len(plan.seq_lens), plan.num_tokens, plan.width()
        return StepInputs(
            slot_mappings=tuple(b[:num_tokens] for b in self.slot_mappings),
            block_tables=tuple(b[:num_seqs, :width] for b in self.block_tables),
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=(None if self.query_start_loc is None
                             else self.query_start_loc[:num_seqs + 1]),
            cascades=cascades,
            chunk_sizes=tuple(None if b is None else b.chunk_size for b in self._chunks),
            block_size=self.block_size, plan=plan)

    def _write(self, plan: StepPlan) -> None:
        if not self.fits(plan):
            raise ValueError(f"StepBuffers: a step of {len(plan.seq_lens)} sequences, "
                             f"{plan.num_tokens} tokens and tables of {plan.width()} blocks "
                             f"exceeds the buffers ({self.max_seqs} sequences, "
                             f"{self.max_tokens} tokens, {self.width} blocks)")
        if plan.query_rows is not None:
            raise ValueError("StepBuffers: fixed buffers have no query_rows; give padding "
                             "queries sequences of their own")
        num_seqs, num_tokens = len(plan.seq_lens), plan.num_tokens
        for group, tables in enumerate(plan.tables):
            self._fill_tables(group, tables)
        # One host tensor per buffer, copied into the fixed storage.
        self.seq_lens[:num_seqs].copy_(host_tensor(plan.seq_lens, torch.int32), non_blocking=True)
        if self.query_start_loc is not None:
            self.query_start_loc[:num_seqs + 1].copy_(
                host_tensor(plan.query_start_loc(), torch.int32), non_blocking=True)
        for buffer, slots in zip(self.slot_mappings, plan.slots):
            buffer[:num_tokens].copy_(host_tensor(slots, torch.int64), non_blocking=True)

    def inputs(self, num_seqs: int, num_tokens: int, cascade: bool = False) -> StepInputs:
        """Views of the buffers for a step of this shape (the same object every time), with
        the staged cascade split or without."""
        key = (num_seqs, num_tokens, cascade)
        if key not in self._inputs:
            starts = None if self.query_start_loc is None else self.query_start_loc[:num_seqs + 1]
            plans = tuple(None if b is None else b.plan(num_seqs, num_seqs, starts)
                          for b in self._cascade) if cascade else ()
            self._inputs[key] = StepInputs(
                slot_mappings=tuple(b[:num_tokens] for b in self.slot_mappings),
                block_tables=tuple(b[:num_seqs] for b in self.block_tables),
                seq_lens=self.seq_lens[:num_seqs], query_start_loc=starts, cascades=plans,
                chunk_local=tuple(
                    None if b is None else b.metadata(b.num_pieces(num_seqs, num_tokens))
                    for b in self._chunks))
        inputs = self._inputs[key]
        inputs.plan = None  # fill() sets the step's host lists; no other caller gets a stale one
        return inputs

    def stage_unsplit(self, num_seqs: int) -> None:
        """A valid split of a step of empty sequences (a warm-up's): one empty group."""
        for buffers in self._cascade:
            if buffers is not None:
                buffers.stage(unsplit_layout([[]] * num_seqs, [0] * num_seqs, [1] * num_seqs),
                              num_seqs, num_seqs)

    def _stage_cascade(self, plan: StepPlan) -> bool:
        """Plan and stage the step's split per group; whether it runs. One sequence has
        nothing to share (and a compiled step of one has a graph of its own)."""
        if not self._cascade or len(plan.seq_lens) < 2:
            return False
        saved = stage_split(self._cascade, plan.tables, plan.seq_lens, plan.query_lens,
                            self.block_size, self.cascade_min_saved_tokens)
        if saved is None:
            return False
        self.cascade_steps += 1
        self.cascade_saved_tokens += saved
        return True

    def _fill_tables(self, group: int, tables: Sequence[Sequence[int]]) -> None:
        _write_rows(self.block_tables[group], self._held[group], tables, self.pad_block)


def _write_rows(buffer: torch.Tensor, held: List[List[int]], tables: Sequence[Sequence[int]],
                pad_block: int) -> None:
    """Rewrite the leading rows of ``buffer`` whose table changed (``held``: what each row
    holds now), as wide as the old or the new table (each row stays its table followed by
    ``pad_block``)."""
    changed = [seq for seq, table in enumerate(tables) if held[seq] != table]
    if not changed:
        return
    width = max(max(len(held[s]), len(tables[s])) for s in changed)
    for seq in changed:
        held[seq] = list(tables[seq])
    flat: List[int] = []
    for seq in changed:
        flat += held[seq]
        flat += [pad_block] * (width - len(held[seq]))
    padded = host_tensor(flat, torch.int32).view(len(changed), width)
    if changed[-1] == len(changed) - 1:  # the leading rows (a prefill's): one slice
        buffer[:len(changed), :width].copy_(padded, non_blocking=True)
        return
    index = torch.tensor(changed).to(buffer.device)
    buffer[:, :width].index_copy_(0, index, padded.to(buffer.device))


class _ChunkBuffers:
    """One chunked group's :func:`~paged_attention_ext.chunked.chunk_local` metadata, computed
    on the host from the step's plan and written in place: a step of a given shape reads the
    same tensors every time. A multi-token step's sequences become pieces of one chunk each,
    padded with empty pieces to :func:`~paged_attention_ext.chunked.max_chunk_pieces` (a
    fixed count per shape); a decode step's are its sequences."""

    def __init__(self, chunk_size: int, max_seqs: int, max_tokens: int, width: int,
                 pad_block: int, device: torch.device, decode: bool) -> None:
        self.chunk_size, self.pad_block, self.decode = chunk_size, pad_block, decode
        rows = max_seqs if decode else max_chunk_pieces(max_seqs, max_tokens, chunk_size)
        self.block_tables = torch.full((rows, width), pad_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_start_loc = (None if decode else
                                torch.zeros(rows + 1, dtype=torch.int32, device=device))
        self._held: List[List[int]] = [[] for _ in range(rows)]

    def num_pieces(self, num_seqs: int, num_tokens: int) -> int:
        return num_seqs if self.decode else max_chunk_pieces(num_seqs, num_tokens, self.chunk_size)

    def tensors(self) -> List[torch.Tensor]:
        starts = [] if self.query_start_loc is None else [self.query_start_loc]
        return [self.block_tables, self.seq_lens, *starts]

    def fill(self, plan: StepPlan, group: int, block_size: int, num_pieces: int) -> None:
        chunk = self.chunk_size
        if self.decode:  # each sequence's chunk is its last position's (padding: length 0)
            pieces = [(seq, max(length - 1, 0) // chunk * chunk, length, 1)
                      for seq, length in enumerate(plan.seq_lens)]
            pieces = [(seq, start, length - start, rows) for seq, start, length, rows in pieces]
        else:
            pieces = chunk_pieces(plan.seq_lens, plan.query_lens, chunk)
        tables = plan.tables[group]
        rows = [list(tables[seq][start // block_size:]) if length else []
                for seq, start, length, _ in pieces]
        pad = num_pieces - len(pieces)
        _write_rows(self.block_tables, self._held, rows + [[]] * pad, self.pad_block)
        self.seq_lens[:num_pieces].copy_(
            host_tensor([piece[2] for piece in pieces] + [0] * pad, torch.int32), non_blocking=True)
        if self.query_start_loc is not None:
            starts = query_starts(piece[3] for piece in pieces)
            self.query_start_loc[:num_pieces + 1].copy_(
                host_tensor(starts + starts[-1:] * pad, torch.int32), non_blocking=True)

    def metadata(self, num_pieces: int) -> ChunkLocalMetadata:
        """Views of the buffers for a step of ``num_pieces`` pieces."""
        return ChunkLocalMetadata(
            self.block_tables[:num_pieces], self.seq_lens[:num_pieces],
            None if self.query_start_loc is None else self.query_start_loc[:num_pieces + 1])
