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

A table of a sliding-window KV group (:mod:`paged_attention_ext.kv_groups`) frees each
block once no later query can see it: the entry becomes :data:`NULL_BLOCK` (logical
positions are kept; the attention op never reads entries wholly before the window) and
a named block goes back to the prefix cache. A chunked group's table (:class:`~paged_attention_ext.
kv_groups.Chunked`) frees a chunk's blocks the same way once the sequence has moved past
it: a query's chunk starts at a block boundary (the chunk size is a multiple of the block
size), and :func:`paged_attention_ext.chunked.chunk_local` starts each table at its chunk.
Tables of several groups share one pool,
so a group's names carry its ``group_key``: equal tokens in two groups are two blocks.
"""

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .block_allocator import BlockAllocator
from .kv_groups import Chunked, Window, first_visible_position

# (source, destination) block rows: a copy-on-write copy (paged.copy_blocks) or a swap
# between the device and the host pool (paged.swap_blocks).
BlockPair = Tuple[int, int]
NULL_BLOCK = -1  # a sliding-window table's freed entry


def blocks_needed(num_new_tokens: int, block_size: int, num_held: int = 0,
                  copy_last: bool = False) -> int:
    """Blocks that ``num_new_tokens`` tokens take after ``num_held`` held ones: the new
    blocks past the partial last one, plus its copy if ``copy_last`` (copy-on-write of a
    shared block). ``num_held=0``: the blocks a new sequence of that many tokens fills."""
    room = -num_held % block_size
    copy = int(copy_last and room > 0 and num_new_tokens > 0)
    return copy + -(-max(0, num_new_tokens - room) // block_size)


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


def check_window(window: Window, block_size: int) -> None:
    """Raise ``ValueError`` unless a table of blocks of ``block_size`` tokens can keep ``window``:
    a chunk must be a whole number of blocks, so that each chunk starts a block."""
    if isinstance(window, Chunked):
        if window.size % block_size:
            raise ValueError(f"attention_chunk_size={window.size} is not a multiple of "
                             f"block_size={block_size}, so a chunk would start inside a block; "
                             f"use a block size that divides the chunk size")
    elif window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                 or window < 1):
        raise ValueError(f"sliding_window must be >= 1, a Chunked span or None, got {window!r}")


@dataclass
class AppendResult:
    """One table's append: where its new tokens go, and the copies to make first."""

    slots: List[int] = field(default_factory=list)  # for paged.write_kv, one per new token
    copies: List[BlockPair] = field(default_factory=list)  # apply with copy_blocks first


class BlockTable:
    def __init__(self, allocator: BlockAllocator, sliding_window: Window = None,
                 group_key: bytes = b"") -> None:
        check_window(sliding_window, allocator.block_size)
        self.allocator = allocator
        self.sliding_window = sliding_window
        self.group_key = group_key
        self.blocks: List[int] = []
        self.num_tokens = 0
        self.block_hashes: List[bytes] = []  # names of the leading full blocks, when given
        # Freed entries are always the leading ones (a window only moves forward).
        self.num_freed = 0

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def live_blocks(self) -> List[int]:
        """The blocks this table holds (freed entries left out), in order."""
        return self.blocks[self.num_freed:]

    def first_visible_block(self, position: int) -> int:
        """The first logical block a query at ``position`` reads (0 without a window)."""
        return first_visible_position(self.sliding_window, position) // self.block_size

    def _first_kept(self) -> int:
        """The first block :meth:`release_unreachable` keeps.

        A sliding table keeps the last token's window (not only the next one's): that costs at
        most one block and lets a caller drop the tokens it appends next again (rejected
        speculative tokens, :meth:`truncate`). A chunked table keeps only the next token's
        chunk: the last token's would be a whole chunk more for a step, so going back into a
        freed chunk raises instead."""
        position = self.num_tokens if isinstance(self.sliding_window, Chunked) else self.num_tokens - 1
        return min(self.first_visible_block(max(0, position)), len(self.blocks))

    def releasable(self) -> int:
        """Blocks :meth:`release_unreachable` would return to the pool now (those no other
        table shares)."""
        first = self._first_kept()
        return sum(1 for b in range(self.num_freed, first)
                   if self.allocator.ref_count(self.blocks[b]) == 1)

    def release_unreachable(self) -> int:
        """Free the blocks no later query can see (sliding window, finished chunks); call it
        once every held token has been computed, before appending. Returns how many."""
        first = self._first_kept()
        dead = range(self.num_freed, first)
        if dead:
            # Tail first, as free(): of a chain, the head is the last evicted.
            self.allocator.free(self.blocks[b] for b in reversed(dead))
            self.blocks[self.num_freed:first] = [NULL_BLOCK] * len(dead)
            self.num_freed = first
        return len(dead)

    def slots(self, start: int, end: int) -> List[int]:
        """Slots of positions ``start`` to ``end - 1``."""
        bs, blocks = self.block_size, self.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def shares_last_block(self, copied_away: int = 0) -> bool:
        """Whether the partial last block has another holder, so an append copies it first
        (copy-on-write). ``copied_away``: how many of its holders copy it away before this
        table appends (the appends of one step: the last sharer writes in place)."""
        return (self.num_tokens % self.block_size != 0
                and self.allocator.ref_count(self.blocks[-1]) - copied_away > 1)

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks an append of this many tokens would allocate (copy-on-write included)."""
        return blocks_needed(num_new_tokens, self.block_size, self.num_tokens,
                             copy_last=self.shares_last_block())

    def append_tokens(self, count: int, names: Sequence[bytes] = (),
                      computed: bool = True) -> AppendResult:
        """Make room for ``count`` new tokens and return where they go.

        ``names`` are the sequence's full-block names (:func:`block_hashes`) after the
        append; blocks it names enter the prefix cache. Without names, later blocks
        are simply not cached. ``computed``: every token held so far has been computed,
        so a sliding-window table may first free what the new tokens cannot see.
        """
        if count < 0:
            raise ValueError(f"number of new tokens must be >= 0, got {count}")
        needed = self.blocks_needed(count)
        release = computed and count > 0
        available = self.allocator.num_free_blocks + (self.releasable() if release else 0)
        if needed > available:
            raise self.allocator.exhausted(needed, available)
        if release:
            self.release_unreachable()
        fresh = self.allocator.allocate(needed)
        result = AppendResult()
        if count > 0 and self.shares_last_block():
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

    def take_prefix_hits(self, names: Sequence[bytes], num_hits: int,
                         first_query: Optional[int] = None) -> None:
        """Start a new sequence's prompt from the prefix cache: reference its ``num_hits``
        cached leading blocks (one of :meth:`possible_hits`, agreed across KV groups; a
        sliding table only those its first query's window reaches). ``names`` are the
        prompt's full-block names; ``first_query``: the first position whose query the
        caller computes (None: the first token after the hits; 0 for a caller that runs
        the hit tokens' queries too, which then read the blocks before). Several KV
        groups' tables take their hits before any places the rest (:meth:`place_prompt`),
        so that no allocation evicts another group's hit."""
        if self.num_tokens or self.blocks:
            raise ValueError("take_prefix_hits is for an empty table")
        first = self._first_read(num_hits, first_query)
        self.blocks = [NULL_BLOCK] * first + [self.allocator.acquire_cached(self._pooled(names[b]))
                                              for b in range(first, num_hits)]
        self.num_freed = first
        self.num_tokens = num_hits * self.block_size
        self.block_hashes = [self._pooled(n) for n in names[:num_hits]]

    def place_prompt(self, num_tokens: int, names: Sequence[bytes]) -> Tuple[AppendResult, int]:
        """Fresh blocks for the rest of the prompt after :meth:`take_prefix_hits` (the
        caller checked they are available: :meth:`blocks_needed_for_prompt`). Returns the
        slots of the tokens that still need prefill and how many leading tokens the prefix
        cache held. The last prompt token is always recomputed, so its logits exist."""
        num_cached = self.num_tokens
        self.blocks += self.allocator.allocate(blocks_needed(num_tokens - num_cached, self.block_size))
        self.num_tokens = num_tokens
        self._register_full_blocks(names)
        return AppendResult(slots=self.slots(num_cached, self.num_tokens)), num_cached

    def possible_hits(self, num_tokens: int, names: Sequence[bytes],
                      first_query: Optional[int] = None) -> List[bool]:
        """``[h]``: whether this table could start the prompt from ``h`` cached blocks.

        Full attention needs blocks ``0 .. h-1`` cached; a sliding window only those
        its first query (``first_query``, as in :meth:`take_prefix_hits`) sees. Entry 0
        is always true.
        """
        ok = [True]
        run = 0  # cached blocks ending at the current one
        for b, name in enumerate(names[:self._prefix_candidates(num_tokens)]):
            run = run + 1 if self.allocator.lookup(self._pooled(name)) is not None else 0
            h = b + 1
            ok.append(run >= h - self._first_read(h, first_query))
            if self.sliding_window is None and not ok[-1]:
                break  # a full-attention hit never gets longer past a miss
        return ok

    def _first_read(self, num_hits: int, first_query: Optional[int]) -> int:
        """The first block the prompt's queries read when ``num_hits`` blocks are cached."""
        return self.first_visible_block(num_hits * self.block_size if first_query is None
                                        else min(first_query, num_hits * self.block_size))

    def blocks_needed_for_prompt(self, num_tokens: int, names: Sequence[bytes], num_hits: int,
                                 first_query: Optional[int] = None) -> int:
        """Blocks :meth:`take_prefix_hits` and :meth:`place_prompt` take from the available
        pool: the fresh ones and the evictable hits."""
        fresh = blocks_needed(num_tokens - num_hits * self.block_size, self.block_size)
        # Hits on evictable blocks take them out of the available pool too.
        first = self._first_read(num_hits, first_query)
        return fresh + sum(1 for b in range(first, num_hits) if self.allocator.ref_count(
            self.allocator.lookup(self._pooled(names[b]))) == 0)

    def fork(self) -> "BlockTable":
        """A new table sharing every block (reference counts +1; never allocates)."""
        self.allocator.fork(self.live_blocks)
        return self.copy(self.allocator)

    def copy(self, allocator: BlockAllocator) -> "BlockTable":
        """An independent copy of this table over `allocator` (its pool, or a copy of it);
        reference counts are not touched."""
        twin = BlockTable(allocator, self.sliding_window, self.group_key)
        twin.blocks, twin.num_tokens = list(self.blocks), self.num_tokens
        twin.num_freed = self.num_freed
        twin.block_hashes = list(self.block_hashes)
        return twin

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens: blocks past them are freed (tail
        first). A block left partial will have its free slots written, so it leaves the
        prefix cache if this table is its only holder (a shared one is copied on write)."""
        self.check_truncate(num_tokens)
        keep = blocks_needed(num_tokens, self.block_size)
        self.allocator.free(reversed(self.blocks[max(keep, self.num_freed):]))
        del self.blocks[keep:]
        del self.block_hashes[num_tokens // self.block_size:]
        self.num_freed = min(self.num_freed, keep)
        self.num_tokens = num_tokens
        if (num_tokens % self.block_size and self.blocks[-1] != NULL_BLOCK
                and self.allocator.ref_count(self.blocks[-1]) == 1):
            self.allocator.unregister(self.blocks[-1])

    def check_truncate(self, num_tokens: int) -> None:
        """Raise unless :meth:`truncate` to ``num_tokens`` can keep every block the last
        kept token's window reads (a sliding table may have freed them)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {self.num_tokens} tokens")
        keep = blocks_needed(num_tokens, self.block_size)
        if NULL_BLOCK in self.blocks[self.first_visible_block(max(0, num_tokens - 1)):keep]:
            raise NotImplementedError(
                f"cannot go back to {num_tokens} tokens: this {self._kind()} has freed blocks the "
                "kept tokens' queries read")

    def _kind(self) -> str:
        if isinstance(self.sliding_window, Chunked):
            return f"chunked table (chunks of {self.sliding_window.size} tokens)"
        return f"sliding-window table (window {self.sliding_window})"

    def free(self) -> None:
        # Tail first: the pool evicts the least recently freed block first, and names
        # chain from the head, so the head must be the last of this prompt to go.
        self.allocator.free(reversed(self.live_blocks))
        self.blocks = []
        self.num_freed = 0
        self.num_tokens = 0
        self.block_hashes = []

    def remap(self, allocator: BlockAllocator, mapping: dict) -> None:
        """Point at other physical blocks (after a swap); reference counts are the caller's."""
        self.allocator = allocator
        self.blocks = [NULL_BLOCK if b == NULL_BLOCK else mapping[b] for b in self.blocks]

    def register_full_blocks(self) -> None:
        """Offer this table's named blocks to the prefix cache (e.g. after a swap-in)."""
        for block, content in zip(self.blocks, self.block_hashes):
            if block != NULL_BLOCK:
                self.allocator.register(block, content)

    def _prefix_candidates(self, num_tokens: int) -> int:
        """Full prompt blocks that may come from the cache: never the last token's block."""
        return (num_tokens - 1) // self.block_size if self.allocator.enable_prefix_caching else 0

    def _pooled(self, name: bytes) -> bytes:
        """A block name as this table's KV group registers it in the shared pool."""
        return name + self.group_key

    def _register_full_blocks(self, names: Sequence[bytes]) -> None:
        if not self.allocator.enable_prefix_caching:
            return
        known = len(self.block_hashes)
        for b in range(known, min(len(names), self.num_tokens // self.block_size)):
            self.block_hashes.append(self._pooled(names[b]))
            if self.blocks[b] != NULL_BLOCK:
                self.allocator.register(self.blocks[b], self.block_hashes[-1])
