"""paged.attention and its variants against the reference, on adversarial layouts."""

import math

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from paged_case import DTYPES, TOLERANCES, make_case, query_start_loc, random_query


def assert_matches_reference(query, case, scale, **kwargs):
    out, lse = pa.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables,
                                     case.seq_lens, scale, **kwargs)
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache,
                                            case.block_tables, case.seq_lens, scale, **kwargs)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert not out.isnan().any(), "NaN in output"
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[query.dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    return out


def edge_lengths(block_size: int):
    return sorted({1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 5})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128, 256])
def test_decode_block_sizes_and_edge_lengths(dtype, block_size):
    lens = edge_lengths(block_size) + [0]  # 0: a padded row
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=block_size, dtype=dtype)
    query = random_query(len(lens), 8, 64, dtype)
    out = assert_matches_reference(query, case, 64 ** -0.5)
    assert (out[-1] == 0).all(), "a padded row must yield zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [8, 32, 40, 64, 80, 96, 112, 120, 128, 256])
def test_decode_head_sizes(dtype, head_size):
    lens = [1, 15, 16, 17, 70]
    case = make_case(lens, num_kv_heads=2, head_size=head_size, block_size=16, dtype=dtype)
    query = random_query(len(lens), 4, head_size, dtype)
    assert_matches_reference(query, case, head_size ** -0.5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2), (8, 1), (64, 1)])
def test_decode_gqa_and_mqa(num_heads, num_kv_heads):
    lens = [5, 33, 64, 100]
    case = make_case(lens, num_kv_heads=num_kv_heads, head_size=64, block_size=16,
                     dtype=torch.float32)
    query = random_query(len(lens), num_heads, 64, torch.float32)
    assert_matches_reference(query, case, 0.125)


@pytest.mark.parametrize("poison", [float("nan"), 1e30, -1e30, float("inf")])
def test_unused_slots_do_not_change_output(poison):
    lens = [1, 15, 16, 17, 0, 40]
    clean = make_case(lens, 2, 64, 16, torch.float32, poison=None)
    query = random_query(len(lens), 4, 64, torch.float32)
    args = (clean.block_tables, clean.seq_lens, 0.125)
    before = pa.attention(query, clean.key_cache, clean.value_cache, *args)
    clean.poison_unused(poison)
    after = pa.attention(query, clean.key_cache, clean.value_cache, *args)
    assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_token_mixed_with_decode(dtype):
    # Prefill from empty, chunked prefill after a cached prefix, a decode row, speculative
    # decoding (3 tokens), a padded sequence, and a long chunk; all in one call.
    lens = [37, 80, 20, 19, 0, 300]
    q_lens = [37, 16, 1, 3, 0, 150]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)
    qsl = query_start_loc(q_lens)
    query = random_query(sum(q_lens), 8, 64, dtype)
    assert_matches_reference(query, case, 0.125, query_start_loc=qsl)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("multi_token", [False, True])
def test_sliding_window(window, multi_token):
    lens = [1, 16, 17, 90, 200]
    q_lens = [1, 16, 5, 40, 1] if multi_token else None
    case = make_case(lens, 2, 64, 16, torch.float32)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 4, 64, torch.float32)
    assert_matches_reference(query, case, 0.125, query_start_loc=qsl, sliding_window=window)


@pytest.mark.parametrize("multi_token", [False, True])
def test_alibi_and_soft_cap(multi_token):
    lens = [3, 17, 64, 129]
    q_lens = [3, 4, 1, 20] if multi_token else None
    case = make_case(lens, 2, 64, 16, torch.bfloat16)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 8, 64, torch.bfloat16)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 8) for h in range(8)], dtype=torch.float32)
    assert_matches_reference(query, case, 0.125, query_start_loc=qsl, alibi_slopes=slopes)
    assert_matches_reference(query * 8, case, 0.125, query_start_loc=qsl, soft_cap=5.0)
    assert_matches_reference(query, case, 0.125, query_start_loc=qsl, alibi_slopes=slopes,
                             sliding_window=10, soft_cap=30.0)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512_bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_instruction_set(isa, dtype, monkeypatch):
    best = pa.cpu_isa()
    order = ["generic", "avx2", "avx512", "avx512_bf16"]
    if order.index(isa) > order.index(best):
        pytest.skip(f"this CPU supports up to {best}")
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", isa)
    assert pa.cpu_isa() == isa
    lens = [1, 15, 16, 17, 100, 0]
    # 128 has its own compile of the kernel; 64 takes the general one, 72 its ragged path.
    for head_size in (64, 72, 128):
        case = make_case(lens, 2, head_size, 16, dtype)
        query = random_query(len(lens), 8, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5)
        qsl = query_start_loc([1, 3, 16, 17, 40, 0])
        query = random_query(int(qsl[-1]), 8, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, query_start_loc=qsl,
                                 soft_cap=20.0)


def test_unknown_instruction_set_is_rejected(monkeypatch):
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="PAGED_ATTENTION_CPU_ISA"):
        pa.cpu_isa()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_long_context(threads, dtype):
    # Few sequences with long contexts are split into partitions and merged.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [4000, 777]
        case = make_case(lens, 1, 128, 16, dtype)
        query = random_query(len(lens), 4, 128, dtype)
        assert_matches_reference(query, case, 128 ** -0.5)
        assert_matches_reference(query, case, 128 ** -0.5, sliding_window=1500)
    finally:
        torch.set_num_threads(previous)


