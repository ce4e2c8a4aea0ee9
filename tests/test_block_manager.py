"""Allocator, block tables, copy-on-write, prefix caching, swapping and admission rules."""

from collections import Counter

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext.block_allocator import BlockAllocator, NoFreeBlocksError
from paged_attention_ext.block_manager import BlockSpaceManager, SeqSpec
from paged_attention_ext.block_table import BlockTable, blocks_needed
from paged_attention_ext.kv_cache import PagedKVCache


def snapshot(allocator: BlockAllocator):
    return (list(allocator._free), list(allocator._ref_counts), dict(allocator._hash_of_block),
            list(allocator._evictable))


def check(allocator: BlockAllocator, *tables: BlockTable):
    allocator.check_invariants(Counter(b for t in tables for b in t.blocks))
    for t in tables:
        assert len(t.blocks) == -(-t.num_tokens // t.block_size)


# ---- allocator ------------------------------------------------------------------------

def test_allocate_fork_free_counts():
    alloc = BlockAllocator(4, 16)
    a, b = alloc.allocate(2)
    alloc.fork([a, a])
    assert alloc.ref_count(a) == 3 and alloc.ref_count(b) == 1
    alloc.free([a, b])
    assert alloc.ref_count(a) == 2 and alloc.num_free_blocks == 3
    alloc.free([a, a])
    assert alloc.num_free_blocks == 4
    alloc.check_invariants(Counter())


def test_double_free_and_bad_ids_raise_without_change():
    alloc = BlockAllocator(4, 16)
    a, b = alloc.allocate(2)
    alloc.free([a])
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="freed"):
        alloc.free([b, a])  # b is fine, a is already free: nothing may change
    with pytest.raises(ValueError, match="not allocated"):
        alloc.fork([b, a])
    with pytest.raises(IndexError):
        alloc.free([7])
    assert snapshot(alloc) == before


def test_failed_allocation_leaves_allocator_unchanged():
    alloc = BlockAllocator(3, 16)
    alloc.allocate(2)
    before = snapshot(alloc)
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate(2)
    assert snapshot(alloc) == before


def test_high_water_mark_bounds_every_id_handed_out():
    alloc = BlockAllocator(8, 16)
    assert alloc.high_water_mark == 0
    a, b, c = alloc.allocate(3)
    alloc.free([a, b])
    assert alloc.high_water_mark == 3
    alloc.allocate(2)  # freed blocks come back before a new id
    assert alloc.high_water_mark == 3
    alloc.allocate(1)
    assert alloc.high_water_mark == 4
    twin = alloc.copy()
    alloc._free.reverse()  # another order: the mark follows the ids handed out
    assert alloc.allocate(1) == [7]
    assert alloc.high_water_mark == 8 and twin.high_water_mark == 4


# ---- block tables and copy-on-write --------------------------------------------------------

