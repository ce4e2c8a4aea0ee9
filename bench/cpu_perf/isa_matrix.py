"""Every kernel this CPU can run, every cache dtype, side by side.

For each head layout (32/32 and 32/8 heads; B=16, context 2048, block 16, head size 128)
one round-robin loop (``common/timing.py``) times, for each instruction set the CPU supports
(``pa.select_cpu_isa`` lowers the kernel per call) and each cache dtype (fp32, bf16,
fp16, e4m3, e5m2; fp8 with a bf16 query and scales of 1), the decode call from DRAM, and
the 1 GiB read. Each cache has its own huge-page pools, blocks in a random physical order,
checked against the reference first. Per row:

* GB/s of KV and % of the read in the same rounds (paired);
* KV elements per second against the same ISA's fp32 row (paired time ratio), and fp8
  against bf16 (paired);
* the arithmetic limit: the same call with its KV resident in L2 (every block table
  cycling over 256 KiB of blocks), timed in a loop of its own; the ISA's inner-loop limit
  for the dtype (``bench/microbench/widen_peak.cpp``, compiled here with the ISA's own
  macros and target from ``csrc/cpu/isa_<isa>.cpp``): KV elements per second of both
  cores when every element is only widened by the kernel's loaders and multiply-added
  into the (query heads / KV heads) queries that read it, in GB/s; and the ISA's bare
  multiply-add ceiling (``bench/microbench/fma_peak.cpp``) in the same units;
* the paged-read ceiling: how much of a sequential read a reader of the
  row's access pattern gets when it does nothing but read (``bench/microbench/paged_read.cpp
  ceiling``, two threads, huge pages, its own paired sequential read): the row's runs of
  contiguous KV (a block's rows of all the KV heads, kv_heads x block_size x head_size
  elements, which a decode item reads in turn) in a random order, the best of the prefetch
  strategies a kernel could use. Shorter runs cost more than a sequential read can show
  (on the Xeon with AMX 32 KiB runs read at 78-82%), so a row near its ceiling is at the memory pattern's limit.

A row meets the target when it reads at >= 80% of the read, or, when its arithmetic limit
is itself below 80% of the read (the arithmetic cannot keep up with memory), when it runs
at >= 80% of that limit. The arithmetic limit is the inner-loop limit, or the row's own L2
rate where the kernel runs faster than that loop (then the loop is not the limit). Multi-token (a 512-token causal chunk over 4096 tokens, 32/8 heads) is timed
per ISA and dtype in one more loop, in GFLOP/s against the multiply-add ceiling.
"""

import functools
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

import paged_attention_ext as pa
from paged_attention_ext import reference
from paged_attention_ext.host_memory import zeros_huge_pages

from common.environment import cpu_details
from common.timing import Candidate, time_interleaved_samples

from . import config
from .config import (BATCH, BLOCK_SIZE, CONTEXT, HEAD_SIZE, KV_HEADS, MT_KV_HEADS, MT_QUERIES,
                     MT_SEQ_LEN, NUM_HEADS, READ_BYTES, Plan)
from .machine import Pool, random_pattern, rate_summary, ratios, with_isa
from .multi_token import visible_pairs

ISAS = pa.CPU_ISAS
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = {**config.DTYPES, **FP8}
QUERY_DTYPE = {**config.DTYPES, **{name: torch.bfloat16 for name in FP8}}
TOLERANCE = {**config.TOLERANCE, **{name: 2e-2 for name in FP8}}
# fma_peak.cpp's compiler flags per kernel: the instruction set the kernel is compiled for.
FMA_FLAGS = {"generic": [], "avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx512f"],
             "avx512_vbmi": ["-mavx512f"], "avx512_bf16": ["-mavx512f"], "amx": ["-mavx512f"]}
FMA_SOURCE = Path(__file__).resolve().parent.parent / "microbench" / "fma_peak.cpp"
WIDEN_SOURCE = FMA_SOURCE.with_name("widen_peak.cpp")
PAGED_READ_SOURCE = FMA_SOURCE.with_name("paged_read.cpp")
KERNEL_SOURCES = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
TARGET = 0.8
L2_BYTES = 256 << 10


def supported_isas() -> List[str]:
    """Every instruction set this CPU runs, asked one by one: the default kernel can be below
    the best (avx512_vbmi's where bf16 dot products do not pay)."""
    def runs(isa: str) -> bool:
        try:
            return with_isa(isa, pa.cpu_isa)() == isa
        except ValueError:
            return False
    return [isa for isa in ISAS if runs(isa)]


