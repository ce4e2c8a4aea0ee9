"""Custom-op registration: opcheck for every op, and torch.compile without graph breaks."""

import pytest
import torch

import attention_scenarios as scenarios
import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from paged_attention_ext.layouts import from_nhd
from paged_case import make_case, query_start_loc, random_query


def attention_args(dtype=torch.float32, multi_token=False, head_size_v=64, sinks=False):
    lens = [5, 17, 0, 33]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, poison=None,
                     head_size_v=head_size_v)
    if multi_token:
        qsl = query_start_loc([5, 2, 0, 1])
        query = random_query(int(qsl[-1]), 4, 64, dtype)
    else:
        qsl = None
        query = random_query(len(lens), 4, 64, dtype)
    return (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, qsl,
            torch.rand(4), 8, 10.0, torch.randn(4) if sinks else None)


@pytest.mark.parametrize("multi_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size_v,sinks", [(64, False), (64, True), (128, False), (32, True)])
def test_opcheck_attention(multi_token, dtype, head_size_v, sinks):
    args = attention_args(dtype, multi_token, head_size_v, sinks)
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args)
    out = args[0].new_empty(args[0].shape[:2] + (head_size_v,))
    lse = torch.empty(args[0].shape[:2])
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, lse) + args)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, None) + args)


@pytest.mark.parametrize("head_size_v", [64, 32])
def test_opcheck_write_kv(head_size_v):
    key_cache, value_cache = torch.zeros(4, 2, 8, 64), torch.zeros(4, 2, 8, head_size_v)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, head_size_v)
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (key, value, key_cache, value_cache, torch.tensor([5, -1, 30])))


@pytest.mark.parametrize("head_size_v", [64, 32])
def test_opcheck_copy_blocks(head_size_v):
    keys = [torch.randn(4, 2, 8, 64) for _ in range(2)]
    values = [torch.randn(4, 2, 8, head_size_v) for _ in range(2)]
    torch.library.opcheck(torch.ops.paged.copy_blocks.default,
                          (keys, values, torch.tensor([[0, 2], [1, 3]])))


def test_opcheck_swap_blocks():
    src, dst = torch.randn(4, 2, 8, 64), torch.zeros(3, 2, 8, 64)
    torch.library.opcheck(torch.ops.paged.swap_blocks.default, (src, dst, torch.tensor([[3, 0]])))


def decode_step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                sinks=None):
    pa.write_kv(key, value, key_cache, value_cache, slot_mapping)
    return pa.attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125,
                        sinks=sinks) * 2.0


@pytest.mark.parametrize("head_size_v,with_sinks", [(64, False), (32, True)])
def test_compile_fullgraph_write_then_attend_matches_eager(head_size_v, with_sinks):
    lens = [9, 16, 1]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=8, dtype=torch.float32,
                     poison=None, head_size_v=head_size_v)
    # The step's new token of each sequence goes to its last position.
    slots = torch.tensor([int(case.block_tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8
                          for i, n in enumerate(lens)])
    query = random_query(3, 4, 64, torch.float32)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, head_size_v)
    sinks = torch.randn(4) if with_sinks else None
    tables = (case.block_tables, case.seq_lens)

    eager_k, eager_v = case.key_cache.clone(), case.value_cache.clone()
    want = decode_step(query, key, value, eager_k, eager_v, slots, *tables, sinks)

    torch._dynamo.reset()
    compiled = torch.compile(decode_step, fullgraph=True)
    got_k, got_v = case.key_cache.clone(), case.value_cache.clone()
    got = compiled(query, key, value, got_k, got_v, slots, *tables, sinks)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_k, eager_k) and torch.equal(got_v, eager_v)

    oracle_k, oracle_v = case.key_cache.clone(), case.value_cache.clone()
    ref.write_kv(key, value, oracle_k, oracle_v, slots)
    oracle = ref.attention(query, oracle_k, oracle_v, *tables, 0.125, sinks=sinks) * 2
    torch.testing.assert_close(got, oracle, atol=2e-5, rtol=2e-5)

    explanation = torch._dynamo.explain(decode_step)(
        query, key, value, case.key_cache.clone(), case.value_cache.clone(), slots, *tables, sinks)
    assert explanation.graph_break_count == 0


