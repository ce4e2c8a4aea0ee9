"""The CUDA kernels' own source, run on the CPU (tests/cuda_emulator.cpp).

The kernels of csrc/cuda/attention_kernels.cuh and cache_kernels.cuh are compiled by the
host C++ compiler with the CUDA keywords, barriers and warp shuffles emulated on host
threads (128 per CTA), and driven here through ctypes against the reference. This checks
the kernels' logic (planner, key schedule and splits, score and value phases, warp merge,
sinks, value head sizes, the split merge, fp8 caches and their scales, strided cache
layouts, write_kv and copy_blocks) on machines without a GPU; it says nothing about
timing, memory-model or hardware-specific behaviour (tests/test_cuda.py and
compute-sanitizer on a GPU do). The fp8 conversions run fp8.cuh's software path (the one
sm_80 uses); the hardware conversion of sm_89+ runs only on a device. Needs g++ (C++20)
and the CUDA headers (``$CUDA_HOME/include``); skipped without them.
"""

import ctypes
import dataclasses
import functools
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

import attention_scenarios as scenarios
from paged_attention_ext import reference as ref
from paged_attention_ext.layouts import from_nhd, split_kv
from paged_attention_ext.token_quantization import head_size_of, is_per_token
from paged_case import TOLERANCES, free_out_of_window, make_case, query_start_loc, random_query

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
         torch.int8: 5, torch.uint8: 6}  # the last two: per-token int8, packed int4
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
Strides = ctypes.c_int64 * 3


class EmuArgs(ctypes.Structure):
    _fields_ = (
        [("kind", ctypes.c_int64), ("cache_kind", ctypes.c_int64), ("query", ctypes.c_void_p),
         ("query_token_stride", ctypes.c_int64), ("query_head_stride", ctypes.c_int64),
         ("key_cache", ctypes.c_void_p), ("value_cache", ctypes.c_void_p), ("key_strides", Strides),
         ("value_strides", Strides), ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p),
         ("k_scale_stride", ctypes.c_int64), ("v_scale_stride", ctypes.c_int64),
         ("block_tables", ctypes.c_void_p), ("block_table_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
         ("query_start_loc", ctypes.c_void_p), ("alibi_slopes", ctypes.c_void_p), ("sinks", ctypes.c_void_p)]
        + [(n, ctypes.c_int64) for n in ("num_tokens", "num_seqs", "num_heads", "num_kv_heads", "head_size",
                                          "head_size_v", "block_size", "num_blocks", "max_blocks_per_seq",
                                          "sliding_window")]
        + [("scale", ctypes.c_double), ("soft_cap", ctypes.c_double), ("out", ctypes.c_void_p),
           ("out_token_stride", ctypes.c_int64), ("out_head_stride", ctypes.c_int64), ("lse", ctypes.c_void_p),
           ("lse_token_stride", ctypes.c_int64), ("multiprocessors", ctypes.c_int64),
           ("ctas_per_sm", ctypes.c_int64), ("num_partitions", ctypes.c_int64),
           ("queries_after_keys", ctypes.c_int64), ("k_scale_strides", Strides), ("v_scale_strides", Strides)]
    )


MAX_MERGE_INPUTS = 16


class MergeStatesParams(ctypes.Structure):
    _fields_ = (
        [("kind", ctypes.c_int32), ("num_inputs", ctypes.c_int32),
         ("outputs", ctypes.c_void_p * MAX_MERGE_INPUTS),
         ("out_token_stride", ctypes.c_int64 * MAX_MERGE_INPUTS),
         ("out_head_stride", ctypes.c_int64 * MAX_MERGE_INPUTS),
         ("lses", ctypes.c_void_p * MAX_MERGE_INPUTS),
         ("lse_token_stride", ctypes.c_int64 * MAX_MERGE_INPUTS),
         ("lse_head_stride", ctypes.c_int64 * MAX_MERGE_INPUTS)]
        + [(n, ctypes.c_int32) for n in ("num_tokens", "num_heads", "head_size")]
        + [("out", ctypes.c_void_p), ("lse", ctypes.c_void_p)]
    )


