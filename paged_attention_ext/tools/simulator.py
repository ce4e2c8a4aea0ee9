"""KV-cache allocation strategies replayed over a request trace, and sharing inside sequence groups.

Memory is counted in token slots (one slot holds one token's keys and values in every
layer; multiply by ``memory.bytes_per_token`` for bytes). Strategies:

* ``max_len``: one contiguous region of max_len slots per request (pre-vLLM systems);
* ``pow2``: contiguous, the next power of two of the current length, doubled when outgrown;
* ``oracle``: contiguous, exactly prompt + output slots (final length known in advance);
* ``paged``: blocks of block_size slots allocated on demand by the package's
  :class:`BlockAllocator` and :class:`BlockTable`;
* ``paged-groups`` (with a layer pattern of sliding-window and full layers): the block
  manager's KV groups (:mod:`paged_attention_ext.kv_groups`), whose sliding groups hold only
  their window. Its pool is the same bytes: ``pool_tokens`` slots of every layer, cut into
  pages of one group's layers; held slots are counted in those all-layer slots.

Contiguous regions are assumed to pack perfectly and to regrow in place (no external
fragmentation, no copy), so their figures are upper bounds. docs/memory.md has the method.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from ..block_allocator import BlockAllocator
from ..block_manager import BlockSpaceManager
from ..block_table import NULL_BLOCK, BlockTable
from ..kv_groups import KVGroupLayout
from .workloads import Trace

STRATEGIES = ("max_len", "pow2", "oracle", "paged")


# ---- paged bookkeeping --------------------------------------------------------------

class PagedPool:
    """The paged strategy's bookkeeping: allocate a prompt, append, fork, free.

    Backed by the real BlockAllocator and BlockTable, so the simulator exercises the
    allocator the ops run with (copy-on-write included).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size

    @property
    def used_blocks(self) -> int:
        return self.allocator.num_used_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.allocator.num_free_blocks

    def allocate_prompt(self, num_tokens: int) -> BlockTable:
        table = BlockTable(self.allocator)
        table.append_tokens(num_tokens)
        return table

    def can_append(self, table: BlockTable, num_tokens: int = 1) -> bool:
        return table.blocks_needed(num_tokens) <= self.allocator.num_free_blocks

    def append(self, table: BlockTable, num_tokens: int = 1) -> None:
        table.append_tokens(num_tokens)

    def fork(self, table: BlockTable) -> BlockTable:
        return table.fork()

    def free(self, table: BlockTable) -> None:
        table.free()


# ---- strategies ----------------------------------------------------------------------

class Strategy(Protocol):
    """Reservations of one pool. admit/grow return False, changing nothing, when the pool is full."""

    name: str

    def admit(self, rid: int, length: int, final_len: int) -> bool: ...

    def grow(self, rid: int, length: int) -> bool: ...

    def held(self, rid: int) -> int: ...

    def release(self, rid: int) -> None: ...

    def on_step(self) -> None:
        """Called once per step, after the step's admissions (for per-step statistics)."""

    @property
    def reserved(self) -> int: ...


Reserve = Callable[[int, int], int]  # (current length, final length) -> region size in slots


class Contiguous:
    """One region per request, sized by `reserve` at admission and again whenever outgrown."""

    def __init__(self, name: str, pool_tokens: int, reserve: Reserve) -> None:
        self.name = name
        self.pool_tokens = pool_tokens
        self.reserve = reserve
        self.regions: Dict[int, Tuple[int, int]] = {}  # rid -> (size, final length)
        self.reserved = 0

    def admit(self, rid: int, length: int, final_len: int) -> bool:
        return self._resize(rid, length, final_len)

    def grow(self, rid: int, length: int) -> bool:
        size, final_len = self.regions[rid]
        return length <= size or self._resize(rid, length, final_len)

    def held(self, rid: int) -> int:
        return self.regions[rid][0]

    def release(self, rid: int) -> None:
        self.reserved -= self.regions.pop(rid)[0]

    def on_step(self) -> None:
        pass

    def _resize(self, rid: int, length: int, final_len: int) -> bool:
        size = self.reserve(length, final_len)
        if size < length:
            raise ValueError(f"{self.name}: request {rid} reaches {length} tokens, beyond its "
                             f"{size}-slot reservation (longer than max_len?)")
        old = self.regions[rid][0] if rid in self.regions else 0
        if self.reserved - old + size > self.pool_tokens:
            return False
        self.reserved += size - old
        self.regions[rid] = (size, final_len)
        return True


