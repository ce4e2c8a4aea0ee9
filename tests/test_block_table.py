"""paged_attention_ext.block_table: block names, slots, the blocks an append needs, KV-group
keys, copies, and sliding-window tables that free what leaves the window.

Copy-on-write, forks and truncation of full-attention tables: test_block_manager.py.
"""

import pytest

from paged_attention_ext.block_allocator import BlockAllocator
from paged_attention_ext.block_table import NULL_BLOCK, BlockTable, block_hashes, chain_hash


# ---- block names --------------------------------------------------------------------------

def test_block_names_chain_over_every_earlier_token():
    tokens = list(range(10))
    names = block_hashes(tokens, 4)
    assert len(names) == 2  # the partial third block has no name
    assert names[1] == chain_hash(names[0], tokens[4:8])
    first_differs = block_hashes([99] + tokens[1:], 4)
    assert first_differs[0] != names[0] and first_differs[1] != names[1]
    second_differs = block_hashes(tokens[:4] + [99] + tokens[5:], 4)
    assert second_differs[0] == names[0] and second_differs[1] != names[1]
    assert block_hashes(tokens, 4, extra_key="adapter")[0] != names[0]


def test_known_names_are_kept_and_only_new_blocks_hashed():
    tokens = list(range(12))
    known = [b"not a hash"]
    names = block_hashes(tokens, 4, known=known)
    assert names[0] == b"not a hash" and names[1] == chain_hash(b"not a hash", tokens[4:8])
    assert block_hashes(tokens, 4, known=block_hashes(tokens[:8], 4)) == block_hashes(tokens, 4)


# ---- slots and what an append needs -------------------------------------------------------------

def test_blocks_needed_counts_new_blocks_and_a_copy_on_write():
    alloc = BlockAllocator(16, 4)
    table = BlockTable(alloc)
    table.append_tokens(6)  # 2 blocks, 2 free slots
    assert [table.blocks_needed(n) for n in (0, 2, 3, 6, 7)] == [0, 0, 1, 1, 2]
    child = table.fork()  # the partial block is now shared: the first write copies it
    assert [child.blocks_needed(n) for n in (0, 1, 3)] == [0, 1, 2]
    free = alloc.num_free_blocks
    result = child.append_tokens(3)
    assert free - alloc.num_free_blocks == 2 and len(result.copies) == 1


def test_slots_follow_the_table():
    table = BlockTable(BlockAllocator(8, 4))
    table.append_tokens(7)
    first, second = table.blocks
    assert table.slots(2, 6) == [first * 4 + 2, first * 4 + 3, second * 4, second * 4 + 1]
    assert table.slots(3, 3) == []


# ---- KV groups in one pool, copies ------------------------------------------------------------

def test_equal_tokens_of_two_groups_are_two_cached_blocks():
    alloc = BlockAllocator(8, 4, enable_prefix_caching=True)
    names = block_hashes(list(range(8)), 4)
    full, sliding = BlockTable(alloc, group_key=b"0"), BlockTable(alloc, 6, group_key=b"1")
    for table in (full, sliding):
        table.append_tokens(8, names)
    assert set(full.blocks).isdisjoint(sliding.blocks)
    assert alloc.lookup(names[0] + b"0") == full.blocks[0]
    assert alloc.lookup(names[0] + b"1") == sliding.blocks[0]
    assert alloc.lookup(names[0]) is None  # no group registers the bare name


def test_copy_shares_no_state_and_remap_keeps_freed_entries():
    alloc = BlockAllocator(8, 4)
    table = BlockTable(alloc, sliding_window=4)
    for _ in range(13):
        table.append_tokens(1)
    assert table.blocks[0] == NULL_BLOCK
    twin = table.copy(alloc)
    assert twin.blocks == table.blocks and twin.num_freed == table.num_freed
    refs = [alloc.ref_count(b) for b in table.live_blocks]
    twin.blocks.append(7)
    assert len(table.blocks) == 4 and [alloc.ref_count(b) for b in table.live_blocks] == refs
    mapping = {b: 10 + i for i, b in enumerate(table.live_blocks)}
    table.remap(alloc, mapping)
    assert table.blocks == [NULL_BLOCK] * table.num_freed + sorted(mapping.values())


# ---- sliding-window tables ----------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 4, 5, 9])
def test_sliding_table_holds_only_its_window(window):
    bs = 4
    alloc = BlockAllocator(64, bs)
    table = BlockTable(alloc, sliding_window=window)
    table.append_tokens(10, computed=False)  # a prompt: every block until it is computed
    assert table.live_blocks == table.blocks and len(table.blocks) == 3
    for _ in range(40):
        table.append_tokens(1)
        # Held: the window of the token before the newest (so it can be dropped again).
        first = table.first_visible_block(table.num_tokens - 2)
        assert all(b == NULL_BLOCK for b in table.blocks[:first])
        assert NULL_BLOCK not in table.blocks[first:]
        assert len(table.live_blocks) <= -(-(window - 1) // bs) + 1 + 1
        assert alloc.num_free_blocks == 64 - len(table.live_blocks)
    assert len(table.blocks) == -(-table.num_tokens // bs)  # logical positions kept
    table.free()
    assert alloc.num_free_blocks == 64


def test_full_table_frees_nothing():
    table = BlockTable(BlockAllocator(32, 4))
    for _ in range(30):
        table.append_tokens(1)
    assert NULL_BLOCK not in table.blocks and len(table.blocks) == 8


def test_sliding_table_refuses_truncating_into_freed_blocks():
    table = BlockTable(BlockAllocator(32, 4), sliding_window=6)
    for _ in range(20):
        table.append_tokens(1)
    table.truncate(19)  # its window is still held
    with pytest.raises(NotImplementedError, match="freed blocks"):
        table.truncate(6)
    assert table.num_tokens == 19
    table.truncate(0)  # nothing kept: every live block goes back
    assert table.blocks == [] and table.allocator.num_free_blocks == 32