def microbench_outputs(source: Path, compile_args: List[str], runs: int,
                       args: Tuple[str, ...] = ()) -> Optional[List[str]]:
    """The standard output of ``runs`` runs of ``source`` compiled with g++ and
    ``compile_args``, each given ``args``. None without g++."""
    if shutil.which("g++") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, source.stem)
        subprocess.run(["g++", *compile_args, str(source), "-o", binary], check=True)
        return [subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout
                for _ in range(runs)]


@functools.lru_cache(maxsize=None)
def fma_ceiling(flags: Tuple[str, ...], runs: int = 3) -> Optional[float]:
    """Lane multiply-adds per second on two threads of fma_peak.cpp compiled with ``flags``
    (FMA_FLAGS; kernels sharing them share one measurement), the best of ``runs`` (a
    ceiling: a run that shared a core reads low). None without g++."""
    outputs = microbench_outputs(FMA_SOURCE, ["-O2", *flags, "-fopenmp"], runs)
    if outputs is None:
        return None
    # "...: fp32 multiply-adds: 1 thread X G/s, 2 threads Y G/s (...)"
    return max(float(out.split("2 threads")[1].split("G/s")[0]) * 1e9 for out in outputs)


def isa_compile_flags(isa: str) -> List[str]:
    """The -D macros and -m target flags ``csrc/cpu/isa_<isa>.cpp`` compiles its kernel with."""
    text = (KERNEL_SOURCES / f"isa_{isa}.cpp").read_text()
    flags = [f"-D{name}={value}" for name, value in
             re.findall(r"^#define (PAGED_(?:VEC_WIDTH|ISA_AVX512|ISA_AVX512_VBMI|ISA_AVX512_BF16|ISA_F16C)) (\d+)$",
                        text, re.M)]
    target = re.search(r'^#define PAGED_ISA_TARGET "([^"]+)"$', text, re.M)
    return flags + ([f"-m{feature}" for feature in target.group(1).split(",")] if target else [])


@functools.lru_cache(maxsize=None)
def widen_limits(isa: str, runs: int = 2) -> Optional[Dict[Tuple[str, int], float]]:
    """KV elements per second on two threads of widen_peak.cpp built for ``isa``, per (dtype,
    queries per KV head), the best of ``runs`` and of the dtype's inner loops (a second,
    "<dtype>_vdpbf16ps", on AVX512_BF16). None without g++."""
    outputs = microbench_outputs(WIDEN_SOURCE, ["-O3", "-fwrapv", "-std=c++20", "-fopenmp", "-Wno-psabi",
                                                *isa_compile_flags(isa), "-I", str(KERNEL_SOURCES)], runs)
    if outputs is None:
        return None
    best: Dict[Tuple[str, int], float] = {}
    for out in outputs:
        # "e4m3 G=4: 1 thread X G elements/s, 2 threads Y G elements/s"
        for name, group, rate in re.findall(r"^(\w+) G=(\d+):.*2 threads ([\d.]+) G", out, re.M):
            key = (name.split("_")[0], int(group))
            best[key] = max(best.get(key, 0.0), float(rate) * 1e9)
    return best


def run_kib(kv_heads: int, itemsize: int) -> int:
    """KiB of one contiguous run of a decode row's K (or V): a block's rows of every KV head."""
    return kv_heads * BLOCK_SIZE * HEAD_SIZE * itemsize >> 10


def paged_read_ceilings(sizes_kib: List[int]) -> Optional[Dict[int, float]]:
    """% of a sequential read that random runs of each size read at (paged_read.cpp's
    ceiling mode, built for this CPU). None without g++."""
    outputs = microbench_outputs(PAGED_READ_SOURCE, ["-O3", "-march=native", "-fopenmp", "-Wno-psabi"], 1,
                                 ("ceiling", *map(str, sizes_kib)))
    if outputs is None:
        return None
    # "ceiling 32 KiB: 80.9% of the read (...)"
    return {int(kib): float(pct) for kib, pct in re.findall(r"^ceiling (\d+) KiB: ([\d.]+)%", outputs[0], re.M)}


