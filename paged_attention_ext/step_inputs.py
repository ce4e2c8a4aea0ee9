"""One step's inputs: where each new token's K/V goes and what each sequence attends over.

A step (an engine step, a ``generate`` forward) runs sequences whose query rows are packed
one after another. Every KV group (:mod:`paged_attention_ext.kv_groups`: full attention,
each sliding window, each chunk size) has its own slots and block tables over the same
sequences, lengths and query rows, and every group appears here alike.

The producer (the engine's runner, a ``PagedCache``) builds the step once as host lists,
a :class:`StepPlan`, and converts it to tensors once, into a :class:`StepInputs`:

* :meth:`StepInputs.from_plan`: fresh tensors of the step's own shapes (a ``PagedCache``'s
  eager forwards);
* :meth:`paged_attention_ext.step_buffers.StepBuffers.fill`: the same written in place into
  persistent buffers (compiled and graph-captured forwards, which read fixed addresses),
  and :meth:`~paged_attention_ext.step_buffers.StepBuffers.fill_sized`: written there too,
  read through views of the step's own shapes (the engine's eager forwards).

Each group's :class:`~paged_attention_ext.attention_metadata.AttentionMetadata` is derived
from the inputs once, when they are built, and read by every layer of the group. A chunked
group's metadata is :func:`~paged_attention_ext.chunked.chunk_local`'s rewrite of the
step's, so its layers attend within their chunks through the same ops.
"""

from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from .attention_metadata import AttentionMetadata
from .cascade import CascadePlan, padded_rows, plan_cascade, query_starts
from .chunked import ChunkLocalMetadata, chunk_local
from .kv_cache import PagedKVCache


_TYPECODES = {torch.int32: "i", torch.int64: "q"}


