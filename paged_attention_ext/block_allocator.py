"""Physical block allocator: free list, reference counts, and an optional prefix cache.

A block is *free* (on the free list, content meaningless), *used* (reference count
> 0), or *cached* (count 0 but its content is a known full block of tokens, kept for
prefix-cache hits and evicted least-recently-used only when the free list runs out).
Cached blocks count as available: allocation takes free blocks first, then evicts.
"""

from collections import Counter, OrderedDict
from typing import Dict, Iterable, List, Optional


class NoFreeBlocksError(RuntimeError):
    """The pool cannot satisfy a request; the allocator was left unchanged."""


class BlockAllocator:
    """``setting``: what sizes this pool, named when it runs out (e.g. ``"num_blocks"``)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 name: str = "device", setting: str = "num_blocks") -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.name = name
        self.setting = setting
        # Popped from the end: block 0 is handed out first (deterministic ids), and freed
        # blocks (appended) are reused before an id never handed out.
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))
        # 1 + the highest id ever handed out (0: none): every block that holds content (used
        # or cached) has a lower id, whatever order ids are handed out in.
        self.high_water_mark = 0
        self._ref_counts: List[int] = [0] * num_blocks
        self._hash_of_block: Dict[int, bytes] = {}
        self._block_of_hash: Dict[bytes, int] = {}
        self._evictable: "OrderedDict[int, None]" = OrderedDict()  # LRU first
        self.cache_hits = 0
        self.cache_queries = 0

    # ---- counts ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_block_ids(self) -> List[int]:
        """Blocks on the free list (content meaningless); cached blocks excluded."""
        return list(self._free)

    def exhausted(self, needed: int, available: Optional[int] = None,
                  who: str = "") -> NoFreeBlocksError:
        """The error for a request of ``needed`` blocks that does not fit, naming the setting
        that sizes the pool."""
        available = self.num_free_blocks if available is None else available
        return NoFreeBlocksError(
            f"{who + ': ' if who else ''}the {self.name} pool has {available} of its "
            f"{self.num_blocks} blocks available and {needed} are needed: raise {self.setting} "
            "(or run fewer or shorter sequences at once)")

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref_counts[block]

    # ---- allocate / share / free ------------------------------------------------
    def allocate(self, count: int = 1) -> List[int]:
        """`count` fresh blocks with reference count 1, or NoFreeBlocksError and no change."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > self.num_free_blocks:
            raise self.exhausted(count)
        blocks = []
        for _ in range(count):
            block = self._free.pop() if self._free else self._evict()
            self._ref_counts[block] = 1
            self.high_water_mark = max(self.high_water_mark, block + 1)
            blocks.append(block)
        return blocks

    def fork(self, blocks: Iterable[int]) -> None:
        """Share used blocks once more each. Never allocates; all-or-nothing on bad ids."""
        blocks = list(blocks)
        for block in blocks:
            if self.ref_count(block) == 0:
                raise ValueError(f"{self.name} pool: cannot share block {block}: it is not allocated")
        for block in blocks:
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per listed block (a block may repeat); all-or-nothing."""
        drops = Counter(blocks)
        for block, times in drops.items():
            if self.ref_count(block) < times:
                raise ValueError(f"{self.name} pool: block {block} freed {times} time(s) but has "
                                 f"{self._ref_counts[block]} reference(s)")
        for block, times in drops.items():
            self._ref_counts[block] -= times
            if self._ref_counts[block] == 0:
                if block in self._hash_of_block:
                    self._evictable[block] = None  # most recently used last
                else:
                    self._free.append(block)

    # ---- prefix cache -----------------------------------------------------------
    def lookup(self, content_hash: bytes) -> Optional[int]:
        """The block holding this full-block content, if cached (used or evictable)."""
        return self._block_of_hash.get(content_hash)

    def acquire_cached(self, content_hash: bytes) -> int:
        """Take one reference to the cached block with this content (a prefix hit)."""
        block = self._block_of_hash[content_hash]
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1
        return block

    def register(self, block: int, content_hash: bytes) -> None:
        """Record that used `block` now holds this full-block content.

        If another block already holds the same content, that one stays the cached
        copy and `block` remains an ordinary block.
        """
        if not self.enable_prefix_caching or content_hash in self._block_of_hash:
            return
        if self.ref_count(block) == 0:
            raise ValueError(f"{self.name} pool: cannot register free block {block}")
        previous = self._hash_of_block.get(block)
        if previous is not None:
            del self._block_of_hash[previous]
        self._hash_of_block[block] = content_hash
        self._block_of_hash[content_hash] = block

    def unregister(self, block: int) -> None:
        """Take a block in use out of the prefix cache (its content is about to change)."""
        self._check_id(block)
        name = self._hash_of_block.pop(block, None)
        if name is not None:
            del self._block_of_hash[name]

    def named_blocks(self) -> Dict[int, bytes]:
        """Every block the prefix cache knows (used or evictable) and its content name."""
        return dict(self._hash_of_block)

    def forget(self, blocks: Iterable[int]) -> None:
        """Take unused cached blocks out of the prefix cache (their content is no longer
        trusted); used blocks and blocks it does not know are left alone."""
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
                del self._block_of_hash[self._hash_of_block.pop(block)]
                self._free.append(block)

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._block_of_hash[self._hash_of_block.pop(block)]
        return block

    def record_lookups(self, hits: int, queries: int) -> None:
        """Prefix-cache statistics: `hits` of `queries` candidate blocks were found."""
        self.cache_queries += queries
        self.cache_hits += hits

    def copy(self) -> "BlockAllocator":
        """An independent copy of this pool's state (for a checkpoint)."""
        twin = BlockAllocator.__new__(BlockAllocator)
        twin.__dict__.update(self.__dict__)
        twin._free, twin._ref_counts = list(self._free), list(self._ref_counts)
        twin._hash_of_block, twin._block_of_hash = dict(self._hash_of_block), dict(self._block_of_hash)
        twin._evictable = OrderedDict(self._evictable)
        return twin

    # ---- checks -----------------------------------------------------------------
    def check_invariants(self, references: Counter) -> None:
        """`references[b]`: how many block-table entries point at block b of this pool."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: a block is on the free list twice"
        assert not free & set(self._evictable), f"{self.name}: a block is both free and cached"
        for block in range(self.num_blocks):
            count = self._ref_counts[block]
            assert count == references.get(block, 0), (
                f"{self.name}: block {block} has count {count} but "
                f"{references.get(block, 0)} table references")
            if count > 0:
                assert block not in free and block not in self._evictable, (
                    f"{self.name}: block {block} is referenced and available")
        assert set(references) <= set(range(self.num_blocks)), f"{self.name}: table holds a bad id"
        for block in self._evictable:
            assert block in self._hash_of_block, f"{self.name}: cached block {block} has no hash"
        for content_hash, block in self._block_of_hash.items():
            assert self._hash_of_block[block] == content_hash, f"{self.name}: hash maps disagree"
        used = sum(1 for c in self._ref_counts if c > 0)
        assert len(free) + len(self._evictable) + used == self.num_blocks, (
            f"{self.name}: free + cached + used != total")

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"{self.name} pool: block id {block} outside [0, {self.num_blocks})")
