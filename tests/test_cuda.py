"""The CUDA kernels against the reference, opcheck, and CUDA graph capture.

Skipped where no GPU is present. Runs under pytest, or as a plain script on a machine
without pytest (``python tests/test_cuda.py [-k SUBSTRING]``, closing with
``N passed, N failed``). ``python tests/test_cuda.py --scenario`` runs one small call of
every kernel path instead (for compute-sanitizer). The planner's host-side tests, which
need no GPU, are in test_cuda_plan.py.
"""

import contextlib
import dataclasses
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # paged_case, as a script too

try:
    import pytest
except ImportError:  # the script runner at the end stands in
    pytest = None

if not torch.cuda.is_available() and pytest is not None and __name__ != "__main__":
    pytest.skip("no CUDA device", allow_module_level=True)

import paged_attention_ext as pa  # noqa: E402
from paged_attention_ext import reference as ref  # noqa: E402
from attention_scenarios import FP8_DTYPES, on_device, relayout, scenario_cases, strided_to  # noqa: E402
from paged_case import DTYPES, TOLERANCES, PagedCase, make_case, query_start_loc, random_query  # noqa: E402

CUDA = torch.device("cuda")


def parametrize(names, values, ids=None):
    """``pytest.mark.parametrize``, also recorded for the script runner."""
    def wrap(fn):
        fn.cases = [(names, values)] + getattr(fn, "cases", [])
        return pytest.mark.parametrize(names, values, ids=ids)(fn) if pytest else fn
    return wrap


def on_cuda(case: PagedCase) -> PagedCase:
    return on_device(case, CUDA)


# ---- paged.attention ---------------------------------------------------------------

@parametrize("case", scenario_cases(), ids=str)
def test_attention_scenario(case):
    """The scenarios the CPU kernel is tested with (attention_scenarios.py)."""
    case.run(CUDA)


def test_split_kv_matches_cpu_kernel():
    case = make_case([30000], 1, 128, 16, torch.float32)
    query = random_query(1, 8, 128, torch.float32)
    want = pa.attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    gpu = on_cuda(case)
    got = pa.attention(query.to(CUDA), gpu.key_cache, gpu.value_cache, gpu.block_tables, gpu.seq_lens, 0.1)
    torch.testing.assert_close(got.cpu(), want, **TOLERANCES[torch.float32])


def test_strided_metadata():
    case = make_case([10, 33, 0], 2, 64, 16, torch.float32)
    gpu = on_cuda(case)
    q_lens = [4, 2, 0]
    qsl = query_start_loc(q_lens)
    slopes = torch.rand(4)
    query = random_query(sum(q_lens), 4, 64, torch.float32)

    def strided(t):  # every other element of a [n, 2] device tensor
        return torch.stack([t.to(CUDA), t.to(CUDA)], 1)[:, 0]

    got = pa.attention(query.to(CUDA), gpu.key_cache, gpu.value_cache, gpu.block_tables, strided(case.seq_lens),
                       0.125, query_start_loc=strided(qsl), alibi_slopes=strided(slopes))
    want = ref.attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125,
                         query_start_loc=qsl, alibi_slopes=slopes)
    torch.testing.assert_close(got.cpu(), want, **TOLERANCES[torch.float32])


@parametrize("multi_token", [False, True])
def test_out_of_range_metadata_never_faults(multi_token):
    # Device metadata is not validated on CUDA (that would need a sync), but no value
    # may make a kernel touch memory outside its tensors. An illegal access would
    # surface at the synchronize, and poison every later CUDA call.
    case = on_cuda(make_case([5, 20, 40], 2, 64, 16, torch.float32))
    tables = torch.tensor([[-1, 2 ** 30, 7, 0], [12345, -7, 3, 1], [2 ** 31 - 1, -2 ** 31, 0, 1]],
                          dtype=torch.int32, device=CUDA)
    seq_lens = torch.tensor([1000, -3, 2 ** 31 - 1], dtype=torch.int32, device=CUDA)
    if multi_token:
        qsl = torch.tensor([0, 50, -3, 2 ** 30], dtype=torch.int32, device=CUDA)
        query = torch.randn(9, 8, 64, device=CUDA)
    else:
        qsl, query = None, torch.randn(3, 8, 64, device=CUDA)
    for window in (-1, 5):
        pa.attention_with_lse(query, case.key_cache, case.value_cache, tables, seq_lens, 0.1,
                              query_start_loc=qsl, sliding_window=window)
    slots = torch.tensor([-5, 10 ** 12, case.key_cache.shape[0] * 16], device=CUDA)
    before = case.key_cache.clone()
    pa.write_kv(torch.ones(3, 2, 64, device=CUDA), torch.ones(3, 2, 64, device=CUDA),
                case.key_cache, case.value_cache, slots)
    pa.copy_blocks([case.key_cache], [case.value_cache],
                   torch.tensor([[-1, 0], [0, 10 ** 9]], device=CUDA))
    torch.cuda.synchronize()
    assert torch.equal(case.key_cache, before), "out-of-range slots and pairs must be skipped"


def test_ops_never_synchronize_the_host():
    # Every input is on the device before the check starts: making one from a Python
    # list is itself a synchronizing copy.
    case = on_cuda(make_case([3000, 5], 2, 64, 16, torch.bfloat16))
    query = random_query(2, 8, 64, torch.bfloat16).to(CUDA)
    new = torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16, device=CUDA)
    slots = torch.tensor([-1], device=CUDA)
    mapping = torch.tensor([[0, 1]], device=CUDA)
    # fp8 caches in NHD views with per-head scales: the scales stay on the device.
    nhd = relayout(case.key_cache.cpu(), case.value_cache.cpu(), "NHD")
    fp8 = [strided_to(c.to(torch.float8_e4m3fn), CUDA) for c in nhd]
    scale = torch.full((2,), 0.5, device=CUDA)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pa.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
        pa.write_kv(new[0], new[1], case.key_cache, case.value_cache, slots)
        pa.copy_blocks([case.key_cache], [case.value_cache], mapping)
        pa.attention_with_lse(query, fp8[0], fp8[1], case.block_tables, case.seq_lens, 0.1, k_scale=scale,
                              v_scale=scale)
        pa.write_kv(new[0], new[1], fp8[0], fp8[1], slots, k_scale=scale, v_scale=scale)
        pa.copy_blocks([fp8[0]], [fp8[1]], mapping)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---- sinks and value head sizes, split-KV planning ----------------------------------

def with_value_head_size(case: PagedCase, head_size_v: int, seed: int = 5) -> PagedCase:
    """``case`` with a value cache of another head size (unused slots NaN-poisoned)."""
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(case.key_cache.shape[:3] + (head_size_v,), generator=gen).to(case.key_cache.dtype)
    value.permute(0, 2, 1, 3)[~case.used_slots] = float("nan")
    return dataclasses.replace(case, value_cache=value)