def test_split_kv_is_exact_across_thread_counts():
    case = make_case([6000], 1, 128, 16, torch.float32)
    query = random_query(1, 8, 128, torch.float32)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = pa.attention(*args)
        torch.set_num_threads(2)
        split = pa.attention(*args)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-5)


def test_large_scores_are_stable():
    case = make_case([50, 3], 1, 64, 16, torch.float32)
    query = random_query(2, 2, 64, torch.float32) * 100.0
    out = assert_matches_reference(query, case, 1.0)
    assert out.isfinite().all()


def test_non_contiguous_query_and_lse_properties():
    lens = [10, 33]
    case = make_case(lens, 2, 64, 8, torch.float32)
    fused = random_query(len(lens), 12, 64, torch.float32)
    query = fused[:, :8]  # a view into a fused projection: strided heads
    assert not query.is_contiguous()
    assert_matches_reference(query, case, 0.125)
    # lse of a single visible key is exactly its score.
    one = make_case([1], 1, 64, 8, torch.float32)
    q = random_query(1, 1, 64, torch.float32)
    _, lse = pa.attention_with_lse(q, one.key_cache, one.value_cache, one.block_tables,
                                   one.seq_lens, 0.5)
    block = int(one.block_tables[0, 0])
    want = 0.5 * torch.dot(q[0, 0], one.key_cache[block, 0, 0])
    torch.testing.assert_close(lse[0, 0], want)


def test_lse_merges_two_halves_exactly():
    # Attention over keys [0, n) equals the LSE-weighted merge of [0, m) and [m, n).
    n, m = 100, 37
    case = make_case([n], 1, 64, 16, torch.float32)
    q = random_query(1, 4, 64, torch.float32)
    full = pa.attention(q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    # Keys [0, m): the same table with seq_len m (the query, placed at m-1, sees them all).
    first, lse1 = pa.attention_with_lse(q, case.key_cache, case.value_cache, case.block_tables,
                                        torch.tensor([m], dtype=torch.int32), 0.125)
    # Keys [m, n): the query at n-1 with a window of n - m.
    second, lse2 = pa.attention_with_lse(q, case.key_cache, case.value_cache, case.block_tables,
                                         case.seq_lens, 0.125, sliding_window=n - m)
    w1, w2 = torch.exp(lse1), torch.exp(lse2)
    merged = (first * w1[..., None] + second * w2[..., None]) / (w1 + w2)[..., None]
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


def test_out_variant_writes_into_caller_buffers():
    lens = [5, 0, 40]
    case = make_case(lens, 2, 64, 16, torch.bfloat16)
    query = random_query(3, 4, 64, torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    lse = torch.full((3, 4), float("nan"))
    address = out.data_ptr()
    result = pa.attention_out(out, query, case.key_cache, case.value_cache, case.block_tables,
                              case.seq_lens, 0.125, lse=lse)
    assert result.data_ptr() == address
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache,
                                            case.block_tables, case.seq_lens, 0.125)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(lse, want_lse)
    assert (out[1] == 0).all() and math.isinf(lse[1, 0]) and lse[1, 0] < 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,group,lens", [
    (8, 1, [40]),          # one short sequence: its KV heads are split across work items
    (32, 1, [3000]),       # one long sequence: key partitions, each holding every KV head
    (8, 4, [3000, 17]),    # partitions and GQA groups together
    (3, 2, [700, 1, 33]),  # a KV head count that does not split evenly
])
def test_work_splits(dtype, num_kv_heads, group, lens):
    case = make_case(lens, num_kv_heads, 128, 16, dtype)
    query = random_query(len(lens), num_kv_heads * group, 128, dtype)
    assert_matches_reference(query, case, 128 ** -0.5)


def test_random_shapes_match_reference():
    """Seeded random mixes of dtype, heads, head and block size, lengths, window and
    multi-token rows: the traversal (spans of blocks, heads within them, ragged chunks)
    must agree with the reference everywhere."""
    rng = torch.Generator().manual_seed(5)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    for seed in range(60):
        dtype = pick(DTYPES)
        kv_heads, group = pick([1, 2, 3, 4, 8]), pick([1, 2, 4, 8])
        head_size, block_size = pick([16, 48, 64, 72, 128, 256]), pick([1, 5, 8, 16, 24, 32, 64])
        lens = [pick([1, max(1, block_size - 1), block_size, block_size + 1,
                      int(torch.randint(1, 700, (1,), generator=rng))])
                for _ in range(pick([1, 2, 3, 5, 16]))]
        case = make_case(lens, kv_heads, head_size, block_size, dtype, seed=seed)
        kwargs = {"sliding_window": pick([0, 0, 7, 40])}
        num_tokens = len(lens)
        if seed % 3 == 0:  # multi-token rows
            q_lens = [int(torch.randint(1, n + 1, (1,), generator=rng)) for n in lens]
            kwargs["query_start_loc"] = query_start_loc(q_lens)
            num_tokens = sum(q_lens)
        query = random_query(num_tokens, kv_heads * group, head_size, dtype)
        assert_matches_reference(query, case, head_size ** -0.5, **kwargs)
