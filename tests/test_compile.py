"""Custom-op registration: opcheck for every op, and torch.compile without graph breaks."""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from paged_case import make_case, query_start_loc, random_query


def attention_args(dtype=torch.float32, multi_token=False):
    lens = [5, 17, 0, 33]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, poison=None)
    if multi_token:
        qsl = query_start_loc([5, 2, 0, 1])
        query = random_query(int(qsl[-1]), 4, 64, dtype)
    else:
        qsl = None
        query = random_query(len(lens), 4, 64, dtype)
    return (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, qsl,
            torch.rand(4), 8, 10.0)


@pytest.mark.parametrize("multi_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_attention(multi_token, dtype):
    args = attention_args(dtype, multi_token)
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args)
    out = torch.empty_like(args[0])
    lse = torch.empty(args[0].shape[:2])
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, lse) + args)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, None) + args)


def test_opcheck_write_kv():
    key_cache, value_cache = torch.zeros(4, 2, 8, 64), torch.zeros(4, 2, 8, 64)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (key, value, key_cache, value_cache, torch.tensor([5, -1, 30])))


def test_opcheck_copy_blocks():
    keys = [torch.randn(4, 2, 8, 64) for _ in range(2)]
    values = [torch.randn(4, 2, 8, 64) for _ in range(2)]
    torch.library.opcheck(torch.ops.paged.copy_blocks.default,
                          (keys, values, torch.tensor([[0, 2], [1, 3]])))


def test_opcheck_swap_blocks():
    src, dst = torch.randn(4, 2, 8, 64), torch.zeros(3, 2, 8, 64)
    torch.library.opcheck(torch.ops.paged.swap_blocks.default, (src, dst, torch.tensor([[3, 0]])))


def decode_step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens):
    pa.write_kv(key, value, key_cache, value_cache, slot_mapping)
    return pa.attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125) * 2.0


def test_compile_fullgraph_write_then_attend_matches_eager():
    lens = [9, 16, 1]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=8, dtype=torch.float32,
                     poison=None)
    # The step's new token of each sequence goes to its last position.
    slots = torch.tensor([int(case.block_tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8
                          for i, n in enumerate(lens)])
    query = random_query(3, 4, 64, torch.float32)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)

    eager_k, eager_v = case.key_cache.clone(), case.value_cache.clone()
    want = decode_step(query, key, value, eager_k, eager_v, slots, case.block_tables, case.seq_lens)

    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True)
    got_k, got_v = case.key_cache.clone(), case.value_cache.clone()
    got = compiled(query, key, value, got_k, got_v, slots, case.block_tables, case.seq_lens)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_k, eager_k) and torch.equal(got_v, eager_v)

    oracle_k, oracle_v = case.key_cache.clone(), case.value_cache.clone()
    ref.write_kv(key, value, oracle_k, oracle_v, slots)
    oracle = ref.attention(query, oracle_k, oracle_v, case.block_tables, case.seq_lens, 0.125) * 2
    torch.testing.assert_close(got, oracle, atol=2e-5, rtol=2e-5)

    explanation = torch._dynamo.explain(decode_step)(
        query, key, value, case.key_cache.clone(), case.value_cache.clone(), slots,
        case.block_tables, case.seq_lens)
    assert explanation.graph_break_count == 0