# ---- fp8 caches with scales, strided views ------------------------------------------------

def fp8_attention_args(fp8, per_head, layout):
    lens = [5, 17, 0, 33]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32,
                     poison=None)
    kv = scenarios.KVFormat(fp8, per_head, layout)
    case, extra = scenarios.with_format(case, kv)
    query = random_query(len(lens), 4, 64, torch.bfloat16)
    return (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, None,
            None, -1, 0.0, torch.randn(4), extra["k_scale"], extra["v_scale"])


# opcheck's test_schema compares inputs with allclose, which torch lacks for fp8; the
# schemas' aliasing is the float caches' (checked above).
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("fp8,per_head,layout", [
    (torch.float8_e4m3fn, False, "HND"), (torch.float8_e5m2, True, "NHD"),
    (torch.float8_e4m3fn, True, "joint")])
def test_opcheck_attention_fp8(fp8, per_head, layout):
    args = fp8_attention_args(fp8, per_head, layout)
    torch.library.opcheck(torch.ops.paged.attention.default, args, test_utils=FP8_OPCHECKS)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args, test_utils=FP8_OPCHECKS)
    out = args[0].new_empty(args[0].shape)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, torch.empty(4, 4)) + args,
                          test_utils=FP8_OPCHECKS)


@pytest.mark.parametrize("layout", ["NHD", "joint"])
def test_opcheck_float_caches_in_strided_views(layout):
    lens = [5, 17, 0, 33]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16,
                     poison=None)
    case, _ = scenarios.with_format(case, scenarios.KVFormat(layout=layout))
    args = (random_query(4, 4, 64, torch.bfloat16), case.key_cache, case.value_cache,
            case.block_tables, case.seq_lens, 0.125)
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (torch.randn(2, 2, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16(),
                           case.key_cache, case.value_cache, torch.tensor([3, 40])))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_opcheck_write_kv_fp8_into_nhd_views(fp8):
    key_cache = from_nhd(torch.zeros(4, 8, 2, 64, dtype=fp8))
    value_cache = from_nhd(torch.zeros(4, 8, 2, 32, dtype=fp8))
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 32)
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (key, value, key_cache, value_cache, torch.tensor([5, -1, 30]),
                           torch.tensor([0.5, 0.25]), torch.tensor(0.1)), test_utils=FP8_OPCHECKS)


def fp8_decode_step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens,
                    k_scale, v_scale):
    pa.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return pa.attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125,
                        k_scale=k_scale, v_scale=v_scale) * 2.0


@pytest.mark.parametrize("per_head", [False, True])
def test_compile_fullgraph_fp8_write_then_attend_matches_eager(per_head):
    lens = [9, 16, 1]
    base = make_case(lens, num_kv_heads=2, head_size=64, block_size=8, dtype=torch.float32,
                     poison=None)
    case, extra = scenarios.with_format(base, scenarios.KVFormat(torch.float8_e4m3fn, per_head, "NHD"))
    slots = torch.tensor([int(case.block_tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8
                          for i, n in enumerate(lens)])
    query = random_query(3, 4, 64, torch.float16)
    key, value = torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()
    args = (case.block_tables, case.seq_lens, extra["k_scale"], extra["v_scale"])

    def fresh():  # the NHD views over copies of the case's storage
        return scenarios.relayout(case.key_cache.contiguous(), case.value_cache.contiguous(), "NHD")

    eager_k, eager_v = fresh()
    want = fp8_decode_step(query, key, value, eager_k, eager_v, slots, *args)
    torch._dynamo.reset()
    compiled = torch.compile(fp8_decode_step, fullgraph=True)
    got_k, got_v = fresh()
    got = compiled(query, key, value, got_k, got_v, slots, *args)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_k.view(torch.uint8), eager_k.view(torch.uint8))
    explanation = torch._dynamo.explain(fp8_decode_step)(query, key, value, *fresh(), slots, *args)
    assert explanation.graph_break_count == 0


