"""Cascade attention: sequences that share their first blocks read them once per step.

Samples and beams of one prompt, and requests whose prompts hit the same prefix-cache
blocks, hold one copy of the shared blocks; plain decode attention still reads that copy
once per sequence. A :class:`CascadePlan` splits a batch's attention into

1. :func:`~paged_attention_ext.ops.shared_prefix_attention` over each group's shared
   prefix, every prefix block read once for all the group's query rows;
2. :func:`~paged_attention_ext.ops.attention_with_lse` over each sequence's own blocks
   (its table after the prefix);
3. :func:`~paged_attention_ext.ops.merge_attention_states` of the two, which is exact.

As FlashInfer's wrappers do, :func:`plan_cascade` runs once per step on the host, from the
block tables and lengths alone (never from device data, so a compiled or captured step
stays valid), and :meth:`CascadePlan.run` once per layer. It returns None where the split
does not pay: no group whose shared prefix saves at least ``min_saved_tokens`` key reads,
such as a single sequence or two sharing a short prompt; the plain op runs then.

A group is a run of consecutive sequences of the batch (the engine and ``PagedCache``
keep the samples and beams of a request next to each other); its prefix is the blocks
every member holds at the same logical positions, whole blocks before each member's
first query. ALiBi and sliding windows depend on each query's position, which the
shared-prefix op does not know: layers with them run the plain op (:meth:`applies_to`).
"""

from dataclasses import dataclass
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import ops

# Key reads a group must save per step ((members - 1) * prefix tokens) before the split
# pays for its two extra ops: bench/bench_cascade.py's sweep (AMD EPYC, AVX2, 2 threads,
# bf16, 32/8 heads) broke even between 3072 and 6144 (4 sequences sharing 1024 tokens:
# 0.92x, sharing 2048: 1.05x; 2 sharing 4096: 0.93x).
DEFAULT_MIN_SAVED_TOKENS = 6144


@dataclass(frozen=True)
class CascadePlan:
    """One step's split of a batch (its packed query rows) into shared prefixes and suffixes.

    ``prefix_*``: one row per group (groups of one sequence, or that do not pay, have
    length 0); ``group_starts``: each group's query rows. ``suffix_*``: one row per
    sequence of the batch, its blocks after its group's prefix; ``query_start_loc`` the
    batch's own.
    """

    prefix_block_tables: torch.Tensor  # int32 [num_groups, width]
    prefix_lens: torch.Tensor          # int32 [num_groups]
    group_starts: torch.Tensor         # int32 [num_groups + 1]
    suffix_block_tables: torch.Tensor  # int32 [num_seqs, width]
    suffix_lens: torch.Tensor          # int32 [num_seqs]
    query_start_loc: Optional[torch.Tensor]  # int32 [num_seqs + 1]; None: one row per sequence
    saved_tokens: int = 0              # key reads per KV head the prefixes save this step

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """The plan's metadata tensors (a compiled step marks their batch dimension dynamic)."""
        return (self.prefix_block_tables, self.prefix_lens, self.group_starts,
                self.suffix_block_tables, self.suffix_lens)

    @staticmethod
    def applies_to(sliding_window: Optional[int], alibi_slopes: Optional[torch.Tensor]) -> bool:
        """Whether a layer can run the split (no window, no ALiBi)."""
        return (sliding_window is None or sliding_window <= 0) and alibi_slopes is None

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scale: float, soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None,
            k_scale: Optional[torch.Tensor] = None,
            v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer's attention of the batch's query rows; equals :func:`ops.attention` with
        the batch's own tables (sinks are counted once, in the prefix part)."""
        prefix_out, prefix_lse = ops.shared_prefix_attention(
            query, key_cache, value_cache, self.prefix_block_tables, self.prefix_lens,
            self.group_starts, scale, soft_cap, sinks, k_scale, v_scale)
        suffix_out, suffix_lse = ops.attention_with_lse(
            query, key_cache, value_cache, self.suffix_block_tables, self.suffix_lens, scale,
            self.query_start_loc, None, -1, soft_cap, None, k_scale, v_scale)
        return ops.merge_attention_states([prefix_out, suffix_out], [prefix_lse, suffix_lse])[0]


