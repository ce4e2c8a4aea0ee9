"""The CUDA kernels over the per-token KV formats (int8, packed int4 with its rotation), run
on the CPU by the emulator of tests/test_cuda_emulated.py, against the formats' definition
(paged_attention_ext.token_quantization) and the reference ops: write_kv's bytes and
scales, and attention over adversarial layouts (random block order, edge lengths, GQA,
head sizes 64 to 512, value head sizes of their own, splits and their merge, sinks,
windows, ALiBi, soft cap, strided caches and scale tensors, NaN in unused slots and in
their scales); and, for every cache kind (bf16, fp8, int8, int4), keys no query sees
against the reference and the CPU kernel."""

import ctypes

import pytest
import torch

import attention_scenarios as scenarios
from latent_rows import latent_case
from paged_attention_ext import reference as ref
from paged_attention_ext import token_quantization as tq
from paged_case import TOLERANCES, free_out_of_window, make_case, query_start_loc, random_query
from test_cuda_emulated import CopyCache, emulated_attention, emulated_write_kv, emulator, fp8_case, in_layout

INT8, INT4 = torch.int8, torch.uint8
FORMATS = [INT8, INT4]
QUERY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bits_equal(a, b):
    """Equal bit for bit."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_scales(got, want):
    """Equal values, NaN where the reference has NaN (its payload is no part of the format)."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def empty_scales(cache, layout="HND"):
    """A scale tensor for `cache` full of NaN (a slot never written keeps it), HND or as a
    strided view ([num_blocks, block_size, num_kv_heads] memory)."""
    num_blocks, heads, block_size = cache.shape[:3]
    tail = (2,) if cache.dtype == INT4 else ()
    if layout == "HND":
        return torch.full((num_blocks, heads, block_size) + tail, float("nan"))
    return torch.full((num_blocks, block_size, heads) + tail, float("nan")).transpose(1, 2)


# ---- write_kv ------------------------------------------------------------------------------

