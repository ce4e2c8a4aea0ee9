"""Block bookkeeping for sequence groups: admission, append, fork, preemption by swap or free.

A *sequence group* is the set of sequences of one request (parallel samples, beams).
Groups are admitted, preempted and restored as a whole (all-or-nothing), so a step
never runs with part of a group's blocks. The manager owns two allocators over the
same block shape: the device pool and a host swap pool, and every block table.

A scheduler asks and acts in one call where the answer decides the action: ``try_admit``
and ``try_swap_in`` place a group or return None with nothing changed (as vLLM's
``allocate_slots``); ``append_cost`` counts the blocks that a group's next tokens take, for
the scheduler's reservations before it places them (``append_group``). Every action
returns what the step must do with the cache: the slots to write, the blocks to copy
(copy-on-write) and to swap. Every method either succeeds (or answers None) or raises with
no state changed. How many blocks tokens take is :func:`block_table.blocks_needed`'s
arithmetic, here only summed over tables and KV groups.

A hybrid model's sequences hold one block table per KV group (``kv_group_windows``,
:mod:`paged_attention_ext.kv_groups`), all over the one device pool: every question
counts the blocks of every group, a sliding-window group frees the blocks its window
has left (a chunked group those of its finished chunks), and a prefix-cache hit is as long
as every group can serve (full groups: the whole prefix; sliding groups: the window before
the first recomputed token; chunked groups: that token's chunk). Slots
then come per group, every group alike (:class:`SeqSlots`).

A model with linear-attention layers (``num_state_slots``) also gives each sequence one
fixed-size state slot (:class:`~paged_attention_ext.state_slots.StateSlots`, owned here
beside the blocks): taken when the sequence is admitted or forked, freed with it, swapped
with its group's blocks, all-or-nothing; admission and swap-in count free slots as they
count free blocks. The slots' moves (zero, copy, swap) are taken with :meth:`take_state_moves`.
A prefix hit then only serves a caller that computes every prompt token anyway
(``queries_from_start``: a transformers forward, whose hits save K/V storage, not compute);
otherwise it would reuse K/V blocks while the linear layers' state at that position is
nowhere kept, so admission takes no hits (docs/linear_attention.md).
"""

from collections import Counter
from types import MappingProxyType
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar

from .block_allocator import BlockAllocator, NoFreeBlocksError
from .block_table import (NULL_BLOCK, AppendResult, BlockPair, BlockTable, block_hashes,
                          blocks_needed, check_window)
from .kv_groups import Window
from .state_slots import StateMove, StateSlots

T = TypeVar("T")

__all__ = ["BlockAllocator", "BlockTable", "AppendResult", "BlockSpaceManager", "NoFreeBlocksError",
           "SeqSlots", "SeqSpec"]


class SeqSlots(NamedTuple):
    """One sequence's new tokens placed in every KV group: per group, one slot per token
    (``slots[g]``, the same tokens in each group); the copy-on-write copies of all groups,
    to apply before any slot is written."""

    slots: List[List[int]]
    copies: List[BlockPair]

    @property
    def num_tokens(self) -> int:
        """Tokens placed: one count, asked of every group alike."""
        return _agreed("slots placed", (len(s) for s in self.slots))


class SeqSpec(NamedTuple):
    """One sequence as the manager needs to know it to place it."""

    seq_id: int
    num_tokens: int
    names: Sequence[bytes] = ()  # its full blocks' names (block_hashes), with prefix caching


class _MovePlan(NamedTuple):
    """A group's move to another pool (:meth:`BlockSpaceManager._move_plan`)."""

    reuse: Dict[int, bytes]  # blocks whose content the target still caches, by name
    to_copy: List[int]       # distinct blocks to copy
    needed: int              # blocks the move takes from the target's available ones


class Checkpoint(NamedTuple):
    """Copies of everything a manager knows (see :meth:`BlockSpaceManager.checkpoint`)."""

    device: BlockAllocator
    host: BlockAllocator
    tables: Dict[int, List[BlockTable]]
    groups: Dict[int, List[int]]
    group_of: Dict[int, int]
    states: Optional[StateSlots]


class BlockSpaceManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, watermark: float = 0.01,
                 kv_group_windows: Sequence[Window] = (None,),
                 device_setting: str = "num_device_blocks",
                 host_setting: str = "num_host_blocks",
                 num_state_slots: Optional[int] = None, num_host_state_slots: int = 0,
                 state_setting: str = "num_state_slots",
                 host_state_setting: str = "num_host_state_slots") -> None:
        """``device_setting`` / ``host_setting`` / ``state_setting`` / ``host_state_setting``:
        what the caller's user sets to size each pool, named when it runs out. ``num_state_slots``: a model with
        linear-attention layers: the most sequences whose states the device holds at once
        (``num_host_state_slots`` in the swap pool); None: no linear layers."""
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if not kv_group_windows:
            raise ValueError("kv_group_windows needs one entry per KV group (None: full attention)")
        for window in kv_group_windows:
            check_window(window, block_size)
        self.kv_group_windows = tuple(kv_group_windows)
        self.device = BlockAllocator(num_device_blocks, block_size, enable_prefix_caching, "device",
                                     device_setting)
        self.host = BlockAllocator(num_host_blocks, block_size, name="host", setting=host_setting)
        self.block_size = block_size
        # Admission keeps this many device blocks spare so running groups can keep decoding.
        self._watermark_blocks = int(watermark * num_device_blocks)
        self._tables: Dict[int, List[BlockTable]] = {}  # per sequence, one per KV group
        self._groups: Dict[int, List[int]] = {}
        self._group_of: Dict[int, int] = {}
        self.states: Optional[StateSlots] = None
        if num_state_slots is not None:
            self.states = StateSlots(num_state_slots, num_host_state_slots, state_setting,
                                     host_state_setting)

    # ---- read-only views, for tests and inspection (library code asks the questions below)
    @property
    def tables(self) -> Mapping[int, Sequence[BlockTable]]:
        """Each sequence's tables, one per KV group (``tables[seq][g]``)."""
        return MappingProxyType(self._tables)

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_group_windows)

    @property
    def group_keys(self) -> Tuple[bytes, ...]:
        """What each KV group's block names carry in the shared pool: key g (group 0: none,
        so a single-group manager names blocks as a plain table does)."""
        return tuple(bytes([g]) if g else b"" for g in range(self.num_kv_groups))

    @property
    def groups(self) -> Mapping[int, List[int]]:
        return MappingProxyType(self._groups)

    @property
    def group_of(self) -> Mapping[int, int]:
        return MappingProxyType(self._group_of)

    def holds(self, group_id: int) -> bool:
        """Whether the group has blocks here (on the device or swapped out)."""
        return group_id in self._groups

    def block_ids(self, seq_id: int, kv_group: int) -> List[int]:
        """The sequence's physical blocks in one KV group, in order (a copy; a sliding
        group's freed entries are ``NULL_BLOCK``)."""
        return list(self._tables[seq_id][kv_group].blocks)

    def has_seq(self, seq_id: int) -> bool:
        """Whether the sequence has a block table here."""
        return seq_id in self._tables

    def num_tokens(self, seq_id: int) -> int:
        """Tokens the sequence's blocks hold (the same in every KV group's table)."""
        return _agreed(f"sequence {seq_id}: tokens", (t.num_tokens for t in self._tables[seq_id]))

    def group_of_seq(self, seq_id: int) -> int:
        return self._group_of[seq_id]

    def seq_append_cost(self, seq_id: int, num_tokens: int) -> int:
        """Device blocks appending `num_tokens` to this one sequence takes, less those its
        sliding windows return (may be negative)."""
        return self._append_cost((t, num_tokens) for t in self._tables[seq_id])

    def new_seq_cost(self, num_tokens: int) -> int:
        """Device blocks a new sequence of `num_tokens` tokens takes in every KV group,
        without prefix-cache hits."""
        return self.num_kv_groups * blocks_needed(num_tokens, self.block_size)

    def named_blocks(self) -> Dict[int, bytes]:
        """The device blocks in the prefix cache (used or evictable) and their names."""
        return self.device.named_blocks()

    @property
    def num_device_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def device_high_water_mark(self) -> int:
        """1 + the highest device block id handed out so far: a K/V pool of this many blocks
        holds every block with content (a pool that grows with use sizes itself from this)."""
        return self.device.high_water_mark

    @property
    def num_used_device_blocks(self) -> int:
        """Device blocks referenced by some sequence (a shared block counts once)."""
        return self.device.num_used_blocks

    @property
    def num_free_device_blocks(self) -> int:
        """Device blocks an allocation may take: free ones and evictable cached ones."""
        return self.device.num_free_blocks

    # ---- questions ----------------------------------------------------------------
    def can_allocate(self, prompt: "int | Sequence[int]", extra_key: str = "",
                     names: Optional[Sequence[bytes]] = None) -> bool:
        """Whether a new group with this prompt (ids, or a length) fits above the watermark.

        ``names``: the prompt's full-block names (:func:`block_hashes`) if the caller
        keeps them; otherwise they are computed from the ids.
        """
        num_tokens, names = self._prompt(prompt, extra_key, names)
        return (self._state_slots_free(1)
                and self._above_watermark(self._admission([SeqSpec(-1, num_tokens, names)], num_tokens)[0]))

    def append_cost(self, group_id: int, tokens_per_seq: int = 1) -> int:
        """Device blocks an append of `tokens_per_seq` to every sequence of the group takes."""
        return self._append_cost((t, tokens_per_seq) for s in self._groups[group_id]
                                 for t in self._tables[s])

    def can_swap_out(self, group_id: int) -> bool:
        return (len(self._distinct_blocks(group_id)) <= self.host.num_free_blocks
                and (self.states is None or self.states.can_move(self._groups[group_id], to_host=True)))

    # ---- lifecycle ----------------------------------------------------------------
    def allocate(self, group_id: int, seq_id: int, prompt: "int | Sequence[int]",
                 extra_key: str = "", names: Optional[Sequence[bytes]] = None,
                 queries_from_start: bool = False) -> Tuple[SeqSlots, int]:
        """Start a group with one sequence holding the prompt (ids, or a length).

        Returns the slots of the prompt tokens to prefill and how many leading tokens
        came from the prefix cache (their KV is already in place). ``names`` as in
        :meth:`can_allocate`. ``queries_from_start``: the caller computes every prompt
        token's query, prefix hits included (a transformers forward does), so sliding
        groups keep every block those queries read.
        """
        num_tokens, names = self._prompt(prompt, extra_key, names)
        [placed] = self.admit(group_id, [SeqSpec(seq_id, num_tokens, names)], num_tokens,
                              queries_from_start)
        return placed, num_tokens - placed.num_tokens

    def admit(self, group_id: int, seqs: Sequence[SeqSpec], shared_len: int,
              queries_from_start: bool = False) -> List[SeqSlots]:
        """Start a group whose sequences share their first ``shared_len`` tokens.

        One sequence: a new prompt (or a recomputation). Several: a group preempted by
        recomputation, whose samples or beams share the prompt's full blocks and each
        recompute the prompt's partial last block into their own block. Returns, per
        sequence, the slots (per KV group) of the tokens that must be computed: the leading tokens not listed are in the prefix cache or
        computed by the first sequence. With state slots every later sequence lists every
        token (its linear-attention state starts at the first), those of the shared full
        blocks at slot -1: written by the first sequence, read by all.
        """
        self._check_new(group_id, [s.seq_id for s in seqs])
        first_query = 0 if queries_from_start else None
        needed, num_hits = self._admission(seqs, shared_len, first_query)
        if needed > self.device.num_free_blocks:
            raise self.device.exhausted(needed, who=f"group {group_id}")
        if not self._state_slots_free(len(seqs)):
            raise self.states.device.exhausted(len(seqs), f"group {group_id}")
        return self._place_group(group_id, seqs, shared_len, num_hits, first_query)

    def try_admit(self, group_id: int, seqs: Sequence[SeqSpec],
                  shared_len: int) -> Optional[List[SeqSlots]]:
        """:meth:`admit` if the group fits above the watermark; None, with nothing changed,
        if it does not."""
        self._check_new(group_id, [s.seq_id for s in seqs])
        needed, num_hits = self._admission(seqs, shared_len)
        if not self._above_watermark(needed) or not self._state_slots_free(len(seqs)):
            return None
        return self._place_group(group_id, seqs, shared_len, num_hits)

    def fork(self, parent_seq: int, child_seq: int) -> None:
        """A new sequence of the parent's group sharing all its blocks (never allocates
        blocks; with state slots, the child takes one holding a copy of the parent's state)."""
        self._check_new(None, [child_seq])
        if self.states is not None:
            self.states.fork(parent_seq, child_seq)  # first: it raises with nothing changed
        self._add(self._group_of[parent_seq], child_seq, [t.fork() for t in self._tables[parent_seq]])

    def append(self, seq_id: int, tokens: "int | Sequence[int]" = 1,
               names: Sequence[bytes] = (), computed: bool = True) -> SeqSlots:
        """Room for new tokens of one sequence: slots, plus copy-on-write copies to apply first.

        ``tokens``: how many (or the new ids, which are only counted). ``names``: the
        sequence's full-block names after the append (:func:`block_hashes`); the
        blocks they name enter the prefix cache. ``computed``: the sequence's tokens so
        far have all been computed (the usual case), so sliding-window groups first
        free the blocks the new tokens cannot see.
        """
        tables = self._device_tables(seq_id)
        count = tokens if isinstance(tokens, int) else len(tokens)
        needed = self._append_cost(((t, count) for t in tables), computed)
        if needed > self.device.num_free_blocks:
            raise self.device.exhausted(needed, who=f"sequence {seq_id}")
        if computed and count:
            self._release(tables)  # before any table allocates: the cost counted them
        parts = [t.append_tokens(count, names, computed=False) for t in tables]
        return self._merged(parts)

    def append_group(self, group_id: int, num_tokens: Mapping[int, int],
                     names: Optional[Mapping[int, Sequence[bytes]]] = None,
                     computed: bool = True) -> Dict[int, SeqSlots]:
        """Append to several sequences of a group at once, all-or-nothing.

        ``names``: per sequence, as in :meth:`append`. Returns each sequence's slots and
        copies; apply every copy before writing any slot.
        """
        for seq_id, count in num_tokens.items():
            if self._group_of.get(seq_id) != group_id:
                raise ValueError(f"sequence {seq_id} is not in group {group_id}")
            if count < 0:
                raise ValueError(f"sequence {seq_id}: number of new tokens must be >= 0, got {count}")
        needed = self._append_cost(((t, n) for s, n in num_tokens.items() for t in self._tables[s]),
                                   computed)
        if needed > self.device.num_free_blocks:
            raise self.device.exhausted(needed, who=f"group {group_id}")
        if computed:  # every sequence's released blocks before any allocates
            self._release(t for s, n in num_tokens.items() if n for t in self._device_tables(s))
        return {seq_id: self.append(seq_id, count, names.get(seq_id, ()) if names else (),
                                    computed=False)
                for seq_id, count in num_tokens.items()}

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drop a sequence's tokens from position ``num_tokens`` on (rejected speculative
        tokens): whole blocks past it are freed, the partial one kept."""
        tables = self._device_tables(seq_id)
        for table in tables:  # every group checked before any changes
            table.check_truncate(num_tokens)
        for table in tables:
            table.truncate(num_tokens)

    def free_seq(self, seq_id: int) -> None:
        """Release one sequence (a finished sample, a dropped beam)."""
        for table in self._tables.pop(seq_id):
            table.free()
        if self.states is not None:
            self.states.free(seq_id)
        group_id = self._group_of.pop(seq_id)
        self._groups[group_id].remove(seq_id)
        if not self._groups[group_id]:
            del self._groups[group_id]

    def free_group(self, group_id: int) -> None:
        """Release a whole group: finished, aborted, or preempted for recomputation."""
        for seq_id in list(self._groups[group_id]):
            self.free_seq(seq_id)

    # ---- swapping -------------------------------------------------------------------
    def swap_out(self, group_id: int) -> List[BlockPair]:
        """Move the group's blocks to host memory; returns (device, host) rows to copy.

        Each distinct device block is copied once, so sharing inside the group
        survives the round trip. Blocks also used by other groups stay on the device.
        """
        return self._move_group(group_id, self.device, self.host)

    def swap_in(self, group_id: int) -> List[BlockPair]:
        """Bring a swapped-out group back; returns (host, device) rows to copy.

        Full blocks still cached on the device are re-used, not copied (not in the rows).
        """
        return self._move_group(group_id, self.host, self.device)

    def try_swap_in(self, group_id: int) -> Optional[List[BlockPair]]:
        """:meth:`swap_in` if the group fits back above the watermark together with the next
        token of each of its sequences; None, with nothing changed, if it does not."""
        return self._move_group(group_id, self.host, self.device,
                                keep_free=self._watermark_blocks + self.append_cost(group_id),
                                or_none=True)

    def take_state_moves(self) -> List[StateMove]:
        """The state slots' moves (zero, copy, swap) recorded since the last call, in order
        (empty without state slots); apply them all before the next forward."""
        return self.states.take_moves() if self.states is not None else []

    def is_swapped_out(self, group_id: int) -> bool:
        return self._pool_of(self._groups[group_id][0]) is self.host

    # ---- transactions -----------------------------------------------------------------
    def checkpoint(self) -> Checkpoint:
        """Everything the manager knows, to :meth:`rollback` to if a step fails."""
        pools = {id(self.device): self.device.copy(), id(self.host): self.host.copy()}
        tables = {s: [t.copy(pools[id(t.allocator)]) for t in ts] for s, ts in self._tables.items()}
        return Checkpoint(pools[id(self.device)], pools[id(self.host)], tables,
                          {g: list(seqs) for g, seqs in self._groups.items()}, dict(self._group_of),
                          self.states.copy() if self.states is not None else None)

    def rollback(self, checkpoint: Checkpoint) -> None:
        """Return to a checkpoint (once). Cached blocks evicted since then may have been
        written, so they stay out of the prefix cache; everything else is as it was."""
        device, host, tables, groups, group_of, states = checkpoint
        now = self.device.named_blocks()
        device.forget(b for b, name in device.named_blocks().items() if now.get(b) != name)
        self.device, self.host = device, host
        self._tables, self._groups, self._group_of = tables, groups, group_of
        self.states = states

    # ---- reporting --------------------------------------------------------------------
    def usage(self) -> Dict[str, float]:
        """Block counts and sharing: references vs distinct physical blocks, slots filled."""
        on_device = [t for ts in self._tables.values() for t in ts if t.allocator is self.device]
        references = sum(len(t.live_blocks) for t in on_device)
        used = self.device.num_used_blocks
        bs = self.block_size
        filled: Dict[int, int] = {}  # tokens in each device block in use
        for table in on_device:
            for i, block in enumerate(table.blocks):
                if block != NULL_BLOCK:
                    filled[block] = max(filled.get(block, 0), min(bs, table.num_tokens - i * bs))
        return {
            "device_blocks_total": self.device.num_blocks,
            "device_blocks_used": used,
            "device_blocks_cached": self.device.num_cached_blocks,
            "device_blocks_free": self.device.num_free_blocks - self.device.num_cached_blocks,
            "host_blocks_used": self.host.num_used_blocks,
            "block_references": references,
            "sharing_saved_blocks": references - used,
            "device_slots_in_use": len(filled) * bs,
            "device_slots_filled": sum(filled.values()),
            "prefix_cache_hit_rate": (self.device.cache_hits / self.device.cache_queries
                                      if self.device.cache_queries else 0.0),
            **({"state_slots_total": self.states.num_slots, "state_slots_used": self.states.num_used}
               if self.states is not None else {}),
        }

    def check_invariants(self) -> None:
        """Reference counts equal table references on both pools; tables are well formed."""
        for allocator in (self.device, self.host):
            refs = Counter(b for ts in self._tables.values() for t in ts if t.allocator is allocator
                           for b in t.live_blocks)
            allocator.check_invariants(refs)
        for seq_id, tables in self._tables.items():
            assert len(tables) == self.num_kv_groups, f"sequence {seq_id}: {len(tables)} tables"
            self.num_tokens(seq_id)  # the groups agree
            for table, window in zip(tables, self.kv_group_windows):
                assert table.sliding_window == window
                assert len(table.blocks) == blocks_needed(table.num_tokens, self.block_size), (
                    f"sequence {seq_id}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
                # Freed entries: the leading ones, where no query from the last token on looks.
                freed = table.num_freed
                assert table.blocks[:freed] == [NULL_BLOCK] * freed
                assert NULL_BLOCK not in table.blocks[freed:], f"sequence {seq_id}: a hole"
                assert freed <= table.first_visible_block(max(0, table.num_tokens - 1)), (
                    f"sequence {seq_id}: a block its window still sees was freed")
            assert seq_id in self._groups[self._group_of[seq_id]]
        tables_in = {s for g in self._groups.values() for s in g}
        assert tables_in == set(self._tables), "group membership and tables disagree"
        for group_id, seqs in self._groups.items():
            pools = {t.allocator.name for s in seqs for t in self._tables[s]}
            assert len(pools) == 1, f"group {group_id} is split across pools {pools}"
        if self.states is not None:
            self.states.check_invariants({s: ts[0].allocator.name for s, ts in self._tables.items()})

    # ---- internals --------------------------------------------------------------------
    def _prompt(self, prompt: "int | Sequence[int]", extra_key: str,
                names: Optional[Sequence[bytes]]) -> Tuple[int, Sequence[bytes]]:
        """(length, full-block names) of a prompt given as ids or as a length."""
        num_tokens = prompt if isinstance(prompt, int) else len(prompt)
        if names is None:
            names = ([] if isinstance(prompt, int) or not self.device.enable_prefix_caching
                     else block_hashes(prompt, self.block_size, extra_key))
        return num_tokens, names

    def _check_new(self, group_id: Optional[int], seq_ids: Sequence[int]) -> None:
        if group_id is not None and group_id in self._groups:
            raise ValueError(f"group {group_id} already exists")
        for seq_id in seq_ids:
            if seq_id in self._tables:
                raise ValueError(f"sequence {seq_id} already exists")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids repeat: {list(seq_ids)}")

    def _device_tables(self, seq_id: int) -> List[BlockTable]:
        """The sequence's tables, which must be on the device (their blocks are written)."""
        tables = self._tables[seq_id]
        if any(t.allocator is not self.device for t in tables):  # every group's, alike
            raise ValueError(f"sequence {seq_id} is swapped out")
        return tables

    def _pool_of(self, seq_id: int) -> BlockAllocator:
        """The pool holding the sequence's blocks (every group's table is in the same one)."""
        return _agreed(f"sequence {seq_id}: pools", (t.allocator for t in self._tables[seq_id]))

    @staticmethod
    def _release(tables: Iterable[BlockTable]) -> None:
        """Free what the sliding windows of these tables (all tokens computed) have left."""
        for table in tables:
            table.release_unreachable()

    def _new_tables(self) -> List[BlockTable]:
        """An empty table per KV group."""
        return [BlockTable(self.device, window, key)
                for window, key in zip(self.kv_group_windows, self.group_keys)]

    def _common_hit(self, tables: Sequence[BlockTable], num_tokens: int,
                    names: Sequence[bytes], first_query: Optional[int] = None) -> int:
        """The most cached leading blocks every KV group can start the prompt from."""
        possible = [t.possible_hits(num_tokens, names, first_query) for t in tables]
        return max(h for h in range(min(map(len, possible))) if all(p[h] for p in possible))

    @staticmethod
    def _placed(tables: Sequence[BlockTable], start: int, end: int) -> SeqSlots:
        """Slots of positions start .. end-1 in every group (no copies)."""
        return SeqSlots([t.slots(start, end) for t in tables], [])

    @staticmethod
    def _merged(parts: Sequence[AppendResult]) -> SeqSlots:
        """One sequence's appends in every group as one result."""
        return SeqSlots([p.slots for p in parts], [c for p in parts for c in p.copies])

    def _add(self, group_id: int, seq_id: int, tables: List[BlockTable]) -> None:
        self._tables[seq_id] = tables
        self._groups.setdefault(group_id, []).append(seq_id)
        self._group_of[seq_id] = group_id

    def _state_slots_free(self, count: int) -> bool:
        """Whether ``count`` new sequences find free device state slots (always, without)."""
        return self.states is None or count <= self.states.num_free

    def _above_watermark(self, needed: int) -> bool:
        """Whether taking ``needed`` device blocks leaves the watermark's blocks free."""
        return self.device.num_free_blocks - needed >= self._watermark_blocks

    def _admission(self, seqs: Sequence[SeqSpec], shared_len: int,
                   first_query: Optional[int] = None) -> Tuple[int, int]:
        """Device blocks :meth:`admit` takes (the prompt's fresh blocks and evictable prefix
        hits, then each sequence's copy of the partial prompt block and growth) and the
        prefix hit, in blocks, every KV group agrees on."""
        if not seqs:
            raise ValueError("a group needs at least one sequence")
        if shared_len < 1:
            raise ValueError(f"a prompt needs at least one token, got {shared_len}")
        bs = self.block_size
        names = seqs[0].names[:shared_len // bs]
        tables = self._new_tables()
        num_hits = self._common_hit(tables, shared_len, names, first_query)
        if self.states is not None and first_query is None:
            num_hits = 0  # the linear layers' state after the hit is not kept: compute it all
        cost = sum(t.blocks_needed_for_prompt(shared_len, names, num_hits, first_query)
                   for t in tables)
        sharers = len(seqs)  # holders of the prompt's partial last block
        for seq in seqs:
            extra = seq.num_tokens - shared_len
            if extra < 0:
                raise ValueError(f"sequence {seq.seq_id}: {seq.num_tokens} tokens, fewer than "
                                 f"the {shared_len} it shares")
            copy = extra > 0 and sharers > 1  # copy-on-write; the last sharer writes in place
            sharers -= copy
            cost += len(tables) * blocks_needed(extra, bs, shared_len, copy_last=copy)
        return cost, num_hits

    def _place_group(self, group_id: int, seqs: Sequence[SeqSpec], shared_len: int,
                     num_hits: int, first_query: Optional[int] = None) -> List[SeqSlots]:
        """Place an admission whose blocks were counted (:meth:`_admission`) and fit."""
        first, bs = seqs[0], self.block_size
        names = first.names[:shared_len // bs]
        tables = self._new_tables()
        # Every group's hits first: allocating one group's fresh blocks may evict cached
        # blocks, which must not be another group's hits.
        for table in tables:
            table.take_prefix_hits(names, num_hits, first_query)
        for table in tables:
            table.place_prompt(shared_len, names)
        if self.states is not None:
            self.states.allocate([first.seq_id], f"group {group_id}")
        if self.device.enable_prefix_caching:
            self.device.record_lookups(hits=num_hits, queries=min(len(names), (shared_len - 1) // bs))
        self._add(group_id, first.seq_id, tables)
        for seq in seqs[1:]:
            self.fork(first.seq_id, seq.seq_id)
        self.append_group(group_id, {s.seq_id: s.num_tokens - shared_len for s in seqs},
                          {s.seq_id: s.names for s in seqs}, computed=False)
        # Copy-on-write copies of the prompt's partial block are not needed: its
        # content does not exist yet, every sequence computes its own copy.
        shared = shared_len // bs * bs
        starts = [num_hits * bs] + [shared] * (len(seqs) - 1)
        placed = [self._placed(self._tables[seq.seq_id], start, seq.num_tokens)
                  for seq, start in zip(seqs, starts)]
        if self.states is not None:
            # Each later sequence builds its linear-attention state from its first token, so it
            # computes the prompt's shared full blocks again, reading what the first sequence
            # writes there in the same forward and writing nothing (slot -1: the ops skip it).
            placed[1:] = [SeqSlots([[-1] * shared + s for s in p.slots], p.copies)
                          for p in placed[1:]]
        return placed

    def _append_cost(self, appends: Iterable[Tuple[BlockTable, int]], computed: bool = True) -> int:
        """Device blocks that these appends, in this order, take (less those they return:
        may be negative): a copy of a shared partial last block for every user but the
        last to append, then growth; ``computed`` appends first free what sliding windows
        have left (blocks no other table holds)."""
        copied: Counter = Counter()  # copies of each shared last block counted so far
        cost = 0
        for table, count in appends:
            if computed and count > 0 and table.allocator is self.device:
                cost -= table.releasable()
            last = table.blocks[-1] if table.blocks else NULL_BLOCK
            copy = count > 0 and table.shares_last_block(copied[last])
            if copy:
                copied[last] += 1
            cost += blocks_needed(count, self.block_size, table.num_tokens, copy_last=copy)
        return cost

    def _move_plan(self, group_id: int, target: BlockAllocator) -> _MovePlan:
        """What moving the group to `target` copies, re-uses and takes from its pool."""
        # Swapping in, full blocks whose content is still cached on the device (e.g. a
        # system prompt other groups share) are taken from there instead of copied; only
        # those that are evictable (count 0) leave the available pool.
        reuse = self._cached_on_device(group_id) if target is self.device else {}
        to_copy = [b for b in self._distinct_blocks(group_id) if b not in reuse]
        evictable_hits = sum(1 for h in reuse.values() if target.ref_count(target.lookup(h)) == 0)
        return _MovePlan(reuse, to_copy, len(to_copy) + evictable_hits)

    def _move_group(self, group_id: int, source: BlockAllocator, target: BlockAllocator,
                    keep_free: int = 0, or_none: bool = False) -> Optional[List[BlockPair]]:
        """Move the group's blocks from `source` to `target`, leaving `keep_free` of the
        target's blocks available; if they do not fit, raise (`or_none`: return None)."""
        tables = [t for s in self._groups[group_id] for t in self._tables[s]]
        if any(t.allocator is not source for t in tables):
            raise ValueError(f"group {group_id} is not in the {source.name} pool")
        reuse, to_copy, needed = self._move_plan(group_id, target)
        if needed + keep_free > target.num_free_blocks:
            if or_none:
                return None
            raise target.exhausted(needed, who=f"group {group_id}")
        if self.states is not None:  # the states travel with the blocks, all or none
            seqs, to_host = self._groups[group_id], target is self.host
            if not self.states.can_move(seqs, to_host):
                if or_none:
                    return None
                raise (self.states.host if to_host else self.states.device).exhausted(
                    len(seqs), f"group {group_id}")
            self.states.move(seqs, to_host, f"group {group_id}")
        references = Counter(b for t in tables for b in t.live_blocks)
        mapping = {old: target.acquire_cached(content) for old, content in reuse.items()}
        copied = dict(zip(to_copy, target.allocate(len(to_copy))))
        mapping.update(copied)
        # Each new reference starts at count 1: add the group's other references.
        for old, new in mapping.items():
            target.fork([new] * (references[old] - 1))
        # Tail first, as BlockTable.free: a chain's head is the last to be evicted.
        source.free(list(references.elements())[::-1])
        for table in tables:
            table.remap(target, mapping)
            if target is self.device:  # back on the device: its full blocks are cached again
                table.register_full_blocks()
        return sorted(copied.items())

    def _cached_on_device(self, group_id: int) -> Dict[int, bytes]:
        """Host blocks of a swapped-out group whose full content the device still caches."""
        found: Dict[int, bytes] = {}
        for seq_id in self._groups[group_id]:
            for table in self._tables[seq_id]:
                for block, content in zip(table.blocks, table.block_hashes):
                    if block != NULL_BLOCK and self.device.lookup(content) is not None:
                        found[block] = content
        return found

    def _distinct_blocks(self, group_id: int) -> List[int]:
        seen: Dict[int, None] = {}
        for seq_id in self._groups[group_id]:
            for table in self._tables[seq_id]:
                for block in table.live_blocks:
                    seen.setdefault(block, None)
        return list(seen)


def _agreed(what: str, values: Iterable[T]) -> T:
    """The one value every KV group gives; groups that disagree break an invariant."""
    distinct = set(values)
    if len(distinct) != 1:
        raise AssertionError(f"{what} differ between KV groups: {distinct}")
    return distinct.pop()