class EmuWriteKv(ctypes.Structure):
    _fields_ = (
        [("kind", ctypes.c_int64), ("cache_kind", ctypes.c_int64), ("key", ctypes.c_void_p),
         ("value", ctypes.c_void_p)]
        + [(n, ctypes.c_int64) for n in ("key_token_stride", "key_head_stride", "value_token_stride",
                                          "value_head_stride")]
        + [("key_cache", ctypes.c_void_p), ("value_cache", ctypes.c_void_p), ("key_strides", Strides),
           ("value_strides", Strides), ("slot_mapping", ctypes.c_void_p)]
        + [(n, ctypes.c_int64) for n in ("num_tokens", "num_slots", "num_kv_heads", "block_size", "key_row_bytes",
                                          "value_row_bytes")]
        + [("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("k_scale_stride", ctypes.c_int64),
           ("v_scale_stride", ctypes.c_int64), ("wide", ctypes.c_int64), ("k_scale_strides", Strides),
           ("v_scale_strides", Strides)]
    )


class CopyCache(ctypes.Structure):
    _fields_ = ([("base", ctypes.c_void_p)]
                + [(n, ctypes.c_int64) for n in ("block_stride", "head_stride", "token_stride", "row_bytes")]
                + [("heads", ctypes.c_int32), ("tokens", ctypes.c_int32)])


@functools.lru_cache(maxsize=None)
def emulator(fp8_path="software"):
    """The emulator library; fp8_path "hardware" builds fp8.cuh's sm_89+ code (with
    cuda_fp8.h's host implementation of the conversion) instead of the software path."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    cuda_include = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
    if cxx is None or not os.path.exists(os.path.join(cuda_include, "cuda_bf16.h")):
        pytest.skip("needs g++ and the CUDA headers")
    lib = os.path.join(tempfile.mkdtemp(prefix="paged_emu_"), "libemu.so")
    # -w: the kernel source compares threadIdx (unsigned) with ints, as CUDA code does.
    defines = ["-DPAGED_FP8_EMULATE_HARDWARE"] if fp8_path == "hardware" else []
    subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread", *defines,
                    "-I", os.path.join(ROOT, "csrc", "cuda"), "-I", cuda_include,
                    os.path.join(ROOT, "tests", "cuda_emulator.cpp"),
                    os.path.join(ROOT, "csrc", "cuda", "attention_plan.cpp"), "-o", lib], check=True)
    library = ctypes.CDLL(lib)
    library.emu_attention.argtypes = [ctypes.POINTER(EmuArgs)]
    library.emu_write_kv.argtypes = [ctypes.POINTER(EmuWriteKv)]
    library.emu_merge_states.argtypes = [ctypes.POINTER(MergeStatesParams)]
    library.emu_copy_blocks.argtypes = [ctypes.POINTER(CopyCache), ctypes.POINTER(CopyCache), ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64]
    library.emu_swap_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                        ctypes.c_int64]
    library.emu_quantize.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                                     ctypes.c_int64]
    library.emu_unpack.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return library


def ptr(t):
    return None if t is None else t.data_ptr()


def scale_stride(scale):
    return 0 if scale is None or scale.dim() != 1 or scale.numel() == 1 else scale.stride(0)


def token_scale_strides(cache, scale):
    """A per-token cache's scale tensor as the kernels address it (block, head, token strides)."""
    return Strides(*scale.stride()[:3]) if is_per_token(cache.dtype) else Strides(0, 0, 0)


def emulated_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, query_start_loc=None,
                       alibi_slopes=None, sliding_window=-1, soft_cap=0.0, sinks=None, k_scale=None,
                       v_scale=None, ctas_per_sm=3, multiprocessors=132, fp8_path="software",
                       queries_after_keys=False):
    """The CUDA kernels' answer (out, lse, number of splits), computed on the CPU. The caches
    may be strided views (as the host code passes their strides). ``queries_after_keys``:
    shared_prefix_attention (block_tables / seq_lens are the groups' prefixes,
    query_start_loc their rows)."""
    lib = emulator(fp8_path)
    num_tokens, num_heads, _ = query.shape
    keep = [t.contiguous() if t is not None else None
            for t in (block_tables, seq_lens, query_start_loc, alibi_slopes, sinks)]
    tables, lens, qsl, slopes, sink = keep
    out = torch.full((num_tokens, num_heads, head_size_of(value_cache)), float("nan"), dtype=query.dtype)
    lse = torch.full((num_tokens, num_heads), float("nan"))
    a = EmuArgs(kind=KINDS[query.dtype], cache_kind=KINDS[key_cache.dtype], query=ptr(query),
                query_token_stride=query.stride(0), query_head_stride=query.stride(1), key_cache=ptr(key_cache),
                value_cache=ptr(value_cache), key_strides=Strides(*key_cache.stride()[:3]),
                value_strides=Strides(*value_cache.stride()[:3]), k_scale=ptr(k_scale), v_scale=ptr(v_scale),
                k_scale_stride=scale_stride(k_scale), v_scale_stride=scale_stride(v_scale),
                block_tables=ptr(tables), block_table_stride=tables.stride(0), seq_lens=ptr(lens),
                query_start_loc=ptr(qsl), alibi_slopes=ptr(slopes), sinks=ptr(sink), num_tokens=num_tokens,
                num_seqs=lens.shape[0], num_heads=num_heads, num_kv_heads=key_cache.shape[1],
                head_size=head_size_of(key_cache), head_size_v=head_size_of(value_cache),
                block_size=key_cache.shape[2],
                num_blocks=key_cache.shape[0], max_blocks_per_seq=tables.shape[1], sliding_window=sliding_window,
                scale=scale, soft_cap=soft_cap, out=ptr(out), out_token_stride=out.stride(0),
                out_head_stride=out.stride(1), lse=ptr(lse), lse_token_stride=lse.stride(0),
                multiprocessors=multiprocessors, ctas_per_sm=ctas_per_sm,
                queries_after_keys=int(queries_after_keys),
                k_scale_strides=token_scale_strides(key_cache, k_scale),
                v_scale_strides=token_scale_strides(value_cache, v_scale))
    lib.emu_attention(ctypes.byref(a))
    return out, lse, a.num_partitions