def _common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(limit, len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class CascadeLayout:
    """A :class:`CascadePlan` as host lists (tables unpadded): what a step with fixed
    buffers copies into them."""

    prefix_tables: List[List[int]]
    prefix_lens: List[int]
    group_starts: List[int]
    suffix_tables: List[List[int]]
    suffix_lens: List[int]
    query_start_loc: List[int]
    saved_tokens: int


class Run(NamedTuple):
    """Consecutive sequences ``[first, end)``; ``shared`` leading blocks of ``anchor`` (the
    first with query rows) are the prefix of its ``members`` (the sequences with query
    rows), 0 where the run does not pay."""

    first: int
    end: int
    shared: int
    anchor: int
    members: int


def find_groups(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                query_lens: Sequence[int], block_size: int, min_saved_tokens: int) -> List[Run]:
    """Runs covering the batch in order. A sequence joins the current run while the run's
    saving ``(members - 1) * shared`` does not drop (a member that shares less shortens the
    prefix of all). Sequences without query rows (padding) join whichever run holds them."""
    runs: List[Run] = []
    start, anchor, common, members = 0, -1, 0, 0
    for i, table in enumerate(block_tables):
        if query_lens[i] == 0:
            continue
        usable = max(0, seq_lens[i] - query_lens[i]) // block_size  # whole blocks before its queries
        if anchor >= 0:
            shared = _common_length(block_tables[anchor], table, min(common, usable))
            if shared > 0 and members * shared >= (members - 1) * common:
                common, members = shared, members + 1
                continue
            runs.append(Run(start, i, common, anchor, members))
            start = i
        anchor, common, members = i, usable, 1
    if block_tables:
        runs.append(Run(start, len(block_tables), common, max(anchor, start), members))
    threshold = max(1, min_saved_tokens)
    return [run if (run.members - 1) * run.shared * block_size >= threshold else run._replace(shared=0)
            for run in runs]


def query_starts(query_lens: Iterable[int]) -> List[int]:
    """Each sequence's first query row in the packed rows, and the rows' count last."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def layout_cascade(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                   query_lens: Sequence[int], block_size: int,
                   min_saved_tokens: int = DEFAULT_MIN_SAVED_TOKENS) -> Optional[CascadeLayout]:
    """The split of a batch as host lists, or None where it does not pay (see
    :func:`plan_cascade`)."""
    # An upper bound first (every sequence but one sharing the longest prefix any could
    # have), so a batch that cannot pay costs one pass over its lengths.
    usable = [max(0, n - q) for n, q in zip(seq_lens, query_lens) if q > 0]
    if len(usable) < 2 or (len(usable) - 1) * max(usable) < max(1, min_saved_tokens):
        return None
    runs = find_groups(block_tables, seq_lens, query_lens, block_size, min_saved_tokens)
    if not any(run.shared for run in runs):
        return None
    starts = query_starts(query_lens)
    layout = CascadeLayout([], [], [0], [], [], starts,
                           sum((run.members - 1) * run.shared * block_size for run in runs))
    for first, end, shared, anchor, _ in runs:
        layout.prefix_tables.append(list(block_tables[anchor][:shared]))
        layout.prefix_lens.append(shared * block_size)
        for i in range(first, end):
            rows = query_lens[i]
            layout.suffix_tables.append(list(block_tables[i][shared:]) if rows else [])
            layout.suffix_lens.append(seq_lens[i] - shared * block_size if rows else 0)
        layout.group_starts.append(starts[end])
    return layout


def unsplit_layout(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                   query_lens: Sequence[int]) -> CascadeLayout:
    """The layout that splits nothing: one group with an empty prefix, every sequence whole
    (for a step whose fixed graph runs the split)."""
    starts = query_starts(query_lens)
    return CascadeLayout([[]], [0], [0, starts[-1]], [list(t) for t in block_tables],
                         list(seq_lens), starts, 0)


def padded_rows(rows: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """int32 ``[len(rows), width]``, each row zero padded (entries past a length are never read)."""
    flat: List[int] = []
    for row in rows:
        flat += row
        flat += [0] * (width - len(row))
    return torch.tensor(flat, dtype=torch.int32).view(len(rows), width)


def plan_cascade(block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
                 query_lens: Sequence[int], block_size: int, device: torch.device,
                 min_saved_tokens: int = DEFAULT_MIN_SAVED_TOKENS) -> Optional[CascadePlan]:
    """The split of a batch (each sequence's block ids, KV length including its
    ``query_lens`` new tokens, which are packed in order), or None where it does not pay:
    no group saves ``min_saved_tokens`` key reads per step."""
    layout = layout_cascade(block_tables, seq_lens, query_lens, block_size, min_saved_tokens)
    if layout is None:
        return None
    width = max([1] + [len(t) for t in block_tables])

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device)

    return CascadePlan(prefix_block_tables=padded_rows(layout.prefix_tables, width).to(device),
                       prefix_lens=tensor(layout.prefix_lens), group_starts=tensor(layout.group_starts),
                       suffix_block_tables=padded_rows(layout.suffix_tables, width).to(device),
                       suffix_lens=tensor(layout.suffix_lens),
                       query_start_loc=tensor(layout.query_start_loc),
                       saved_tokens=layout.saved_tokens)


class CascadeBuffers:
    """A :class:`CascadePlan` at fixed shapes for compiled and captured steps: up to
    ``max_groups`` groups and ``max_seqs`` sequences, rewritten in place each step. A
    step's groups are padded with empty ones (no prefix, no rows), so the plan's shapes
    depend on the batch size alone."""

    def __init__(self, max_seqs: int, max_groups: int, width: int, device: torch.device) -> None:
        ints = dict(dtype=torch.int32, device=device)
        self.prefix_tables = torch.zeros(max_groups, width, **ints)
        self.prefix_lens = torch.zeros(max_groups, **ints)
        self.group_starts = torch.zeros(max_groups + 1, **ints)
        self.suffix_tables = torch.zeros(max_seqs, width, **ints)
        self.suffix_lens = torch.zeros(max_seqs, **ints)

    def stage(self, layout: CascadeLayout, num_seqs: int, num_groups: int) -> None:
        """Copy a layout of ``num_seqs`` sequences in, padded to ``num_groups`` groups."""
        groups = len(layout.prefix_lens)
        if groups > num_groups or len(layout.suffix_lens) != num_seqs:
            raise ValueError(f"CascadeBuffers: a split of {groups} groups and "
                             f"{len(layout.suffix_lens)} sequences does not fit {num_groups} "
                             f"groups of {num_seqs} sequences")
        pad = num_groups - groups
        width = max([1] + [len(t) for t in layout.prefix_tables + layout.suffix_tables])
        self.prefix_tables[:groups, :width].copy_(padded_rows(layout.prefix_tables, width))
        self.suffix_tables[:num_seqs, :width].copy_(padded_rows(layout.suffix_tables, width))
        self.prefix_lens[:num_groups].copy_(torch.tensor(layout.prefix_lens + [0] * pad, dtype=torch.int32))
        self.suffix_lens[:num_seqs].copy_(torch.tensor(layout.suffix_lens, dtype=torch.int32))
        self.group_starts[:num_groups + 1].copy_(
            torch.tensor(layout.group_starts + [layout.group_starts[-1]] * pad, dtype=torch.int32))

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """Every buffer (a compiled forward marks their addresses static)."""
        return (self.prefix_tables, self.prefix_lens, self.group_starts, self.suffix_tables,
                self.suffix_lens)

    def plan(self, num_seqs: int, num_groups: int,
             query_start_loc: Optional[torch.Tensor] = None) -> CascadePlan:
        """The plan over views of the buffers (``query_start_loc`` None: decode rows)."""
        return CascadePlan(self.prefix_tables[:num_groups], self.prefix_lens[:num_groups],
                           self.group_starts[:num_groups + 1], self.suffix_tables[:num_seqs],
                           self.suffix_lens[:num_seqs], query_start_loc)


def stage_split(buffers: Sequence[Optional[CascadeBuffers]],
                block_tables: Sequence[Sequence[Sequence[int]]], seq_lens: Sequence[int],
                query_lens: Sequence[int], block_size: int,
                min_saved_tokens: int) -> Optional[int]:
    """One fixed-shape step: plan each KV group's split (a group whose buffers are None
    attends plainly) and, if any group takes one, stage every group's (an unsplit layout
    for the others, whose graph runs the split too). Returns the key reads saved, or None:
    run the plain step."""
    layouts = [None if b is None else
               layout_cascade(tables, seq_lens, query_lens, block_size, min_saved_tokens)
               for b, tables in zip(buffers, block_tables)]
    if all(layout is None for layout in layouts):
        return None
    for b, layout, tables in zip(buffers, layouts, block_tables):
        if b is not None:
            b.stage(layout or unsplit_layout(tables, seq_lens, query_lens), len(seq_lens),
                    len(seq_lens))
    return sum(layout.saved_tokens for layout in layouts if layout is not None)
