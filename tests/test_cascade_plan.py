"""paged_attention_ext.cascade: which sequences form groups, when the split pays, and that a
plan's three ops equal plain attention on batches as the engine and PagedCache build them."""

import random

import pytest
import torch

from paged_attention_ext import ops
from paged_attention_ext.cascade import (CascadeBuffers, find_groups, layout_cascade, plan_cascade,
                                         unsplit_layout)
from paged_case import TOLERANCES

BS = 4


def runs(tables, lens, q_lens, min_saved=1):
    return [(r.first, r.end, r.shared) for r in find_groups(tables, lens, q_lens, BS, min_saved)]


def test_samples_of_one_prompt_form_one_group():
    prompt = [7, 3, 9]  # 12 tokens in whole blocks, then each sample's own block
    tables = [prompt + [20 + i] for i in range(4)]
    assert runs(tables, [14] * 4, [1] * 4) == [(0, 4, 3)]


def test_a_sharer_of_less_joins_only_while_the_saving_does_not_drop():
    a, b = [1, 2, 3, 4], [1, 30, 31, 32]
    # Two sequences sharing 4 blocks (1 x 4 blocks saved), a third sharing 1 (2 x 1): it
    # starts a run of its own.
    assert runs([a + [9], a + [10], b + [11]], [17] * 3, [1] * 3) == [(0, 2, 4), (2, 3, 0)]
    # Four sharing 4 blocks (3 x 4), a fifth sharing 3 (4 x 3): it joins, the prefix shrinks.
    tables = [a + [9 + i] for i in range(4)] + [[1, 2, 3, 40, 41]]
    assert runs(tables, [17] * 5, [1] * 5) == [(0, 5, 3)]
    # ... but one sharing 2 (4 x 2 < 3 x 4) does not.
    tables[-1] = [1, 2, 40, 41, 42]
    assert runs(tables, [17] * 5, [1] * 5) == [(0, 4, 4), (4, 5, 0)]


def test_the_prefix_stops_before_each_members_queries():
    # A request that hit the shared prompt blocks and prefills the rest (6 query tokens from
    # position 8): only the 2 blocks before its first query are its prefix.
    tables = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 10], [1, 2, 3, 11]]
    assert runs(tables, [17, 17, 14], [1, 1, 6]) == [(0, 3, 2)]


def test_padding_sequences_join_any_run():
    # PagedCache's compile mode: each row is a padding sequence (no rows) and a real one.
    scratch = [99]
    tables = [scratch, [1, 2, 5], scratch, [1, 2, 6], scratch, [7, 8, 9]]
    got = find_groups(tables, [0, 10, 0, 10, 0, 10], [0, 1, 0, 1, 0, 1], BS, 1)
    assert [(r.first, r.end, r.shared, r.anchor) for r in got] == [(0, 5, 2, 1), (5, 6, 0, 5)]
    layout = layout_cascade(tables, [0, 10, 0, 10, 0, 10], [0, 1, 0, 1, 0, 1], BS, 1)
    # The prefix is the anchor's blocks (not the padding sequence's scratch block).
    assert layout.prefix_tables == [[1, 2], []] and layout.suffix_lens == [0, 2, 0, 2, 0, 10]


@pytest.mark.parametrize("members,prefix_blocks,threshold,pays", [
    (1, 100, 1, False),           # one sequence: nothing to share
    (2, 64, 1024, False),         # 2 sequences x 256 tokens: 256 saved reads
    (2, 256, 1024, True),         # 1024 saved
    (8, 256, 1024, True),
])
def test_threshold(members, prefix_blocks, threshold, pays):
    prompt = list(range(prefix_blocks))
    tables = [prompt + [1000 + i] for i in range(members)]
    lens = [prefix_blocks * BS + 1] * members
    assert (plan_cascade(tables, lens, [1] * members, BS, torch.device("cpu"), threshold)
            is not None) == pays


def engine_like_batch(seed, num_blocks=200, head_size=32):
    """Requests with common prompts (prefix hits), samples and beams (forked tables whose
    last blocks were copied on write), unrelated requests, decode and prefill rows."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, lens, q_lens = [], [], []
    for _ in range(5):
        prompt = [free.pop() for _ in range(rng.randint(1, 6))]
        for _ in range(rng.randint(1, 4)):
            own = [free.pop() for _ in range(rng.randint(1, 3))]
            q = rng.choice([1, 1, 1, rng.randint(2, 4 * BS)])
            length = (len(prompt) + len(own) - 1) * BS + rng.randint(1, BS)
            tables.append(prompt + own)
            lens.append(length)
            q_lens.append(min(q, length - len(prompt) * BS) if rng.random() < 0.8 else min(q, length))
    kc = torch.randn(num_blocks, 2, BS, head_size)
    vc = torch.randn(num_blocks, 2, BS, head_size)
    return tables, lens, q_lens, kc, vc


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_run_equals_plain_attention(seed, dtype):
    tables, lens, q_lens, kc, vc = engine_like_batch(seed)
    kc, vc = kc.to(dtype), vc.to(dtype)
    plan = plan_cascade(tables, lens, q_lens, BS, torch.device("cpu"), min_saved_tokens=1)
    assert plan is not None and plan.saved_tokens > 0
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), 8, kc.shape[-1]).to(dtype)
    sinks = torch.randn(8)
    got = plan.run(query, kc, vc, 0.3, soft_cap=5.0, sinks=sinks)
    want = ops.attention(query, kc, vc, table, torch.tensor(lens, dtype=torch.int32), 0.3, starts,
                         soft_cap=5.0, sinks=sinks)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])


def test_fixed_buffers_hold_any_split_of_their_size():
    tables, lens, q_lens, kc, vc = engine_like_batch(3)
    n = len(tables)
    layout = layout_cascade(tables, lens, q_lens, BS, 1)
    buffers = CascadeBuffers(n + 2, n + 2, 16, torch.device("cpu"))
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), 8, kc.shape[-1])
    buffers.stage(layout, n, n)  # padded with empty groups
    got = buffers.plan(n, n, starts).run(query, kc, vc, 0.3)
    buffers.stage(unsplit_layout(tables, lens, q_lens), n, n)
    plain = buffers.plan(n, n, starts).run(query, kc, vc, 0.3)
    torch.testing.assert_close(got, plain, **TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="does not fit"):
        buffers.stage(layout, n + 1, n)