def check_against_reference(case, query, scale, *, atol_lse=1e-4, **kwargs):
    """paged.attention_with_lse on the GPU against the fp32 reference on the CPU."""
    gpu = on_cuda(case)
    moved = {k: v.to(CUDA) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    out, lse = pa.attention_with_lse(query.to(CUDA), gpu.key_cache, gpu.value_cache, gpu.block_tables,
                                     gpu.seq_lens, scale, **moved)
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables,
                                            case.seq_lens, scale, **kwargs)
    assert out.shape == want.shape
    torch.testing.assert_close(out.cpu().float(), want.float(), **TOLERANCES[query.dtype])
    torch.testing.assert_close(lse.cpu(), want_lse, atol=atol_lse, rtol=1e-5)
    return out.cpu(), lse.cpu()


@parametrize("dtype", DTYPES)
@parametrize("multi_token", [False, True])
@parametrize("lens", [[0, 5, 40, 1], [3000, 0, 17]])  # the second splits the keys (sinks in the merge)
def test_sinks(dtype, multi_token, lens):
    case = make_case(lens, 2, 64, 16, dtype)
    sinks = torch.tensor([-1.0, 0.5, 3.0, -20.0, 2.0, 0.0, 1.5, -3.0])
    q_lens = [min(n, 3) for n in lens] if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 8, 64, dtype)
    qsl = query_start_loc(q_lens) if multi_token else None
    for window in (-1, 7):
        out, lse = check_against_reference(case, query, 0.125, query_start_loc=qsl, sinks=sinks,
                                           sliding_window=window)
    if not multi_token:
        empty = lens.index(0)
        assert (out[empty] == 0).all() and torch.equal(lse[empty], sinks), "no key: out 0, lse = sink"


@parametrize("head_sizes", [(192, 128), (96, 64), (64, 128), (128, 64), (256, 256), (40, 24), (192, 192)])
@parametrize("dtype", [torch.float32, torch.bfloat16])
@parametrize("multi_token", [False, True])
def test_value_head_size_differs(head_sizes, dtype, multi_token):
    head_size, head_size_v = head_sizes
    lens = [1, 33, 2500, 0] if not multi_token else [1, 33, 2500, 4]
    case = with_value_head_size(make_case(lens, 2, head_size, 16, dtype), head_size_v)
    q_lens = [1, 5, 9, 4] if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 16, head_size, dtype)
    qsl = query_start_loc(q_lens) if multi_token else None
    out, _ = check_against_reference(case, query, head_size ** -0.5, query_start_loc=qsl,
                                     sinks=torch.linspace(-2, 2, 16), soft_cap=30.0)
    assert out.shape[-1] == head_size_v


def test_window_near_int32_max_equals_no_window():
    # window + rows_per_tile - 1 was once computed in int32 and wrapped, so a
    # multi-token call with such a window got partitions of one key and wrong output.
    case = make_case([900, 4100], 2, 64, 16, torch.float32)
    q_lens = [7, 12]
    query = random_query(sum(q_lens), 8, 64, torch.float32)
    qsl = query_start_loc(q_lens)
    for window in (2 ** 31 - 1, 2 ** 31 - 5):
        check_against_reference(case, query, 0.125, query_start_loc=qsl, sliding_window=window)


@parametrize("batch,real_len", [(1, 4096), (1, 70000), (3, 1), (64, 4000)])
def test_padded_block_table(batch, real_len):
    # Tables padded far past the real lengths (CUDA-graph
    # style), so most splits are empty and the merge weighs many partitions.
    dtype = torch.bfloat16
    bs, width = 16, 128 * 1024 // 16
    lens = [max(0, real_len - 37 * i) for i in range(batch)]
    case = make_case(lens, 2, 128, bs, dtype, poison=None)
    tables = torch.full((batch, width), 2 ** 30, dtype=torch.int32)
    tables[:, :case.block_tables.shape[1]] = case.block_tables
    case = dataclasses.replace(case, block_tables=tables)
    query = random_query(batch, 8, 128, dtype)
    check_against_reference(case, query, 128 ** -0.5, sinks=torch.zeros(8))


@parametrize("heads,kv_heads", [(8, 8), (8, 4), (12, 4), (8, 2), (16, 2), (40, 2)])
@parametrize("multi_token", [False, True])
def test_every_query_bucket(heads, kv_heads, multi_token):
    # Instances with 1, 2, 4 and 8 query vectors per CTA.
    case = make_case([1, 700, 5000], kv_heads, 128, 16, torch.bfloat16)
    q_lens = [1, 6, 11] if multi_token else None
    query = random_query(sum(q_lens) if multi_token else 3, heads, 128, torch.bfloat16)
    check_against_reference(case, query, 0.08, query_start_loc=query_start_loc(q_lens) if multi_token else None,
                            alibi_slopes=torch.rand(heads))


@parametrize("dtype", DTYPES)
def test_cache_ops_with_value_head_size(dtype):
    # write_kv and copy_blocks when value rows are shorter than key rows (192/128).
    gen = torch.Generator().manual_seed(3)
    key_cache = torch.randn(8, 2, 16, 192, generator=gen).to(dtype)
    value_cache = torch.randn(8, 2, 16, 128, generator=gen).to(dtype)
    key = torch.randn(5, 2, 192, generator=gen).to(dtype)
    value = torch.randn(5, 2, 128, generator=gen).to(dtype)
    slots = torch.tensor([3, -1, 40, 127, 64])
    mapping = torch.tensor([[0, 5], [3, 1], [7, 6]])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    ref.copy_blocks([want_k], [want_v], mapping)
    got_k, got_v = key_cache.to(CUDA), value_cache.to(CUDA)
    pa.write_kv(key.to(CUDA), value.to(CUDA), got_k, got_v, slots.to(CUDA))
    pa.copy_blocks([got_k], [got_v], mapping)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_swap_blocks_keeps_the_pinned_source_alive():
    # The pinned-memory allocator must not hand a host pool freed
    # right after swap_blocks to another tensor while the copy is still in flight.
    pool = random_caches(num_blocks=16, head_size=128)[0]
    host = pool.pin_memory()
    device_pool = torch.zeros_like(pool, device=CUDA)
    address = host.data_ptr()
    torch.cuda._sleep(50_000_000)  # keeps the stream busy: the copy below waits behind it
    pa.swap_blocks(host, device_pool, torch.tensor([[i, i] for i in range(16)]))
    del host
    other = torch.empty_like(pool).pin_memory()
    assert other.data_ptr() != address, "the host pool was reused while its copy was pending"
    other.fill_(float("nan"))
    torch.cuda.synchronize()
    assert torch.equal(device_pool.cpu(), pool)