def check(case, query, scale, *, want_split=None, fp8_path="software", **kwargs):
    out, lse, splits = emulated_attention(query, case.key_cache, case.value_cache, case.block_tables,
                                          case.seq_lens, scale, fp8_path=fp8_path, **kwargs)
    if want_split is not None:
        assert (splits > 1) == want_split, splits
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables,
                                            case.seq_lens, scale, **kwargs)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[query.dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    return out, lse


def with_value_head_size(case, head_size_v, seed=5):
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(case.key_cache.shape[:3] + (head_size_v,), generator=gen).to(case.key_cache.dtype)
    value.permute(0, 2, 1, 3)[~case.used_slots] = float("nan")
    return dataclasses.replace(case, value_cache=value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("multi_token", [False, True])
def test_basic(dtype, multi_token):
    case = make_case([1, 17, 40, 0], 2, 64, 16, dtype)
    q_lens = [1, 5, 3, 0]
    query = random_query(sum(q_lens) if multi_token else 4, 8, 64, dtype)
    check(case, query, 0.125, query_start_loc=query_start_loc(q_lens) if multi_token else None, want_split=False)


@pytest.mark.parametrize("window", [1, 16, 17, 700])
@pytest.mark.parametrize("multi_token", [False, True])
def test_window_never_reads_freed_blocks(window, multi_token):
    # Blocks wholly before the window freed (-1 / stale ids, NaN memory), long enough rows to split.
    lens, q_lens = [1300, 17, 0, 2100], [4, 3, 0, 2]
    case = free_out_of_window(make_case(lens, 2, 64, 16, torch.float32), window,
                              q_lens if multi_token else [1, 1, 0, 1])
    assert case.freed > 0
    query = random_query(sum(q_lens) if multi_token else 4, 4, 64, torch.float32)
    check(case, query, 0.125, sliding_window=window,  # NaN anywhere fails the comparison
          query_start_loc=query_start_loc(q_lens) if multi_token else None)


@pytest.mark.parametrize("multi_token", [False, True])
def test_split_with_sinks_window_alibi_softcap(multi_token):
    case = make_case([1300, 3, 0, 2100], 2, 64, 16, torch.float32)
    q_lens = [4, 3, 0, 2]
    query = random_query(sum(q_lens) if multi_token else 4, 4, 64, torch.float32)
    sinks = torch.tensor([0.5, -2.0, 4.0, 0.0])
    for window in (-1, 700, 2 ** 31 - 1):
        out, lse = check(case, query, 0.1, query_start_loc=query_start_loc(q_lens) if multi_token else None,
                         sliding_window=window, alibi_slopes=torch.rand(4), soft_cap=20.0, sinks=sinks,
                         want_split=True)
    if not multi_token:  # the empty sequence: zeros and lse = sink, through the merge
        assert (out[2] == 0).all() and torch.equal(lse[2], sinks)


@pytest.mark.parametrize("head_sizes", [(192, 128), (96, 64), (64, 128), (40, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_head_size(head_sizes, dtype):
    head_size, head_size_v = head_sizes
    case = with_value_head_size(make_case([1, 33, 900], 1, head_size, 16, dtype), head_size_v)
    for q_lens in (None, [1, 4, 3]):
        query = random_query(8 if q_lens else 3, 4, head_size, dtype)
        out, _ = check(case, query, head_size ** -0.5, query_start_loc=query_start_loc(q_lens) if q_lens else None,
                       sinks=torch.linspace(-1, 1, 4))
        assert out.shape[-1] == head_size_v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1), (20, 2)])
def test_query_buckets_and_head_chunks(heads, kv_heads):
    case = make_case([5, 600], kv_heads, 64, 8, torch.bfloat16)
    for q_lens in (None, [3, 7]):
        query = random_query(10 if q_lens else 2, heads, 64, torch.bfloat16)
        check(case, query, 0.125, query_start_loc=query_start_loc(q_lens) if q_lens else None)


def test_padded_table_many_empty_splits():
    # A table 16k keys wide holding 1 to 700 keys: most splits exit at once, and the
    # merge must ignore their (never written, NaN-filled) rows.
    case = make_case([700, 1, 0], 1, 64, 16, torch.float32, poison=None)
    tables = torch.full((3, 1024), 2 ** 30, dtype=torch.int32)
    tables[:, :case.block_tables.shape[1]] = case.block_tables
    case = dataclasses.replace(case, block_tables=tables)
    query = random_query(3, 2, 64, torch.float32)
    check(case, query, 0.125, sinks=torch.tensor([1.0, -1.0]), want_split=True)
    check(case, query, 0.125, want_split=True)


def test_occupancy_changes_split_not_result():
    case = make_case([3000], 1, 64, 16, torch.float32, poison=None)
    tables = torch.zeros((1, 1024), dtype=torch.int32)  # 16k keys wide: up to 32 chunks
    tables[:, :case.block_tables.shape[1]] = case.block_tables
    case = dataclasses.replace(case, block_tables=tables)
    query = random_query(1, 2, 64, torch.float32)
    splits = set()
    for ctas in (1, 3, 8):
        out, _, n = emulated_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                       0.125, ctas_per_sm=ctas, multiprocessors=16)
        splits.add(n)
        torch.testing.assert_close(out, ref.attention(query, case.key_cache, case.value_cache, case.block_tables,
                                                      case.seq_lens, 0.125), **TOLERANCES[torch.float32])
    assert len(splits) > 1


# ---- fp8 caches ------------------------------------------------------------------------

def fp8_max(dtype):
    return torch.finfo(dtype).max


def quantize_cache(cache, scale, dtype):
    """The reference's quantization of a whole [blocks, kv_heads, block_size, head] cache."""
    limit = fp8_max(dtype)
    return (cache.float() / scale.float().view(1, -1, 1, 1)).clamp(-limit, limit).to(dtype)


def random_scales(cache, dtype, per_head, seed):
    """Per-head (or one per-layer) scales near absmax / fp8 max, so that a few values saturate."""
    gen = torch.Generator().manual_seed(seed)
    amax = torch.nan_to_num(cache.float(), nan=0.0).abs().amax(dim=(0, 2, 3))
    scale = amax / fp8_max(dtype) * (0.6 + 0.8 * torch.rand(amax.shape, generator=gen))
    return scale if per_head else scale.max()


def fp8_case(case, dtype, scales="head", seed=11):
    """(case with fp8 caches, k_scale, v_scale); scales: "head" [kv_heads], "layer" [], "layer1" [1]."""
    per_head = scales == "head"
    k_scale = random_scales(case.key_cache, dtype, per_head, seed)
    v_scale = random_scales(case.value_cache, dtype, per_head, seed + 1)
    if scales == "layer1":
        k_scale, v_scale = k_scale.reshape(1), v_scale.reshape(1)
    quantized = dataclasses.replace(case, key_cache=quantize_cache(case.key_cache, k_scale, dtype),
                                    value_cache=quantize_cache(case.value_cache, v_scale, dtype))
    return quantized, k_scale, v_scale


@pytest.mark.parametrize("fp8_path", ["software", "hardware"])
def test_fp8_unpack_every_byte(fp8_path):
    lib = emulator(fp8_path)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in FP8:
        got = torch.empty(256)
        lib.emu_unpack(KINDS[dtype], codes.data_ptr(), got.data_ptr(), 256)
        torch.testing.assert_close(got, codes.view(dtype).float(), rtol=0, atol=0, equal_nan=True)


def quantization_inputs(dtype):
    """Every fp8 value, the midpoints between neighbours (ties) and one fp32 ulp either side,
    a sweep over all fp32 bit patterns, and the special values."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = values[values.isfinite()].unique()
    mids = (finite[1:].double() + finite[:-1].double()) / 2
    mids = mids.float()
    near = torch.cat([torch.nextafter(mids, torch.tensor(float("inf"))),
                      torch.nextafter(mids, torch.tensor(float("-inf")))])
    sweep = torch.arange(0, 2 ** 32, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
                            fp8_max(dtype), -fp8_max(dtype), 2 * fp8_max(dtype), 3.4e38, -3.4e38])
    return torch.cat([finite, mids, near, sweep, special])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.0078125, 3.7, 1e-3])
def test_fp8_quantize_bit_identical_to_reference(dtype, scale):
    # write_kv's conversion against the reference's (x / s).clamp(-max, max).to(fp8),
    # byte for byte: rounding to nearest even, saturation, NaN keeping its sign.
    lib = emulator()
    x = quantization_inputs(dtype) * scale
    got = torch.empty(x.shape, dtype=torch.uint8)
    lib.emu_quantize(KINDS[dtype], x.data_ptr(), scale, got.data_ptr(), x.numel())
    want = (x / torch.tensor(scale)).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:5]]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scales", ["head", "layer", "layer1"])
def test_fp8_attention(dtype, query_dtype, scales):
    case, k_scale, v_scale = fp8_case(make_case([1, 17, 40, 0], 2, 64, 16, torch.float32), dtype, scales)
    q_lens = [1, 5, 3, 0]
    for multi_token in (False, True):
        query = random_query(sum(q_lens) if multi_token else 4, 8, 64, query_dtype)
        check(case, query, 0.125, query_start_loc=query_start_loc(q_lens) if multi_token else None,
              k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_attention_sm89_code_path(dtype):
    # The code sm_89+ compiles (cvt.rn.f16x2 through cuda_fp8.h, unpack_scale 1), with the
    # header's host implementation of the conversion standing in for the instruction.
    case, k_scale, v_scale = fp8_case(make_case([1, 17, 40, 0, 700], 2, 64, 16, torch.float32), dtype)
    q_lens = [1, 5, 3, 0, 2]
    for multi_token in (False, True):
        query = random_query(sum(q_lens) if multi_token else 5, 8, 64, torch.bfloat16)
        check(case, query, 0.125, query_start_loc=query_start_loc(q_lens) if multi_token else None,
              k_scale=k_scale, v_scale=v_scale, sinks=torch.linspace(-1, 1, 8), fp8_path="hardware")


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_split_sinks_features_and_value_head_size(dtype):
    # Splits (the scales must apply before the merge), sinks, window, ALiBi, soft cap, and a
    # value head size of its own (192/128, both 8-byte-vector buckets).
    base = with_value_head_size(make_case([1300, 3, 0, 2100], 2, 192, 16, torch.float32), 128)
    case, k_scale, v_scale = fp8_case(base, dtype)
    q_lens = [4, 3, 0, 2]
    sinks = torch.tensor([0.5, -2.0, 4.0, 0.0])
    for multi_token in (False, True):
        query = random_query(sum(q_lens) if multi_token else 4, 4, 192, torch.bfloat16)
        check(case, query, 192 ** -0.5, query_start_loc=query_start_loc(q_lens) if multi_token else None,
              sliding_window=700, alibi_slopes=torch.rand(4), soft_cap=20.0, sinks=sinks, k_scale=k_scale,
              v_scale=v_scale, want_split=True)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("which", ["key", "value"])
def test_fp8_nan_in_a_used_slot_reaches_the_output(dtype, which):
    # A NaN stored in a visible row is no padding: the rows that see it must be NaN, as in
    # the reference (e4m3fn's NaN bytes 0x7f / 0xff are patched in the software conversion;
    # a NaN score used to end as 0 through a `total > 0` test).
    case, k_scale, v_scale = fp8_case(make_case([9, 9], 1, 64, 16, torch.float32), dtype, "layer")
    block = int(case.block_tables[0, 0])
    cache = case.key_cache if which == "key" else case.value_cache
    cache.view(torch.uint8)[block, 0, 3, 5] = 0xff
    query = random_query(2, 2, 64, torch.float32)
    out, lse, _ = emulated_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                     0.125, k_scale=k_scale, v_scale=v_scale)
    want, want_lse = ref.attention_with_lse(query, case.key_cache, case.value_cache, case.block_tables,
                                            case.seq_lens, 0.125, k_scale=k_scale, v_scale=v_scale)
    assert not out[1].isnan().any()
    assert out[0].isnan().all() if which == "key" else out[0, :, 5].isnan().all()
    torch.testing.assert_close(out, want, equal_nan=True, **TOLERANCES[torch.float32])
    torch.testing.assert_close(lse, want_lse, equal_nan=True, atol=1e-4, rtol=1e-5)


# ---- strided cache layouts ---------------------------------------------------------------

def nhd_views(case):
    """case with its caches copied into NHD tensors and passed as HND-shaped views."""
    return dataclasses.replace(case, key_cache=from_nhd(case.key_cache.transpose(1, 2).contiguous()),
                               value_cache=from_nhd(case.value_cache.transpose(1, 2).contiguous()))


def joint_views(case, layout="NHD"):
    """case with K and V in one joint tensor, vLLM's [2, blocks, block_size, kv_heads, head]
    (or [2, blocks, kv_heads, block_size, head]), passed as the views split_kv makes."""
    if layout == "NHD":
        kv = torch.stack([case.key_cache.transpose(1, 2), case.value_cache.transpose(1, 2)])
    else:
        kv = torch.stack([case.key_cache, case.value_cache])
    key, value = split_kv(kv, layout)
    return dataclasses.replace(case, key_cache=key, value_cache=value)


@pytest.mark.parametrize("layout", ["NHD", "joint_NHD", "joint_HND", "mixed"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_strided_layouts(layout, cache_dtype):
    dtype = torch.float32 if cache_dtype in FP8 else cache_dtype
    case = make_case([1, 17, 40, 0, 33], 2, 64, 16, dtype)
    k_scale = v_scale = None
    if cache_dtype in FP8:
        case, k_scale, v_scale = fp8_case(case, cache_dtype)
    if layout == "NHD":
        case = nhd_views(case)
    elif layout.startswith("joint"):
        case = joint_views(case, layout[-3:])
    else:  # K contiguous HND, V an NHD view: the two caches' strides differ
        case = dataclasses.replace(case, value_cache=nhd_views(case).value_cache)
    if layout != "joint_HND":
        assert not case.key_cache.is_contiguous() or not case.value_cache.is_contiguous()
    q_lens = [1, 4, 9, 0, 2]
    for multi_token in (False, True):
        query = random_query(sum(q_lens) if multi_token else 5, 8, 64, dtype)
        check(case, query, 0.125, query_start_loc=query_start_loc(q_lens) if multi_token else None,
              sinks=torch.linspace(-1, 1, 8), k_scale=k_scale, v_scale=v_scale)


def test_strided_value_head_size_with_split():
    case = nhd_views(with_value_head_size(make_case([1500, 7], 2, 96, 16, torch.bfloat16), 64))
    check(case, random_query(2, 4, 96, torch.bfloat16), 96 ** -0.5, want_split=True)


# ---- write_kv and copy_blocks ------------------------------------------------------------

def in_layout(cache, layout):
    """(view of `cache`'s values in `layout`, the tensor that owns the memory)."""
    if layout == "HND":
        owner = cache.clone()
        return owner, owner
    owner = cache.transpose(1, 2).contiguous()
    return from_nhd(owner), owner


def emulated_write_kv(key, value, key_cache, value_cache, slots, k_scale=None, v_scale=None, wide=True):
    lib = emulator()
    elem = key.element_size()
    cache_elem = key_cache.element_size()
    a = EmuWriteKv(kind=KINDS[key.dtype], cache_kind=KINDS[key_cache.dtype], key=ptr(key), value=ptr(value),
                   key_token_stride=key.stride(0) * elem, key_head_stride=key.stride(1) * elem,
                   value_token_stride=value.stride(0) * elem, value_head_stride=value.stride(1) * elem,
                   key_cache=ptr(key_cache), value_cache=ptr(value_cache),
                   key_strides=Strides(*[s * cache_elem for s in key_cache.stride()[:3]]),
                   value_strides=Strides(*[s * cache_elem for s in value_cache.stride()[:3]]),
                   slot_mapping=ptr(slots), num_tokens=slots.numel(),
                   num_slots=key_cache.shape[0] * key_cache.shape[2], num_kv_heads=key_cache.shape[1],
                   block_size=key_cache.shape[2], key_row_bytes=key_cache.shape[3] * cache_elem,
                   value_row_bytes=value_cache.shape[3] * cache_elem, k_scale=ptr(k_scale), v_scale=ptr(v_scale),
                   k_scale_stride=scale_stride(k_scale), v_scale_stride=scale_stride(v_scale), wide=int(wide),
                   k_scale_strides=token_scale_strides(key_cache, k_scale),
                   v_scale_strides=token_scale_strides(value_cache, v_scale))
    lib.emu_write_kv(ctypes.byref(a))


@pytest.mark.parametrize("cache_dtype,input_dtype,scales", [(torch.bfloat16, torch.bfloat16, None),
                                                            (torch.float8_e4m3fn, torch.float32, "head"),
                                                            (torch.float8_e4m3fn, torch.bfloat16, "layer"),
                                                            (torch.float8_e5m2, torch.float16, "head"),
                                                            (torch.float8_e5m2, torch.float32, "layer")])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_write_kv(cache_dtype, input_dtype, scales, layout):
    # Scattered slots and padding (-1), rows of keys 64 and values 32 wide, inputs as strided
    # views of a fused projection, and values that saturate, overflow or are NaN: the bytes
    # must equal the reference's.
    gen = torch.Generator().manual_seed(4)
    num_blocks, kv_heads, block_size = 5, 2, 8
    key_cache = torch.randn(num_blocks, kv_heads, block_size, 64, generator=gen).to(cache_dtype)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, 32, generator=gen).to(cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[::6] = -1
    fused = torch.randn(20, 5, 64, generator=gen) * 300
    fused[3, 1, :4] = torch.tensor([float("nan"), -float("nan"), float("inf"), float("-inf")])
    fused[7, 4, 10:12] = torch.tensor([1e9, -1e-30])
    fused = fused.to(input_dtype)
    key, value = fused[:, 1:3], fused[:, 3:5, :32]
    k_scale = v_scale = None
    if scales is not None:
        shape = (kv_heads,) if scales == "head" else ()
        k_scale, v_scale = torch.rand(shape, generator=gen) + 0.05, torch.rand(shape, generator=gen) + 0.05
    got_k, own_k = in_layout(key_cache, layout)
    got_v, own_v = in_layout(value_cache, layout)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots, k_scale=k_scale, v_scale=v_scale)
    emulated_write_kv(key, value, got_k, got_v, slots, k_scale, v_scale)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8)