def adversarial_rows(num_tokens, heads, head_size, dtype, seed):
    """Rows of every kind a write meets: random, huge, a NaN, an inf, constant (scale 0),
    zero, one outlier channel, exact rounding ties (x / scale = k + 1/2)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, heads, head_size, generator=gen) * 3
    x[0, 0] = 0.0
    x[1, 0] = 2.5
    x[2, 0, 5] = float("nan")
    x[3, -1, 7] = float("inf")
    x[4, 0] *= 1e6
    x[5, -1, 3] = 1e4
    x[6, 0] = torch.arange(head_size) % 255 - 127 + 0.5  # int8: scale 127/127 = 1, every ratio a tie
    x[6, 0, 0] = 127.0
    return x.to(dtype)


def check_int4_rows(got, got_scales, want, want_scales, x):
    """Scales identical; nibbles equal but for a rounding tie reached in another fp32
    order (then one step apart), so the dequantized rows agree within one step."""
    assert_same_scales(got_scales, want_scales)
    q_got = torch.stack((got & 15, got >> 4), -1).flatten(-2).int()
    q_want = torch.stack((want & 15, want >> 4), -1).flatten(-2).int()
    differ = q_got != q_want
    assert (q_got - q_want).abs().max() <= 1
    if differ.any():
        r = tq.rotate(x)
        ratio = (r - want_scales[..., 1:]) / want_scales[..., :1]
        assert ((ratio - ratio.floor() - 0.5).abs()[differ] < 1e-3).all(), "a difference off a rounding tie"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("input_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_write_kv(fmt, input_dtype, layout):
    # Scattered slots and padding (-1), keys 64 and values 96 wide (int4: rotation blocks of
    # 64 and 32), inputs as strided views of a fused projection, scale tensors as strided
    # views too, caches and scales full of garbage that the unwritten slots keep.
    gen = torch.Generator().manual_seed(4)
    num_blocks, kv_heads, block_size, tokens = 5, 2, 8, 20
    key_cache = torch.randint(0, 256, (num_blocks, kv_heads, block_size, tq.stored_head_size(fmt, 64)),
                              generator=gen, dtype=torch.uint8).view(fmt)
    value_cache = torch.randint(0, 256, (num_blocks, kv_heads, block_size, tq.stored_head_size(fmt, 96)),
                                generator=gen, dtype=torch.uint8).view(fmt)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::6] = -1
    fused = adversarial_rows(tokens, 4, 96, input_dtype, seed=3)
    key, value = fused[:, 0:2, :64], fused[:, 2:4]
    got_k, _ = in_layout(key_cache, layout)
    got_v, _ = in_layout(value_cache, layout)
    k_scale, v_scale = empty_scales(key_cache, layout), empty_scales(value_cache, layout)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    want_ks, want_vs = k_scale.clone(), v_scale.clone()
    ref.write_kv(key, value, want_k, want_v, slots, want_ks, want_vs)
    emulated_write_kv(key, value, got_k, got_v, slots, k_scale, v_scale)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    b, o = slots[slots >= 0] // block_size, slots[slots >= 0] % block_size
    written[b, o] = True
    for got, want, scales, want_scales, x in ((got_k, want_k, k_scale, want_ks, key),
                                              (got_v, want_v, v_scale, want_vs, value)):
        if fmt == INT8:
            assert bits_equal(got, want)
            assert_same_scales(scales, want_scales)
        else:
            # Unwritten slots keep their bytes and NaN scales; written rows as the definition.
            assert bits_equal(got.permute(0, 2, 1, 3)[~written], want.permute(0, 2, 1, 3)[~written])
            assert scales.transpose(1, 2)[~written].isnan().all()
            check_int4_rows(got[b, :, o], scales[b, :, o], want[b, :, o], want_scales[b, :, o],
                            x[slots >= 0].float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_size", [8, 40, 256, 512, 576])
def test_write_kv_head_sizes(fmt, head_size):
    # Rows shorter than a warp, rotation blocks of 8 (40), 256, 512 and 64 (576: MLA's latent row).
    gen = torch.Generator().manual_seed(head_size)
    cache = torch.zeros(3, 1, 4, tq.stored_head_size(fmt, head_size), dtype=fmt)
    slots = torch.randperm(12, generator=gen)[:8]
    slots[-1] = -1
    x = adversarial_rows(8, 1, head_size, torch.float32, seed=head_size)
    got, want = cache.clone(), cache.clone()
    scales, want_scales = empty_scales(cache), empty_scales(cache)
    ref.write_kv(x, x, want, want.clone(), slots, want_scales, want_scales.clone())
    emulated_write_kv(x, x, got, got.clone(), slots, scales, scales.clone())
    if fmt == INT8:
        assert bits_equal(got, want)
        assert_same_scales(scales, want_scales)
    else:
        b, o = slots[:-1] // 4, slots[:-1] % 4
        check_int4_rows(got[b, :, o], scales[b, :, o], want[b, :, o], want_scales[b, :, o], x[:-1].float())


# ---- attention -----------------------------------------------------------------------------

def token_case(case, fmt, layout="HND"):
    """``case`` (float, HND, unused slots NaN) quantized into the per-token format ``fmt``:
    (case, k_scale, v_scale). An unused slot's row quantizes to zeros with a NaN scale; the
    scales of every slot no sequence uses are set NaN explicitly as well. ``layout``:
    "NHD" stores caches and scales as NHD views."""
    caches, scales = [], []
    for cache in (case.key_cache, case.value_cache):
        rows, s = tq.quantize(cache, fmt)
        s.permute(0, 2, 1, *range(3, s.dim()))[~case.used_slots] = float("nan")
        if layout == "NHD":
            rows = rows.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            s = s.permute(0, 2, 1, *range(3, s.dim())).contiguous().permute(0, 2, 1, *range(3, s.dim()))
        caches.append(rows)
        scales.append(s)
    return (scenarios.dataclasses.replace(case, key_cache=caches[0], value_cache=caches[1]), *scales)


def check_token(case, fmt, query, scale, *, want_split=None, layout="HND", **kwargs):
    qcase, k_scale, v_scale = token_case(case, fmt, layout)
    out, lse, splits = emulated_attention(query, qcase.key_cache, qcase.value_cache, qcase.block_tables,
                                          qcase.seq_lens, scale, k_scale=k_scale, v_scale=v_scale, **kwargs)
    if want_split is not None:
        assert (splits > 1) == want_split, splits
    want, want_lse = ref.attention_with_lse(query, qcase.key_cache, qcase.value_cache, qcase.block_tables,
                                            qcase.seq_lens, scale, k_scale=k_scale, v_scale=v_scale, **kwargs)
    # The kernel scales integer dot products (int4: in the rotated space) where the
    # reference dots dequantized rows: fp32 summation order apart, a little more for int4.
    tol = dict(atol=5e-5, rtol=5e-5) if query.dtype == torch.float32 else TOLERANCES[query.dtype]
    torch.testing.assert_close(out.float(), want.float(), **tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("multi_token", [False, True])
def test_attention(fmt, query_dtype, multi_token):
    # Lengths 1, bs-1, bs, bs+1 and 0, blocks in random order, GQA 4:1, unused slots NaN.
    case = make_case([1, 15, 16, 17, 0], 2, 64, 16, torch.float32)
    q_lens = [1, 5, 3, 17, 0]
    query = random_query(sum(q_lens) if multi_token else 5, 8, 64, query_dtype)
    check_token(case, fmt, query, 0.125, query_start_loc=query_start_loc(q_lens) if multi_token else None,
                want_split=False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_size,heads", [(128, (6, 2)), (256, (4, 4)), (512, (8, 2)), (64, (20, 2))])
def test_attention_head_sizes_and_groups(fmt, head_size, heads):
    # Every equal-size bucket past 64, groups of 3 (one CTA), 1 (MHA), 4 (cut at 4 queries
    # for 512-wide values) and 10 (two CTAs, each rotating its own queries); int4 rotation
    # blocks of 128, 256, 512 and 64.
    case = make_case([1, 33, 70], heads[1], head_size, 16, torch.float32)
    query = random_query(3, heads[0], head_size, torch.bfloat16)
    check_token(case, fmt, query, head_size ** -0.5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("multi_token", [False, True])
def test_attention_split_sinks_window_alibi_softcap(fmt, multi_token):
    # Long rows split over partitions (int4: each partition's result stays rotated, the
    # merge rotates once), sinks, ALiBi, soft cap; then a sliding window.
    lens, q_lens = [1300, 17, 2100], [4, 3, 2]
    case = make_case(lens, 2, 64, 16, torch.float32)
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else 3, 8, 64, torch.float32)
    check_token(case, fmt, query, 0.125, query_start_loc=qsl, sinks=scenarios.random_sinks(8),
                alibi_slopes=scenarios.alibi(8), soft_cap=8.0, want_split=True)
    check_token(case, fmt, query, 0.125, query_start_loc=qsl, sliding_window=700, want_split=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_sizes", [(96, 64), (192, 128), (64, 40)])
def test_attention_value_head_size(fmt, head_sizes):
    # Keys and values of their own widths (and rotation blocks: 32 / 64, 64 / 128, 64 / 8), with a split.
    head_size, head_size_v = head_sizes
    case = make_case([700, 5], 2, head_size, 16, torch.float32, head_size_v=head_size_v)
    query = random_query(2, 4, head_size, torch.float16)
    check_token(case, fmt, query, head_size ** -0.5, want_split=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_strided_caches_and_scales(fmt):
    # NHD views of the caches and of their scale tensors, multi-token, with a split.
    case = make_case([1, 17, 600], 2, 128, 16, torch.float32)
    query = random_query(9, 4, 128, torch.bfloat16)
    check_token(case, fmt, query, 128 ** -0.5, layout="NHD", query_start_loc=query_start_loc([1, 3, 5]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", ["key", "value"])
def test_nan_scale_in_a_used_slot_reaches_the_output(fmt, which):
    # A row that held a NaN: its scale is NaN, and the sequence's output is NaN as in the
    # reference; the other sequence's output is not.
    case = make_case([17, 5], 1, 64, 16, torch.float32)
    block = int(case.block_tables[0, 1])
    getattr(case, f"{which}_cache")[block, 0, 0, 3] = float("nan")
    query = random_query(2, 2, 64, torch.float32)
    qcase, k_scale, v_scale = token_case(case, fmt)
    out, _, _ = emulated_attention(query, qcase.key_cache, qcase.value_cache, qcase.block_tables, qcase.seq_lens,
                                   0.125, k_scale=k_scale, v_scale=v_scale)
    assert out[0].isnan().all() and not out[1].isnan().any()


# ---- keys a query does not see: every cache kind -------------------------------------------

MASKED_CACHES = [torch.bfloat16, torch.float8_e4m3fn, INT8, INT4]


def poisoned_case(cache_dtype, lens, q_lens, window, poison, seed=0):
    """(case, k_scale, v_scale) over ``cache_dtype`` whose slots no query sees hold
    ``poison`` in their rows and (per-token) their scales: slots past each length, blocks
    wholly before the first query's window (freed: table entries -1 or out of the pool),
    and the slots before that window in its first block."""
    case = free_out_of_window(make_case(lens, 2, 64, 16, torch.float32, seed=seed), window, q_lens, poison)
    bs = case.block_size
    masked = ~case.used_slots
    for i, (kv_len, q_len) in enumerate(zip(lens, q_lens)):
        first_key = max(0, kv_len - q_len - window + 1)
        for pos in range(first_key // bs * bs, first_key):
            masked[int(case.block_tables[i, pos // bs]), pos % bs] = True
    for cache in (case.key_cache, case.value_cache):
        cache.permute(0, 2, 1, 3)[masked] = poison
    case, k_scale, v_scale = converted(case, cache_dtype)
    for s in (k_scale, v_scale) if cache_dtype in FORMATS else ():
        s.permute(0, 2, 1, *range(3, s.dim()))[masked] = poison
    return case, k_scale, v_scale


def converted(case, cache_dtype):
    """(case, k_scale, v_scale): ``case`` (float32) in ``cache_dtype``."""
    if cache_dtype in FORMATS:
        return token_case(case, cache_dtype)
    if cache_dtype == torch.bfloat16:
        return (scenarios.dataclasses.replace(case, key_cache=case.key_cache.to(cache_dtype),
                                              value_cache=case.value_cache.to(cache_dtype)), None, None)
    return fp8_case(case, cache_dtype)


def three_ways(case, k_scale, v_scale, query, **kwargs):
    """(CUDA kernel via the emulator, reference, CPU kernel) outputs and lses."""
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    kwargs.update(k_scale=k_scale, v_scale=v_scale)
    got, got_lse, _ = emulated_attention(*args, **kwargs)
    return (got, got_lse), ref.attention_with_lse(*args, **kwargs), torch.ops.paged.attention_with_lse(*args, **kwargs)


@pytest.mark.parametrize("cache_dtype", MASKED_CACHES)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("multi_token", [False, True])
def test_keys_no_query_sees_never_reach_the_output(cache_dtype, poison, multi_token):
    # NaN / inf in the rows and scales of slots past the length, of freed blocks before the
    # window (padded table entries) and of the slots before the window in its first block:
    # the CUDA kernel, the reference and the CPU kernel all give finite rows, the same ones
    # (lengths 1, bs+1, a split's length; windows inside a block; GQA 2:1).
    lens, window = [1, 17, 40, 1300], 10
    q_lens = [1, 3, 4, 2] if multi_token else [1] * len(lens)
    case, k_scale, v_scale = poisoned_case(cache_dtype, lens, q_lens, window, poison)
    query_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    query = random_query(sum(q_lens), 4, 64, query_dtype)
    qsl = query_start_loc(q_lens) if multi_token else None
    (got, got_lse), (want, want_lse), (cpu, cpu_lse) = three_ways(
        case, k_scale, v_scale, query, query_start_loc=qsl, sliding_window=window)
    for out, lse in ((got, got_lse), (want, want_lse), (cpu, cpu_lse)):
        assert out.isfinite().all() and lse.isfinite().all()
    tol = TOLERANCES[query_dtype] if cache_dtype == torch.bfloat16 else dict(atol=5e-5, rtol=5e-5)
    for out, lse in ((got, got_lse), (cpu, cpu_lse)):
        torch.testing.assert_close(out.float(), want.float(), **tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", MASKED_CACHES)
def test_nan_in_a_key_masked_for_earlier_queries(cache_dtype):
    # A chunk's last key holding a NaN value (per-token: its value scale) is read for the
    # whole chunk: the queries before it meet it with weight 0 and, as in the reference's
    # probs @ values and the CPU kernel, 0 * NaN makes their rows NaN too (as in eager
    # attention); the other sequence stays finite. The scales take the value row's rule.
    lens, q_lens = [20, 9], [3, 2]
    case = make_case(lens, 1, 64, 16, torch.float32)
    case.value_cache[int(case.block_tables[0, 1]), 0, 3, 5] = float("nan")  # key 19
    case, k_scale, v_scale = converted(case, cache_dtype)
    query_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    query = random_query(sum(q_lens), 2, 64, query_dtype)
    (got, _), (want, _), (cpu, _) = three_ways(case, k_scale, v_scale, query, query_start_loc=query_start_loc(q_lens))
    nan_rows = want.isnan().any(-1)
    assert nan_rows[:3].all() and not nan_rows[3:].any()
    for out in (got, cpu):
        assert torch.equal(out.isnan().any(-1), nan_rows)
        torch.testing.assert_close(out[3:].float(), want[3:].float(), **TOLERANCES[query_dtype])


@pytest.mark.parametrize("fmt", FORMATS)
def test_shared_prefix_attention(fmt):
    # Every query after all its group's keys (one rotated query tile per group and head
    # chunk), prefixes of 1, bs+1 and a split's length, sinks.
    case = scenarios.shared_prefix_case([1, 17, 600], [2, 1, 3], [1] * 6, 2, 64, 16, torch.float32)
    prefixes, k_scale, v_scale = token_case(case.prefixes, fmt)
    query = random_query(int(case.group_starts[-1]), 8, 64, torch.bfloat16)
    sinks = scenarios.random_sinks(8)
    out, lse, _ = emulated_attention(query, prefixes.key_cache, prefixes.value_cache, prefixes.block_tables,
                                     prefixes.seq_lens, 0.125, query_start_loc=case.group_starts,
                                     queries_after_keys=True, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    want, want_lse = ref.shared_prefix_attention(query, prefixes.key_cache, prefixes.value_cache,
                                                 prefixes.block_tables, prefixes.seq_lens, case.group_starts,
                                                 0.125, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


# ---- copy_blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_blocks_moves_rows_and_scales(fmt):
    # The cache (int8 / uint8) and its scale tensor (fp32, 3-D or 4-D) moved with one mapping,
    # as the caller does: one CopyCache per tensor, a 3-D scale tensor as rows of one float.
    gen = torch.Generator().manual_seed(6)
    cache = torch.randint(0, 256, (6, 2, 4, 32), generator=gen, dtype=torch.uint8).view(fmt)
    scales = torch.randn((6, 2, 4) + ((2,) if fmt == INT4 else ()), generator=gen)
    mapping = torch.tensor([[0, 3], [5, 1], [2, 4]])
    want_cache, want_scales = cache.clone(), scales.clone()
    ref.copy_blocks([want_cache, want_scales], [want_cache.clone(), want_scales.clone()], mapping)

    def dense(t):
        return CopyCache(t.data_ptr(), t.stride(0) * t.element_size(), 0, 0, t[0].numel() * t.element_size(), 1, 1)

    rows = [dense(cache), dense(scales)]
    emulator().emu_copy_blocks(ctypes.byref(rows[0]), ctypes.byref(rows[1]), mapping.data_ptr(), 3, 6)
    assert bits_equal(cache, want_cache) and bits_equal(scales, want_scales)


# ---- MLA latent rows: quantized whole, values a view of the keys ---------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_write_latent_rows_as_keys_alone(fmt, input_dtype):
    # write_latent's CUDA path: each [latent | rotary_key] row gathered, then quantized whole
    # by the write_kv kernel as keys alone (value_row_bytes 0: no value rows, whose scales
    # would overwrite the keys'), against the reference's write_latent.
    gen = torch.Generator().manual_seed(7)
    cache = torch.randint(0, 256, (3, 1, 4, tq.stored_head_size(fmt, 576)), generator=gen,
                          dtype=torch.uint8).view(fmt)
    slots = torch.randperm(12, generator=gen)[:9]
    slots[4] = -1
    rows = adversarial_rows(9, 1, 576, input_dtype, seed=11)
    got, want = cache.clone(), cache.clone()
    scales, want_scales = empty_scales(cache), empty_scales(cache)
    ref.write_latent(rows[..., :512], rows[..., 512:], want, slots, want_scales)
    emulated_write_kv(rows, rows, got, got[..., :0], slots, scales, scales)
    if fmt == INT8:
        assert bits_equal(got, want)
        assert_same_scales(scales, want_scales)
    else:
        kept = slots >= 0
        b, o = slots[kept] // 4, slots[kept] % 4
        check_int4_rows(got[b, :, o], scales[b, :, o], want[b, :, o], want_scales[b, :, o],
                        rows[kept].float())
        unwritten = torch.ones(3, 4, dtype=torch.bool)
        unwritten[b, o] = False
        assert bits_equal(got.permute(0, 2, 1, 3)[unwritten], cache.permute(0, 2, 1, 3)[unwritten])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lens, heads, split", [([1, 15, 16, 17], 16, False), ([1, 900, 33], 16, True),
                                                ([5, 40], 128, False)])
def test_attention_over_latent_rows(fmt, lens, heads, split):
    # Keys the 576-wide rows, values their leading 512 columns (a view of the same memory),
    # one scale tensor for both: int4's output is rotated back with the key rows' blocks of
    # 64, in the attention kernel and (split) in the merge kernel.
    cache, scale, tables, seq_lens = latent_case(lens, 16, fmt, seed=len(lens) + heads)
    values = cache[..., :tq.stored_head_size(fmt, 512)]
    query = random_query(len(lens), heads, 576, torch.bfloat16)
    out, lse, splits = emulated_attention(query, cache, values, tables, seq_lens, 576 ** -0.5,
                                          k_scale=scale, v_scale=scale)
    assert (splits > 1) == split, splits
    want, want_lse = ref.attention_with_lse(query.double(), cache, values, tables, seq_lens, 576 ** -0.5,
                                            k_scale=scale, v_scale=scale)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)