class Paged:
    """Blocks on demand: a request holds ceil(length / block_size) blocks."""

    name = "paged"

    def __init__(self, pool_tokens: int, block_size: int) -> None:
        self.pool = PagedPool(pool_tokens // block_size, block_size)
        self.tables: Dict[int, BlockTable] = {}

    def admit(self, rid: int, length: int, final_len: int) -> bool:
        if not self.pool.can_allocate(length):
            return False
        self.tables[rid] = self.pool.allocate_prompt(length)
        return True

    def grow(self, rid: int, length: int) -> bool:
        table = self.tables[rid]
        new = length - table.num_tokens
        if not self.pool.can_append(table, new):
            return False
        self.pool.append(table, new)
        return True

    def held(self, rid: int) -> int:
        return len(self.tables[rid].blocks) * self.pool.block_size

    def release(self, rid: int) -> None:
        self.pool.free(self.tables.pop(rid))

    def on_step(self) -> None:
        pass

    @property
    def reserved(self) -> int:
        return self.pool.used_blocks * self.pool.block_size


class PagedGroups:
    """The block manager over a hybrid model's KV groups: each group's blocks on demand, a
    sliding group's freed once they leave its window."""

    name = "paged-groups"

    def __init__(self, pool_tokens: int, block_size: int, layout: KVGroupLayout) -> None:
        self.layout, self.block_size = layout, block_size
        # A page holds one group's layers: the same bytes hold num_layers / layers_per_group
        # times the pages of one all-layer block.
        pages = pool_tokens * layout.num_layers // (layout.layers_per_group * block_size)
        self.manager = BlockSpaceManager(pages, 0, block_size, watermark=0.0,
                                         kv_group_windows=layout.windows)
        self._filled = [0] * len(layout.groups)  # token-steps in each group's live blocks
        self._slots = [0] * len(layout.groups)   # slot-steps of each group's live blocks

    def admit(self, rid: int, length: int, final_len: int) -> bool:
        if not self.manager.can_allocate(length):
            return False
        self.manager.allocate(rid, rid, length)
        return True

    def grow(self, rid: int, length: int) -> bool:
        new = length - self.manager.num_tokens(rid)
        if self.manager.seq_append_cost(rid, new) > self.manager.num_free_device_blocks:
            return False
        self.manager.append(rid, new)
        return True

    def held(self, rid: int) -> int:
        pages = sum(len(t.live_blocks) for t in self.manager.tables[rid])
        return self._all_layer_slots(pages)

    def release(self, rid: int) -> None:
        self.manager.free_group(rid)

    def on_step(self) -> None:
        for rid in self.manager.groups:
            for g, table in enumerate(self.manager.tables[rid]):
                live = [b for b, block in enumerate(table.blocks) if block != NULL_BLOCK]
                if live:
                    self._filled[g] += table.num_tokens - live[0] * self.block_size
                    self._slots[g] += len(live) * self.block_size

    def group_utilisation(self) -> List[float]:
        """Per KV group: tokens in its live blocks over their slots, averaged over steps."""
        return [f / s if s else 0.0 for f, s in zip(self._filled, self._slots)]

    @property
    def reserved(self) -> int:
        return self._all_layer_slots(self.manager.num_used_device_blocks)

    def _all_layer_slots(self, pages: int) -> int:
        return pages * self.layout.layers_per_group * self.block_size // self.layout.num_layers


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def make_strategy(name: str, pool_tokens: int, max_len: int = 2048, block_size: int = 16) -> Strategy:
    if name == "max_len":
        return Contiguous(name, pool_tokens, lambda length, final: max_len)
    if name == "pow2":
        return Contiguous(name, pool_tokens, lambda length, final: min(next_pow2(length), max_len))
    if name == "oracle":
        return Contiguous(name, pool_tokens, lambda length, final: final)
    if name == "paged":
        return Paged(pool_tokens, block_size)
    raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")


# ---- replay ------------------------------------------------------------------------------

@dataclass
class ReplayStats:
    strategy: str
    utilisation: float  # token-steps / reserved-slot-steps over the whole replay
    utilisation_at_peak: float  # tokens / reserved slots at the step storing the most tokens
    peak_tokens: int
    peak_reserved: int  # the most slots reserved at any step
    mean_batch: Optional[float]  # mean running requests over steps where some wait (None: none did)
    peak_batch: int
    steps: int
    preemptions: int
    mean_waste_at_finish: float  # reserved - stored tokens of a request just before release
    max_waste_at_finish: int


def replay(trace: Trace, strategy: Strategy) -> ReplayStats:
    """A saturated continuous-batching server: every request arrives at step 0.

    Each step, every running request appends one token; when the pool cannot hold it,
    the newest running request is preempted (freed and requeued first in line, its
    generated tokens to be recomputed with the prompt, as vLLM does). Then, unless
    that step preempted, waiting requests are admitted in arrival order while their
    current length fits. A request is released at the end of the step that stores its
    last output token.
    """
    generated = [0] * len(trace)
    waiting = deque(range(len(trace)))
    running: List[int] = []  # admission order: the newest is preempted first
    live_tokens = steps = preemptions = peak_batch = 0
    token_steps = reserved_steps = peak_reserved = peak_tokens = reserved_at_peak = 0
    saturated_steps = saturated_batch = 0
    wastes: List[int] = []
    while waiting or running:
        preempted = False
        i = 0
        while i < len(running):
            rid = running[i]
            if strategy.grow(rid, trace[rid].prompt_len + generated[rid] + 1):
                generated[rid] += 1
                live_tokens += 1
                i += 1
                continue
            victim = running.pop()  # may be rid itself, which ends the loop
            strategy.release(victim)
            live_tokens -= trace[victim].prompt_len + generated[victim]
            waiting.appendleft(victim)
            preemptions += 1
            preempted = True
        while waiting and not preempted:
            rid = waiting[0]
            length = trace[rid].prompt_len + generated[rid]
            if not strategy.admit(rid, length, trace[rid].prompt_len + trace[rid].output_len):
                break
            waiting.popleft()
            running.append(rid)
            live_tokens += length
        if not running:
            raise ValueError(f"request {waiting[0]} {trace[waiting[0]]} does not fit in an empty pool")

        strategy.on_step()
        steps += 1
        reserved = strategy.reserved
        token_steps += live_tokens
        reserved_steps += reserved
        peak_reserved = max(peak_reserved, reserved)
        if live_tokens > peak_tokens:
            peak_tokens, reserved_at_peak = live_tokens, reserved
        peak_batch = max(peak_batch, len(running))
        if waiting:
            saturated_steps += 1
            saturated_batch += len(running)

        still_running = []
        for rid in running:
            request = trace[rid]
            if generated[rid] < request.output_len:
                still_running.append(rid)
                continue
            final_len = request.prompt_len + request.output_len
            wastes.append(strategy.held(rid) - final_len)
            strategy.release(rid)
            live_tokens -= final_len
        running = still_running

    return ReplayStats(
        strategy=strategy.name,
        utilisation=token_steps / reserved_steps,
        utilisation_at_peak=peak_tokens / reserved_at_peak,
        peak_tokens=peak_tokens,
        peak_reserved=peak_reserved,
        mean_batch=saturated_batch / saturated_steps if saturated_steps else None,
        peak_batch=peak_batch,
        steps=steps,
        preemptions=preemptions,
        mean_waste_at_finish=float(np.mean(wastes)),
        max_waste_at_finish=int(max(wastes)),
    )


# ---- internal waste --------------------------------------------------------------------

@dataclass
class WasteStats:
    block_size: int
    mean_waste: float  # empty slots in a finished sequence's blocks; theory: (block_size - 1) / 2
    max_waste: int
    mean_table_len: float  # block-table entries per finished sequence


def internal_waste(trace: Trace, block_size: int) -> WasteStats:
    """Place each request's prompt, append its whole output, and count the empty slots left."""
    longest = max(r.prompt_len + r.output_len for r in trace)
    pool = PagedPool(-(-longest // block_size), block_size)
    wastes, lengths = [], []
    for request in trace:
        table = pool.allocate_prompt(request.prompt_len)
        pool.append(table, request.output_len)
        wastes.append(len(table.blocks) * block_size - table.num_tokens)
        lengths.append(len(table.blocks))
        pool.free(table)
    return WasteStats(block_size, float(np.mean(wastes)), int(max(wastes)), float(np.mean(lengths)))


# ---- sharing in sequence groups ---------------------------------------------------------

@dataclass
class SharingStats:
    mode: str  # "parallel_sampling" or "beam_search"
    width: int
    block_refs: int  # block-table entries summed over decode steps: blocks needed without sharing
    blocks_used: int  # distinct physical blocks summed over the same steps
    saved_fraction: float  # (block_refs - blocks_used) / block_refs


def parallel_sampling_savings(trace: Trace, num_samples: int, block_size: int) -> SharingStats:
    """Each request decodes `num_samples` samples of its output length from one prompt.

    The samples share the prompt's full blocks; the partly filled last prompt block is
    copied on each sample's first write (by the BlockTable).
    """
    return _group_sharing("parallel_sampling", trace, num_samples, block_size, 0.0, seed=0)


def beam_search_savings(trace: Trace, beam_width: int, block_size: int,
                        switch_prob: float = 0.1, seed: int = 0) -> SharingStats:
    """Each request decodes `beam_width` beams of its output length.

    Beam 0 is the top beam. At every step each other beam, with probability
    `switch_prob`, is dropped and replaced by a child of the top beam (a fork: its
    blocks are shared, the last one copied on write). Beams so share a long common
    prefix and differ in a suffix of mean length about 1 / switch_prob tokens.
    """
    return _group_sharing("beam_search", trace, beam_width, block_size, switch_prob, seed)


def _group_sharing(mode: str, trace: Trace, width: int, block_size: int, switch_prob: float,
                   seed: int) -> SharingStats:
    if width < 1:
        raise ValueError(f"group width must be >= 1, got {width}")
    rng = np.random.default_rng(seed)
    longest = max(r.prompt_len + r.output_len for r in trace)
    # One group at a time; each sequence may hold one block being copied on write.
    pool = PagedPool(width * (-(-longest // block_size) + 1), block_size)
    refs = used = 0
    for request in trace:
        first = pool.allocate_prompt(request.prompt_len)
        seqs = [first] + [pool.fork(first) for _ in range(width - 1)]
        switches = rng.random((request.output_len, width)) < switch_prob
        for row in switches:
            seqs = _reparent(pool, seqs, row)
            for seq in seqs:
                pool.append(seq)
            refs += sum(len(seq.blocks) for seq in seqs)
            used += pool.used_blocks
        for seq in seqs:
            pool.free(seq)
    return SharingStats(mode, width, refs, used, (refs - used) / refs)


def _reparent(pool: PagedPool, beams: List[BlockTable], switch: Sequence[bool]) -> List[BlockTable]:
    """Beams i > 0 with switch[i] become children of the top beam; the dropped beams are freed."""
    new = list(beams)
    for i in np.flatnonzero(switch[1:]) + 1:
        new[i] = pool.fork(beams[0])
        pool.free(beams[i])
    return new
