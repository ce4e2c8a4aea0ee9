"""A sequence's block table: logical blocks -> physical blocks, with copy-on-write.

Appending tokens fills the last block in place when this table is its only user,
copies it first when it is shared (copy-on-write), and allocates new blocks only
when the last one is full. The invariant ``len(blocks) == ceil(num_tokens /
block_size)`` holds after every call, and a call that cannot get its blocks
raises :class:`NoFreeBlocksError` with nothing changed.

With prefix caching, every full block is named by a SHA-256 hash chained over all
tokens up to and including it (and an optional extra key such as an adapter id),
so equal prefixes map to the same physical blocks. A table never sees token ids:
whoever owns the tokens names the blocks once with :func:`block_hashes` and passes
the names in.
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


def block_hashes(token_ids: Sequence[int], block_size: int, extra_key: str = "",
                 known: Sequence[bytes] = ()) -> List[bytes]:
    """Names of every full block of ``token_ids``, chained from the first.

    ``known`` holds the names of the leading blocks computed before (e.g. before the
    sequence grew); only the blocks filled since are hashed.
    """
    names = list(known)
    for b in range(len(names), len(token_ids) // block_size):
        names.append(chain_hash(names[-1] if names else None,
                                token_ids[b * block_size:(b + 1) * block_size], extra_key))
    return names


@dataclass
class AppendResult:
    slots: List[int] = field(default_factory=list)  # for paged.write_kv, one per new token
    copies: List[BlockCopy] = field(default_factory=list)  # apply with copy_blocks first


class BlockTable:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.blocks: List[int] = []
        self.num_tokens = 0
        self.block_hashes: List[bytes] = []  # names of the leading full blocks, when given

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def slots(self, start: int, end: int) -> List[int]:
        """Slots of positions ``start`` to ``end - 1``."""
        bs, blocks = self.block_size, self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks an append of this many tokens would allocate (copy-on-write included)."""
        room = len(self.blocks) * self.block_size - self.num_tokens
        copy = int(room > 0 and num_new_tokens > 0 and
                   self.allocator.ref_count(self.blocks[-1]) > 1)
        grow = max(0, num_new_tokens - room)
        return copy + -(-grow // self.block_size)

    def append_tokens(self, count: int, names: Sequence[bytes] = ()) -> AppendResult:
        """Make room for ``count`` new tokens and return where they go.

        ``names`` are the sequence's full-block names (:func:`block_hashes`) after the
        append; blocks it names enter the prefix cache. Without names, later blocks
        are simply not cached.
        """
        if count < 0:
            raise ValueError(f"number of new tokens must be >= 0, got {count}")
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
        result.slots = self.slots(start, self.num_tokens)
        self._register_full_blocks(names)
        return result

    def allocate_prompt(self, num_tokens: int, names: Sequence[bytes]) -> Tuple[AppendResult, int]:
        """Place a new sequence's prompt, reusing cached full blocks of its prefix.

        ``names`` are the prompt's full-block names. Returns the slots of the tokens
        that still need prefill (the first ``num_cached`` tokens are already in the
        cache) and ``num_cached``. The last prompt token is always recomputed, so its
        logits exist.
        """
        if self.num_tokens:
            raise ValueError("allocate_prompt is for an empty table")
        hits = self._cached_prefix(num_tokens, names)
        needed = self._prompt_blocks(num_tokens, hits)
        if needed > self.allocator.num_free_blocks:
            raise NoFreeBlocksError(f"{self.allocator.name} pool: prompt needs {needed} blocks, "
                                    f"{self.allocator.num_free_blocks} available")
        # Take the hits first so that allocating the rest cannot evict them.
        cached = [self.allocator.acquire_cached(h) for h in hits]
        fresh = self.allocator.allocate(-(-(num_tokens - len(hits) * self.block_size)
                                          // self.block_size))
        self.allocator.record_lookups(hits=len(hits),
                                      queries=min(len(names), self._prefix_candidates(num_tokens)))
        self.blocks = cached + fresh
        num_cached = len(hits) * self.block_size
        self.num_tokens = num_tokens
        self.block_hashes = list(hits)
        self._register_full_blocks(names)
        return AppendResult(slots=self.slots(num_cached, self.num_tokens)), num_cached

    def blocks_needed_for_prompt(self, num_tokens: int, names: Sequence[bytes]) -> int:
        return self._prompt_blocks(num_tokens, self._cached_prefix(num_tokens, names))

    def _prompt_blocks(self, num_tokens: int, hits: Sequence[bytes]) -> int:
        fresh = -(-(num_tokens - len(hits) * self.block_size) // self.block_size)
        # Hits on evictable blocks take them out of the available pool too.
        return fresh + sum(1 for h in hits if self.allocator.ref_count(self.allocator.lookup(h)) == 0)

    def fork(self) -> "BlockTable":
        """A new table sharing every block (reference counts +1; never allocates)."""
        self.allocator.fork(self.blocks)
        return self.copy(self.allocator)

    def copy(self, allocator: BlockAllocator) -> "BlockTable":
        """An independent copy of this table over `allocator` (its pool, or a copy of it);
        reference counts are not touched."""
        twin = BlockTable(allocator)
        twin.blocks, twin.num_tokens = list(self.blocks), self.num_tokens
        twin.block_hashes = list(self.block_hashes)
        return twin

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens: blocks past them are freed (tail
        first). A block left partial will have its free slots written, so it leaves the
        prefix cache if this table is its only holder (a shared one is copied on write)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {self.num_tokens} tokens")
        keep = -(-num_tokens // self.block_size)
        self.allocator.free(reversed(self.blocks[keep:]))
        del self.blocks[keep:]
        del self.block_hashes[num_tokens // self.block_size:]
        self.num_tokens = num_tokens
        if num_tokens % self.block_size and self.allocator.ref_count(self.blocks[-1]) == 1:
            self.allocator.unregister(self.blocks[-1])

    def free(self) -> None:
        # Tail first: the pool evicts the least recently freed block first, and names
        # chain from the head, so the head must be the last of this prompt to go.
        self.allocator.free(reversed(self.blocks))
        self.blocks = []
        self.num_tokens = 0
        self.block_hashes = []

    def remap(self, allocator: BlockAllocator, mapping: dict) -> None:
        """Point at other physical blocks (after a swap); reference counts are the caller's."""
        self.allocator = allocator
        self.blocks = [mapping[b] for b in self.blocks]

    def register_full_blocks(self) -> None:
        """Offer this table's named blocks to the prefix cache (e.g. after a swap-in)."""
        for block, content in zip(self.blocks, self.block_hashes):
            self.allocator.register(block, content)

    def _prefix_candidates(self, num_tokens: int) -> int:
        """Full prompt blocks that may come from the cache: never the last token's block."""
        return (num_tokens - 1) // self.block_size if self.allocator.enable_prefix_caching else 0

    def _cached_prefix(self, num_tokens: int, names: Sequence[bytes]) -> List[bytes]:
        hits: List[bytes] = []
        for name in names[:self._prefix_candidates(num_tokens)]:
            if self.allocator.lookup(name) is None:
                break
            hits.append(name)
        return hits

    def _register_full_blocks(self, names: Sequence[bytes]) -> None:
        if not self.allocator.enable_prefix_caching:
            return
        known = len(self.block_hashes)
        for b in range(known, min(len(names), self.num_tokens // self.block_size)):
            self.block_hashes.append(names[b])
            self.allocator.register(self.blocks[b], names[b])
