"""Where a ``generate`` batch's rows keep their tokens: one block-manager sequence per row.

:class:`RowPlacement` owns the :class:`~paged_attention_ext.block_manager.BlockSpaceManager`
of a :class:`~paged_attention_ext.hf.PagedCache` and the sequence id of each batch row, and
answers its questions: how many new tokens each row has (from the 2D padding mask), whether
the rows and the pool have room for them, which slots they take, which rows a beam step keeps.

Prefix caching: ``generate`` repeats each prompt per returned sequence or beam. The cache
never sees token ids, so it names each prompt token by a 63-bit fingerprint of its layer-0
key and value (which depend only on the token and its position, RoPE included) and lets the
block manager's prefix cache match full blocks: a repeated row takes the blocks the first
row registered in the same forward and skips writing them.
"""

import hashlib
from typing import List, NamedTuple, Optional, Sequence

import torch

from ..block_allocator import NoFreeBlocksError
from ..block_manager import BlockSpaceManager
from ..kv_groups import KVGroupLayout


class RowLimit(NamedTuple):
    """The most tokens a row may hold, and how an error message names that limit."""
    tokens: int
    described: str  # follows "more than " in the message


class Placed(NamedTuple):
    """A forward's new tokens, placed: per KV group the ``rows * q_len`` slots (-1: padding
    or a prefix hit), the copy-on-write copies to apply before any layer writes, and the
    rows that started a sequence."""
    slots: List[List[int]]
    copies: List
    started: List[int]


def token_fingerprints(keys: torch.Tensor, values: torch.Tensor) -> List[int]:
    """A 63-bit name per token from its K and V (``[kv_heads, tokens, head_size]`` each)."""
    data = torch.cat([keys, values], dim=-1).transpose(0, 1).contiguous()
    raw = data.view(data.shape[0], -1).view(torch.uint8).cpu().numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1
            for row in raw]


def new_token_counts(mask: Optional[torch.Tensor], rows: int, q_len: int, past: int) -> List[int]:
    """Real (non-padding) new tokens per row from the 2D mask ``[rows, past + q_len]``."""
    if mask is None:
        return [q_len] * rows
    if tuple(mask.shape) != (rows, past + q_len):
        raise ValueError(f"PagedCache: attention_mask has shape {tuple(mask.shape)}, expected "
                         f"{(rows, past + q_len)} (past and new tokens)")
    valid = mask[:, -q_len:].to("cpu", torch.bool)
    counts = valid.sum(dim=1)
    left_padded = torch.arange(q_len) >= (q_len - counts)[:, None]
    if not torch.equal(valid, left_padded):
        raise ValueError("PagedCache supports left padding only")
    return counts.tolist()


