"""Chunked local attention: the paged ops over chunk_local's metadata against a float64
brute force that masks every key outside the query's chunk."""

import pytest
import torch

import attention_scenarios as scenarios
import paged_attention_ext as pa
from paged_attention_ext.chunked import chunk_local
from paged_case import make_case, query_start_loc, random_query


def brute_force(query, case, scale, chunk, q_lens=None, sinks=None, k_scale=None, v_scale=None):
    """Each query row over the keys [p // chunk * chunk, p] of its sequence, in float64."""
    lens = case.seq_lens.tolist()
    q_lens = q_lens or [1] * len(lens)
    heads, kv_heads = query.shape[1], case.key_cache.shape[1]
    bs = case.block_size

    def rows(cache, scale_of):
        values = cache.double() if cache.dtype.itemsize > 1 else cache.float().double()
        if scale_of is not None:
            values = values * scale_of.double().reshape(-1)[:, None, None].expand(kv_heads, 1, 1)[None]
        return values

    keys, values = rows(case.key_cache, k_scale), rows(case.value_cache, v_scale)
    out = torch.zeros(query.shape[:2] + case.value_cache.shape[3:], dtype=torch.float64)
    row = 0
    for seq, (length, q_len) in enumerate(zip(lens, q_lens)):
        if length == 0:  # a padded row: zeros
            row += q_len
            continue
        positions = torch.arange(length)
        blocks = case.block_tables[seq, positions // bs].long()
        seq_keys = keys[blocks, :, positions % bs]  # [length, kv_heads, head]
        seq_values = values[blocks, :, positions % bs]
        for p in range(length - q_len, length):
            start = p // chunk * chunk
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = seq_keys[start:p + 1, kv] @ query[row, h].double() * scale
                top = scores.max() if sinks is None else torch.maximum(scores.max(), sinks[h].double())
                weights = (scores - top).exp()
                total = weights.sum() + (0.0 if sinks is None else (sinks[h].double() - top).exp())
                out[row, h] = weights @ seq_values[start:p + 1, kv] / total
            row += 1
    return out


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("block_size, chunk", [(16, 16), (16, 32), (8, 64), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_sees_only_its_chunk(block_size, chunk, dtype):
    lens = [1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 0, 5 * chunk]
    case = make_case(lens, 2, 64, block_size, dtype)  # NaN in every unused slot
    query = random_query(len(lens), 8, 64, dtype)
    sinks = scenarios.random_sinks(8)
    local = chunk_local(case.block_tables, case.seq_lens, chunk, block_size)
    got = pa.attention(query, case.key_cache, case.value_cache, local.block_tables, local.seq_lens,
                       0.125, sinks=sinks)
    want = brute_force(query, case, 0.125, chunk, sinks=sinks)
    torch.testing.assert_close(got.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert (got[5] == 0).all(), "a padded row yields zeros"


@pytest.mark.parametrize("block_size, chunk", [(16, 32), (4, 8), (1, 3)])
def test_multi_token_rows_split_at_chunk_boundaries(block_size, chunk):
    """Prefill, chunked prefill after cached tokens, rows crossing several chunks, a decode
    row and a padded row in one call: the pieces' rows are the original rows."""
    lens = [3 * chunk + 5, 2 * chunk, chunk + 1, 7, 0]
    q_lens = [3 * chunk + 5, chunk + 3, 1, 7, 0]
    case = make_case(lens, 2, 64, block_size, torch.float32)
    qsl = query_start_loc(q_lens)
    query = random_query(sum(q_lens), 4, 64, torch.float32)
    local = chunk_local(case.block_tables, case.seq_lens, chunk, block_size, qsl)
    assert local.query_start_loc[-1] == sum(q_lens)
    got = pa.attention(query, case.key_cache, case.value_cache, local.block_tables, local.seq_lens,
                       0.125, query_start_loc=local.query_start_loc)
    want = brute_force(query, case, 0.125, chunk, q_lens=q_lens)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_fp8_cache_and_nhd_view():
    chunk, block_size = 32, 16
    lens = [1, 31, 33, 70]
    kv = scenarios.KVFormat(torch.float8_e4m3fn, per_head_scales=True, layout="NHD")
    case, extra = scenarios.with_format(make_case(lens, 2, 128, block_size, torch.float32), kv)
    query = random_query(len(lens), 4, 128, torch.bfloat16)
    local = chunk_local(case.block_tables, case.seq_lens, chunk, block_size)
    got = pa.attention(query, case.key_cache, case.value_cache, local.block_tables, local.seq_lens,
                       128 ** -0.5, **extra)
    want = brute_force(query, case, 128 ** -0.5, chunk, **extra)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_decode_form_compiles_without_graph_break():
    chunk, block_size = 32, 16
    case = make_case([5, 40, 64, 65], 2, 64, block_size, torch.float32)
    query = random_query(4, 4, 64, torch.float32)

    def step(query, key_cache, value_cache, block_tables, seq_lens):
        local = chunk_local(block_tables, seq_lens, chunk, block_size)
        return pa.attention(query, key_cache, value_cache, local.block_tables, local.seq_lens, 0.125)

    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(*args), step(*args))


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=24, block_size=16), "chunk_size=24 is not a multiple of block_size=16"),
    (dict(chunk_size=0, block_size=16), "'chunk_size' must be a positive int"),
    (dict(chunk_size=32, block_size=True), "'block_size' must be a positive int"),
])
def test_bad_sizes_are_named(kwargs, match):
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        chunk_local(tables, torch.tensor([3], dtype=torch.int32), **kwargs)


def test_more_query_rows_than_tokens_is_named():
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="'query_start_loc' gives sequence 0 5 query rows but "
                                         "'seq_lens' only 3 tokens"):
        chunk_local(tables, torch.tensor([3], dtype=torch.int32), 16, 16,
                    torch.tensor([0, 5], dtype=torch.int32))