# ---- fp8 caches and strided layouts -------------------------------------------------
# The attention scenarios cover fp8 and the layouts across features (attention_scenarios.py,
# kv_format_*); these check what they do not: the device's fp8 conversion of every byte,
# write_kv's bytes, the cache ops on fp8 and strided views, graphs with fp8 scales.

@parametrize("dtype", FP8_DTYPES)
@parametrize("query_dtype", DTYPES)
def test_fp8_every_byte_dequantizes_exactly(dtype, query_dtype):
    # One key per sequence: out = its value row * v_scale. The value rows hold all 256
    # byte values, so the device's conversion (hardware on sm_89+, software below) is
    # checked value by value, NaN included, through the fp32 output.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    value = torch.zeros(1, 2, 16, 256, dtype=torch.uint8)
    value[0, :, 0] = codes
    value = value.view(dtype)
    key = torch.zeros(1, 2, 16, 256, dtype=dtype)
    v_scale = torch.tensor([1.0, 0.25])
    query = torch.randn(1, 2, 256).to(query_dtype)
    out = pa.attention(query.to(CUDA), key.to(CUDA), value.to(CUDA), torch.zeros(1, 1, dtype=torch.int32, device=CUDA),
                       torch.ones(1, dtype=torch.int32, device=CUDA), 0.1, k_scale=torch.ones(2, device=CUDA),
                       v_scale=v_scale.to(CUDA)).cpu()
    want = (codes.view(dtype).float()[None, :] * v_scale[:, None]).to(query_dtype)
    torch.testing.assert_close(out[0], want, rtol=0, atol=0, equal_nan=True)


def fp8_write_inputs(input_dtype, num_tokens, kv_heads, head_size, seed=4):
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, 2 * kv_heads + 1, head_size, generator=gen) * 300
    fused[1, 1, :6] = torch.tensor([float("nan"), -float("nan"), float("inf"), float("-inf"), 1e9, -1e-30])
    fused = fused.to(input_dtype)
    return fused[:, 1:1 + kv_heads], fused[:, 1 + kv_heads:]  # strided views, as from a fused projection


@parametrize("dtype", FP8_DTYPES)
@parametrize("input_dtype", DTYPES)
@parametrize("per_head", [False, True])
@parametrize("layout", ["HND", "NHD", "joint", "padded"])
def test_write_kv_fp8_bit_identical(dtype, input_dtype, per_head, layout):
    # Quantization, saturation (inf, 1e9) and NaN with its sign, byte for byte against the
    # reference, into every layout the attention scenarios use.
    num_blocks, kv_heads, block_size, head_size = 6, 2, 16, 64
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.randn(num_blocks, kv_heads, block_size, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_size, generator=gen).to(dtype)
    key, value = fp8_write_inputs(input_dtype, 40, kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    slots[::7] = -1
    shape = (kv_heads,) if per_head else ()
    k_scale, v_scale = torch.rand(shape, generator=gen) + 0.1, torch.rand(shape, generator=gen) + 0.1
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots, k_scale=k_scale, v_scale=v_scale)
    got_k, got_v = (strided_to(c, CUDA) for c in relayout(key_cache, value_cache, layout))
    pa.write_kv(key.to(CUDA), value.to(CUDA), got_k, got_v, slots.to(CUDA), k_scale=k_scale.to(CUDA),
                v_scale=v_scale.to(CUDA))
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.cpu().contiguous().view(torch.uint8), want.view(torch.uint8))


@parametrize("cache_dtype", [torch.int8, torch.uint8])
@parametrize("input_dtype", DTYPES)
@parametrize("layout", ["HND", "NHD", "joint", "padded"])
def test_write_kv_per_token(cache_dtype, input_dtype, layout):
    # int8 bytes and every scale as the reference's (rounding ties, NaN and inf rows, a
    # constant row); int4 nibbles too, but for a rounding tie the rotation reached in
    # another fp32 order (then one step apart). Caches and scales in every layout.
    from paged_attention_ext import token_quantization as tq
    from attention_scenarios import relayout_scales

    num_blocks, kv_heads, block_size, head_size = 6, 2, 16, 64
    gen = torch.Generator().manual_seed(2)
    stored = tq.stored_head_size(cache_dtype, head_size)
    key_cache = torch.randint(0, 256, (num_blocks, kv_heads, block_size, stored), generator=gen,
                              dtype=torch.uint8).view(cache_dtype)
    value_cache = key_cache.flip(0).clone()
    scale_shape = tq.scale_shape(cache_dtype, num_blocks, kv_heads, block_size)
    k_scale, v_scale = torch.full(scale_shape, float("nan")), torch.full(scale_shape, 7.0)
    key, value = fp8_write_inputs(input_dtype, 40, kv_heads, head_size)
    key[2, 0] = 2.5  # a constant row: scale 0, stored exactly
    ties = torch.arange(head_size) - 126.5  # int8: amax 127, scale 1, every other ratio k + 1/2
    ties[0] = 127.0
    value[3, 1] = ties.to(input_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    slots[::7] = -1
    want = [t.clone() for t in (key_cache, value_cache, k_scale, v_scale)]
    ref.write_kv(key, value, *want[:2], slots, *want[2:])
    got_k, got_v = (strided_to(c, CUDA) for c in relayout(key_cache, value_cache, layout))
    got_ks, got_vs = (strided_to(s, CUDA) for s in relayout_scales(k_scale, v_scale, layout))
    pa.write_kv(key.to(CUDA), value.to(CUDA), got_k, got_v, slots.to(CUDA), k_scale=got_ks, v_scale=got_vs)
    for got, want_t in zip((got_ks, got_vs), want[2:]):
        torch.testing.assert_close(got.cpu(), want_t, rtol=0, atol=0, equal_nan=True)
    for got, want_t in zip((got_k, got_v), want[:2]):
        got = got.cpu().contiguous()
        if cache_dtype == torch.int8:
            assert torch.equal(got, want_t)
        else:
            nibbles = [torch.stack((t & 15, t >> 4), -1).int() for t in (got, want_t)]
            assert (nibbles[0] - nibbles[1]).abs().max() <= 1
            assert (nibbles[0] != nibbles[1]).float().mean() < 1e-3


@parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn, torch.int8, torch.uint8])
def test_write_latent_and_attention_over_latent_rows(cache_dtype):
    # Rows and scales as the reference's (int4: a nibble one step apart at a rounding tie),
    # then decode over the rows (values their leading columns, one scale tensor) against the
    # reference over what the kernel stored.
    from paged_attention_ext import token_quantization as tq

    per_token = tq.is_per_token(cache_dtype)
    width = tq.stored_head_size(cache_dtype, 576) if per_token else 576
    cache = torch.zeros(4, 1, 16, width, dtype=cache_dtype)
    scale = (torch.zeros(tq.scale_shape(cache_dtype, 4, 1, 16)) if per_token
             else torch.tensor([0.05]) if cache_dtype == torch.float8_e4m3fn else None)
    latent, rotary = torch.randn(5, 1, 512).half(), torch.randn(5, 1, 64).half()
    slots = torch.tensor([3, -1, 17, 40, 63])
    got = cache.to(CUDA)
    got_scale = None if scale is None else scale.to(CUDA)
    pa.write_latent(latent.to(CUDA), rotary.to(CUDA), got, slots.to(CUDA), got_scale)
    ref.write_latent(latent, rotary, cache, slots, scale)
    if cache_dtype == torch.uint8:
        nibbles = [torch.stack((t & 15, t >> 4), -1).int() for t in (got.cpu(), cache)]
        assert (nibbles[0] - nibbles[1]).abs().max() <= 1
    else:
        assert torch.equal(got.cpu().view(torch.uint8), cache.view(torch.uint8))
    if per_token:
        torch.testing.assert_close(got_scale.cpu(), scale, rtol=1e-6, atol=0)
    values = got[..., :tq.stored_head_size(cache_dtype, 512) if per_token else 512]
    tables = torch.arange(4, dtype=torch.int32)[None].to(CUDA)
    lens = torch.tensor([64], dtype=torch.int32, device=CUDA)
    query = torch.randn(1, 16, 576, device=CUDA, dtype=torch.float16 if not per_token else torch.bfloat16)
    got_scale = got_scale if cache_dtype != torch.float16 else None
    out = pa.attention(query, got, values, tables, lens, 0.05, k_scale=got_scale, v_scale=got_scale)
    want = ref.attention(query.cpu().double(), got.cpu(), values.cpu(), tables.cpu(), lens.cpu(), 0.05,
                         k_scale=None if got_scale is None else got_scale.cpu(),
                         v_scale=None if got_scale is None else got_scale.cpu())
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-2, rtol=2e-2)