class RowPlacement:
    """The batch rows' sequences in one block manager (created with the first forward)."""

    def __init__(self, num_rows: int, capacity: int, block_size: int, enable_prefix_caching: bool,
                 kv_groups: KVGroupLayout, num_state_slots: Optional[int] = None) -> None:
        """``num_state_slots``: a model with linear-attention layers: state slots (one per
        row's sequence, see :mod:`paged_attention_ext.state_slots`)."""
        self.manager = BlockSpaceManager(capacity, 0, block_size,
                                         enable_prefix_caching=enable_prefix_caching,
                                         watermark=0.0, kv_group_windows=kv_groups.windows,
                                         device_setting="PagedCache(num_blocks=...)",
                                         num_state_slots=num_state_slots)
        self.prefix_caching = enable_prefix_caching
        self.rows: List[Optional[int]] = [None] * num_rows  # sequence ids; None: no token yet
        self._next_seq_id = 0

    # ---- questions (no state changes) -----------------------------------------------------
    def check_rows(self, num_rows: int) -> None:
        if num_rows != len(self.rows):
            raise ValueError(f"PagedCache holds {len(self.rows)} rows, the forward has {num_rows}")

    def check_left_padding(self, counts: Sequence[int], q_len: int) -> None:
        """Rows that hold tokens get no padding: only left padding (before a row's first
        token) is supported."""
        for row, count in enumerate(counts):
            if self.rows[row] is not None and 0 < count < q_len:
                raise ValueError(f"PagedCache: row {row} has padding after its first token "
                                 "(only left padding is supported)")

    def check_room(self, counts: Sequence[int], limit: Optional[RowLimit],
                   pool_advice: Optional[str], new_rows_exact: bool) -> None:
        """Refuse new tokens a row (``limit``) or the pool cannot take, before any change.

        The pool is checked when ``pool_advice`` (the message's remedy) is given. New rows
        are counted without prefix hits; with ``new_rows_exact`` False a forward that starts
        rows is let through (its prefix hits may make it fit; the allocation then decides).
        """
        if limit is not None:
            for row, (seq, count) in enumerate(zip(self.rows, counts)):
                total = (self.manager.num_tokens(seq) if seq is not None else 0) + count
                if total > limit.tokens:
                    raise ValueError(f"PagedCache: row {row} would hold {total} tokens, more "
                                     f"than {limit.described}")
        if pool_advice is None:
            return
        needed = sum(self.manager.seq_append_cost(s, c) if s is not None
                     else self.manager.new_seq_cost(c) for s, c in zip(self.rows, counts))
        free = self.manager.num_free_device_blocks
        starts_rows = any(s is None and c > 0 for s, c in zip(self.rows, counts))
        if needed > free and (new_rows_exact or not starts_rows):
            raise NoFreeBlocksError(
                f"PagedCache: this forward needs {needed} more blocks, the fixed pool "
                f"(num_blocks={self.manager.num_device_blocks}) has {free} free; {pool_advice}")

    def tables(self) -> List[List[List[int]]]:
        """Per KV group, each row's block ids (``[]`` for a row without tokens)."""
        return [[self.manager.block_ids(s, g) if s is not None else [] for s in self.rows]
                for g in range(self.manager.num_kv_groups)]

    def state_slots(self) -> List[int]:
        """Each row's state slot (every row holds a sequence)."""
        return [self.manager.states.slot(s) for s in self.rows]

    def seq_lens(self) -> List[int]:
        return [self.manager.num_tokens(s) if s is not None else 0 for s in self.rows]

    def block_references(self) -> int:
        """Every row's blocks, shared ones once per row."""
        return sum(len(t.live_blocks) for s in self.rows
                   if s is not None and self.manager.has_seq(s)
                   for t in self.manager.tables[s])

    # ---- actions ----------------------------------------------------------------------------
    def place(self, counts: Sequence[int], q_len: int, keys: Optional[torch.Tensor] = None,
              values: Optional[torch.Tensor] = None) -> Placed:
        """Give each row's new tokens slots (new rows: a sequence, with prefix hits when
        ``keys`` and ``values`` are given to fingerprint; others: an append)."""
        slots = [[-1] * (len(counts) * q_len) for _ in range(self.manager.num_kv_groups)]
        copies: List = []
        started: List[int] = []
        for row, count in enumerate(counts):
            if count == 0:
                continue
            pad = q_len - count
            seq_id = self.rows[row]
            if seq_id is None:
                seq_id = self._new_seq_id()
                prompt = (token_fingerprints(keys[row, :, pad:], values[row, :, pad:])
                          if self.prefix_caching and keys is not None else count)
                # The forward computes every prompt token's query, prefix hits included.
                placed, num_cached = self.manager.allocate(seq_id, seq_id, prompt,
                                                           queries_from_start=True)
                self.rows[row] = seq_id  # only once the manager knows it
                started.append(row)
                pad += num_cached  # prefix hits: already stored, not written again
            else:
                placed = self.manager.append(seq_id, count)
                copies.extend(placed.copies)
            for group_slots, placed_slots in zip(slots, placed.slots):
                group_slots[row * q_len + pad:(row + 1) * q_len] = placed_slots
        return Placed(slots, copies, started)

    def replace_rows(self, rows: Sequence[int], counts: Sequence[int], q_len: int,
                     keys: torch.Tensor, values: torch.Tensor, slots: List[List[int]]) -> None:
        """Place the sequences that ``rows`` started again, now with prefix fingerprints of
        their K/V (nothing is written yet), and update their entries of ``slots``."""
        for row in rows:
            self.manager.free_seq(self.rows[row])
            self.rows[row] = None
        only = [count if row in rows else 0 for row, count in enumerate(counts)]
        placed = self.place(only, q_len, keys, values)
        for group_slots, group_placed in zip(slots, placed.slots):
            for row in rows:
                group_slots[row * q_len:(row + 1) * q_len] = group_placed[row * q_len:(row + 1) * q_len]

    def select_rows(self, indices: Sequence[int]) -> None:
        """Row i becomes a fork of old row ``indices[i]``; the old rows are freed."""
        bad = [i for i in indices if not 0 <= i < len(self.rows)]
        if bad:
            raise IndexError(f"PagedCache: rows {bad} do not exist (the cache holds "
                             f"{len(self.rows)} rows)")
        new_rows: List[Optional[int]] = []
        for index in indices:
            parent = self.rows[index]
            child = None
            if parent is not None:
                child = self._new_seq_id()
                self.manager.fork(parent, child)
            new_rows.append(child)
        for seq_id in self.rows:  # after the forks, so shared blocks never drop to zero
            if seq_id is not None:
                self.manager.free_seq(seq_id)
        self.rows = new_rows

    def remove_last(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` of every row that holds tokens (all rows checked
        before any changes); padding is on the left, so those tokens are real."""
        keep = {seq_id: max(0, self.manager.num_tokens(seq_id) - num_tokens)
                for seq_id in self.rows if seq_id is not None}
        for seq_id, kept in keep.items():
            for table in self.manager.tables[seq_id]:
                table.check_truncate(kept)
        for seq_id, kept in keep.items():
            self.manager.truncate(seq_id, kept)

    def free_all(self) -> None:
        for seq_id in self.rows:
            if seq_id is not None and self.manager.has_seq(seq_id):
                self.manager.free_seq(seq_id)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