def test_write_kv_fp8_unaligned_rows(dtype):
    # Rows 12 bytes long (12 = not a multiple of the 8-byte words): the byte-store path.
    gen = torch.Generator().manual_seed(5)
    cache = torch.zeros(3, 2, 4, 12, dtype=dtype)
    key = torch.randn(5, 2, 12, generator=gen) * 50
    slots = torch.tensor([0, 11, -1, 5, 6])
    scale = torch.tensor([0.5, 2.0])
    want_k, want_v = cache.clone(), cache.clone()
    ref.write_kv(key, key, want_k, want_v, slots, k_scale=scale, v_scale=scale)
    got_k, got_v = cache.clone(), cache.clone()
    emulated_write_kv(key, key, got_k, got_v, slots, scale, scale, wide=False)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def copy_rows(cache):
    """The CopyCache the host code builds: one row per block when it is one dense chunk."""
    elem = cache.element_size()
    dims = sorted((cache.stride(d), cache.shape[d]) for d in (1, 2, 3) if cache.shape[d] > 1)
    expected, dense = 1, True
    for stride, size in dims:
        dense &= stride == expected
        expected *= size
    if dense:
        return CopyCache(ptr(cache), cache.stride(0) * elem, 0, 0, cache[0].numel() * elem, 1, 1)
    return CopyCache(ptr(cache), cache.stride(0) * elem, cache.stride(1) * elem, cache.stride(2) * elem,
                     cache.shape[3] * elem, cache.shape[1], cache.shape[2])