@parametrize("cache_dtype", [torch.int8, torch.uint8])
@parametrize("layout", ["HND", "NHD", "padded"])
def test_copy_and_swap_blocks_per_token_caches_and_scales(cache_dtype, layout):
    # A cache and its scale tensor (int8's 3-D, int4's 4-D) moved with one mapping: dense
    # blocks as one chunk, padded ones (a spare row per block) row by row, scales included.
    from paged_attention_ext import token_quantization as tq
    from attention_scenarios import relayout_scales

    gen = torch.Generator().manual_seed(3)
    cache = torch.randint(0, 256, (6, 2, 16, tq.stored_head_size(cache_dtype, 64)), generator=gen,
                          dtype=torch.uint8).view(cache_dtype)
    scales = torch.randn(tq.scale_shape(cache_dtype, 6, 2, 16), generator=gen)
    key, value = (strided_to(c, CUDA) for c in relayout(cache, cache.flip(0).clone(), layout))
    k_scale, v_scale = (strided_to(t, CUDA) for t in relayout_scales(scales, scales.flip(0).clone(), layout))
    mapping = torch.tensor([[0, 3], [5, 1]])
    want = [t.cpu().clone() for t in (key, k_scale, value, v_scale)]
    ref.copy_blocks(want[:2], want[2:], mapping)
    pa.copy_blocks([key, k_scale], [value, v_scale], mapping.to(CUDA))
    for got, expected in zip((key, k_scale, value, v_scale), want):
        assert torch.equal(got.cpu().contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    for t in (key, k_scale):
        host = torch.zeros((3,) + tuple(t.shape[1:]), dtype=t.dtype).pin_memory()
        pa.swap_blocks(t, host, torch.tensor([[4, 0], [2, 2]]))
        pa.swap_blocks(host, t, torch.tensor([[0, 5]]))
        torch.cuda.synchronize()
        assert torch.equal(host[2].view(torch.uint8), t[2].cpu().contiguous().view(torch.uint8))
        assert torch.equal(t[5].cpu().contiguous().view(torch.uint8), t[4].cpu().contiguous().view(torch.uint8))


@parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@parametrize("layout", ["NHD", "joint", "padded"])
def test_write_kv_strided_caches(dtype, layout):
    key_cache, value_cache = random_caches(num_blocks=6, dtype=torch.float32)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    input_dtype = torch.bfloat16
    key, value = fp8_write_inputs(input_dtype if dtype in FP8_DTYPES else dtype, 30, 2, 64)
    slots = torch.randperm(6 * 16)[:30]
    scales = dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0)) if dtype in FP8_DTYPES else {}
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots, **scales)
    got_k, got_v = (strided_to(c, CUDA) for c in relayout(key_cache, value_cache, layout))
    assert not got_k.is_contiguous()
    pa.write_kv(key.to(CUDA), value.to(CUDA), got_k, got_v, slots.to(CUDA),
                **{k: v.to(CUDA) for k, v in scales.items()})
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.cpu().contiguous().view(torch.uint8), want.view(torch.uint8))


def interleaved(key_cache, value_cache):
    """K and V rows alternating per token, [blocks, block_size, 2, heads, head]: blocks that
    are no dense chunk (copied row by row)."""
    kv = torch.stack([key_cache.transpose(1, 2), value_cache.transpose(1, 2)], 2).contiguous()
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


@parametrize("dtype", [torch.float16, torch.float8_e5m2])
@parametrize("layout", ["NHD", "joint", "padded", "interleaved"])
@parametrize("mapping_device", ["cpu", "cuda"])
def test_copy_blocks_fp8_and_strided(dtype, layout, mapping_device):
    layers = [tuple(c.to(dtype) for c in random_caches(seed=s)) for s in range(3)]
    mapping = torch.tensor([[0, 5], [0, 6], [3, 1], [11, 2]])
    want_keys, want_values = [k.clone() for k, _ in layers], [v.clone() for _, v in layers]
    ref.copy_blocks(want_keys, want_values, mapping)
    views = [interleaved(k, v) if layout == "interleaved" else relayout(k, v, layout) for k, v in layers]
    keys = [strided_to(k, CUDA) for k, _ in views]
    values = [strided_to(v, CUDA) for _, v in views]
    pa.copy_blocks(keys, values, mapping.to(mapping_device))
    for got, want in zip(keys + values, want_keys + want_values):
        assert torch.equal(got.cpu().contiguous().view(torch.uint8), want.view(torch.uint8))


@parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@parametrize("layouts", [("NHD", "NHD"), ("HND", "NHD"), ("joint", "HND"), ("interleaved", "padded")])
def test_swap_blocks_strided(dtype, layouts):
    # Same dense layout on both sides: block (or run) copies; different or non-dense
    # layouts: 2-D copies per block and head. Device to pinned host and back.
    src_layout, dst_layout = layouts
    key, value = (c.to(dtype) for c in random_caches(num_blocks=10))

    def view(layout, k, v):
        return (interleaved(k, v) if layout == "interleaved" else relayout(k, v, layout))[0]

    device_pool = strided_to(view(src_layout, key, value), CUDA)
    host_pool = view(dst_layout, torch.zeros_like(key[:6]), torch.zeros_like(value[:6]))  # pageable
    out_map = torch.tensor([[7, 0], [2, 3], [9, 5], [8, 1]])
    pa.swap_blocks(device_pool, host_pool, out_map)
    torch.cuda.synchronize()
    for s, d in out_map.tolist():
        assert torch.equal(host_pool[d].contiguous().view(torch.uint8), key[s].view(torch.uint8))
    back = strided_to(view(src_layout, torch.zeros_like(key), torch.zeros_like(value)), CUDA)
    pa.swap_blocks(host_pool, back, out_map.flip(1))
    torch.cuda.synchronize()
    for s, _ in out_map.tolist():
        assert torch.equal(back[s].cpu().contiguous().view(torch.uint8), key[s].view(torch.uint8))