def test_append_in_place_and_new_block_only_when_full():
    alloc = BlockAllocator(8, 4)
    table = BlockTable(alloc)
    r = table.append_tokens(3)
    assert len(table.blocks) == 1 and r.copies == []
    assert r.slots == [table.blocks[0] * 4 + i for i in range(3)]
    r = table.append_tokens(1)  # fills the last slot in place
    assert len(table.blocks) == 1 and r.slots == [table.blocks[0] * 4 + 3]
    r = table.append_tokens(6)  # 4 + 2 tokens: two new blocks
    assert len(table.blocks) == 3 and table.num_tokens == 10
    assert r.slots == [table.blocks[p // 4] * 4 + p % 4 for p in range(4, 10)] == table.slots(4, 10)
    check(alloc, table)


def test_copy_on_write_of_shared_partial_block():
    alloc = BlockAllocator(8, 4)
    parent = BlockTable(alloc)
    parent.append_tokens(6)  # one full block + 2 tokens in a partial block
    child = parent.fork()
    full, partial = parent.blocks
    assert alloc.ref_count(full) == 2 and alloc.ref_count(partial) == 2
    r = child.append_tokens(1)
    new = child.blocks[1]
    assert r.copies == [(partial, new)] and new != partial
    assert child.blocks[0] == full  # full blocks stay shared
    assert alloc.ref_count(partial) == 1 and alloc.ref_count(new) == 1
    assert r.slots == [new * 4 + 2]
    r = parent.append_tokens(1)  # now unshared: in place, no copy
    assert r.copies == [] and parent.blocks[1] == partial
    check(alloc, parent, child)


def test_truncate_frees_whole_blocks_and_copies_a_shared_partial_one_on_write():
    alloc = BlockAllocator(8, 4)
    parent = BlockTable(alloc)
    parent.append_tokens(11)  # blocks of 4, 4, 3 tokens
    child = parent.fork()
    first, second, third = parent.blocks
    child.truncate(6)  # drops the third block, leaves the second partial and shared
    assert child.blocks == [first, second] and child.num_tokens == 6
    assert alloc.ref_count(third) == 1 and alloc.ref_count(second) == 2
    r = child.append_tokens(1)  # writes slot 6: the parent still reads the old block
    assert r.copies == [(second, child.blocks[1])] and r.slots == [child.blocks[1] * 4 + 2]
    for bad in (-1, 8):
        with pytest.raises(ValueError, match="cannot keep"):
            child.truncate(bad)
    assert child.num_tokens == 7
    child.truncate(0)
    assert child.blocks == [] and child.num_tokens == 0
    check(alloc, parent, child)


def test_shared_full_last_block_needs_no_copy():
    alloc = BlockAllocator(8, 4)
    parent = BlockTable(alloc)
    parent.append_tokens(4)
    child = parent.fork()
    r = child.append_tokens(1)
    assert r.copies == [] and child.blocks[0] == parent.blocks[0] and len(child.blocks) == 2
    check(alloc, parent, child)


def test_forks_of_forks_and_frees():
    alloc = BlockAllocator(16, 4)
    root = BlockTable(alloc)
    root.append_tokens(5)
    a = root.fork()
    b = a.fork()
    c = b.fork()
    assert alloc.ref_count(root.blocks[0]) == 4
    for t in (a, b, c):
        t.append_tokens(2)
    check(alloc, root, a, b, c)
    # three copies of the shared partial block: root keeps the original
    assert len({t.blocks[1] for t in (root, a, b, c)}) == 4
    b.free()
    a.free()
    check(alloc, root, c)
    root.free()
    c.free()
    assert alloc.num_free_blocks == 16


def test_failed_append_changes_nothing():
    alloc = BlockAllocator(2, 4)
    parent = BlockTable(alloc)
    parent.append_tokens(6)
    child = parent.fork()
    before = snapshot(alloc), list(child.blocks), child.num_tokens
    with pytest.raises(NoFreeBlocksError):
        child.append_tokens(1)  # needs a copy of the shared partial block
    assert (snapshot(alloc), list(child.blocks), child.num_tokens) == before
    check(alloc, parent, child)


def test_beam_search_sharing_follows_the_beams():
    mgr = BlockSpaceManager(64, 0, 4)
    mgr.allocate(0, 0, 6)
    for child in (1, 2, 3):
        mgr.fork(0, child)
    mgr.check_invariants()
    step = mgr.append_group(0, {s: 1 for s in range(4)})
    assert sum(len(r.copies) for r in step.values()) == 3  # three beams copy the shared partial block, one writes in place
    # Next step: beams 0 and 0 survive as two children, 1 is kept, 2 and 3 are dropped.
    mgr.free_seq(2)
    mgr.free_seq(3)
    mgr.fork(0, 4)
    mgr.check_invariants()
    step = mgr.append_group(0, {0: 1, 1: 1, 4: 1})
    assert sum(len(r.copies) for r in step.values()) == 1  # only the new fork of beam 0 copies
    mgr.check_invariants()
    mgr.free_group(0)
    mgr.check_invariants()
    assert mgr.device.num_free_blocks == 64


# ---- prefix caching ----------------------------------------------------------------------

def test_prefix_hit_reuses_full_blocks_and_prefills_the_rest():
    mgr = BlockSpaceManager(32, 0, 4, enable_prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    first, cached = mgr.allocate(0, 0, prompt)
    assert cached == 0 and len(first.slots[0]) == 11
    second, cached = mgr.allocate(1, 1, prompt[:9] + [7, 7])
    assert cached == 8 and len(second.slots[0]) == 3
    assert mgr.tables[1][0].blocks[:2] == mgr.tables[0][0].blocks[:2]
    assert mgr.device.ref_count(mgr.tables[0][0].blocks[0]) == 2
    # A different first block shares nothing (the hash chains over the whole prefix).
    _, cached = mgr.allocate(2, 2, [0] + prompt[1:])
    assert cached == 0
    # An extra key (e.g. an adapter) separates equal tokens.
    _, cached = mgr.allocate(3, 3, prompt, extra_key="lora-1")
    assert cached == 0
    assert mgr.usage()["prefix_cache_hit_rate"] == pytest.approx(2 / 8)
    mgr.check_invariants()


def test_last_prompt_token_is_always_recomputed():
    mgr = BlockSpaceManager(8, 0, 4, enable_prefix_caching=True)
    prompt = list(range(8))  # exactly two full blocks
    mgr.allocate(0, 0, prompt)
    result, cached = mgr.allocate(1, 1, prompt)
    assert cached == 4 and len(result.slots[0]) == 4
    mgr.check_invariants()


def test_cached_blocks_survive_free_and_are_evicted_lru_only_when_needed():
    mgr = BlockSpaceManager(6, 0, 4, enable_prefix_caching=True)
    a, b = list(range(9)), list(range(50, 59))  # 2 full blocks + 1 token each
    mgr.allocate(0, 0, a)
    mgr.allocate(1, 1, b)
    mgr.free_group(0)
    mgr.free_group(1)
    assert mgr.device.num_cached_blocks == 4 and mgr.device.num_free_blocks == 6
    mgr.check_invariants()
    _, cached = mgr.allocate(2, 2, a)  # hit while cached with count 0
    assert cached == 8
    mgr.free_group(2)
    # a was used more recently than b: filling the pool evicts b's blocks first.
    mgr.allocate(3, 3, 16)
    mgr.check_invariants()
    assert mgr.device.num_cached_blocks == 2
    mgr.free_group(3)
    _, cached = mgr.allocate(4, 4, b)  # b was evicted; free blocks serve it, a stays cached
    assert cached == 0
    mgr.free_group(4)
    _, cached = mgr.allocate(5, 5, a)
    assert cached == 8
    mgr.check_invariants()


@pytest.mark.parametrize("evicted", [0, 1, 2, 3])
def test_eviction_takes_a_cached_prompt_tail_first(evicted):
    """Names chain from the head, so evicting the head would strand every later block."""
    n, bs = 3, 4
    mgr = BlockSpaceManager(n + 1, 0, bs, enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(n * bs + 1))  # n full blocks, then the last token's block
    mgr.allocate(0, 0, prompt)
    mgr.free_group(0)
    assert mgr.device.num_cached_blocks == n
    mgr.allocate(1, 1, (1 + evicted) * bs)  # the free block, then `evicted` cached ones
    mgr.free_group(1)
    assert mgr.device.num_cached_blocks == n - evicted
    _, num_cached = mgr.allocate(2, 2, prompt)
    assert num_cached == (n - evicted) * bs
    mgr.check_invariants()


def test_swap_out_caches_the_tail_as_least_recently_used():
    bs = 4
    mgr = BlockSpaceManager(5, 4, bs, enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(3 * bs + 1))
    mgr.allocate(0, 0, prompt)
    mgr.swap_out(0)  # the device blocks stay cached under their names
    mgr.allocate(1, 1, 3 * bs)  # the two free blocks and one cached block
    mgr.free_group(1)
    _, num_cached = mgr.allocate(2, 2, prompt[:3 * bs] + [99])
    assert num_cached == 2 * bs
    mgr.check_invariants()


def test_failed_prompt_allocation_changes_nothing():
    mgr = BlockSpaceManager(4, 0, 4, enable_prefix_caching=True)
    mgr.allocate(0, 0, list(range(9)))
    mgr.free_group(0)
    before = snapshot(mgr.device)
    assert not mgr.can_allocate(list(range(9)) + list(range(20)))
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate(1, 1, list(range(9)) + list(range(20)))
    assert snapshot(mgr.device) == before and 1 not in mgr.tables
    mgr.check_invariants()


def test_prefix_hit_does_not_change_attention_output():
    torch.manual_seed(0)
    bs, kv_heads, head = 4, 2, 32
    prompt = list(range(11))
    keys, values = torch.randn(11, kv_heads, head), torch.randn(11, kv_heads, head)
    query = torch.randn(1, 4, head)

    def run(mgr: BlockSpaceManager, cache: PagedKVCache, group: int) -> torch.Tensor:
        result, cached = mgr.allocate(group, group, prompt)
        slots = torch.tensor(result.slots[0])
        pa.write_kv(keys[cached:], values[cached:], *cache.layer(0), slots)
        table = torch.tensor([mgr.tables[group][0].blocks], dtype=torch.int32)
        return pa.attention(query, *cache.layer(0), table, torch.tensor([11], dtype=torch.int32),
                            head ** -0.5)

    mgr = BlockSpaceManager(16, 0, bs, enable_prefix_caching=True)
    cache = PagedKVCache(1, kv_heads, head, bs, torch.float32, num_blocks=16)
    cold = run(mgr, cache, 0)
    warm = run(mgr, cache, 1)
    assert mgr.tables[1][0].blocks[:2] == mgr.tables[0][0].blocks[:2]
    assert torch.equal(cold, warm)


# ---- swapping and admission ------------------------------------------------------------

def test_swap_round_trip_preserves_sharing_and_contents():
    bs = 4
    mgr = BlockSpaceManager(16, 8, bs)
    cache = PagedKVCache(2, 2, 32, bs, torch.bfloat16, num_blocks=16, num_host_blocks=8)
    result, _ = mgr.allocate(0, 0, 10)
    for layer in range(2):
        k = torch.randn(10, 2, 32).bfloat16()
        pa.write_kv(k, -k, *cache.layer(layer), torch.tensor(result.slots[0]))
    mgr.fork(0, 1)
    step = mgr.append(1, 1)
    cache.apply_copies(step.copies)
    tables_before = {s: list(mgr.tables[s][0].blocks) for s in (0, 1)}
    content = {s: [torch.stack([cache.key_caches[l][b] for b in tables_before[s]]) for l in range(2)]
               for s in (0, 1)}
    distinct = len(set(tables_before[0]) | set(tables_before[1]))

    assert mgr.can_swap_out(0)
    out_map = mgr.swap_out(0)
    cache.swap_out(out_map)
    mgr.check_invariants()
    assert len(out_map) == distinct and mgr.host.num_used_blocks == distinct
    assert mgr.device.num_used_blocks == 0
    assert mgr.tables[0][0].blocks[:2] == mgr.tables[1][0].blocks[:2]  # still shared on the host
    for layer in range(2):  # the device pool is reused meanwhile
        cache.key_caches[layer].fill_(float("nan"))

    mgr.allocate(5, 5, 20)  # someone else takes blocks while the group is out
    in_map = mgr.try_swap_in(0)
    assert in_map is not None
    cache.swap_in(in_map)
    mgr.check_invariants()
    assert mgr.host.num_used_blocks == 0
    for s in (0, 1):
        for layer in range(2):
            got = torch.stack([cache.key_caches[layer][b] for b in mgr.tables[s][0].blocks])
            assert torch.equal(got.view(torch.int16), content[s][layer].view(torch.int16))


def test_swap_out_fails_whole_when_host_is_full():
    mgr = BlockSpaceManager(16, 2, 4)
    mgr.allocate(0, 0, 12)
    assert not mgr.can_swap_out(0)
    before = snapshot(mgr.device), snapshot(mgr.host)
    with pytest.raises(NoFreeBlocksError):
        mgr.swap_out(0)
    assert (snapshot(mgr.device), snapshot(mgr.host)) == before
    mgr.check_invariants()


def test_admission_watermark_and_group_append():
    mgr = BlockSpaceManager(100, 0, 4, watermark=0.05)  # 5 blocks kept spare
    assert mgr.can_allocate(4 * 95)
    assert not mgr.can_allocate(4 * 95 + 1)
    mgr.allocate(0, 0, 4 * 94 + 2)  # 95 blocks, last one half full
    mgr.fork(0, 1)
    assert mgr.append_cost(0) == 1  # two sequences: one copy-on-write block needed, 5 free
    before = snapshot(mgr.device)
    with pytest.raises(NoFreeBlocksError):
        mgr.append_group(0, {0: 12, 1: 12})
    assert snapshot(mgr.device) == before
    mgr.append_group(0, {0: 1, 1: 1})
    mgr.check_invariants()


def test_kv_cache_sizes_from_a_memory_budget():
    cache = PagedKVCache(num_layers=2, num_kv_heads=4, head_size=64, block_size=16,
                         dtype=torch.float16, memory_bytes=10 * 2 * 2 * 4 * 16 * 64 * 2 + 5)
    assert cache.num_blocks == 10
    assert cache.usage(used_blocks=5)["device_fraction_used"] == 0.5
    with pytest.raises(ValueError):
        PagedKVCache(2, 4, 64, num_blocks=4, memory_bytes=100)


def test_host_pools_are_zeroed_and_usable():
    from paged_attention_ext.host_memory import zeros_huge_pages
    pool = zeros_huge_pages((64, 2, 16, 64), torch.bfloat16)
    assert pool.shape == (64, 2, 16, 64) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and not pool.any()
    cache = PagedKVCache(1, 2, 64, 16, torch.float32, num_blocks=8)
    assert not cache.key_caches[0].any()
    pa.write_kv(torch.ones(1, 2, 64), torch.ones(1, 2, 64), *cache.layer(0), torch.tensor([17]))
    assert cache.key_caches[0][1, :, 1].eq(1).all() and cache.key_caches[0].sum() == 128


def test_swap_in_reuses_blocks_still_cached_on_the_device():
    mgr = BlockSpaceManager(16, 8, 4, enable_prefix_caching=True, watermark=0.0)
    system = list(range(100, 108))  # two full blocks shared by both requests
    mgr.allocate(0, 0, system + [1, 2, 3])
    mgr.allocate(1, 1, system + [4, 5])
    shared = mgr.tables[0][0].blocks[:2]
    assert mgr.tables[1][0].blocks[:2] == shared
    out_map = mgr.swap_out(1)
    assert len(out_map) == 3  # every block of the group is saved to the host
    mgr.check_invariants()
    in_map = mgr.swap_in(1)
    mgr.check_invariants()
    assert mgr.tables[1][0].blocks[:2] == shared  # re-used where group 0 still holds them
    assert len(in_map) == 1  # only the private partial block is copied back
    assert mgr.device.ref_count(shared[0]) == 2 and mgr.host.num_used_blocks == 0


@pytest.mark.parametrize("free", [6, 7])
def test_admission_of_a_recomputed_group_is_counted_exactly(free):
    """Three samples of a 6-token prompt with 3 tokens each: the prompt's 2 blocks, two
    copies of its partial block (the last sample writes in place) and 3 new blocks."""
    mgr = BlockSpaceManager(free, 0, 4, watermark=0.0)
    seqs = [SeqSpec(s, 9) for s in range(3)]
    if free < 7:
        assert mgr.try_admit(0, seqs, 6) is None
        with pytest.raises(NoFreeBlocksError):
            mgr.admit(0, seqs, 6)
        assert mgr.device.num_free_blocks == free and not mgr.tables
        return
    slots = [placed.slots[0] for placed in mgr.admit(0, seqs, 6)]
    assert mgr.device.num_free_blocks == 0
    assert len(slots[0]) == 9  # the first sample computes the prompt
    assert [len(s) for s in slots[1:]] == [5, 5]  # the others from the prompt's partial block
    assert len({slot // 4 for s in slots for slot in s[-5:]}) == 6  # own partial + own new block
    mgr.check_invariants()


def test_blocks_needed_counts_growth_and_the_copy_of_a_shared_partial_block():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert blocks_needed(2, 4, num_held=6) == 0 and blocks_needed(3, 4, num_held=6) == 1
    assert blocks_needed(2, 4, num_held=6, copy_last=True) == 1  # copy-on-write first
    assert blocks_needed(1, 4, num_held=8, copy_last=True) == 1  # a full block is never copied
    assert blocks_needed(0, 4, num_held=6, copy_last=True) == 0


@pytest.mark.parametrize("windows", [(None,), (None, 4)])
def test_new_seq_cost_is_what_a_new_sequence_takes_in_every_kv_group(windows):
    mgr = BlockSpaceManager(32, 0, 4, watermark=0.0, kv_group_windows=windows)
    for group, num_tokens in enumerate((1, 4, 9)):
        free = mgr.num_free_device_blocks
        assert mgr.new_seq_cost(num_tokens) == len(windows) * -(-num_tokens // 4)
        mgr.allocate(group, group, num_tokens)
        assert free - mgr.num_free_device_blocks == mgr.new_seq_cost(num_tokens)
    mgr.check_invariants()


@pytest.mark.parametrize("free", [7, 8])
def test_try_admit_places_the_group_or_changes_nothing(free):
    """The group of test_admission_of_a_recomputed_group_is_counted_exactly takes 7 blocks;
    with one block kept spare it fits in 8 free blocks, not in 7."""
    mgr = BlockSpaceManager(10, 0, 4, watermark=0.1)
    mgr.allocate(9, 9, 4 * (10 - free))  # leaves `free` blocks
    seqs = [SeqSpec(s, 9) for s in range(3)]
    before = snapshot(mgr.device)
    placed = mgr.try_admit(0, seqs, 6)
    if free == 8:
        assert [len(p.slots[0]) for p in placed] == [9, 5, 5] and mgr.num_free_device_blocks == 1
    else:
        assert placed is None and snapshot(mgr.device) == before and not mgr.holds(0)
    mgr.check_invariants()


@pytest.mark.parametrize("free", [1, 2])
def test_try_swap_in_counts_the_next_token_and_changes_nothing_when_full(free):
    mgr = BlockSpaceManager(1 + free, 4, 4, watermark=0.0)
    mgr.allocate(0, 0, 4)  # one full block: the next token needs a new one
    mgr.swap_out(0)
    mgr.allocate(1, 1, 4)  # leaves `free` device blocks
    before = snapshot(mgr.device), snapshot(mgr.host)
    mapping = mgr.try_swap_in(0)
    if free == 2:
        assert mapping == [(0, 1)] and not mgr.is_swapped_out(0)
    else:
        assert mapping is None and (snapshot(mgr.device), snapshot(mgr.host)) == before
        assert mgr.is_swapped_out(0)
    mgr.check_invariants()


def test_bad_counts_and_ids_raise_value_error_without_change():
    mgr = BlockSpaceManager(8, 0, 4)
    mgr.allocate(0, 0, 5)
    before = snapshot(mgr.device), dict(mgr.tables[0][0].__dict__)
    with pytest.raises(ValueError, match="new tokens must be >= 0"):
        mgr.append(0, -5)
    with pytest.raises(ValueError, match="new tokens must be >= 0"):
        mgr.append_group(0, {0: -1})
    with pytest.raises(ValueError, match="at least one token"):
        mgr.allocate(1, 1, -3)
    with pytest.raises(ValueError, match="at least one token"):
        mgr.allocate(1, 1, [])
    with pytest.raises(ValueError, match="already exists"):
        mgr.allocate(0, 2, 3)
    with pytest.raises(ValueError, match="not in group"):
        mgr.append_group(5, {0: 1})
    with pytest.raises(ValueError, match="fewer than"):
        mgr.admit(1, [SeqSpec(1, 6), SeqSpec(2, 3)], 4)
    assert (snapshot(mgr.device), dict(mgr.tables[0][0].__dict__)) == before
    mgr.check_invariants()


def test_rollback_restores_the_checkpoint_but_forgets_evicted_cached_blocks():
    mgr = BlockSpaceManager(6, 4, 4, enable_prefix_caching=True, watermark=0.0)
    mgr.allocate(0, 0, list(range(9)))       # two named blocks and a partial one
    mgr.allocate(1, 1, list(range(50, 59)))
    head = mgr.tables[1][0].blocks[0]
    mgr.free_group(1)                        # its two named blocks stay cached
    cached_before = list(mgr.device._evictable)
    refs_before = [mgr.device.ref_count(b) for b in range(6)]
    table_before = (list(mgr.tables[0][0].blocks), mgr.tables[0][0].num_tokens)
    checkpoint = mgr.checkpoint()

    mgr.append(0, 1)
    mgr.allocate(2, 2, 8)                    # the free block, then evicts group 1's tail
    tail = [b for b in cached_before if b not in mgr.device._evictable]
    mgr.swap_out(0)
    mgr.rollback(checkpoint)

    assert len(tail) == 1 and head not in tail
    assert [mgr.device.ref_count(b) for b in range(6)] == refs_before
    assert (mgr.tables[0][0].blocks, mgr.tables[0][0].num_tokens) == table_before
    assert not mgr.holds(2) and mgr.host.num_used_blocks == 0
    assert list(mgr.device._evictable) == [b for b in cached_before if b not in tail]
    assert tail[0] in mgr.device.free_block_ids()  # its memory may have been overwritten
    mgr.check_invariants()
    _, num_cached = mgr.allocate(3, 3, list(range(50, 59)))
    assert num_cached == 4                   # the head is still served
