"""Chunked KV groups (Llama-4's chunked local attention) in the block layer: a chunked
group's table frees the blocks of finished chunks, keeps the current chunk's blocks where
``chunk_local`` reads them, and works with forks, swap, recomputation and prefix caching.
Sliding groups: test_kv_groups.py; the ops' chunked metadata: test_chunked.py."""

import random

import pytest
import torch

from paged_attention_ext.block_manager import BlockSpaceManager, SeqSpec
from paged_attention_ext.block_table import NULL_BLOCK, block_hashes
from paged_attention_ext.chunked import chunk_local
from paged_attention_ext.kv_groups import Chunked, KVGroupLayout

from group_walk import random_group_walk

C, BS = 8, 4
LLAMA4_8 = [None if (i + 1) % 4 == 0 else Chunked(C) for i in range(8)]  # 3 chunked : 1 full


def manager(num_blocks=64, host=64, windows=(None, Chunked(C)), caching=False):
    return BlockSpaceManager(num_blocks, host, BS, enable_prefix_caching=caching, watermark=0.0,
                             kv_group_windows=windows)


def read_blocks(mgr, seq):
    """The blocks chunk_local makes the ops read for the sequence's last position."""
    table = mgr.block_ids(seq, 1)
    n = mgr.num_tokens(seq)
    local = chunk_local(torch.tensor([table], dtype=torch.int32),
                        torch.tensor([n], dtype=torch.int32), C, BS)
    return local.block_tables[0, :-(-int(local.seq_lens[0]) // BS)].tolist()


def test_layout_of_chunked_and_full_layers():
    layout = KVGroupLayout.from_windows(LLAMA4_8)
    assert layout.windows == (None, Chunked(C), Chunked(C), Chunked(C))
    assert [g.layers for g in layout.groups] == [(3, 7), (0, 1), (2, 4), (5, 6)]
    assert [g.chunk_size for g in layout.groups] == [None, C, C, C]
    assert KVGroupLayout.from_windows([Chunked(C), 6, None]).windows == (None, Chunked(C), 6)


@pytest.mark.parametrize("size", [0, -8, True, 2.0])
def test_chunk_size_must_be_a_positive_int(size):
    with pytest.raises(ValueError, match="'size' must be a positive int"):
        Chunked(size)


def test_chunk_not_a_whole_number_of_blocks_is_refused_at_construction():
    with pytest.raises(ValueError, match="attention_chunk_size=6 is not a multiple of block_size=4"):
        manager(windows=(None, Chunked(6)))


def test_decode_frees_finished_chunks_and_keeps_what_chunk_local_reads():
    mgr = manager()
    mgr.allocate(0, 0, 1)
    for n in range(2, 60):
        mgr.append(0, 1)
        mgr.check_invariants()
        table = mgr.block_ids(0, 1)
        live = [b for b in table if b != NULL_BLOCK]
        # The current chunk's blocks only: the chunk before is freed as the next one starts.
        assert len(live) == -(-(n - (n - 1) // C * C) // BS) <= C // BS
        start = (n - 1) // C * C // BS
        assert table[:start] == [NULL_BLOCK] * start
        assert read_blocks(mgr, 0) == table[(n - 1) // C * C // BS:]
        assert NULL_BLOCK not in read_blocks(mgr, 0)
    assert len(mgr.block_ids(0, 0)) == 15 and NULL_BLOCK not in mgr.block_ids(0, 0)


def test_prefill_across_chunks_keeps_every_chunk_until_computed():
    mgr = manager()
    mgr.allocate(0, 0, 21)  # queries of chunks 0, 1 and 2 are computed in this step
    assert NULL_BLOCK not in mgr.block_ids(0, 1) and len(mgr.block_ids(0, 1)) == 6
    mgr.append(0, 1)  # computed: positions 0-15 are no query's keys any more
    assert mgr.block_ids(0, 1)[:4] == [NULL_BLOCK] * 4
    assert mgr.num_used_device_blocks == 6 + 2
    mgr.check_invariants()


def test_fork_copy_on_write_and_swap_keep_freed_entries():
    mgr = manager()
    mgr.allocate(0, 0, 5)
    mgr.fork(0, 1)
    for _ in range(15):
        placed = mgr.append_group(0, {0: 1, 1: 1})
        assert all(len(p.slots) == 2 for p in placed.values())
        mgr.check_invariants()
    assert mgr.block_ids(0, 1) != mgr.block_ids(1, 1)  # each wrote its own last block
    before = [mgr.block_ids(s, 1) for s in (0, 1)]
    out = mgr.swap_out(0)
    assert mgr.num_free_device_blocks == 64
    back = mgr.swap_in(0)
    assert len(back) == len(out)
    for old, new in zip(before, [mgr.block_ids(s, 1) for s in (0, 1)]):
        assert [b == NULL_BLOCK for b in old] == [b == NULL_BLOCK for b in new]
    mgr.check_invariants()


def test_truncate_into_a_freed_chunk_is_refused_naming_it():
    mgr = manager()
    mgr.allocate(0, 0, 1)
    for _ in range(20):
        mgr.append(0, 1)  # 21 tokens: chunk 16-23 current, chunk 8-15 freed
    mgr.truncate(0, 17)  # the same chunk
    with pytest.raises(NotImplementedError, match="chunked table \\(chunks of 8 tokens\\)"):
        mgr.truncate(0, 12)
    assert mgr.num_tokens(0) == 17
    mgr.check_invariants()


def test_recomputation_of_a_group_shares_the_prompt():
    mgr = manager()
    prompt = 20
    placed = mgr.admit(0, [SeqSpec(0, prompt + 3), SeqSpec(1, prompt + 5)], prompt)
    assert [len(p.slots[1]) for p in placed] == [23, 5 + prompt % BS]
    mgr.check_invariants()
    mgr.append_group(0, {0: 1, 1: 1})
    assert mgr.block_ids(0, 1)[:4] == [NULL_BLOCK] * 4 == mgr.block_ids(1, 1)[:4]
    mgr.check_invariants()


def cached_prompt(windows=(None, Chunked(C))):
    prompt = list(range(40))
    mgr = manager(windows=windows, caching=True)
    mgr.allocate(0, 0, prompt)
    mgr.free_group(0)
    return mgr, prompt, block_hashes(prompt, BS)


def test_prefix_hit_takes_only_the_first_querys_chunk():
    mgr, prompt, names = cached_prompt()
    _, cached = mgr.allocate(1, 1, prompt)
    assert cached == 36  # the last block is recomputed; its chunk starts at 32
    assert mgr.block_ids(1, 1)[:8] == [NULL_BLOCK] * 8
    mgr.free_group(1)
    # The chunked group's blocks before that chunk may be gone.
    mgr.device.forget([b for b, n in mgr.named_blocks().items()
                       if n in {m + bytes([1]) for m in names[:8]}])
    _, cached = mgr.allocate(2, 2, prompt)
    assert cached == 36
    mgr.check_invariants()


def test_prefix_hit_shortened_to_a_chunk_boundary_when_the_chunk_is_lost():
    mgr, prompt, names = cached_prompt()
    mgr.device.forget([b for b, n in mgr.named_blocks().items() if n == names[8] + bytes([1])])
    # Starting at 36 reads block 8 (chunk 32-39); starting at 32 reads no cached block.
    _, cached = mgr.allocate(1, 1, prompt)
    assert cached == 32
    mgr.check_invariants()


def test_prefix_hit_with_queries_from_the_start_needs_every_chunk():
    mgr, prompt, names = cached_prompt()
    mgr.device.forget([b for b, n in mgr.named_blocks().items() if n == names[1] + bytes([1])])
    _, cached = mgr.allocate(1, 1, prompt, queries_from_start=True)
    assert cached == 4  # block 0 only: position 4's query (chunk 0-7) reads the lost block 1
    mgr.check_invariants()


def test_random_operations_keep_invariants():
    """admit / append / fork / free / swap / recompute over full, chunked and sliding groups,
    invariants checked after every operation."""
    rng = random.Random(7)
    mgr = manager(num_blocks=48, host=48, windows=(None, Chunked(C), 5, Chunked(2 * C)),
                  caching=True)

    def admit(group):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        seqs = [SeqSpec(group + i, len(prompt) + rng.randrange(3), block_hashes(prompt, BS))
                for i in range(rng.choice([1, 1, 2]))]
        mgr.admit(group, seqs, len(prompt))
        return [s.seq_id for s in seqs]

    def reads_no_freed_block(seq):
        assert NULL_BLOCK not in read_blocks(mgr, seq)

    random_group_walk(mgr, rng, 500, admit, append_count=lambda: rng.choice([1, 1, 3]),
                      after_append=reads_no_freed_block)
    assert mgr.num_free_device_blocks == 48 and mgr.host.num_free_blocks == 48


def test_a_steps_chunked_metadata_attends_within_chunks():
    """StepInputs gives a chunked group chunk_local's metadata: one step mixing a prefill
    across three chunks, a decode past several freed chunks and a continuation that crosses
    a chunk, against a float64 brute force over each sequence's keys; unwritten (and freed)
    blocks are NaN, so a read outside the chunk shows."""
    from paged_attention_ext.kv_cache import PagedKVCache
    from paged_attention_ext.step_inputs import StepInputs, StepPlan

    heads, kv_heads, size = 4, 2, 16
    layout = KVGroupLayout.from_windows([None, Chunked(C)])
    kv = PagedKVCache(2, kv_heads, size, BS, dtype=torch.float32, num_blocks=64, kv_groups=layout)
    for pool in (*kv.key_caches, *kv.value_caches):
        pool.fill_(float("nan"))
    mgr = manager()
    mgr.allocate(0, 1, 29)
    mgr.append(1, 1)      # decode at position 29: chunks 0-2 freed
    mgr.allocate(1, 2, 14)
    mgr.append(2, 5)      # positions 14-18: chunk 0 freed, the rows cross into chunk 2
    mgr.allocate(2, 0, 21)  # a prompt over three chunks
    seqs, lens, q_lens = [0, 1, 2], [21, 30, 19], [21, 1, 5]
    g = torch.Generator().manual_seed(0)
    keys = {s: torch.randn(n, kv_heads, size, generator=g) for s, n in zip(seqs, lens)}
    values = {s: torch.randn(n, kv_heads, size, generator=g) for s, n in zip(seqs, lens)}
    for layer, group in ((0, 0), (1, 1)):
        for s, n in zip(seqs, lens):
            table = mgr.tables[s][group]
            live = [p for p in range(n) if table.blocks[p // BS] != NULL_BLOCK]
            kv.write(layer, keys[s][live], values[s][live],
                     torch.tensor(table.slots(live[0], n), dtype=torch.int64))
    tables = [[mgr.block_ids(s, group) for s in seqs] for group in (0, 1)]
    plan = StepPlan(tables, [[-1] * sum(q_lens)] * 2, lens, q_lens)
    inputs = StepInputs.from_plan(plan, kv)
    query = torch.randn(sum(q_lens), heads, size, generator=g)
    for layer, chunk in ((0, None), (1, C)):
        got = inputs.attention[layer].run(query, *kv.layer(layer), size ** -0.5)
        row = 0
        for s, n, q_len in zip(seqs, lens, q_lens):
            for p in range(n - q_len, n):
                first = 0 if chunk is None else p // chunk * chunk
                k = keys[s][first:p + 1].double().repeat_interleave(heads // kv_heads, 1)
                v = values[s][first:p + 1].double().repeat_interleave(heads // kv_heads, 1)
                scores = torch.einsum("hd,khd->hk", query[row].double(), k) * size ** -0.5
                want = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
                torch.testing.assert_close(got[row].double(), want, atol=1e-5, rtol=1e-5)
                row += 1
