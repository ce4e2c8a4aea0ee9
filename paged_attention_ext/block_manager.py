"""Block bookkeeping for sequence groups: admission, append, fork, preemption by swap or free.

A *sequence group* is the set of sequences of one request (parallel samples, beams).
Groups are admitted, preempted and restored as a whole (all-or-nothing), so a step
never runs with part of a group's blocks. The manager owns two allocators over the
same block shape: the device pool and a host swap pool.

Every method either succeeds or raises with no state changed; ``can_*`` answer the
admission questions first so a scheduler never needs the exception.
"""

from collections import Counter
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .block_allocator import BlockAllocator, NoFreeBlocksError
from .block_table import AppendResult, BlockCopy, BlockTable, block_hashes

__all__ = ["BlockAllocator", "BlockTable", "AppendResult", "BlockSpaceManager", "NoFreeBlocksError"]

BlockMapping = List[Tuple[int, int]]  # rows for paged.swap_blocks


class BlockSpaceManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False, watermark: float = 0.01) -> None:
        self.device = BlockAllocator(num_device_blocks, block_size, enable_prefix_caching, "device")
        self.host = BlockAllocator(num_host_blocks, block_size, name="host")
        self.block_size = block_size
        # Admission keeps this many device blocks spare so running groups can keep decoding.
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.tables: Dict[int, BlockTable] = {}
        self.groups: Dict[int, List[int]] = {}
        self.group_of: Dict[int, int] = {}

    # ---- admission ----------------------------------------------------------------
    def can_allocate(self, prompt: "int | Sequence[int]", extra_key: str = "",
                     names: Optional[Sequence[bytes]] = None) -> bool:
        """Whether a new group with this prompt (ids, or a length) fits above the watermark.

        ``names``: the prompt's full-block names (:func:`block_hashes`) if the caller
        keeps them; otherwise they are computed from the ids.
        """
        num_tokens, names = self._prompt(prompt, extra_key, names)
        needed = BlockTable(self.device).blocks_needed_for_prompt(num_tokens, names)
        return self.device.num_free_blocks - needed >= self.watermark_blocks

    def can_append(self, group_id: int, tokens_per_seq: int = 1) -> bool:
        """Whether every sequence of the group can take `tokens_per_seq` more tokens."""
        needed = sum(self.tables[s].blocks_needed(tokens_per_seq) for s in self.groups[group_id])
        return needed <= self.device.num_free_blocks

    def can_swap_in(self, group_id: int) -> bool:
        distinct = self._distinct_blocks(group_id)
        # Blocks still cached on the device come back without a copy; only those that
        # are evictable (count 0) leave the available pool.
        cached = self._cached_on_device(group_id)
        needed = sum(1 for b in distinct if b not in cached or
                     self.device.ref_count(self.device.lookup(cached[b])) == 0)
        return self.device.num_free_blocks - needed >= self.watermark_blocks

    def can_swap_out(self, group_id: int) -> bool:
        return len(self._distinct_blocks(group_id)) <= self.host.num_free_blocks

    # ---- lifecycle ----------------------------------------------------------------
    def allocate(self, group_id: int, seq_id: int, prompt: "int | Sequence[int]",
                 extra_key: str = "", names: Optional[Sequence[bytes]] = None
                 ) -> Tuple[AppendResult, int]:
        """Start a group with one sequence holding the prompt (ids, or a length).

        Returns the slots of the prompt tokens to prefill and how many leading tokens
        came from the prefix cache (their KV is already in place). ``names`` as in
        :meth:`can_allocate`.
        """
        if group_id in self.groups or seq_id in self.tables:
            raise ValueError(f"group {group_id} or sequence {seq_id} already exists")
        num_tokens, names = self._prompt(prompt, extra_key, names)
        table = BlockTable(self.device)
        result, num_cached = table.allocate_prompt(num_tokens, names)
        self.tables[seq_id] = table
        self.groups[group_id] = [seq_id]
        self.group_of[seq_id] = group_id
        return result, num_cached

    def fork(self, parent_seq: int, child_seq: int) -> None:
        """A new sequence of the parent's group sharing all its blocks (never allocates)."""
        if child_seq in self.tables:
            raise ValueError(f"sequence {child_seq} already exists")
        self.tables[child_seq] = self.tables[parent_seq].fork()
        group_id = self.group_of[parent_seq]
        self.groups[group_id].append(child_seq)
        self.group_of[child_seq] = group_id

    def append(self, seq_id: int, tokens: "int | Sequence[int]" = 1,
               names: Sequence[bytes] = ()) -> AppendResult:
        """Room for new tokens of one sequence: slots, plus copy-on-write copies to apply first.

        ``tokens``: how many (or the new ids, which are only counted). ``names``: the
        sequence's full-block names after the append (:func:`block_hashes`); the
        blocks they name enter the prefix cache.
        """
        table = self.tables[seq_id]
        if table.allocator is not self.device:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return table.append_tokens(tokens if isinstance(tokens, int) else len(tokens), names)

    def append_group(self, group_id: int, num_tokens: Mapping[int, int],
                     names: Optional[Mapping[int, Sequence[bytes]]] = None) -> AppendResult:
        """Append to several sequences of a group at once, all-or-nothing.

        ``names``: per sequence, as in :meth:`append`.
        """
        for seq_id, count in num_tokens.items():
            if count < 0:
                raise ValueError(f"sequence {seq_id}: number of new tokens must be >= 0, got {count}")
        needed = sum(self.tables[s].blocks_needed(n) for s, n in num_tokens.items())
        if needed > self.device.num_free_blocks:
            raise NoFreeBlocksError(f"group {group_id}: needs {needed} blocks, "
                                    f"{self.device.num_free_blocks} available")
        merged = AppendResult()
        for seq_id, count in num_tokens.items():
            part = self.append(seq_id, count, names.get(seq_id, ()) if names else ())
            merged.slots.extend(part.slots)
            merged.copies.extend(part.copies)
        return merged

    def free_seq(self, seq_id: int) -> None:
        """Release one sequence (a finished sample, a dropped beam)."""
        self.tables.pop(seq_id).free()
        group_id = self.group_of.pop(seq_id)
        self.groups[group_id].remove(seq_id)
        if not self.groups[group_id]:
            del self.groups[group_id]

    def free_group(self, group_id: int) -> None:
        """Release a whole group: finished, aborted, or preempted for recomputation."""
        for seq_id in list(self.groups[group_id]):
            self.free_seq(seq_id)

    # ---- swapping -------------------------------------------------------------------
    def swap_out(self, group_id: int) -> BlockMapping:
        """Move the group's blocks to host memory; returns (device, host) rows to copy.

        Each distinct device block is copied once, so sharing inside the group
        survives the round trip. Blocks also used by other groups stay on the device.
        """
        return self._move_group(group_id, self.device, self.host)

    def swap_in(self, group_id: int) -> BlockMapping:
        """Bring a swapped-out group back; returns (host, device) rows to copy.

        Full blocks still cached on the device are re-used, not copied (not in the rows).
        """
        mapping = self._move_group(group_id, self.host, self.device)
        for seq_id in self.groups[group_id]:
            self.tables[seq_id].register_full_blocks()
        return mapping

    def is_swapped_out(self, group_id: int) -> bool:
        return self.tables[self.groups[group_id][0]].allocator is self.host

    def _move_group(self, group_id: int, source: BlockAllocator,
                    target: BlockAllocator) -> BlockMapping:
        tables = [self.tables[s] for s in self.groups[group_id]]
        if any(t.allocator is not source for t in tables):
            raise ValueError(f"group {group_id} is not in the {source.name} pool")
        distinct = self._distinct_blocks(group_id)
        # Swapping in, full blocks whose content is still cached on the device (e.g. a
        # system prompt other groups share) are taken from there instead of copied.
        reuse = self._cached_on_device(group_id) if target is self.device else {}
        to_copy = [b for b in distinct if b not in reuse]
        evictable_hits = sum(1 for h in reuse.values() if target.ref_count(target.lookup(h)) == 0)
        if len(to_copy) + evictable_hits > target.num_free_blocks:
            raise NoFreeBlocksError(f"{target.name} pool: group {group_id} needs "
                                    f"{len(to_copy) + evictable_hits} blocks, "
                                    f"{target.num_free_blocks} available")
        references = Counter(b for t in tables for b in t.blocks)
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
        return sorted(copied.items())

    def _prompt(self, prompt: "int | Sequence[int]", extra_key: str,
                names: Optional[Sequence[bytes]]) -> Tuple[int, Sequence[bytes]]:
        """(length, full-block names) of a prompt given as ids or as a length."""
        num_tokens = prompt if isinstance(prompt, int) else len(prompt)
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {num_tokens}")
        if names is None:
            names = ([] if isinstance(prompt, int) or not self.device.enable_prefix_caching
                     else block_hashes(prompt, self.block_size, extra_key))
        return num_tokens, names

    def _cached_on_device(self, group_id: int) -> Dict[int, bytes]:
        """Host blocks of a swapped-out group whose full content the device still caches."""
        found: Dict[int, bytes] = {}
        for seq_id in self.groups[group_id]:
            table = self.tables[seq_id]
            for block, content in zip(table.blocks, table.block_hashes):
                if self.device.lookup(content) is not None:
                    found[block] = content
        return found

    def _distinct_blocks(self, group_id: int) -> List[int]:
        seen: Dict[int, None] = {}
        for seq_id in self.groups[group_id]:
            for block in self.tables[seq_id].blocks:
                seen.setdefault(block, None)
        return list(seen)

    # ---- reporting --------------------------------------------------------------------
    def usage(self) -> Dict[str, float]:
        """Block counts and sharing: references vs distinct physical blocks."""
        references = sum(len(t.blocks) for t in self.tables.values() if t.allocator is self.device)
        used = self.device.num_used_blocks
        return {
            "device_blocks_total": self.device.num_blocks,
            "device_blocks_used": used,
            "device_blocks_cached": self.device.num_cached_blocks,
            "device_blocks_free": self.device.num_free_blocks - self.device.num_cached_blocks,
            "host_blocks_used": self.host.num_used_blocks,
            "block_references": references,
            "sharing_saved_blocks": references - used,
            "prefix_cache_hit_rate": (self.device.cache_hits / self.device.cache_queries
                                      if self.device.cache_queries else 0.0),
        }

    def check_invariants(self) -> None:
        """Reference counts equal table references on both pools; tables are well formed."""
        for allocator in (self.device, self.host):
            refs = Counter(b for t in self.tables.values() if t.allocator is allocator
                           for b in t.blocks)
            allocator.check_invariants(refs)
        for seq_id, table in self.tables.items():
            assert len(table.blocks) == -(-table.num_tokens // self.block_size), (
                f"sequence {seq_id}: {len(table.blocks)} blocks for {table.num_tokens} tokens")
            assert seq_id in self.groups[self.group_of[seq_id]]
        tables_in = {s for g in self.groups.values() for s in g}
        assert tables_in == set(self.tables), "group membership and tables disagree"
        for group_id, seqs in self.groups.items():
            pools = {self.tables[s].allocator.name for s in seqs}
            assert len(pools) == 1, f"group {group_id} is split across pools {pools}"