@pytest.mark.parametrize("layout", ["HND", "NHD", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2])
def test_copy_blocks(layout, dtype):
    gen = torch.Generator().manual_seed(9)
    num_blocks, kv_heads, block_size, head = 6, 2, 4, 16
    if layout == "interleaved":  # K and V rows alternate per token: blocks are not dense
        owner = torch.randn(num_blocks, block_size, 2, kv_heads, head, generator=gen).to(dtype)
        key, value = owner[:, :, 0].transpose(1, 2), owner[:, :, 1].transpose(1, 2)
    else:
        owner = torch.randn(2, num_blocks, kv_heads, block_size, head, generator=gen).to(dtype)
        key, value = owner[0], owner[1]
        if layout == "NHD":
            owner = owner.transpose(2, 3).contiguous()
            key, value = from_nhd(owner[0]), from_nhd(owner[1])
    mapping = torch.tensor([[0, 5], [0, 3], [4, 1]])
    want_k, want_v = key.clone(), value.clone()
    ref.copy_blocks([want_k], [want_v], mapping)
    k_rows, v_rows = copy_rows(key), copy_rows(value)
    assert (k_rows.heads == 1) == (layout != "interleaved")
    emulator().emu_copy_blocks(ctypes.byref(k_rows), ctypes.byref(v_rows), mapping.data_ptr(), 3, num_blocks)
    assert torch.equal(key.contiguous().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(value.contiguous().view(torch.uint8), want_v.view(torch.uint8))


def swap_pool(layout, num_blocks, dtype=torch.float32):
    """(view, the tensor whose memory it is) of a pool of 3 x 4 x 8 (x ...) blocks in
    ``layout``: views of every stride pattern swap_blocks meets, and some it may."""
    make = {
        "HND": lambda: torch.zeros(num_blocks, 3, 4, 8),
        "NHD": lambda: torch.zeros(num_blocks, 4, 3, 8),  # [blocks, tokens, heads, head_size]
        "joint": lambda: torch.zeros(num_blocks, 2, 4, 3, 8),  # vLLM's K/V tensor, its K half
        "int8 scales": lambda: torch.zeros(num_blocks, 4, 3),
        "int4 scales": lambda: torch.zeros(num_blocks, 4, 3, 2),
        "strided head": lambda: torch.zeros(num_blocks, 3, 4, 16),  # every other channel
        "5-D": lambda: torch.zeros(num_blocks, 2, 3, 4, 5),
        "2-D": lambda: torch.zeros(num_blocks, 10, 2),
    }
    views = {
        "HND": lambda t: t,
        "NHD": lambda t: t.permute(0, 2, 1, 3),
        "joint": lambda t: t[:, 0].permute(0, 2, 1, 3),
        "int8 scales": lambda t: t.transpose(1, 2),
        "int4 scales": lambda t: t.permute(0, 2, 1, 3),
        "strided head": lambda t: t[..., ::2],
        "5-D": lambda t: t.transpose(2, 3),
        "2-D": lambda t: t[..., 0],
    }
    memory = make[layout]().to(dtype)
    return views[layout](memory), memory


@pytest.mark.parametrize("layouts", [("HND", "NHD"), ("NHD", "joint"), ("int8 scales", "int8 scales"),
                                     ("int4 scales", "int4 scales"), ("strided head", "HND"),
                                     ("HND", "strided head"), ("5-D", "5-D"), ("2-D", "2-D")])
def test_swap_blocks_plan_moves_any_layout(layouts):
    # swap_blocks' strided path (block_copies.h) as the CUDA op issues it: each block the
    # 2-D copies of its rows; the destination's other memory (the V half of a joint tensor,
    # the channels between a strided head's) untouched, like the CPU op's copy.
    src, _ = swap_pool(layouts[0], 6)
    src.copy_(torch.randn(src.shape))
    dst, memory = swap_pool(layouts[1], 5)
    memory.copy_(torch.randn(memory.shape))
    mapping = torch.tensor([[5, 0], [2, 3], [0, 4]])
    before = memory.clone()
    torch.ops.paged.swap_blocks(src, dst, mapping)  # the CPU op: what the CUDA op must give
    cpu_result = memory.clone()
    memory.copy_(before)
    sizes, src_strides, dst_strides = (torch.tensor(x) for x in (src.shape, src.stride(), dst.stride()))
    emulator().emu_swap_blocks(src.dim(), sizes.data_ptr(), src.data_ptr(), src_strides.data_ptr(), dst.data_ptr(),
                               dst_strides.data_ptr(), src.element_size(), mapping.data_ptr(), mapping.shape[0])
    assert torch.equal(memory, cpu_result)
    for s, d in mapping.tolist():
        assert torch.equal(dst[d], src[s])
    assert not torch.equal(cpu_result, before)


# ---- shared_prefix_attention and merge_attention_states ------------------------------------

def emulated_prefix_attention(query, case, group_starts, scale, **kwargs):
    return emulated_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              scale, query_start_loc=group_starts, queries_after_keys=True, **kwargs)