def host_tensor(values: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
    """Python ints as a 1-D CPU tensor of ``dtype`` (int32 or int64): packed through an
    ``array``, about 3.5x faster than ``torch.tensor`` on a list of a few hundred."""
    packed = array(_TYPECODES[dtype], values)
    return torch.frombuffer(packed, dtype=dtype) if packed else torch.empty(0, dtype=dtype)


@dataclass(frozen=True)
class StepPlan:
    """A step as host lists, its sequences in packed order."""

    tables: Sequence[Sequence[Sequence[int]]]  # per KV group, per sequence: its block ids
    slots: Sequence[Sequence[int]]  # per KV group, per query token: its slot (-1: not written)
    seq_lens: Sequence[int]          # per sequence: KV tokens, this step's included
    query_lens: Sequence[int]        # per sequence: its query rows this step
    # The rows of a flattened [rows, q_len] query that are real tokens, in packed order
    # (left padding leaves the others out); None: every row.
    query_rows: Optional[Sequence[int]] = None

    @cached_property
    def num_tokens(self) -> int:
        """Query tokens (each has a slot in every group)."""
        return sum(self.query_lens)

    def query_start_loc(self) -> List[int]:
        return query_starts(self.query_lens)

    @cached_property
    def _width(self) -> int:
        return max([1] + [len(t) for group in self.tables for t in group])

    def width(self) -> int:
        """The longest table of any group (at least 1)."""
        return self._width


@dataclass
class StepInputs:
    """A step's inputs as tensors; the tuples have one entry per KV group."""

    slot_mappings: Tuple[torch.Tensor, ...]  # int64 [num_tokens]: each token's slot; -1: skip
    block_tables: Tuple[torch.Tensor, ...]   # int32 [num_seqs, width]
    seq_lens: torch.Tensor                   # int32 [num_seqs]
    query_start_loc: Optional[torch.Tensor]  # int32 [num_seqs + 1]; None: one row per sequence
    # Per group, its cascade split (shared prefixes read once) or None; empty: none at all.
    cascades: Tuple[Optional[CascadePlan], ...] = ()
    query_rows: Optional[torch.Tensor] = None  # int64, as StepPlan's
    # Per group, its chunk size (chunked local attention) or None; empty: no chunked group.
    chunk_sizes: Tuple[Optional[int], ...] = ()
    block_size: int = 0  # tokens per block; needed with chunk_sizes
    # Per group, a chunked group's chunk-local metadata already rewritten (StepBuffers'
    # fixed buffers) or None; empty: rewrite chunked groups here (chunk_sizes).
    chunk_local: Tuple[Optional[ChunkLocalMetadata], ...] = ()
    # The host lists these tensors hold (None: built from tensors alone): a layer that
    # decides on the step's lengths reads them here, once per step, not back from the
    # tensors. Inputs handed out for every step of a shape (StepBuffers.fill) get each
    # step's.
    plan: Optional[StepPlan] = field(default=None, repr=False)
    # Per group, its attention metadata: derived and checked once, read by its layers.
    attention: Tuple[AttentionMetadata, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.attention = tuple(self._metadata(group, tables)
                               for group, tables in enumerate(self.block_tables))

    def _metadata(self, group: int, tables: torch.Tensor) -> AttentionMetadata:
        if self.chunk_local and self.chunk_local[group] is not None:
            return AttentionMetadata(*self.chunk_local[group])
        chunk = self.chunk_sizes[group] if self.chunk_sizes else None
        if chunk is not None:  # never split: a cascade's shared prefix ignores chunks
            return AttentionMetadata(*chunk_local(tables, self.seq_lens, chunk, self.block_size,
                                                  self.query_start_loc))
        return AttentionMetadata(tables, self.seq_lens, self.query_start_loc,
                                 self.cascades[group] if self.cascades else None)

    @property
    def num_kv_groups(self) -> int:
        return len(self.block_tables)

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V this step writes (every group's slot mapping has one per token)."""
        return self.slot_mappings[0].shape[0]

    @property
    def cascade_saved_tokens(self) -> int:
        """Key reads (per layer and KV head) the step's cascade split saves."""
        return sum(plan.saved_tokens for plan in self.cascades if plan is not None)

    @classmethod
    def from_plan(cls, plan: StepPlan, kv_cache: PagedKVCache,
                  cascade_min_saved_tokens: Optional[int] = None) -> "StepInputs":
        """The plan as fresh tensors on the cache's device. ``cascade_min_saved_tokens``:
        plan cascade attention for the groups without a sliding window, where it saves at
        least that many key reads (:func:`~paged_attention_ext.cascade.plan_cascade`);
        None: the plain op only."""
        device, width = kv_cache.device, plan.width()
        return cls(
            slot_mappings=tuple(host_tensor(slots, torch.int64).to(device) for slots in plan.slots),
            block_tables=tuple(padded_rows(tables, width).to(device) for tables in plan.tables),
            seq_lens=host_tensor(plan.seq_lens, torch.int32).to(device),
            query_start_loc=host_tensor(plan.query_start_loc(), torch.int32).to(device),
            cascades=plan_cascades(plan, kv_cache, cascade_min_saved_tokens),
            query_rows=(None if plan.query_rows is None else
                        host_tensor(plan.query_rows, torch.int64).to(device)),
            chunk_sizes=tuple(group.chunk_size for group in kv_cache.kv_groups.groups),
            block_size=kv_cache.block_size, plan=plan)


def plan_cascades(plan: StepPlan, kv_cache: PagedKVCache,
                  min_saved_tokens: Optional[int]) -> Tuple[Optional[CascadePlan], ...]:
    """Per group, the step's cascade split where it saves ``min_saved_tokens`` key reads
    (groups with a sliding window: none); empty where no group takes one."""
    if min_saved_tokens is None:
        return ()
    plans = tuple(
        None if group.sliding_window is not None else
        plan_cascade(tables, plan.seq_lens, plan.query_lens, kv_cache.block_size,
                     kv_cache.device, min_saved_tokens)
        for group, tables in zip(kv_cache.kv_groups.groups, plan.tables))
    return plans if any(p is not None for p in plans) else ()