# ---- per-token int8 / int4 caches: scale tensors beside the caches, written by write_kv --------

@pytest.mark.parametrize("cache_dtype,layout", [(torch.int8, "HND"), (torch.uint8, "NHD"),
                                                (torch.int8, "joint"), (torch.uint8, "padded")],
                         ids=str)
def test_opcheck_per_token_caches(cache_dtype, layout):
    # int caches compare with allclose, so the full opcheck runs (test_schema included: write_kv
    # declares k_scale / v_scale mutable, and the attention ops mutate nothing).
    lens = [5, 17, 0, 33]
    case = make_case(lens, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32,
                     poison=None)
    case, extra = scenarios.with_format(case, scenarios.KVFormat(cache_dtype, layout=layout))
    query = random_query(len(lens), 4, 64, torch.bfloat16)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, None,
            None, -1, 0.0, torch.randn(4), extra["k_scale"], extra["v_scale"])
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args)
    torch.library.opcheck(torch.ops.paged.attention_out.default,
                          (query.new_empty(query.shape), torch.empty(4, 4)) + args)
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (torch.randn(3, 2, 64), torch.randn(3, 2, 64), case.key_cache,
                           case.value_cache, torch.tensor([5, -1, 40]), extra["k_scale"],
                           extra["v_scale"]))
    torch.library.opcheck(torch.ops.paged.copy_blocks.default,
                          ([case.key_cache, extra["k_scale"]], [case.value_cache, extra["v_scale"]],
                           torch.tensor([[0, 5]])))
    torch.library.opcheck(torch.ops.paged.swap_blocks.default,
                          (extra["k_scale"], torch.zeros((2,) + extra["k_scale"].shape[1:]),
                           torch.tensor([[3, 0]])))


def token_decode_step(query, key, value, key_cache, value_cache, slot_mapping, block_tables,
                      seq_lens, k_scale, v_scale):
    pa.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return pa.attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125,
                        k_scale=k_scale, v_scale=v_scale) * 2.0


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.uint8], ids=["int8", "int4"])
def test_compile_fullgraph_per_token_write_then_attend_matches_eager(cache_dtype):
    lens = [9, 16, 1]
    base = make_case(lens, num_kv_heads=2, head_size=64, block_size=8, dtype=torch.float32,
                     poison=None)
    case, extra = scenarios.with_format(base, scenarios.KVFormat(cache_dtype))
    slots = torch.tensor([int(case.block_tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8
                          for i, n in enumerate(lens)])
    query = random_query(3, 4, 64, torch.float16)
    key, value = torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half()

    def fresh():  # copies of the caches and the scales (write_kv writes both)
        return [t.clone() for t in (case.key_cache, case.value_cache, extra["k_scale"], extra["v_scale"])]

    def run(step, tensors):
        k, v, ks, vs = tensors
        return step(query, key, value, k, v, slots, case.block_tables, case.seq_lens, ks, vs)

    eager = fresh()
    want = run(token_decode_step, eager)
    torch._dynamo.reset()
    got_tensors = fresh()
    got = run(torch.compile(token_decode_step, fullgraph=True), got_tensors)
    torch.testing.assert_close(got, want)
    for g, e in zip(got_tensors, eager):
        assert torch.equal(g, e), "the compiled step stores the rows and scales eager does"
    explanation = torch._dynamo.explain(token_decode_step)(
        query, key, value, *fresh()[:2], slots, case.block_tables, case.seq_lens, *fresh()[2:])
    assert explanation.graph_break_count == 0