@pytest.mark.parametrize("dtype,heads", [(torch.float32, (8, 2)), (torch.bfloat16, (4, 4)),
                                         (torch.float32, (16, 1))])
def test_shared_prefix_attention(dtype, heads):
    # Prefixes of 1, bs-1, bs, bs+1, long (split-KV) and 0 tokens; groups of 1 to 3 rows, then
    # 2 rows per sequence; GQA groups within and beyond one CTA's 8 query vectors; sinks.
    num_heads, num_kv_heads = heads
    case = scenarios.shared_prefix_case([1, 15, 16, 17, 600, 0], [2, 1, 1, 3, 2, 1], [1] * 10,
                                        num_kv_heads, 64, 16, dtype)
    sinks = scenarios.random_sinks(num_heads)
    for starts, extra in ((case.group_starts, {}),
                          (query_start_loc([4, 2, 2, 6, 4, 2]), dict(sinks=sinks, soft_cap=4.0))):
        query = random_query(int(starts[-1]), num_heads, 64, dtype)
        out, lse, _ = emulated_prefix_attention(query, case.prefixes, starts, 0.125, **extra)
        want, want_lse = ref.shared_prefix_attention(query, case.prefixes.key_cache,
                                                     case.prefixes.value_cache,
                                                     case.prefixes.block_tables,
                                                     case.prefixes.seq_lens, starts, 0.125, **extra)
        torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[dtype])
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