class DecodeCandidate:
    """One cache dtype at one head layout: its pools, a DRAM call and an L2-resident call."""

    def __init__(self, dtype_name: str, kv_heads: int, table: torch.Tensor, seed: int):
        dtype = DTYPES[dtype_name]
        self.dtype_name = dtype_name
        blocks_per_seq = table.shape[1]
        num_blocks = table.numel()
        shape = (num_blocks, kv_heads, BLOCK_SIZE, HEAD_SIZE)
        elements = num_blocks * kv_heads * BLOCK_SIZE * HEAD_SIZE
        self.pools = [Pool(elements * dtype.itemsize, True) for _ in range(2)]
        for i, pool in enumerate(self.pools):
            pool.fill(random_pattern(torch.float32, seed + i).to(dtype))
        self.key, self.value = (pool.tensor(dtype, shape) for pool in self.pools)
        gen = torch.Generator().manual_seed(seed)
        self.query = torch.randn(BATCH, NUM_HEADS, HEAD_SIZE, generator=gen).to(QUERY_DTYPE[dtype_name])
        self.scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if dtype.itemsize == 1 else {}
        self.table = table
        block_bytes = 2 * kv_heads * BLOCK_SIZE * HEAD_SIZE * dtype.itemsize
        distinct = max(1, L2_BYTES // block_bytes)
        self.l2_table = (torch.arange(num_blocks) % distinct).to(torch.int32).view(BATCH, blocks_per_seq)
        self.lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
        self.kv_elements = 2 * BATCH * CONTEXT * kv_heads * HEAD_SIZE
        self.kv_bytes = self.kv_elements * dtype.itemsize

    def run(self, table: torch.Tensor) -> torch.Tensor:
        return pa.attention(self.query, self.key, self.value, table, self.lens, HEAD_SIZE ** -0.5,
                            **self.scales)

    def check(self, isa: str) -> float:
        """Max abs error of sequence 0 on ``isa`` against the reference."""
        got = with_isa(isa, lambda: self.run(self.table))()[:1].float()
        used = self.table[0].long()
        want = reference.attention(self.query[:1], self.key[used], self.value[used],
                                   torch.arange(self.table.shape[1], dtype=torch.int32)[None],
                                   self.lens[:1], HEAD_SIZE ** -0.5, **self.scales).float()
        error = (got - want).abs().max().item()
        if not error <= TOLERANCE[self.dtype_name]:
            raise AssertionError(f"{isa} {self.dtype_name} decode differs from reference by {error:.3g}")
        return error


def ceiling_gbps(fma_per_s: Optional[float], kv_heads: int, itemsize: int) -> Optional[float]:
    """GB/s of KV at which every multiply-add slot is busy: a KV element costs `group` of them."""
    if fma_per_s is None:
        return None
    return fma_per_s / (NUM_HEADS // kv_heads) * itemsize / 1e9


def bench_layout(kv_heads: int, isas: List[str], fma: Dict[str, Optional[float]],
                 widen: Dict[str, Optional[Dict[Tuple[str, int], float]]], plan: Plan,
                 read: torch.Tensor, ceilings: Optional[Dict[int, float]]) -> List[Dict[str, object]]:
    blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
    table = torch.randperm(BATCH * blocks_per_seq, dtype=torch.int32).view(BATCH, blocks_per_seq)
    cases = {name: DecodeCandidate(name, kv_heads, table, seed=10 * i)
             for i, name in enumerate(DTYPES)}
    errors = {(isa, name): case.check(isa) for isa in isas for name, case in cases.items()}
    dram: Dict[str, Candidate] = {"read": read.sum}
    l2: Dict[str, Candidate] = {}
    for isa in isas:
        for name, case in cases.items():
            dram[f"{isa}/{name}"] = with_isa(isa, lambda case=case: case.run(case.table))
            l2[f"{isa}/{name}"] = with_isa(isa, lambda case=case: case.run(case.l2_table))
    s = time_interleaved_samples(dram, plan.warmup, plan.decode_reps)
    s_l2 = time_interleaved_samples(l2, plan.warmup, max(3, plan.decode_reps // 3))
    read_rate = rate_summary(s["read"], READ_BYTES)
    rows = []
    for isa in isas:
        for name, case in cases.items():
            key = f"{isa}/{name}"
            t, t_l2 = s[key], s_l2[key]
            ceiling = ceiling_gbps(fma[isa], kv_heads, DTYPES[name].itemsize)
            group = NUM_HEADS // kv_heads
            run = run_kib(kv_heads, DTYPES[name].itemsize)
            limit = (widen[isa][(name, group)] * DTYPES[name].itemsize / 1e9
                     if widen[isa] and (name, group) in widen[isa] else None)
            row = {"isa": isa, "dtype": name, "num_heads": NUM_HEADS, "num_kv_heads": kv_heads,
                   "batch": BATCH, "context": CONTEXT, "block_size": BLOCK_SIZE,
                   "head_size": HEAD_SIZE, "kv_bytes": case.kv_bytes,
                   "max_abs_error_seq0": errors[(isa, name)],
                   "dram": rate_summary(t, case.kv_bytes) | ratios(t, case.kv_bytes, s["read"], READ_BYTES),
                   "l2": rate_summary(t_l2, case.kv_bytes),
                   "read_bandwidth": read_rate,
                   "fma_ceiling_gbps": ceiling,
                   "inner_loop_limit_gbps": limit,
                   "run_kib": run,
                   "paged_read_ceiling_pct": (ceilings or {}).get(run),
                   "elements_vs_fp32_paired": statistics.median(
                       f / a for a, f in zip(t, s[f"{isa}/fp32"])),
                   "samples_s": {"dram": t, "l2": t_l2}}
            if DTYPES[name].itemsize == 1:
                row["speedup_over_bf16_paired"] = statistics.median(
                    b / a for a, b in zip(t, s[f"{isa}/bf16"]))
            row["verdict"] = verdict(row)
            rows.append(row)
            print_row(row)
    del cases
    return rows


def verdict(row: Dict[str, object]) -> Dict[str, object]:
    read = row["read_bandwidth"]["rate_median"]
    loop_limit = row["inner_loop_limit_gbps"]
    pct_read = row["dram"]["pct_paired"] / 100
    l2_rate = row["l2"]["rate_median"]
    of_l2 = row["dram"]["rate_median"] / l2_rate
    # The arithmetic runs at least as fast as the kernel does from L2: where the kernel
    # beats the inner loop (a smarter loop than widen_peak's), its own rate is the limit.
    limit = max(loop_limit, l2_rate) if loop_limit is not None else None
    compute_bound = limit is not None and limit < TARGET * read
    met = pct_read >= TARGET or (compute_bound and row["dram"]["rate_median"] >= TARGET * limit)
    return {"bound": "arithmetic" if compute_bound else "memory", "pct_of_read": round(100 * pct_read, 1),
            "dram_of_l2": round(of_l2, 3),
            "dram_of_limit": round(row["dram"]["rate_median"] / limit, 3) if limit else None,
            "l2_of_limit": round(l2_rate / loop_limit, 3) if loop_limit else None,
            "met": met}


def bench_multi_token_isas(isas: List[str], fma: Dict[str, Optional[float]], plan: Plan
                           ) -> List[Dict[str, object]]:
    """A 512-token chunk over 4096 tokens (32/8 heads) per ISA and dtype, one loop."""
    num_blocks = MT_SEQ_LEN // BLOCK_SIZE
    table = torch.randperm(num_blocks, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([MT_SEQ_LEN], dtype=torch.int32)
    starts = torch.tensor([0, MT_QUERIES], dtype=torch.int32)
    flops = 4 * NUM_HEADS * HEAD_SIZE * visible_pairs(MT_SEQ_LEN, MT_QUERIES)
    shape = (num_blocks, MT_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    candidates: Dict[str, Candidate] = {}
    for name, dtype in DTYPES.items():
        gen = torch.Generator().manual_seed(7)
        k = torch.randn(shape, generator=gen).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
        q = torch.randn(MT_QUERIES, NUM_HEADS, HEAD_SIZE, generator=gen).to(QUERY_DTYPE[name])
        scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if dtype.itemsize == 1 else {}
        out = torch.empty_like(q)
        args = (q, k, v, table, lens, HEAD_SIZE ** -0.5, starts)
        want = reference.attention(*args, **scales).float()
        for isa in isas:
            def run(args=args, scales=scales, out=out):
                return pa.attention_out(out, *args, **scales)
            call = with_isa(isa, run)
            error = (call().float() - want).abs().max().item()
            if not error <= 10 * TOLERANCE[name]:
                raise AssertionError(f"{isa} {name} multi-token differs from reference by {error:.3g}")
            candidates[f"{isa}/{name}"] = call
    s = time_interleaved_samples(candidates, 1, max(3, plan.mt_reps // 2))
    rows = []
    for key, t in s.items():
        isa, name = key.split("/")
        rate = rate_summary(t, flops)
        ceiling = 2 * fma[isa] / 1e9 if fma[isa] else None
        rows.append({"isa": isa, "dtype": name, "seq_len": MT_SEQ_LEN, "queries": MT_QUERIES,
                     "num_heads": NUM_HEADS, "num_kv_heads": MT_KV_HEADS, "flops": flops,
                     "paged": rate, "fma_ceiling_gflops": ceiling,
                     "of_ceiling": rate["rate_median"] / ceiling if ceiling else None,
                     "vs_fp32_paired": statistics.median(f / a for a, f in zip(t, s[f"{isa}/fp32"]))})
        r = rows[-1]
        print(f"multi-token [{isa:>11}] {name:4} {rate['rate_median']:6.1f} GFLOP/s"
              + (f" ({100 * r['of_ceiling']:.0f}% of {ceiling:.0f})" if ceiling else "")
              + f" | vs fp32 {r['vs_fp32_paired']:.2f}x", flush=True)
    return rows


def print_row(row: Dict[str, object]) -> None:
    d, l2, v = row["dram"], row["l2"], row["verdict"]
    limit = f"{row['inner_loop_limit_gbps']:6.1f}" if row["inner_loop_limit_gbps"] else "   n/a"
    fp8 = f" | vs bf16 {row['speedup_over_bf16_paired']:.2f}x" if "speedup_over_bf16_paired" in row else ""
    ceiling = row["paged_read_ceiling_pct"]
    pattern = f" (its {row['run_kib']} KiB runs: {ceiling:.0f}%)" if ceiling else ""
    print(f"isa [{row['isa']:>11}] {row['dtype']:4} 32/{row['num_kv_heads']:<2} | DRAM {d['rate_median']:5.1f} GB/s "
          f"{d['pct_paired']:4.0f}% of read {row['read_bandwidth']['rate_median']:.1f}{pattern} | L2 "
          f"{l2['rate_median']:6.1f} | inner-loop limit {limit} | elements vs fp32 "
          f"{row['elements_vs_fp32_paired']:.2f}x{fp8} | {v['bound']}, {'met' if v['met'] else 'NOT met'}",
          flush=True)


def bench_isa_matrix(plan: Plan) -> Dict[str, object]:
    isas = supported_isas()
    fma = {isa: fma_ceiling(tuple(FMA_FLAGS[isa])) for isa in isas}
    print("fp32 multiply-adds/s, two threads: "
          + ", ".join(f"{isa} {v / 1e9:.1f} G" if v else f"{isa} n/a" for isa, v in fma.items()), flush=True)
    widen = {isa: widen_limits(isa) for isa in isas}
    for isa, limits in widen.items():
        if limits:
            print(f"inner-loop limit, two threads, {isa} (G elements/s, 1 / 4 queries per KV head): "
                  + ", ".join(f"{name} " + " / ".join(f"{limits[(name, g)] / 1e9:.1f}" if (name, g) in limits
                                                       else "n/a" for g in (1, 4))
                              for name in DTYPES), flush=True)
    sizes = sorted({run_kib(kv_heads, dtype.itemsize) for kv_heads in KV_HEADS for dtype in DTYPES.values()})
    ceilings = paged_read_ceilings(sizes)
    if ceilings:
        print("paged-read ceiling, two threads (% of a sequential read): "
              + ", ".join(f"{kib} KiB runs {pct:.1f}%" for kib, pct in ceilings.items()), flush=True)
    read = zeros_huge_pages((READ_BYTES // 4,), torch.float32)
    read.fill_(1.0)
    decode = [row for kv_heads in KV_HEADS for row in bench_layout(kv_heads, isas, fma, widen, plan, read, ceilings)]
    del read
    return {"cpu": cpu_details(), "isas": isas, "fma_per_s_two_threads": fma,
            "inner_loop_elements_per_s_two_threads": {
                isa: {f"{name}/G{group}": rate for (name, group), rate in limits.items()} if limits else None
                for isa, limits in widen.items()},
            "paged_read_ceiling_pct": ceilings,
            "decode": decode,
            "multi_token": bench_multi_token_isas(isas, fma, plan)}
