"""KV groups: the layout of a hybrid model's layers and the block manager over
several groups (admission, forks, copy-on-write, swap, recompute, prefix-cache hits
intersected across groups). A sliding-window table alone: test_block_table.py."""

import random

import pytest

from paged_attention_ext.block_manager import BlockSpaceManager, NoFreeBlocksError, SeqSpec
from paged_attention_ext.block_table import NULL_BLOCK, block_hashes
from paged_attention_ext.kv_groups import KVGroupLayout, trailing_readers

from group_walk import random_group_walk

GEMMA3_26 = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 5 local : 1 global


def test_layout_of_mixed_layers_has_one_page_size():
    layout = KVGroupLayout.from_windows(GEMMA3_26)
    assert layout.windows[0] is None and set(layout.windows[1:]) == {512}
    assert layout.layers_per_group == 4  # the 4 full layers set the group size
    assert [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert layout.padded_layers == 2 and layout.num_layers == 26
    placed = sorted(layout.place(layer) for layer in range(26))
    assert len(set(placed)) == 26  # every layer has its own (group, pool tensor)
    assert layout.place(5) == (0, 0) and layout.place(23) == (0, 3)


def test_layout_of_uniform_layers_is_one_group():
    assert KVGroupLayout.from_windows([None] * 3).groups[0].layers == (0, 1, 2)
    sliding = KVGroupLayout.from_windows([8] * 4)
    assert sliding.windows == (8,) and not sliding.is_hybrid
    alternating = KVGroupLayout.from_windows([8, None] * 3)  # GPT-OSS, Gemma-2
    assert alternating.windows == (None, 8) and alternating.layers_per_group == 3


@pytest.mark.parametrize("bad", [[], [0], [None, -3], [None, 2.5], [True]])
def test_layout_refuses_bad_windows(bad):
    with pytest.raises(ValueError):
        KVGroupLayout.from_windows(bad)


def hybrid(num_blocks=64, host=64, bs=4, windows=(None, 6), caching=False):
    return BlockSpaceManager(num_blocks, host, bs, enable_prefix_caching=caching, watermark=0.0,
                             kv_group_windows=windows)


def test_hybrid_groups_get_their_own_blocks_and_slots():
    mgr = hybrid()
    placed, cached = mgr.allocate(0, 0, 10)
    assert cached == 0 and len(placed.slots) == 2
    full, sliding = mgr.block_ids(0, 0), mgr.block_ids(0, 1)
    assert not set(full) & set(sliding)  # one pool, distinct blocks
    assert mgr.num_used_device_blocks == 6
    for _ in range(30):
        result = mgr.append(0, 1)
        assert [len(s) for s in result.slots] == [1, 1]
        mgr.check_invariants()
    # 40 tokens: the full group holds 10 blocks, the sliding one its window's (6 - 1 keys back).
    assert len(mgr.block_ids(0, 0)) == 10 and NULL_BLOCK not in mgr.block_ids(0, 0)
    assert len([b for b in mgr.block_ids(0, 1) if b != NULL_BLOCK]) <= 3
    assert mgr.num_used_device_blocks <= 13
    mgr.free_group(0)
    assert mgr.num_free_device_blocks == 64
    mgr.check_invariants()


def test_hybrid_admission_counts_every_group():
    mgr = hybrid(num_blocks=5)
    assert not mgr.can_allocate(12)  # 3 blocks per group
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate(0, 0, 12)
    assert mgr.num_free_device_blocks == 5 and not mgr.tables
    assert mgr.can_allocate(8)
    mgr.allocate(0, 0, 8)
    assert mgr.num_free_device_blocks == 1


def test_hybrid_fork_and_copy_on_write_per_group():
    mgr = hybrid()
    mgr.allocate(0, 0, 6)  # a partial last block in each group
    mgr.fork(0, 1)
    used = mgr.num_used_device_blocks
    results = mgr.append_group(0, {0: 1, 1: 1})
    copies = [c for r in results.values() for c in r.copies]
    assert len(copies) == 2  # the shared partial block, once per group
    assert mgr.num_used_device_blocks == used + 2
    for _ in range(20):
        mgr.append_group(0, {0: 1, 1: 1})
        mgr.check_invariants()
    mgr.free_seq(1)
    mgr.free_seq(0)
    assert mgr.num_free_device_blocks == 64


def test_hybrid_swap_round_trip_keeps_freed_entries():
    mgr = hybrid()
    mgr.allocate(0, 0, 5)
    mgr.fork(0, 1)
    for _ in range(15):
        mgr.append_group(0, {0: 1, 1: 1})
    before = [(mgr.block_ids(s, 0), mgr.block_ids(s, 1)) for s in (0, 1)]
    out = mgr.swap_out(0)
    assert len(out) == len({b for s in (0, 1) for g in (0, 1) for b in mgr.block_ids(s, g)
                            if b != NULL_BLOCK})
    assert mgr.num_free_device_blocks == 64 and mgr.is_swapped_out(0)
    mgr.check_invariants()
    back = mgr.swap_in(0)
    assert len(back) == len(out)
    after = [(mgr.block_ids(s, 0), mgr.block_ids(s, 1)) for s in (0, 1)]
    for (f0, s0), (f1, s1) in zip(before, after):
        assert [b == NULL_BLOCK for b in s0] == [b == NULL_BLOCK for b in s1]
        assert len(f0) == len(f1)
    mgr.check_invariants()


def cached_prompt():
    """(manager, prompt, block names) with the 40-token prompt's 10 blocks cached in both
    groups (full attention, window 6) and nothing in use."""
    prompt = list(range(40))
    mgr = hybrid(windows=(None, 6), caching=True)
    mgr.allocate(0, 0, prompt)
    mgr.free_group(0)
    return mgr, prompt, block_hashes(prompt, 4)


def forget(mgr, names):
    """Evict the cached blocks of these (pooled) names."""
    mgr.device.forget([b for b, n in mgr.named_blocks().items() if n in names])


def test_prefix_hit_needs_every_group():
    mgr, prompt, names = cached_prompt()
    _, cached = mgr.allocate(1, 1, prompt)
    assert cached == 36  # the last block is recomputed
    mgr.free_group(1)
    mgr.check_invariants()

    # A sliding group only needs the window before the first recomputed token: its other
    # blocks may be gone. Evict the sliding group's early blocks only.
    forget(mgr, {n + bytes([1]) for n in names[:6]})
    _, cached = mgr.allocate(2, 2, prompt)
    assert cached == 36
    assert mgr.block_ids(2, 1)[:6] == [NULL_BLOCK] * 6  # before the window: not taken
    mgr.free_group(2)

    # Without the full group's blocks there is no hit at all.
    forget(mgr, {names[0]})
    _, cached = mgr.allocate(3, 3, prompt)
    assert cached == 0
    mgr.check_invariants()


def test_prefix_hit_shortened_to_where_the_window_is_cached():
    mgr, prompt, names = cached_prompt()
    # The sliding group lost block 7: starting at 32 or 36 needs it (keys from 27 / 31).
    forget(mgr, {names[7] + bytes([1])})
    _, cached = mgr.allocate(1, 1, prompt)
    assert cached == 28  # starting at 28 needs blocks 5 and 6 only
    mgr.check_invariants()


def test_hybrid_random_operations_keep_invariants():
    """A random walk over admit / append / fork / free / swap / recompute with invariants
    checked after every operation (reference counts, freed entries only outside windows)."""
    rng = random.Random(4)
    mgr = hybrid(num_blocks=48, host=48, windows=(None, 5, 9), caching=True)

    def admit(group):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        mgr.admit(group, [SeqSpec(group, len(prompt), block_hashes(prompt, 4))], len(prompt))
        return [group]

    random_group_walk(mgr, rng, 400, admit)
    assert mgr.num_free_device_blocks == 48 and mgr.host.num_free_blocks == 48


def test_one_groups_allocation_cannot_evict_anothers_prefix_hit():
    """Every group takes its hits before any allocates fresh blocks: allocating group 0's
    rest of the prompt must not evict group 1's cached hit blocks (review finding)."""
    mgr = BlockSpaceManager(40, 0, 2, enable_prefix_caching=True, watermark=0.0,
                            kv_group_windows=(None, 6))
    first, other = list(range(100, 109)), list(range(500, 521))
    mgr.allocate(1, 1, first)
    mgr.allocate(2, 2, other)
    mgr.free_group(1)
    mgr.free_group(2)
    prompt = first[:8] + list(range(900, 926))
    assert mgr.can_allocate(prompt)
    _, cached = mgr.allocate(3, 3, prompt)
    assert cached == 8
    mgr.check_invariants()
    mgr.free_group(3)
    assert mgr.num_free_device_blocks == 40


def test_appends_count_the_blocks_the_window_returns():
    """At a block boundary a sliding table frees a block before it allocates one: a pool
    exactly the window's size keeps decoding (review finding)."""
    mgr = BlockSpaceManager(4, 0, 2, watermark=0.0, kv_group_windows=(6,))
    mgr.allocate(0, 0, 7)
    for _ in range(20):
        assert mgr.append_cost(0) <= mgr.num_free_device_blocks
        mgr.append(0, 1)
        mgr.check_invariants()
    assert mgr.num_tokens(0) == 27 and mgr.seq_append_cost(0, 1) <= 0


def test_layers_without_kv_are_in_no_group():
    """A hybrid model's linear-attention layers keep no K/V: the groups and the pools hold the
    other layers only, and writing a layer without K/V has no pool."""
    import torch

    from paged_attention_ext.kv_cache import PagedKVCache

    layout = KVGroupLayout.from_windows([None, None, None, None, 8, None], without_kv=[0, 1, 2])
    # Groups of the rarest kind's count (one sliding layer), full attention first.
    assert [g.layers for g in layout.groups] == [(3,), (5,), (4,)]
    assert layout.stored_layers == 3 and layout.num_layers == 6
    assert layout.without_kv == (0, 1, 2)
    cache = PagedKVCache(6, 1, 4, 4, torch.float32, num_blocks=2, kv_groups=layout)
    assert len(cache.key_caches) == 1 and cache.kv_group(4) == 2
    with pytest.raises(KeyError):
        cache.layer(1)
    with pytest.raises(ValueError, match="kv_groups places 6 layers, the cache has 5"):
        PagedKVCache(5, 1, 4, 4, torch.float32, num_blocks=2, kv_groups=layout)
    with pytest.raises(ValueError, match="outside the model's 2"):
        KVGroupLayout.from_windows([None, None], without_kv=[2])
    with pytest.raises(ValueError, match="at least one layer that stores K/V"):
        KVGroupLayout.from_windows([None, None], without_kv=[0, 1])


# ---- groups per layer shape, layers that read another's K/V ---------------------------------
def test_groups_per_shape_are_sized_by_bytes():
    """Gemma-4-31B-like: 50 sliding layers of 16 heads x 256 and 10 full of 4 x 512: a full
    layer stores half a sliding one, so pages hold 10 full or 5 sliding layers, none padded."""
    windows = [1024 if i % 6 < 5 else None for i in range(60)]
    shapes = [(16, 256, 256) if w else (4, 512, 512) for w in windows]
    layout = KVGroupLayout.from_windows(windows, shapes)
    assert [len(g.layers) for g in layout.groups] == [10] + [5] * 10
    assert {layout.page_elements(g, 16) for g in range(len(layout.groups))} == {16 * 40960}
    assert layout.is_shaped and layout.windows == (None,) + (1024,) * 10
    # One shape: the layout without shapes.
    assert KVGroupLayout.from_windows(windows, [(2, 64, 64)] * 60) == KVGroupLayout.from_windows(windows)


def test_readers_are_in_no_group():
    windows = [4, 4, None, 4, None, 4, 4, None]
    layout = KVGroupLayout.from_windows(windows, readers={5: 3, 6: 3, 7: 4})
    assert layout.stored_layers == 5 and layout.num_layers == 8
    assert layout.place(6) == layout.place(3) and layout.place(7) == layout.place(4)
    assert trailing_readers(["s", "s", "f", "s", "f", "s", "s", "f"], 3) == {5: 3, 6: 3, 7: 4}
    with pytest.raises(ValueError, match="layer 2 \\(f\\) reuses K/V .* no earlier layer of its kind"):
        trailing_readers(["s", "s", "f"], 1)


@pytest.mark.parametrize("readers, match", [
    ({1: 0}, "window or shape differs"),
    ({3: 1, 1: 0}, "which stores nothing itself"),
    ({9: 0}, "the model has layers 0-3"),
])
def test_bad_readers_raise(readers, match):
    with pytest.raises(ValueError, match=match):
        KVGroupLayout.from_windows([None, 4, None, 4], readers=readers)