def test_shared_prefix_fp8_nhd():
    case = scenarios.shared_prefix_case([17, 300], [3, 2], [1] * 5, 2, 64, 16, torch.float32)
    prefixes, extra = scenarios.with_format(case.prefixes, scenarios.KVFormat(torch.float8_e4m3fn, True, "NHD"))
    query = random_query(5, 8, 64, torch.bfloat16)
    out, lse, _ = emulated_prefix_attention(query, prefixes, case.group_starts, 0.125, **extra)
    want, want_lse = ref.shared_prefix_attention(query.double(), prefixes.key_cache, prefixes.value_cache,
                                                 prefixes.block_tables, prefixes.seq_lens,
                                                 case.group_starts, 0.125, **extra)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-5)


def emulated_merge(outputs, lses):
    out = torch.full(outputs[0].shape, float("nan"), dtype=outputs[0].dtype)
    lse = torch.full(outputs[0].shape[:2], float("nan"))
    p = MergeStatesParams(kind=KINDS[out.dtype], num_inputs=len(outputs), num_tokens=out.shape[0],
                          num_heads=out.shape[1], head_size=out.shape[2], out=ptr(out), lse=ptr(lse))
    for k, (o, l) in enumerate(zip(outputs, lses)):
        p.outputs[k], p.out_token_stride[k], p.out_head_stride[k] = ptr(o), o.stride(0), o.stride(1)
        p.lses[k], p.lse_token_stride[k], p.lse_head_stride[k] = ptr(l), l.stride(0), l.stride(1)
    emulator().emu_merge_states(ctypes.byref(p))
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 3, 16])
def test_merge_attention_states(dtype, parts):
    gen = torch.Generator().manual_seed(parts)
    outputs, lses = [], []
    for k in range(parts):
        out = torch.randn(5, 3, 136 + 8 * k, generator=gen).to(dtype)[..., :136]  # > 128 lanes: two strips
        lse = torch.randn(3, 5, generator=gen).t() * 20  # strided lse
        lse[k % 5, 0] = float("-inf")
        out[k % 5, 0] = float("nan")  # never read: its weight is 0
        outputs.append(out)
        lses.append(lse)
    lses[0][4, 2] = float("nan")
    got, got_lse = emulated_merge(outputs, lses)
    want, want_lse = ref.merge_attention_states(outputs, lses)
    torch.testing.assert_close(got.float(), want.float(), equal_nan=True, **TOLERANCES[dtype])
    torch.testing.assert_close(got_lse, want_lse, equal_nan=True, atol=1e-5, rtol=1e-5)
    assert got[4, 2].isnan().all(), "a NaN lse makes its row NaN"


