"""AttentionMetadata: one step's metadata, checked once, run by every layer."""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext.cascade import plan_cascade
from paged_case import make_case, query_start_loc, random_query


@pytest.fixture
def case():
    return make_case([5, 20, 33], num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)


def ints(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("name,change,error,match", [
    ("tables dtype", lambda c: dict(block_tables=c.block_tables.long()), TypeError,
     "'block_tables' must have dtype torch.int32, got torch.int64"),
    ("tables not a tensor", lambda c: dict(block_tables=[[0, 1]]), TypeError,
     "'block_tables' must be a tensor, got list"),
    ("tables rank", lambda c: dict(block_tables=c.block_tables[0]), ValueError,
     r"'block_tables' must be 2-D \[num_seqs, max_blocks_per_seq\], got shape \[4\]"),
    ("tables rows", lambda c: dict(block_tables=c.block_tables[:2]), ValueError,
     "'block_tables' has 2 rows but 'seq_lens' has 3 sequences"),
    ("lens dtype", lambda c: dict(seq_lens=c.seq_lens.long()), TypeError,
     "'seq_lens' must have dtype torch.int32"),
    ("lens rank", lambda c: dict(seq_lens=c.seq_lens[None]), ValueError, "'seq_lens' must be 1-D"),
    ("lens device", lambda c: dict(seq_lens=c.seq_lens.to("meta")), ValueError,
     r"'seq_lens' must be on the device of 'block_tables' \(cpu\), got meta"),
    ("starts dtype", lambda c: dict(query_start_loc=query_start_loc([1, 1, 1]).long()), TypeError,
     "'query_start_loc' must have dtype torch.int32"),
    ("starts length", lambda c: dict(query_start_loc=query_start_loc([1, 1])), ValueError,
     r"'query_start_loc' must have num_seqs \+ 1 = 4 entries, got 3"),
    ("starts device", lambda c: dict(query_start_loc=query_start_loc([1, 1, 1]).to("meta")),
     ValueError, "'query_start_loc' must be on the device of 'block_tables'"),
])
def test_refuses_bad_metadata_naming_the_argument(name, change, error, match, case):
    args = dict(block_tables=case.block_tables, seq_lens=case.seq_lens)
    args.update(change(case))
    with pytest.raises(error, match=f"AttentionMetadata: {match}"):
        pa.AttentionMetadata(**args)


@pytest.mark.parametrize("q_lens", [None, [2, 0, 5]], ids=["decode", "mixed"])
def test_run_equals_the_op(q_lens, case):
    starts = None if q_lens is None else query_start_loc(q_lens)
    query = random_query(3 if q_lens is None else sum(q_lens), 4, 64, torch.float32)
    step = pa.AttentionMetadata(case.block_tables, case.seq_lens, starts)
    layer = dict(alibi_slopes=torch.rand(4), sliding_window=12, soft_cap=30.0, sinks=torch.randn(4))
    for options in ({}, layer):  # two layers over one metadata
        want = pa.attention(query, case.key_cache, case.value_cache, case.block_tables,
                            case.seq_lens, 0.125, starts, **options)
        torch.testing.assert_close(step.run(query, case.key_cache, case.value_cache, 0.125,
                                            **options), want, atol=0, rtol=0)
        out = torch.empty_like(want)
        assert step.run(query, case.key_cache, case.value_cache, 0.125, out=out, **options) is out
        torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_run_takes_the_cascade_split_where_the_layer_can():
    key_cache, value_cache = torch.randn(8, 2, 16, 32), torch.randn(8, 2, 16, 32)
    tables = [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 5]]
    lens = [60, 55, 50]
    plan = plan_cascade(tables, lens, [1, 1, 1], 16, torch.device("cpu"), min_saved_tokens=1)
    assert plan is not None
    block_tables, seq_lens = torch.tensor(tables, dtype=torch.int32), ints(*lens)
    step = pa.AttentionMetadata(block_tables, seq_lens, cascade=plan)
    query = torch.randn(3, 4, 32)
    for options in ({}, dict(sinks=torch.randn(4)), dict(sliding_window=20),
                    dict(alibi_slopes=torch.rand(4))):
        want = pa.attention(query, key_cache, value_cache, block_tables, seq_lens, 0.2, **options)
        torch.testing.assert_close(step.run(query, key_cache, value_cache, 0.2, **options), want)
        out = torch.empty_like(want)
        step.run(query, key_cache, value_cache, 0.2, out=out, **options)
        torch.testing.assert_close(out, want)


def test_docstring_example_runs():
    import doctest

    from paged_attention_ext import attention_metadata

    result = doctest.testmod(attention_metadata, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 4 and result.failed == 0, result
