"""The CUDA attention kernels' own source, run on the CPU (tests/cuda_emulator.cpp).

The kernels of csrc/cuda/attention_kernels.cuh are compiled by the host C++ compiler
with the CUDA keywords, barriers and warp shuffles emulated on host threads (128 per
CTA), and driven here through ctypes against the fp32 reference. This checks the
kernels' logic (planner, key schedule and splits, score and value phases, warp merge,
sinks, value head sizes, the split merge) on machines without a GPU; it says nothing
about timing, memory-model or hardware-specific behaviour (tests/test_cuda.py and
compute-sanitizer on a GPU do). Needs g++ (C++20) and the CUDA headers
(``$CUDA_HOME/include``); skipped without them.
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

from paged_attention_ext import reference as ref
from paged_case import TOLERANCES, make_case, query_start_loc, random_query

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class EmuArgs(ctypes.Structure):
    _fields_ = (
        [("kind", ctypes.c_int64), ("query", ctypes.c_void_p), ("query_token_stride", ctypes.c_int64),
         ("query_head_stride", ctypes.c_int64), ("key_cache", ctypes.c_void_p), ("value_cache", ctypes.c_void_p),
         ("block_tables", ctypes.c_void_p), ("block_table_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
         ("query_start_loc", ctypes.c_void_p), ("alibi_slopes", ctypes.c_void_p), ("sinks", ctypes.c_void_p)]
        + [(n, ctypes.c_int64) for n in ("num_tokens", "num_seqs", "num_heads", "num_kv_heads", "head_size",
                                          "head_size_v", "block_size", "num_blocks", "max_blocks_per_seq",
                                          "sliding_window")]
        + [("scale", ctypes.c_double), ("soft_cap", ctypes.c_double), ("out", ctypes.c_void_p),
           ("out_token_stride", ctypes.c_int64), ("out_head_stride", ctypes.c_int64), ("lse", ctypes.c_void_p),
           ("lse_token_stride", ctypes.c_int64), ("multiprocessors", ctypes.c_int64),
           ("ctas_per_sm", ctypes.c_int64), ("num_partitions", ctypes.c_int64)]
    )


@functools.lru_cache(maxsize=None)
def emulator():
    cxx = os.environ.get("CXX") or shutil.which("g++")
    cuda_include = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
    if cxx is None or not os.path.exists(os.path.join(cuda_include, "cuda_bf16.h")):
        pytest.skip("needs g++ and the CUDA headers")
    lib = os.path.join(tempfile.mkdtemp(prefix="paged_emu_"), "libemu.so")
    # -w: the kernel source compares threadIdx (unsigned) with ints, as CUDA code does.
    subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-pthread",
                    "-I", os.path.join(ROOT, "csrc", "cuda"), "-I", cuda_include,
                    os.path.join(ROOT, "tests", "cuda_emulator.cpp"),
                    os.path.join(ROOT, "csrc", "cuda", "attention_plan.cpp"), "-o", lib], check=True)
    library = ctypes.CDLL(lib)
    library.emu_attention.argtypes = [ctypes.POINTER(EmuArgs)]
    return library


def ptr(t):
    return None if t is None else t.data_ptr()


def emulated_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, query_start_loc=None,
                       alibi_slopes=None, sliding_window=-1, soft_cap=0.0, sinks=None, ctas_per_sm=3,
                       multiprocessors=132):
    """The CUDA kernels' answer (out, lse, number of splits), computed on the CPU."""
    lib = emulator()
    num_tokens, num_heads, _ = query.shape
    keep = [t.contiguous() if t is not None else None
            for t in (block_tables, seq_lens, query_start_loc, alibi_slopes, sinks)]
    tables, lens, qsl, slopes, sink = keep
    out = torch.full((num_tokens, num_heads, value_cache.shape[3]), float("nan"), dtype=query.dtype)
    lse = torch.full((num_tokens, num_heads), float("nan"))
    a = EmuArgs(kind=KINDS[query.dtype], query=ptr(query), query_token_stride=query.stride(0),
                query_head_stride=query.stride(1), key_cache=ptr(key_cache), value_cache=ptr(value_cache),
                block_tables=ptr(tables), block_table_stride=tables.stride(0), seq_lens=ptr(lens),
                query_start_loc=ptr(qsl), alibi_slopes=ptr(slopes), sinks=ptr(sink), num_tokens=num_tokens,
                num_seqs=lens.shape[0], num_heads=num_heads, num_kv_heads=key_cache.shape[1],
                head_size=key_cache.shape[3], head_size_v=value_cache.shape[3], block_size=key_cache.shape[2],
                num_blocks=key_cache.shape[0], max_blocks_per_seq=tables.shape[1], sliding_window=sliding_window,
                scale=scale, soft_cap=soft_cap, out=ptr(out), out_token_stride=out.stride(0),
                out_head_stride=out.stride(1), lse=ptr(lse), lse_token_stride=lse.stride(0),
                multiprocessors=multiprocessors, ctas_per_sm=ctas_per_sm)
    lib.emu_attention(ctypes.byref(a))
    return out, lse, a.num_partitions


def check(case, query, scale, *, want_split=None, **kwargs):
    out, lse, splits = emulated_attention(query, case.key_cache, case.value_cache, case.block_tables,
                                          case.seq_lens, scale, **kwargs)
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