# ---- head sizes past 256 -------------------------------------------------------------------

@pytest.mark.parametrize("dtype, multi_token", [(torch.float32, False), (torch.bfloat16, True),
                                               (torch.float16, False), (torch.float8_e4m3fn, True)],
                         ids=str)
def test_head_sizes_past_256(dtype, multi_token):
    """The (512, 512) and (576, 512) instances (4 query vectors per CTA at most): Gemma-4's
    global layers with GQA 4:1 and an MLA latent cache read as keys and, through a view of
    its leading columns, values; 16 query heads cut into CTAs of 4."""
    fp8 = dtype if dtype in FP8 else None
    query_dtype = torch.bfloat16 if fp8 else dtype
    lens, q_lens = [1, 17, 200, 0], [1, 5, 3, 0]
    gemma = make_case(lens, 2, 512, 16, torch.float32 if fp8 else dtype)
    k_scale = v_scale = None
    if fp8:
        gemma, k_scale, v_scale = fp8_case(gemma, fp8)
    latent, latent_scales = scenarios.latent_case(lens, 16, torch.float32 if fp8 else dtype, fp8)
    for case, heads, head_size, ks, vs in ((gemma, 8, 512, k_scale, v_scale),
                                           (latent, 16, 576, latent_scales.get("k_scale"),
                                            latent_scales.get("v_scale"))):
        query = random_query(sum(q_lens) if multi_token else len(lens), heads, head_size, query_dtype)
        qsl = query_start_loc(q_lens) if multi_token else None
        check(case, query, 192 ** -0.5, query_start_loc=qsl, sinks=scenarios.random_sinks(heads),
              k_scale=ks, v_scale=vs)


# ---- chunked local attention ---------------------------------------------------------------

@pytest.mark.parametrize("multi_token", [False, True])
def test_chunked_local_attention_metadata(multi_token):
    """The CUDA kernels over chunked.chunk_local's metadata see only each query's chunk (the
    float64 brute force of test_chunked.py), decode and rows that cross chunk boundaries."""
    from test_chunked import brute_force

    from paged_attention_ext.chunked import chunk_local

    chunk, block_size = 32, 16
    lens, q_lens = [1, 31, 33, 100, 0], [1, 20, 33, 70, 0]
    case = make_case(lens, 2, 64, block_size, torch.float32)
    q_lens = q_lens if multi_token else None
    qsl = query_start_loc(q_lens) if multi_token else None
    query = random_query(sum(q_lens) if multi_token else len(lens), 4, 64, torch.float32)
    local = chunk_local(case.block_tables, case.seq_lens, chunk, block_size, qsl)
    out, _, _ = emulated_attention(query, case.key_cache, case.value_cache, local.block_tables,
                                   local.seq_lens, 0.125, query_start_loc=local.query_start_loc)
    want = brute_force(query, case, 0.125, chunk, q_lens=q_lens)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
