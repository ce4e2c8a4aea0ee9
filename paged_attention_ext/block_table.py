"""A sequence's block table: logical blocks -> physical blocks, with copy-on-write.

Appending tokens fills the last block in place when this table is its only user,
copies it first when it is shared (copy-on-write), and allocates new blocks only
when the last one is full. The invariant ``len(blocks) == ceil(num_tokens /
block_size)`` holds after every call, and a call that cannot get its blocks
raises :class:`NoFreeBlocksError` with nothing changed.

With prefix caching, every full block is named by a SHA-256 hash chained over all
tokens up to and including it (and an optional extra key such as an adapter id),
so equal prefixes map to the same physical blocks.
"""

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .block_allocator import BlockAllocator, NoFreeBlocksError

BlockCopy = Tuple[int, int]  # (src, dst) rows for paged.copy_blocks


def chain_hash(parent: Optional[bytes], tokens: Sequence[int], extra_key: str = "") -> bytes:
    """Content name of a full block: its tokens and everything before them."""
    digest = hashlib.sha256(parent if parent is not None else extra_key.encode() + b"\x00root")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass
class AppendResult:
    slots: List[int] = field(default_factory=list)  # for paged.write_kv, one per new token
    copies: List[BlockCopy] = field(default_factory=list)  # apply with copy_blocks first


class BlockTable:
    def __init__(self, allocator: BlockAllocator, extra_key: str = "") -> None:
        self.allocator = allocator
        self.extra_key = extra_key
        self.blocks: List[int] = []
        self.num_tokens = 0
        self.token_ids: List[int] = []  # kept when known: prefix hashes and recomputation
        self.block_hashes: List[bytes] = []  # of the full blocks, when token ids are known

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def slot(self, position: int) -> int:
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks an append of this many tokens would allocate (copy-on-write included)."""
        room = len(self.blocks) * self.block_size - self.num_tokens
        copy = int(room > 0 and num_new_tokens > 0 and
                   self.allocator.ref_count(self.blocks[-1]) > 1)
        grow = max(0, num_new_tokens - room)
        return copy + -(-grow // self.block_size)

    def append_tokens(self, tokens: "int | Sequence[int]") -> AppendResult:
        """Make room for new tokens and return where they go.

        Pass token ids to let full blocks enter the prefix cache; a bare count
        works too, and such a table's later blocks are simply not cached.
        """
        token_ids = None if isinstance(tokens, int) else list(tokens)
        count = tokens if token_ids is None else len(token_ids)
        fresh = self.allocator.allocate(self.blocks_needed(count))  # all-or-nothing
        result = AppendResult()
        room = len(self.blocks) * self.block_size - self.num_tokens
        if room > 0 and count > 0 and self.allocator.ref_count(self.blocks[-1]) > 1:
            shared, private = self.blocks[-1], fresh.pop(0)
            result.copies.append((shared, private))
            self.blocks[-1] = private
            self.allocator.free([shared])
        self.blocks.extend(fresh)
        start = self.num_tokens
        self.num_tokens += count
        result.slots = [self.slot(p) for p in range(start, self.num_tokens)]
        if token_ids is not None:
            self.token_ids.extend(token_ids)
            self._register_full_blocks()
        return result

    def allocate_prompt(self, token_ids: Sequence[int]) -> Tuple[AppendResult, int]:
        """Place a new sequence's prompt, reusing cached full blocks of its prefix.

        Returns the slots of the tokens that still need prefill (the first
        ``num_cached`` tokens are already in the cache) and ``num_cached``. The last
        prompt token is always recomputed, so its logits exist.
        """
        if self.num_tokens:
            raise ValueError("allocate_prompt is for an empty table")
        hits = self._cached_prefix_hashes(token_ids)
        needed = self.blocks_needed_for_prompt(token_ids)
        if needed > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(f"{self.allocator.name} pool: prompt needs {needed} blocks, "
                                    f"{self.allocator.num_free_blocks} available")
        # Take the hits first so that allocating the rest cannot evict them.
        cached = [self.allocator.acquire_cached(h) for h in hits]
        fresh = self.allocator.allocate(-(-(len(token_ids) - len(hits) * self.block_size)
                                          // self.block_size))
        self.allocator.record_lookups(hits=len(hits), queries=self._prefix_candidates(token_ids))
        self.blocks = cached + fresh
        num_cached = len(hits) * self.block_size
        self.num_tokens = len(token_ids)
        self.token_ids = list(token_ids)
        self.block_hashes = list(hits)
        self._register_full_blocks()
        slots = [self.slot(p) for p in range(num_cached, self.num_tokens)]
        return AppendResult(slots=slots), num_cached

    def blocks_needed_for_prompt(self, token_ids: Sequence[int]) -> int:
        hits = self._cached_prefix_hashes(token_ids)
        fresh = -(-(len(token_ids) - len(hits) * self.block_size) // self.block_size)
        # Hits on evictable blocks take them out of the available pool too.
        return fresh + sum(1 for h in hits if self.allocator.ref_count(self.allocator.lookup(h)) == 0)

    def fork(self) -> "BlockTable":
        """A new table sharing every block (reference counts +1; never allocates)."""
        self.allocator.fork(self.blocks)
        child = BlockTable(self.allocator, self.extra_key)
        child.blocks = list(self.blocks)
        child.num_tokens = self.num_tokens
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        return child

    def free(self) -> None:
        # Tail first: the pool evicts the least recently freed block first, and names
        # chain from the head, so the head must be the last of this prompt to go.
        self.allocator.free(reversed(self.blocks))
        self.blocks = []
        self.num_tokens = 0
        self.token_ids = []
        self.block_hashes = []

    def remap(self, allocator: BlockAllocator, mapping: dict) -> None:
        """Point at other physical blocks (after a swap); reference counts are the caller's."""
        self.allocator = allocator
        self.blocks = [mapping[b] for b in self.blocks]

    def register_full_blocks(self) -> None:
        """Offer this table's full blocks to the prefix cache (e.g. after a swap-in)."""
        for block, content in zip(self.blocks, self.block_hashes):
            self.allocator.register(block, content)

    def _prefix_candidates(self, token_ids: Sequence[int]) -> int:
        """Full prompt blocks that may come from the cache: never the last token's block."""
        return (len(token_ids) - 1) // self.block_size if self.allocator.enable_prefix_caching else 0

    def _cached_prefix_hashes(self, token_ids: Sequence[int]) -> List[bytes]:
        hits: List[bytes] = []
        parent = None
        bs = self.block_size
        for b in range(self._prefix_candidates(token_ids)):
            parent = chain_hash(parent, token_ids[b * bs:(b + 1) * bs], self.extra_key)
            if self.allocator.lookup(parent) is None:
                break
            hits.append(parent)
        return hits

    def _register_full_blocks(self) -> None:
        if not self.allocator.enable_prefix_caching or len(self.token_ids) != self.num_tokens:
            return
        bs = self.block_size
        while len(self.block_hashes) < self.num_tokens // bs:
            b = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            content = chain_hash(parent, self.token_ids[b * bs:(b + 1) * bs], self.extra_key)
            self.block_hashes.append(content)
            self.allocator.register(self.blocks[b], content)