def error_message(fn):
    """The message of the ValueError or TypeError fn() raises."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


@parametrize("shapes", [((4, 2, 8), (4, 2, 8, 2)), ((4, 2, 8, 2), (4, 2, 8, 3)), ((4, 2, 8), (4, 3, 8)),
                        ((4, 2, 8, 64), (4, 2, 16, 64))])
def test_swap_blocks_refuses_bad_pools_as_the_cpu_op(shapes):
    # One check for both devices (check_swap_pools): the same error and message for a bad
    # 3-D / 4-D pair (scales of int8 against int4, caches of other block shapes).
    src, dst = torch.zeros(shapes[0]), torch.zeros(shapes[1])
    mapping = torch.tensor([[0, 1]])
    want = error_message(lambda: pa.swap_blocks(src, dst, mapping))
    assert error_message(lambda: pa.swap_blocks(src.to(CUDA), dst, mapping)) == want
    assert error_message(lambda: pa.swap_blocks(src, dst.to(CUDA), mapping)) == want
    assert error_message(lambda: pa.swap_blocks(src.to(CUDA), dst.to(CUDA), mapping)) == want


@parametrize("layouts", [("strided head", "HND"), ("5-D", "5-D"), ("2-D", "2-D"), ("int4 scales", "int8 scales")])
def test_swap_blocks_any_layout_as_the_cpu_op(layouts):
    # Pools of any rank and strides (block_copies.h), as the CPU op moves them; an int8
    # scale layout against an int4 one is a different block shape, refused as on the CPU.
    from test_cuda_emulated import swap_pool
    src, _ = swap_pool(layouts[0], 6)
    src.copy_(torch.randn(src.shape))
    dst, memory = swap_pool(layouts[1], 5)
    mapping = torch.tensor([[5, 0], [2, 3]])
    if src.shape[1:] != dst.shape[1:]:
        want = error_message(lambda: pa.swap_blocks(src, dst, mapping))
        assert error_message(lambda: pa.swap_blocks(strided_to(src, CUDA), dst, mapping)) == want
        return
    before = memory.clone()
    pa.swap_blocks(src, dst, mapping)
    want = memory.clone()
    memory.copy_(before)
    pa.swap_blocks(strided_to(src, CUDA), dst, mapping)  # device to host, through the strided path
    torch.cuda.synchronize()
    assert torch.equal(memory, want)


@parametrize("dtype", FP8_DTYPES)
def test_cuda_graph_with_fp8_scales(dtype):
    # write_kv + attention with fp8 caches captured once; the replay reads the scale tensors'
    # new values (a recalibration), new lengths and new data.
    gen = torch.Generator().manual_seed(2)
    num_seqs, width, bs, kv_heads, heads, hs = 4, 16, 16, 2, 8, 64
    num_blocks = num_seqs * width
    cache_shape = (num_blocks, kv_heads, bs, hs)
    key_cache = torch.zeros(cache_shape, dtype=dtype)
    value_cache = torch.zeros(cache_shape, dtype=dtype)
    g_key, g_value = key_cache.to(CUDA), value_cache.to(CUDA)
    g_k_scale, g_v_scale = torch.ones(kv_heads, device=CUDA), torch.ones(kv_heads, device=CUDA)
    g_query = torch.zeros(num_seqs, heads, hs, dtype=torch.bfloat16, device=CUDA)
    g_new = torch.zeros(2, num_seqs, kv_heads, hs, dtype=torch.bfloat16, device=CUDA)
    g_slots = torch.full((num_seqs,), -1, dtype=torch.int64, device=CUDA)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, width)
    g_tables = tables.to(CUDA)
    g_lens = torch.zeros(num_seqs, dtype=torch.int32, device=CUDA)
    out = torch.empty_like(g_query)

    def step():
        pa.write_kv(g_new[0], g_new[1], g_key, g_value, g_slots, k_scale=g_k_scale, v_scale=g_v_scale)
        pa.attention_out(out, g_query, g_key, g_value, g_tables, g_lens, 0.125, k_scale=g_k_scale,
                         v_scale=g_v_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        lens = torch.randint(1, width * bs + 1, (num_seqs,), generator=gen).int()
        k_scale, v_scale = torch.rand(kv_heads, generator=gen) + 0.01, torch.rand(kv_heads, generator=gen) + 0.01
        rows = torch.randn(2, num_blocks, kv_heads, bs, hs, generator=gen)
        key_cache.copy_(ref.quantize(rows[0].transpose(1, 2), k_scale, dtype).transpose(1, 2))
        value_cache.copy_(ref.quantize(rows[1].transpose(1, 2), v_scale, dtype).transpose(1, 2))
        query = torch.randn(num_seqs, heads, hs, generator=gen).to(torch.bfloat16)
        new = torch.randn(2, num_seqs, kv_heads, hs, generator=gen).to(torch.bfloat16)
        slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens.tolist())])
        for dst, src in ((g_key, key_cache), (g_value, value_cache), (g_k_scale, k_scale), (g_v_scale, v_scale),
                         (g_query, query), (g_new, new), (g_slots, slots), (g_lens, lens)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref.write_kv(new[0], new[1], key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
        want = ref.attention(query, key_cache, value_cache, tables, lens, 0.125, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(g_key.cpu().view(torch.uint8), key_cache.view(torch.uint8))
        torch.testing.assert_close(out.cpu().float(), want.float(), **TOLERANCES[torch.bfloat16])


def test_fp8_and_layout_errors_on_cuda():
    case = on_cuda(make_case([5, 20], 2, 64, 16, torch.float32))
    query = torch.randn(2, 4, 64, device=CUDA)
    fp8 = case.key_cache.to(torch.float8_e4m3fn)
    one = torch.ones(1, device=CUDA)
    # Rows hs + 1 elements apart cannot be read in 8-byte (fp8) or 16-byte vectors.
    for cache in (fp8, case.key_cache):
        buf = torch.zeros(cache.shape[:3] + (65,), dtype=cache.dtype, device=CUDA)
        odd = buf[..., :64]
        scales = dict(k_scale=one, v_scale=one) if cache.dtype == torch.float8_e4m3fn else {}
        with raises(ValueError, "multiples of"):
            pa.attention(query, odd, odd, case.block_tables, case.seq_lens, 0.1, **scales)
    with raises(ValueError, "k_scale"):
        pa.attention(query, fp8, fp8, case.block_tables, case.seq_lens, 0.1)
    # Per-token caches: int4 rows read in 4-byte vectors; write_kv quantizes rows of at most 576.
    num_blocks = case.key_cache.shape[0]
    int4 = torch.zeros(num_blocks, 2, 16, 33, dtype=torch.uint8, device=CUDA)[..., :32]
    token_scales = torch.zeros(num_blocks, 2, 16, 2, device=CUDA)
    with raises(ValueError, "multiples of 4 bytes"):
        pa.attention(query, int4, int4, case.block_tables, case.seq_lens, 0.1, k_scale=token_scales,
                     v_scale=token_scales)
    wide = torch.zeros(4, 1, 16, 640, dtype=torch.int8, device=CUDA)
    wide_scales = torch.full((4, 1, 16), float("nan"), device=CUDA)
    with raises(ValueError, "at most 576"):
        pa.write_kv(torch.ones(1, 1, 640, device=CUDA), torch.ones(1, 1, 640, device=CUDA), wide, wide.clone(),
                    torch.tensor([3], device=CUDA), k_scale=wide_scales, v_scale=wide_scales.clone())
    assert wide_scales.isnan().all(), "refused before anything is written"


# ---- CUDA graphs -----------------------------------------------------------------

@parametrize("multi_token", [False, True])
@parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_and_replay_with_padded_rows(multi_token, dtype):
    """One captured step (write_kv, then attention_out into fixed buffers), replayed with
    new metadata each time: new lengths (some 0: padded rows), new block tables, new
    queries. The block tables are wide, so the capture also holds the split-KV
    workspace and the merge."""
    gen = torch.Generator().manual_seed(0)
    num_seqs, width, bs, kv_heads, heads, hs = 6, 64, 16, 2, 8, 64
    num_blocks = num_seqs * width + 4
    key_cache = torch.randn(num_blocks, kv_heads, bs, hs, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, bs, hs, generator=gen).to(dtype)
    num_tokens = 16 if multi_token else num_seqs

    g_key, g_value = key_cache.to(CUDA), value_cache.to(CUDA)
    g_query = torch.zeros(num_tokens, heads, hs, dtype=dtype, device=CUDA)
    g_new = torch.zeros(2, num_tokens, kv_heads, hs, dtype=dtype, device=CUDA)
    g_slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=CUDA)
    g_tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=CUDA)
    # Capture-time metadata: every row padding (decode), or one prefill from empty.
    first_q_lens = [num_tokens] + [0] * (num_seqs - 1)
    g_lens = torch.tensor(first_q_lens if multi_token else [0] * num_seqs, dtype=torch.int32, device=CUDA)
    g_qsl = query_start_loc(first_q_lens).to(CUDA) if multi_token else None
    out = torch.empty_like(g_query)
    lse = torch.empty(num_tokens, heads, device=CUDA)

    def step():
        pa.write_kv(g_new[0], g_new[1], g_key, g_value, g_slots)
        pa.attention_out(out, g_query, g_key, g_value, g_tables, g_lens, 0.125, query_start_loc=g_qsl, lse=lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch's docs advise
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    address = out.data_ptr()

    for trial in range(3):
        q_lens = [[5, 0, 1, 3, 7, 0], [16, 0, 0, 0, 0, 0], [1, 2, 3, 4, 6, 0]][trial] if multi_token else [1] * num_seqs
        lens = torch.maximum(torch.randint(1, width * bs + 1, (num_seqs,), generator=gen),
                             torch.tensor(q_lens)).int()
        if not multi_token:
            lens[trial % num_seqs] = 0  # a padded row (multi-token: the sequences with q_len 0)
        tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * width].view(num_seqs, width).int()
        query = torch.randn(num_tokens, heads, hs, generator=gen).to(dtype)
        new = torch.randn(2, num_tokens, kv_heads, hs, generator=gen).to(dtype)
        qsl = query_start_loc(q_lens) if multi_token else None
        # Each query row's key/value is written at its own position first.
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        for i, n in enumerate(lens.tolist()):
            rows = range(int(qsl[i]), int(qsl[i + 1])) if multi_token else ([i] if n > 0 else [])
            for r, position in zip(rows, range(n - len(rows), n)):
                slots[r] = int(tables[i, position // bs]) * bs + position % bs
        for dst, src in ((g_query, query), (g_new, new), (g_slots, slots), (g_tables, tables), (g_lens, lens)):
            dst.copy_(src)
        if multi_token:
            g_qsl.copy_(qsl)
        graph.replay()
        torch.cuda.synchronize()

        ref.write_kv(new[0], new[1], key_cache, value_cache, slots)
        want, want_lse = ref.attention_with_lse(query, key_cache, value_cache, tables, lens, 0.125,
                                                query_start_loc=qsl)
        assert out.data_ptr() == address
        torch.testing.assert_close(out.cpu().float(), want.float(), **TOLERANCES[dtype])
        torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-4, rtol=1e-5)
        assert torch.equal(g_key.cpu(), key_cache) and torch.equal(g_value.cpu(), value_cache)
        if not multi_token:
            assert (out[trial % num_seqs] == 0).all(), "a padded row must yield zeros"


# ---- opcheck -----------------------------------------------------------------------

@parametrize("multi_token", [False, True])
@parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_attention(multi_token, dtype):
    case = on_cuda(make_case([5, 17, 0, 33], num_kv_heads=2, head_size=64, block_size=16, dtype=dtype,
                             poison=None))
    qsl = query_start_loc([5, 2, 0, 1]).to(CUDA) if multi_token else None
    query = random_query(8 if multi_token else 4, 4, 64, dtype).to(CUDA)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125, qsl,
            torch.rand(4, device=CUDA), 8, 10.0)
    torch.library.opcheck(torch.ops.paged.attention.default, args)
    torch.library.opcheck(torch.ops.paged.attention_with_lse.default, args)
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device=CUDA)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, lse) + args)
    torch.library.opcheck(torch.ops.paged.attention_out.default, (out, None) + args)


def test_opcheck_cache_ops():
    key_cache, value_cache = torch.zeros(4, 2, 8, 64, device=CUDA), torch.zeros(4, 2, 8, 64, device=CUDA)
    key, value = torch.randn(3, 2, 64, device=CUDA), torch.randn(3, 2, 64, device=CUDA)
    torch.library.opcheck(torch.ops.paged.write_kv.default,
                          (key, value, key_cache, value_cache, torch.tensor([5, -1, 30], device=CUDA)))
    keys = [torch.randn(4, 2, 8, 64, device=CUDA) for _ in range(2)]
    values = [torch.randn(4, 2, 8, 64, device=CUDA) for _ in range(2)]
    torch.library.opcheck(torch.ops.paged.copy_blocks.default,
                          (keys, values, torch.tensor([[0, 2], [1, 3]], device=CUDA)))
    src, dst = torch.randn(4, 2, 8, 64, device=CUDA), torch.zeros(3, 2, 8, 64, device=CUDA)
    torch.library.opcheck(torch.ops.paged.swap_blocks.default, (src, dst, torch.tensor([[3, 0]])))


# ---- cache ops ---------------------------------------------------------------------

def random_caches(num_blocks=12, num_kv_heads=2, block_size=16, head_size=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@parametrize("dtype", DTYPES)
@parametrize("block_size,head_size", [(1, 64), (16, 64), (256, 64), (16, 12), (8, 36)])
def test_write_kv_scattered_slots_and_padding(dtype, block_size, head_size):
    # Head sizes 12 and 36 make rows that 16-byte units do not divide.
    key_cache, value_cache = random_caches(num_blocks=6, block_size=block_size, head_size=head_size, dtype=dtype)
    num_slots = key_cache.shape[0] * block_size
    num_tokens = min(40, num_slots)
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[::5] = -1
    qkv = torch.randn(num_tokens, 7, head_size).to(dtype)  # strided views, as from a fused projection
    key, value = qkv[:, 1:3], qkv[:, 4:6]
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    got_k, got_v = key_cache.to(CUDA), value_cache.to(CUDA)
    pa.write_kv(key.to(CUDA), value.to(CUDA), got_k, got_v, slots.to(CUDA))
    qkv_gpu = qkv.to(CUDA)
    strided_k, strided_v = key_cache.to(CUDA), value_cache.to(CUDA)
    pa.write_kv(qkv_gpu[:, 1:3], qkv_gpu[:, 4:6], strided_k, strided_v, slots.to(CUDA))
    for got in ((got_k, got_v), (strided_k, strided_v)):
        assert torch.equal(got[0].cpu(), want_k) and torch.equal(got[1].cpu(), want_v)


@parametrize("dtype", DTYPES)
@parametrize("mapping_device", ["cpu", "cuda"])
def test_copy_blocks_all_layers(dtype, mapping_device):
    layers = [random_caches(dtype=dtype, seed=s) for s in range(3)]
    mapping = torch.tensor([[0, 5], [0, 6], [3, 1], [11, 2]], dtype=torch.int64)
    want_keys, want_values = [k.clone() for k, _ in layers], [v.clone() for _, v in layers]
    ref.copy_blocks(want_keys, want_values, mapping)
    keys, values = [k.to(CUDA) for k, _ in layers], [v.to(CUDA) for _, v in layers]
    pa.copy_blocks(keys, values, mapping.to(mapping_device))
    for got, want in zip(keys + values, want_keys + want_values):
        assert torch.equal(got.cpu(), want)


def test_copy_blocks_more_layers_than_one_launch_holds():
    keys = [torch.full((4, 1, 2, 8), float(i), device=CUDA) for i in range(300)]
    values = [-k for k in keys]
    pa.copy_blocks(keys, values, torch.tensor([[1, 3]]))
    for i, (k, v) in enumerate(zip(keys, values)):
        assert (k[3] == i).all() and (v[3] == -i).all()


@parametrize("dtype", DTYPES)
@parametrize("pinned", [True, False])
def test_swap_blocks_round_trip_is_bit_identical(dtype, pinned):
    device_pool = random_caches(num_blocks=10, dtype=dtype)[0].to(CUDA)
    host_pool = torch.zeros((6,) + device_pool.shape[1:], dtype=dtype)
    if pinned:
        host_pool = host_pool.pin_memory()
    original = device_pool.clone()
    # Adjacent pairs (7, 8 -> 0, 1) travel as one copy.
    out_map = torch.tensor([[7, 0], [2, 3], [9, 5], [8, 1]], dtype=torch.int64)
    pa.swap_blocks(device_pool, host_pool, out_map)
    torch.cuda.synchronize()
    for src, dst in out_map.tolist():
        assert torch.equal(host_pool[dst], original[src].cpu())
    device_pool.zero_()
    pa.swap_blocks(host_pool, device_pool, out_map.flip(1))
    for src, _ in out_map.tolist():
        assert torch.equal(device_pool[src].view(torch.uint8), original[src].view(torch.uint8))


def test_swap_blocks_device_to_device():
    src, dst = torch.randn(5, 2, 4, 8, device=CUDA), torch.zeros(3, 2, 4, 8, device=CUDA)
    pa.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[2], src[1]) and (dst[1] == 0).all()


def test_host_side_errors_on_cuda():
    case = on_cuda(make_case([5, 20], 2, 64, 16, torch.float32))
    query = torch.randn(2, 4, 64, device=CUDA)
    with raises(ValueError, "same device"):
        pa.attention(query, case.key_cache, case.value_cache, case.block_tables.cpu(), case.seq_lens, 0.1)
    with raises(ValueError, "head_size"):
        pa.attention(query[..., :32], case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    # A cache view that starts mid-row cannot be read in 16-byte vectors.
    pool = torch.zeros(case.key_cache.numel() + 1, device=CUDA)
    misaligned = pool[1:].view(case.key_cache.shape)
    with raises(ValueError, "16-byte aligned"):
        pa.attention(query, misaligned, misaligned, case.block_tables, case.seq_lens, 0.1)
    with raises(ValueError, "CPU tensor"):
        pa.swap_blocks(case.key_cache, torch.zeros_like(case.key_cache).cpu(), torch.tensor([[0, 1]], device=CUDA))
    with raises(IndexError, "destination"):
        pa.swap_blocks(case.key_cache, torch.zeros(2, 2, 16, 64), torch.tensor([[0, 2]]))
    with raises(ValueError, "also writes"):
        pa.copy_blocks([case.key_cache], [case.value_cache], torch.tensor([[0, 1], [1, 2]]))


@contextlib.contextmanager
def raises(error, match):
    """``pytest.raises(error, match=...)`` that also works without pytest."""
    try:
        yield
    except error as e:
        assert match in str(e), f"{match!r} not in {str(e)!r}"
    else:
        raise AssertionError(f"{error.__name__} not raised")


# ---- compute-sanitizer scenario ----------------------------------------------------

def sanitizer_scenario():
    """One small call of every kernel path, for ``compute-sanitizer`` (memcheck,
    racecheck, synccheck) in bench/gpu_check.sh: ``python tests/test_cuda.py --scenario``.
    Small shapes, since the tools slow kernels down 10-100x; results are checked too."""
    dtype = torch.bfloat16
    lens = [0, 1, 37, 1500]
    case = with_value_head_size(make_case(lens, 2, 96, 16, dtype), 64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    # decode without and with a split (a wide, padded table), multi-token, a window
    check_against_reference(case, random_query(4, 4, 96, dtype), 0.1, sinks=sinks)
    wide = torch.full((4, 400), 2 ** 30, dtype=torch.int32)
    wide[:, :case.block_tables.shape[1]] = case.block_tables
    check_against_reference(dataclasses.replace(case, block_tables=wide), random_query(4, 4, 96, dtype), 0.1,
                            sinks=sinks)
    q_lens = [0, 1, 5, 9]
    check_against_reference(case, random_query(15, 4, 96, dtype), 0.1, query_start_loc=query_start_loc(q_lens),
                            sliding_window=20, sinks=sinks)
    for multi_token in (False, True):  # out-of-range metadata, never faults
        test_out_of_range_metadata_never_faults(multi_token)
    # cache ops with key and value head sizes that differ
    gpu = on_cuda(case)
    slots = torch.tensor([3, -1, 40, 7], device=CUDA)
    pa.write_kv(torch.randn(4, 2, 96, device=CUDA).to(dtype), torch.randn(4, 2, 64, device=CUDA).to(dtype),
                gpu.key_cache, gpu.value_cache, slots)
    pa.copy_blocks([gpu.key_cache], [gpu.value_cache], torch.tensor([[0, 2], [1, 3]], device=CUDA))
    host = torch.zeros((4,) + tuple(gpu.value_cache.shape[1:]), dtype=dtype).pin_memory()
    pa.swap_blocks(gpu.value_cache, host, torch.tensor([[1, 0], [2, 3]]))
    pa.swap_blocks(host, gpu.value_cache, torch.tensor([[0, 5]]))
    # fp8 caches in an NHD layout: attention with a split, write_kv, copy_blocks
    fp8 = make_case([0, 3, 900], 2, 64, 16, torch.float32)
    key, value = (c.to(torch.float8_e4m3fn) for c in relayout(fp8.key_cache, fp8.value_cache, "NHD"))
    fp8 = dataclasses.replace(fp8, key_cache=key, value_cache=value)
    scales = dict(k_scale=torch.tensor([0.5, 1.0]), v_scale=torch.tensor(2.0))
    check_against_reference(fp8, random_query(3, 4, 64, dtype), 0.1, **scales)
    gpu = on_cuda(fp8)
    scales = {k: v.to(CUDA) for k, v in scales.items()}
    pa.write_kv(torch.randn(3, 2, 64, device=CUDA).to(dtype), torch.randn(3, 2, 64, device=CUDA).to(dtype),
                gpu.key_cache, gpu.value_cache, torch.tensor([3, -1, 40], device=CUDA), **scales)
    pa.copy_blocks([gpu.key_cache], [gpu.value_cache], torch.tensor([[0, 2]], device=CUDA))
    # per-token int8 and int4 caches: write_kv, attention with a split, copy_blocks of the scales
    from paged_attention_ext import token_quantization as tq
    for cache_dtype in (torch.int8, torch.uint8):
        token = make_case([0, 3, 900], 2, 64, 16, torch.float32, poison=None)
        (key, k_scale), (value, v_scale) = (tq.quantize(c, cache_dtype) for c in (token.key_cache, token.value_cache))
        token = dataclasses.replace(token, key_cache=key, value_cache=value)
        check_against_reference(token, random_query(3, 4, 64, dtype), 0.1, k_scale=k_scale, v_scale=v_scale)
        gpu, k_scale, v_scale = on_cuda(token), k_scale.to(CUDA), v_scale.to(CUDA)
        pa.write_kv(torch.randn(3, 2, 64, device=CUDA).to(dtype), torch.randn(3, 2, 64, device=CUDA).to(dtype),
                    gpu.key_cache, gpu.value_cache, torch.tensor([3, -1, 40], device=CUDA), k_scale=k_scale,
                    v_scale=v_scale)
        pa.copy_blocks([gpu.key_cache, k_scale], [gpu.value_cache, v_scale], torch.tensor([[0, 2]], device=CUDA))
    # cascade: the shared-prefix op (with a split) and the merge of its result with a suffix
    import attention_scenarios as scenarios
    shared = scenarios.shared_prefix_case([700, 16, 0], [3, 2, 1], [1, 5, 17, 1, 2, 9], 2, 64, 16, dtype)
    query = random_query(6, 8, 64, dtype)
    scenarios.assert_prefix_matches_reference("cuda", query, shared.prefixes, shared.group_starts, 0.1,
                                              sinks=scenarios.random_sinks(8))
    out, lse = scenarios.cascade("cuda", query, shared, 0.1)
    want = ref.attention(query, shared.whole.key_cache, shared.whole.value_cache, shared.whole.block_tables,
                         shared.whole.seq_lens, 0.1)
    torch.testing.assert_close(out.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
    torch.cuda.synchronize()


# ---- the script runner -------------------------------------------------------------

def _cases(fn):
    combos = [{}]
    for names, values in getattr(fn, "cases", []):
        keys = [n.strip() for n in names.split(",")]
        combos = [{**c, **dict(zip(keys, v if len(keys) > 1 else (v,)))} for c in combos for v in values]
    return combos


def main(argv):
    if not torch.cuda.is_available():
        print("no CUDA device: nothing run")
        return 0
    if "--scenario" in argv:
        sanitizer_scenario()
        print("sanitizer scenario done")
        return 0
    pattern = argv[argv.index("-k") + 1] if "-k" in argv else ""
    passed = failed = 0
    tests = [(n, f) for n, f in list(globals().items()) if n.startswith("test_") and callable(f) and pattern in n]
    for name, fn in tests:
        for kwargs in _cases(fn):
            label = name + ("[" + "-".join(str(v) for v in kwargs.values()) + "]" if kwargs else "")
            try:
                fn(**kwargs)
                passed += 1
            except Exception:  # noqa: BLE001 (report every failure, then go on)
                failed += 1
                print(f"FAILED {label}")
                traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
