"""CPU kernels against the machine's limits (issue 5): bandwidth, FLOP/s and copy speed.

Usage: ``.venv/bin/python bench/bench_cpu_perf.py [--quick] [--out PATH] [--no-plots]``

Every paged-attention configuration is timed round-robin (``timing.py``) together with a
reference that runs in the same rounds, so both see the same machine load:

* read bandwidth: ``torch.sum`` over a 1 GiB fp32 tensor (32x the L3), bytes read per second;
* matmul: ``torch.mm`` of two 4096 x 4096 matrices of the attention's dtype (2 n^3 FLOP);
* copy: ``dst.copy_(src)`` of 256 MiB (payload bytes per second).

Ratios are reported three ways: ``paired`` = median over rounds of (candidate / reference
in the same round), the headline because bandwidth on a shared host moves in bursts;
``median`` = candidate median / reference median; ``best`` = candidate median / the
reference's best round (the strictest reading). Effective KV bandwidth is the bytes of K
and V a decode step must read, ``B * ctx * kv_heads * D * 2 * element_size`` (bytes of the
16-bit cache for bf16/fp16), over the per-call time.

Memory: every KV cache is a view into two 1 GiB pools (K and V) allocated once with
``zeros_huge_pages`` (the engine's allocation: transparent huge pages) and refilled with
random values per dtype; the main decode rows are also run on a copy in a 2 x 512 MiB
pool from plain ``torch.zeros`` (4 KiB pages) with the same values and block table.
A configuration's pool is exactly its sequences' blocks, in a random physical order.
Allocating once also avoids repeated multi-GiB alloc/free churn, which on this VM
(memory handed back to the host) disturbs later timings.

Sections: decode (fp32/bf16/fp16 x 32/32 and 32/8 heads, B=16, ctx 2048, block 16),
context sweep 512..32k (B=16, or the largest B whose K fits the 1 GiB pool), batch 1 at
32k with 1 and 2 threads, block-size sweep 1..256, a diagnostic with the KV resident in
L3 (the kernel's speed with DRAM out of the way), multi-token GFLOP/s against matmul,
and write_kv / copy_blocks / swap_blocks against a copy. Writes
``bench/results/cpu_perf.json`` and ``cpu_perf_context.png`` / ``cpu_perf_block_size.png``.
"""

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import paged_attention_ext as pa
from paged_attention_ext import reference
from paged_attention_ext.host_memory import zeros_huge_pages

from bench_attention import machine_info
from timing import Candidate, summarize, time_interleaved_samples

NUM_HEADS = 32
HEAD_SIZE = 128
BATCH = 16
CONTEXT = 2048
BLOCK_SIZE = 16
KV_HEADS = (32, 8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-3}

MIB = 1 << 20
GIB = 1 << 30
POOL_BYTES = GIB  # each of the K and V pools (huge pages)
PLAIN_POOL_BYTES = 512 * MIB  # each of the plain-allocation K and V pools
READ_BYTES = GIB
COPY_BYTES = 256 * MIB

CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_SERIES = (("fp32", 32), ("fp32", 8), ("bf16", 32), ("bf16", 8))
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
L3_CONTEXT = 512
LONG_CONTEXT = 32768
LONG_KV_HEADS = (32, 8)

MT_SEQ_LEN = 4096
MT_QUERIES = 512
MT_KV_HEADS = 8
MT_DTYPES = ("fp32", "bf16")
MATMUL_N = 4096

CACHE_KV_HEADS = 8

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "cpu_perf.json"

# Issue 5's thresholds, in percent.
DECODE_TARGET = {"fp32": 80.0, "bf16": 70.0, "fp16": 70.0}
LONG_TARGET = 70.0
BLOCK_TARGET = 70.0
MT_TARGET = 50.0
COPY_TARGET = 80.0


@dataclass(frozen=True)
class Plan:
    warmup: int
    decode_reps: int
    sweep_reps: int
    long_reps: int
    mt_reps: int
    cache_op_reps: int


FULL = Plan(warmup=2, decode_reps=60, sweep_reps=30, long_reps=30, mt_reps=9, cache_op_reps=50)
QUICK = Plan(warmup=1, decode_reps=4, sweep_reps=2, long_reps=3, mt_reps=2, cache_op_reps=4)


# --- memory ---------------------------------------------------------------------------------


class Pool:
    """One allocation of ``nbytes``, viewed as caches of any dtype and shape."""

    def __init__(self, nbytes: int, huge: bool):
        self.nbytes = nbytes
        self.huge = huge
        self.raw = zeros_huge_pages((nbytes,), torch.uint8) if huge else torch.zeros(nbytes, dtype=torch.uint8)

    def tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        count = math.prod(shape)
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"{tuple(shape)} {dtype} does not fit a {self.nbytes >> 20} MiB pool")
        return self.raw.view(dtype)[:count].view(tuple(shape))

    def fill(self, pattern: torch.Tensor) -> None:
        """Tile ``pattern`` (1-D, the dtype to store) over the whole pool."""
        flat = self.raw.view(pattern.dtype)
        period = pattern.numel()
        whole = flat.numel() // period
        flat[: whole * period].view(whole, period).copy_(pattern.expand(whole, period))
        flat[whole * period:].copy_(pattern[: flat.numel() - whole * period])


def random_pattern(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((1 << 20) + 3, generator=gen).to(dtype)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``tensor`` (from /proc/self/smaps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return -1
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@dataclass
class Memory:
    key: Pool
    value: Pool
    plain_key: Pool
    plain_value: Pool
    read: torch.Tensor  # fp32, READ_BYTES, huge pages
    read_plain: torch.Tensor  # fp32, READ_BYTES, plain torch.ones (4 KiB pages)
    copy_src: torch.Tensor  # fp32, COPY_BYTES, huge pages
    copy_dst: torch.Tensor
    filled: Optional[str] = None

    def fill(self, dtype_name: str, plain: bool = False) -> None:
        """Random values of ``dtype_name`` in the K/V pools (and the plain ones, same values)."""
        if self.filled == (dtype_name, plain) or self.filled == (dtype_name, True):
            return
        dtype = DTYPES[dtype_name]
        k, v = random_pattern(dtype, 1), random_pattern(dtype, 2)
        pools = [(self.key, k), (self.value, v)]
        if plain:
            pools += [(self.plain_key, k), (self.plain_value, v)]
        for pool, pattern in pools:
            pool.fill(pattern)
        self.filled = (dtype_name, plain)


def allocate() -> Memory:
    mem = Memory(Pool(POOL_BYTES, True), Pool(POOL_BYTES, True), Pool(PLAIN_POOL_BYTES, False),
                 Pool(PLAIN_POOL_BYTES, False), zeros_huge_pages((READ_BYTES // 4,), torch.float32),
                 torch.ones(READ_BYTES // 4),
                 zeros_huge_pages((COPY_BYTES // 4,), torch.float32),
                 zeros_huge_pages((COPY_BYTES // 4,), torch.float32))
    mem.read.fill_(1.0)
    mem.copy_src.copy_(random_pattern(torch.float32, 3).repeat(COPY_BYTES // 4 // ((1 << 20) + 3) + 1)[: COPY_BYTES // 4])
    return mem


def memory_info(mem: Memory) -> Dict[str, object]:
    def mib(t: torch.Tensor) -> float:
        return round(huge_page_bytes(t) / MIB, 1)
    return {
        "thp_enabled": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
        "huge_page_mib": {"key_pool": mib(mem.key.raw), "value_pool": mib(mem.value.raw),
                          "plain_key_pool": mib(mem.plain_key.raw),
                          "plain_value_pool": mib(mem.plain_value.raw), "read": mib(mem.read),
                          "read_plain": mib(mem.read_plain),
                          "copy_src": mib(mem.copy_src), "copy_dst": mib(mem.copy_dst)},
    }


# --- statistics -----------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def rate_summary(samples: List[float], amount: float) -> Dict[str, float]:
    """Times and ``amount`` per second (GB/s for bytes, GFLOP/s for FLOPs) of one candidate."""
    t = summarize(samples)
    return {"median_s": t.median_s, "min_s": t.min_s, "reps": t.reps,
            "rate_median": amount / t.median_s / 1e9, "rate_best": amount / t.min_s / 1e9}


def ratios(samples: List[float], amount: float, ref_samples: List[float],
           ref_amount: float) -> Dict[str, float]:
    """Candidate rate as % of the reference rate: paired per round, median/median, median/best."""
    per_round = [(amount / a) / (ref_amount / b) for a, b in zip(samples, ref_samples)]
    med, ref_med, ref_best = (statistics.median(samples), statistics.median(ref_samples),
                              min(ref_samples))
    return {"pct_paired": 100 * statistics.median(per_round),
            "pct_median": 100 * (amount / med) / (ref_amount / ref_med),
            "pct_best": 100 * (amount / med) / (ref_amount / ref_best)}


REGIME_GBPS = 60.0  # read bandwidth that splits the host's slow and fast states


def regimes(samples: List[float], amount: int, read_samples: List[float]) -> Dict[str, object]:
    """The candidate's GB/s and paired % in rounds whose read was below / above REGIME_GBPS."""
    out: Dict[str, object] = {}
    for name, keep in (("read_below", lambda g: g < REGIME_GBPS),
                       ("read_above", lambda g: g >= REGIME_GBPS)):
        rounds = [(a, b) for a, b in zip(samples, read_samples) if keep(gbps(READ_BYTES, b))]
        if rounds:
            out[name] = {"rounds": len(rounds),
                         "read_gbps_median": statistics.median(gbps(READ_BYTES, b) for _, b in rounds),
                         "rate_median": statistics.median(gbps(amount, a) for a, _ in rounds),
                         "pct_paired": 100 * statistics.median(
                             (amount / a) / (READ_BYTES / b) for a, b in rounds)}
        else:
            out[name] = {"rounds": 0}
    return {"threshold_gbps": REGIME_GBPS, **out}


def load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- decode cases ---------------------------------------------------------------------------


@dataclass
class DecodeCase:
    dtype_name: str
    batch: int
    kv_heads: int
    context: int
    block_size: int
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        return (self.batch * self.context * self.kv_heads * HEAD_SIZE * 2
                * DTYPES[self.dtype_name].itemsize)

    @property
    def flops(self) -> int:
        """4 * H * D per query-key pair (q.k and p.v multiply-adds)."""
        return 4 * NUM_HEADS * HEAD_SIZE * self.batch * self.context

    def run(self) -> torch.Tensor:
        return pa.attention(self.query, self.key_cache, self.value_cache, self.block_tables,
                            self.seq_lens, HEAD_SIZE**-0.5)

    def describe(self) -> Dict[str, object]:
        return {"dtype": self.dtype_name, "batch": self.batch, "num_heads": NUM_HEADS,
                "num_kv_heads": self.kv_heads, "head_size": HEAD_SIZE, "context": self.context,
                "block_size": self.block_size, "kv_bytes": self.kv_bytes}


def decode_case(key_pool: Pool, value_pool: Pool, dtype_name: str, batch: int, kv_heads: int,
                context: int, block_size: int, like: Optional[DecodeCase] = None) -> DecodeCase:
    """A decode step over ``key_pool``/``value_pool``; ``like`` shares its query and block table."""
    dtype = DTYPES[dtype_name]
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, kv_heads, block_size, HEAD_SIZE)
    if like is None:
        table = torch.randperm(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
        query = torch.randn(batch, NUM_HEADS, HEAD_SIZE).to(dtype)
    else:
        table, query = like.block_tables, like.query
    return DecodeCase(dtype_name, batch, kv_heads, context, block_size, query,
                      key_pool.tensor(dtype, shape), value_pool.tensor(dtype, shape), table,
                      torch.full((batch,), context, dtype=torch.int32))


def cache_resident(case: DecodeCase) -> DecodeCase:
    """``case`` with every sequence reading the first sequence's blocks (the L3-resident
    diagnostic: same arithmetic and byte count, far fewer distinct bytes)."""
    shared = case.block_tables[:1].expand(case.batch, -1).contiguous()
    return DecodeCase(**{**case.__dict__, "block_tables": shared})


def core_resident(case: DecodeCase, distinct_bytes: int = 256 << 10) -> DecodeCase:
    """``case`` with every block table cycling over the first few physical blocks, about
    ``distinct_bytes`` of K and V in all: the KV stays in each core's L2, so the time is
    the kernel's arithmetic (the compute-bound diagnostic)."""
    block_bytes = 2 * case.key_cache[0].numel() * case.key_cache.element_size()
    distinct = max(1, distinct_bytes // block_bytes)
    table = (torch.arange(case.block_tables.numel()) % distinct).to(torch.int32)
    return DecodeCase(**{**case.__dict__, "block_tables": table.view_as(case.block_tables)})


def check_decode(case: DecodeCase, out: torch.Tensor) -> float:
    """Max abs error of sequence 0 of ``out`` against the plain-PyTorch reference."""
    expected = reference.attention(case.query[:1], case.key_cache, case.value_cache,
                                   case.block_tables[:1], case.seq_lens[:1], HEAD_SIZE**-0.5)
    error = (out[:1].float() - expected.float()).abs().max().item()
    if error > TOLERANCE[case.dtype_name]:
        raise AssertionError(f"paged decode {case.describe()} differs from reference by {error:.3g}")
    return error


def fit_batch(bytes_per_token: int, context: int) -> int:
    """B=16, or the largest batch whose K (or V) fits one pool."""
    return max(1, min(BATCH, POOL_BYTES // (bytes_per_token * context)))


def read_candidate(mem: Memory) -> Candidate:
    return mem.read.sum


# --- sections -------------------------------------------------------------------------------


def bench_decode(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """Main decode rows: huge-page pools and plain pools side by side with the read sum."""
    rows = []
    for dtype_name in DTYPES:
        mem.fill(dtype_name, plain=True)
        for kv_heads in KV_HEADS:
            huge = decode_case(mem.key, mem.value, dtype_name, BATCH, kv_heads, CONTEXT, BLOCK_SIZE)
            plain = decode_case(mem.plain_key, mem.plain_value, dtype_name, BATCH, kv_heads,
                                CONTEXT, BLOCK_SIZE, like=huge)
            out_huge = huge.run()
            if not torch.equal(out_huge, plain.run()):
                raise AssertionError("huge-page and plain pools give different results")
            error = check_decode(huge, out_huge)
            candidates = {"paged_huge": huge.run, "paged_plain": plain.run,
                          "read": read_candidate(mem), "read_plain": mem.read_plain.sum}
            lower = lower_isa() if dtype_name == "bf16" else None
            if lower:
                candidates[f"paged_huge_{lower}"] = with_isa(lower, huge.run)
            s = time_interleaved_samples(candidates, plan.warmup, plan.decode_reps)
            kv = huge.kv_bytes
            rows.append({
                **huge.describe(), "max_abs_error_seq0": error, "decode_gflop": huge.flops / 1e9,
                "paged_huge_gflops_median": huge.flops / statistics.median(s["paged_huge"]) / 1e9,
                "read_bandwidth": rate_summary(s["read"], READ_BYTES),
                "read_bandwidth_plain_pages": rate_summary(s["read_plain"], READ_BYTES),
                "paged_huge": rate_summary(s["paged_huge"], kv)
                | ratios(s["paged_huge"], kv, s["read"], READ_BYTES),
                "paged_plain": rate_summary(s["paged_plain"], kv)
                | ratios(s["paged_plain"], kv, s["read"], READ_BYTES),
                "huge_vs_plain_speedup_paired": statistics.median(
                    p / h for p, h in zip(s["paged_plain"], s["paged_huge"])),
                **({f"speedup_over_{lower}_paired": statistics.median(
                    o / h for o, h in zip(s[f"paged_huge_{lower}"], s["paged_huge"]))} if lower else {}),
                "by_read_regime": regimes(s["paged_huge"], kv, s["read"]),
                "samples_s": s,
            })
            print_decode_row(rows[-1])
    return rows


def time_sweep(mem: Memory, plan: Plan, cases: Dict[int, DecodeCase],
               prefix: str) -> Tuple[List[Dict[str, object]], List[float]]:
    """Every case of a sweep in one round-robin with the read sum: one point per case
    (description, rate, % of read) and the read's samples."""
    s = time_interleaved_samples({f"{prefix}{k}": case.run for k, case in cases.items()}
                                 | {"read": read_candidate(mem)}, plan.warmup, plan.sweep_reps)
    points = []
    for k, case in cases.items():
        name = f"{prefix}{k}"
        points.append({**case.describe(), **rate_summary(s[name], case.kv_bytes),
                       **ratios(s[name], case.kv_bytes, s["read"], READ_BYTES)})
    return points, s["read"]


def bench_context_sweep(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """Per series, every context length in one round-robin with the read sum."""
    series = []
    for dtype_name, kv_heads in SWEEP_SERIES:
        mem.fill(dtype_name)
        token_bytes = kv_heads * HEAD_SIZE * DTYPES[dtype_name].itemsize
        cases = {ctx: decode_case(mem.key, mem.value, dtype_name, fit_batch(token_bytes, ctx),
                                  kv_heads, ctx, BLOCK_SIZE) for ctx in CONTEXTS}
        points, read = time_sweep(mem, plan, cases, "ctx")
        series.append({"dtype": dtype_name, "num_kv_heads": kv_heads,
                       "read_bandwidth": rate_summary(read, READ_BYTES), "points": points})
        print_sweep(series[-1], "context")
    return series


def bench_cache_resident(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """Diagnostic: the kernel's speed when its KV is L3- or L2-resident, beside the same
    shape from DRAM.

    B=16 sequences of 512 tokens; ``l3`` points all 16 block tables at the same 32 blocks
    (16 MiB of distinct KV in fp32 32/32, 4 MiB in 32/8; L3 is 32 MiB), ``l2`` cycles every
    table over 256 KiB of blocks (each core's L2 holds it: the arithmetic alone), ``dram``
    gives each sequence its own blocks. All do the same arithmetic on the same number of bytes.
    """
    rows = []
    for dtype_name in DTYPES:
        mem.fill(dtype_name)
        for kv_heads in KV_HEADS:
            dram = decode_case(mem.key, mem.value, dtype_name, BATCH, kv_heads, L3_CONTEXT,
                               BLOCK_SIZE)
            l3 = cache_resident(dram)
            l2 = core_resident(dram)
            check_decode(l3, l3.run())
            check_decode(l2, l2.run())
            distinct = L3_CONTEXT * kv_heads * HEAD_SIZE * 2 * DTYPES[dtype_name].itemsize
            # The L3 case runs in its own loop: interleaved with the 1 GiB read it would
            # always start from a cache the read has just flushed.
            s = time_interleaved_samples({"dram": dram.run, "read": read_candidate(mem)},
                                         plan.warmup, plan.decode_reps)
            s_l3 = time_interleaved_samples({"l3": l3.run}, plan.warmup, plan.decode_reps)["l3"]
            s_l2 = time_interleaved_samples({"l2": l2.run}, plan.warmup, plan.decode_reps)["l2"]
            kv = dram.kv_bytes
            rows.append({**dram.describe(), "l3_distinct_kv_bytes": distinct,
                         "read_bandwidth": rate_summary(s["read"], READ_BYTES),
                         "l3": rate_summary(s_l3, kv),
                         "dram": rate_summary(s["dram"], kv)
                         | ratios(s["dram"], kv, s["read"], READ_BYTES),
                         "l2": rate_summary(s_l2, kv),
                         "l3_gflops_median": dram.flops / statistics.median(s_l3) / 1e9,
                         "l2_gflops_median": dram.flops / statistics.median(s_l2) / 1e9,
                         "l3_speedup_median": statistics.median(s["dram"]) / statistics.median(s_l3)})
            r = rows[-1]
            print(f"cache-resident {dtype_name} 32/{kv_heads:<2} | L2 {r['l2']['rate_median']:5.1f} GB/s "
                  f"({r['l2_gflops_median']:.0f} GFLOP/s) | L3 {r['l3']['rate_median']:5.1f} GB/s "
                  f"({r['l3_gflops_median']:.0f} GFLOP/s) | DRAM {r['dram']['rate_median']:5.1f} GB/s "
                  f"{r['dram']['pct_paired']:4.0f}% of read | L3/DRAM {r['l3_speedup_median']:.2f}x | "
                  f"read {r['read_bandwidth']['rate_median']:.1f}", flush=True)
    return rows


def lower_isa() -> Optional[str]:
    """The kernel without bf16 dot products, when the best one has them (bf16 rows only)."""
    return "avx512" if pa.cpu_isa() == "avx512_bf16" else None


def with_isa(isa: str, fn: Candidate) -> Candidate:
    """``fn`` with the kernel forced to ``isa`` (the library reads the variable per call)."""
    def call():
        os.environ["PAGED_ATTENTION_CPU_ISA"] = isa
        try:
            return fn()
        finally:
            del os.environ["PAGED_ATTENTION_CPU_ISA"]
    return call


def with_threads(threads: int, fn: Candidate) -> Candidate:
    def call():
        torch.set_num_threads(threads)
        return fn()
    return call


def bench_long_context(mem: Memory, plan: Plan, threads: int) -> Dict[str, object]:
    """Batch 1 at 32k tokens, fp32, with 1 and ``threads`` threads, and the read sum with each."""
    mem.fill("fp32")
    cases = {h: decode_case(mem.key, mem.value, "fp32", 1, h, LONG_CONTEXT, BLOCK_SIZE)
             for h in LONG_KV_HEADS}
    for case in cases.values():
        check_decode(case, case.run())
    candidates: Dict[str, Candidate] = {}
    for h, case in cases.items():
        candidates[f"kvh{h}_t{threads}"] = with_threads(threads, case.run)
        candidates[f"kvh{h}_t1"] = with_threads(1, case.run)
    candidates[f"read_t{threads}"] = with_threads(threads, read_candidate(mem))
    candidates["read_t1"] = with_threads(1, read_candidate(mem))
    s = time_interleaved_samples(candidates, plan.warmup, plan.long_reps)
    torch.set_num_threads(threads)
    read_name = f"read_t{threads}"
    rows = []
    for h, case in cases.items():
        kv = case.kv_bytes
        many, one = s[f"kvh{h}_t{threads}"], s[f"kvh{h}_t1"]
        rows.append({
            **case.describe(),
            f"threads_{threads}": rate_summary(many, kv) | ratios(many, kv, s[read_name], READ_BYTES),
            "threads_1": rate_summary(one, kv) | ratios(one, kv, s["read_t1"], READ_BYTES),
            "speedup_paired": statistics.median(a / b for a, b in zip(one, many)),
        })
    result = {"threads": threads, f"read_bandwidth_t{threads}": rate_summary(s[read_name], READ_BYTES),
              "read_bandwidth_t1": rate_summary(s["read_t1"], READ_BYTES), "rows": rows}
    print_long(result)
    return result


def bench_block_sweep(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """Per series, every block size in one round-robin with the read sum."""
    series = []
    for dtype_name, kv_heads in SWEEP_SERIES:
        mem.fill(dtype_name)
        cases = {bs: decode_case(mem.key, mem.value, dtype_name, BATCH, kv_heads, CONTEXT, bs)
                 for bs in BLOCK_SIZES}
        check_decode(cases[BLOCK_SIZES[0]], cases[BLOCK_SIZES[0]].run())
        points, read = time_sweep(mem, plan, cases, "bs")
        best = max(p["rate_median"] for p in points)
        best_paired = max(p["pct_paired"] for p in points)
        for p in points:
            p["pct_of_best"] = 100 * p["rate_median"] / best
            p["pct_of_best_read_normalized"] = 100 * p["pct_paired"] / best_paired
        series.append({"dtype": dtype_name, "num_kv_heads": kv_heads,
                       "read_bandwidth": rate_summary(read, READ_BYTES), "points": points})
        print_sweep(series[-1], "block_size")
    return series


def visible_pairs(seq_len: int, queries: int) -> int:
    """Causal query-key pairs of the last ``queries`` positions of a ``seq_len`` sequence."""
    return sum(p + 1 for p in range(seq_len - queries, seq_len))


@dataclass
class MultiTokenCase:
    """A 512-token chunk over 4096 cached tokens (32/8 heads), causal."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    out: torch.Tensor

    @property
    def flops(self) -> int:
        return 4 * NUM_HEADS * HEAD_SIZE * visible_pairs(MT_SEQ_LEN, MT_QUERIES)

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                HEAD_SIZE**-0.5, self.query_start_loc)

    def run(self) -> torch.Tensor:
        return pa.attention_out(self.out, *self.args())


def multi_token_case(key_pool: Pool, value_pool: Pool, dtype_name: str) -> MultiTokenCase:
    dtype = DTYPES[dtype_name]
    num_blocks = MT_SEQ_LEN // BLOCK_SIZE
    shape = (num_blocks, MT_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    query = torch.randn(MT_QUERIES, NUM_HEADS, HEAD_SIZE).to(dtype)
    return MultiTokenCase(query, key_pool.tensor(dtype, shape), value_pool.tensor(dtype, shape),
                          torch.randperm(num_blocks, dtype=torch.int32).view(1, -1),
                          torch.tensor([MT_SEQ_LEN], dtype=torch.int32),
                          torch.tensor([0, MT_QUERIES], dtype=torch.int32), torch.empty_like(query))


def bench_multi_token(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """A 512-token chunk over 4096 tokens (32/8 heads) against torch.mm, same dtype."""
    rows = []
    for dtype_name in MT_DTYPES:
        dtype = DTYPES[dtype_name]
        mem.fill(dtype_name)
        case = multi_token_case(mem.key, mem.value, dtype_name)
        expected = reference.attention(*case.args())
        error = (case.run().float() - expected.float()).abs().max().item()
        if error > 10 * TOLERANCE[dtype_name]:
            raise AssertionError(f"multi-token {dtype_name} differs from reference by {error:.3g}")
        a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        c = torch.empty(MATMUL_N, MATMUL_N, dtype=dtype)
        flops = case.flops
        mm_flops = 2 * MATMUL_N**3
        s = time_interleaved_samples({"paged": case.run, "matmul": lambda: torch.mm(a, b, out=c)},
                                     plan.warmup, plan.mt_reps)
        rows.append({"dtype": dtype_name, "seq_len": MT_SEQ_LEN, "queries": MT_QUERIES,
                     "num_heads": NUM_HEADS, "num_kv_heads": MT_KV_HEADS, "head_size": HEAD_SIZE,
                     "block_size": BLOCK_SIZE, "flops": flops, "matmul_n": MATMUL_N,
                     "max_abs_error": error, "paged": rate_summary(s["paged"], flops)
                     | ratios(s["paged"], flops, s["matmul"], mm_flops),
                     "matmul": rate_summary(s["matmul"], mm_flops)})
        print_multi_token(rows[-1])
    return rows


def compare_to_copy(mem: Memory, name: str, op: Candidate, payload: int, plan: Plan,
                    extra: Optional[Dict[str, Candidate]] = None) -> Dict[str, object]:
    """Time ``op`` (and ``extra`` diagnostics, same payload) with a copy and the read sum."""
    extra = extra or {}
    s = time_interleaved_samples({name: op, **extra,
                                  "copy": lambda: mem.copy_dst.copy_(mem.copy_src),
                                  "read": read_candidate(mem)}, plan.warmup, plan.cache_op_reps)
    row = {"op": name, "payload_bytes": payload,
           name: rate_summary(s[name], payload) | ratios(s[name], payload, s["copy"], COPY_BYTES),
           "copy": rate_summary(s["copy"], COPY_BYTES),
           "read_bandwidth": rate_summary(s["read"], READ_BYTES)}
    for other in extra:
        row[other] = rate_summary(s[other], payload) | ratios(s[other], payload, s["copy"], COPY_BYTES)
    print_cache_op(row)
    return row


def bench_cache_ops(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """write_kv, copy_blocks, swap_blocks (fp32, 8 KV heads, block 16) of 256 MiB each."""
    mem.fill("fp32")
    block_shape = (CACHE_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    block_bytes = math.prod(block_shape) * 4
    pool_blocks = POOL_BYTES // block_bytes
    key_cache = mem.key.tensor(torch.float32, (pool_blocks, *block_shape))
    value_cache = mem.value.tensor(torch.float32, (pool_blocks, *block_shape))
    rows = []

    # write_kv: COPY_BYTES of K+V for tokens scattered over the 1 GiB pools.
    tokens = COPY_BYTES // (2 * CACHE_KV_HEADS * HEAD_SIZE * 4)
    # The inputs are the copy's source bytes, so both read the same memory.
    key, value = mem.copy_src.view(2, tokens, CACHE_KV_HEADS, HEAD_SIZE)
    slots = torch.randperm(pool_blocks * BLOCK_SIZE)[:tokens]
    sequential = torch.arange(tokens)  # diagnostic: the same op writing consecutive slots
    rows.append(compare_to_copy(mem, "write_kv",
                                lambda: pa.write_kv(key, value, key_cache, value_cache, slots),
                                COPY_BYTES, plan,
                                {"write_kv_sequential_slots": lambda: pa.write_kv(
                                    key, value, key_cache, value_cache, sequential)}))

    # copy_blocks: 4 layers of 256 MiB K and V caches, COPY_BYTES over all of them.
    layers = 4
    layer_blocks = pool_blocks // layers
    key_caches = list(key_cache.split(layer_blocks))
    value_caches = list(value_cache.split(layer_blocks))
    pairs = COPY_BYTES // (block_bytes * 2 * layers)
    src, dst = torch.randperm(layer_blocks)[: 2 * pairs].view(2, pairs)
    mapping = torch.stack([src, dst], dim=1)
    rows.append(compare_to_copy(mem, "copy_blocks",
                                lambda: pa.copy_blocks(key_caches, value_caches, mapping),
                                COPY_BYTES, plan))

    # swap_blocks: COPY_BYTES of random blocks from the K pool to random blocks of the V pool.
    pairs = COPY_BYTES // block_bytes
    mapping = torch.stack([torch.randperm(pool_blocks)[:pairs], torch.randperm(pool_blocks)[:pairs]],
                          dim=1)
    rows.append(compare_to_copy(mem, "swap_blocks",
                                lambda: pa.swap_blocks(key_cache, value_cache, mapping),
                                COPY_BYTES, plan))
    return rows


# --- targets --------------------------------------------------------------------------------


def target(name: str, config: str, measured: float, threshold: float, unit: str,
           detail: str) -> Dict[str, object]:
    return {"target": name, "config": config, "measured": round(measured, 1),
            "threshold": threshold, "unit": unit, "pass": measured >= threshold, "detail": detail}


def evaluate(report: Dict[str, object]) -> List[Dict[str, object]]:
    targets = []
    for row in report["decode"]:
        h = row["paged_huge"]
        targets.append(target(
            "decode % of read BW", f"{row['dtype']} 32/{row['num_kv_heads']} B=16 ctx 2048 bs 16",
            h["pct_paired"], DECODE_TARGET[row["dtype"]], "% (paired)",
            f"{h['rate_median']:.1f} GB/s; median/median {h['pct_median']:.0f}%, "
            f"vs best read {h['pct_best']:.0f}%; plain 4K pages {row['paged_plain']['pct_paired']:.0f}%"))
    long = report["long_context"]
    t = long["threads"]
    for row in long["rows"]:
        if row["num_kv_heads"] not in KV_HEADS:
            continue
        many = row[f"threads_{t}"]
        targets.append(target(
            "B=1 ctx 32k % of read BW", f"fp32 32/{row['num_kv_heads']}, {t} threads",
            many["pct_paired"], LONG_TARGET, "% (paired)",
            f"{many['rate_median']:.1f} GB/s; {t} vs 1 thread {row['speedup_paired']:.2f}x"))
    for series in report["block_sweep"]:
        eligible = [p for p in series["points"] if p["block_size"] >= 8]
        worst = min(eligible, key=lambda p: p["pct_of_best"])
        worst_norm = min(p["pct_of_best_read_normalized"] for p in eligible)
        best = max(series["points"], key=lambda p: p["rate_median"])
        targets.append(target(
            "block size >= 8 vs best", f"{series['dtype']} 32/{series['num_kv_heads']}",
            worst["pct_of_best"], BLOCK_TARGET, "% of best",
            f"worst bs {worst['block_size']}, best bs {best['block_size']} "
            f"({best['rate_median']:.1f} GB/s); read-normalized worst {worst_norm:.0f}%"))
    for row in report["multi_token"]:
        p = row["paged"]
        targets.append(target(
            "multi-token % of matmul", f"{row['dtype']} 512 q over 4096, 32/8",
            p["pct_paired"], MT_TARGET, "% (paired)",
            f"{p['rate_median']:.0f} GFLOP/s vs mm {row['matmul']['rate_median']:.0f} GFLOP/s"))
    for row in report["cache_ops"]:
        op = row[row["op"]]
        targets.append(target(
            f"{row['op']} % of copy", f"fp32 {row['payload_bytes'] >> 20} MiB", op["pct_paired"],
            COPY_TARGET, "% (paired)",
            f"{op['rate_median']:.1f} GB/s vs copy {row['copy']['rate_median']:.1f} GB/s"))
    return targets


# --- printing -------------------------------------------------------------------------------


def print_decode_row(row: Dict[str, object]) -> None:
    h, p, r = row["paged_huge"], row["paged_plain"], row["read_bandwidth"]
    print(f"decode {row['dtype']} 32/{row['num_kv_heads']:<2} | huge {h['median_s'] * 1e3:6.2f} ms "
          f"{h['rate_median']:5.1f} GB/s {h['pct_paired']:4.0f}% (med {h['pct_median']:3.0f}%, "
          f"best {h['pct_best']:3.0f}%) | plain {p['rate_median']:5.1f} GB/s {p['pct_paired']:4.0f}% | "
          f"huge/plain {row['huge_vs_plain_speedup_paired']:.2f}x | read {r['rate_median']:.1f} "
          f"(best {r['rate_best']:.1f}, 4K pages {row['read_bandwidth_plain_pages']['rate_median']:.1f}) "
          f"| {row['paged_huge_gflops_median']:.0f} GFLOP/s", flush=True)
    for key, value in row.items():
        if key.startswith("speedup_over_"):
            print(f"  {key}: {value:.2f}x", flush=True)


def print_sweep(series: Dict[str, object], key: str) -> None:
    r = series["read_bandwidth"]
    print(f"{key} sweep {series['dtype']} 32/{series['num_kv_heads']}: read {r['rate_median']:.1f} "
          f"GB/s (best {r['rate_best']:.1f})", flush=True)
    for p in series["points"]:
        extra = f" {p['pct_of_best']:4.0f}% of best" if "pct_of_best" in p else ""
        print(f"  {key}={p[key]:<6} B={p['batch']:<2} {p['median_s'] * 1e3:7.2f} ms "
              f"{p['rate_median']:5.1f} GB/s {p['pct_paired']:4.0f}% of read{extra}", flush=True)


def print_long(result: Dict[str, object]) -> None:
    t = result["threads"]
    r1, rt = result["read_bandwidth_t1"], result[f"read_bandwidth_t{t}"]
    print(f"B=1 ctx {LONG_CONTEXT} fp32: read {rt['rate_median']:.1f} GB/s ({t} threads), "
          f"{r1['rate_median']:.1f} GB/s (1 thread)")
    for row in result["rows"]:
        m, o = row[f"threads_{t}"], row["threads_1"]
        print(f"  32/{row['num_kv_heads']:<2} {t}t {m['rate_median']:5.1f} GB/s {m['pct_paired']:4.0f}% "
              f"| 1t {o['rate_median']:5.1f} GB/s {o['pct_paired']:4.0f}% "
              f"of 1-thread read | speedup {row['speedup_paired']:.2f}x", flush=True)


def print_multi_token(row: Dict[str, object]) -> None:
    p, m = row["paged"], row["matmul"]
    print(f"multi-token {row['dtype']}: {p['median_s'] * 1e3:.1f} ms {p['rate_median']:.0f} GFLOP/s "
          f"vs mm {m['rate_median']:.0f} GFLOP/s: {p['pct_paired']:.0f}% (err {row['max_abs_error']:.2g})",
          flush=True)


def print_cache_op(row: Dict[str, object]) -> None:
    o, c = row[row["op"]], row["copy"]
    print(f"{row['op']:<11} {o['median_s'] * 1e3:6.2f} ms {o['rate_median']:5.1f} GB/s vs copy "
          f"{c['rate_median']:5.1f} GB/s: {o['pct_paired']:4.0f}% (median {o['pct_median']:.0f}%)",
          flush=True)
    for other in row:
        if other.startswith(row["op"] + "_"):
            o = row[other]
            print(f"  {other}: {o['rate_median']:5.1f} GB/s, {o['pct_paired']:4.0f}% of copy", flush=True)


def print_targets(targets: List[Dict[str, object]]) -> None:
    print("\nTargets (paired = median over rounds of candidate / reference in the same round)")
    for t in targets:
        verdict = "PASS" if t["pass"] else "FAIL"
        print(f"  {verdict}  {t['target']:<26} {t['config']:<34} {t['measured']:6.1f} "
              f"(>= {t['threshold']:.0f})  {t['detail']}")


# --- plots ----------------------------------------------------------------------------------


COLORS = {("fp32", 32): "tab:blue", ("fp32", 8): "tab:orange", ("bf16", 32): "tab:green",
          ("bf16", 8): "tab:red"}


def plot_sweep(series_list: List[Dict[str, object]], key: str, path: Path, title: str,
               long: Optional[Dict[str, object]] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 9), sharex=True)
    for series in series_list:
        label = f"{series['dtype']} 32/{series['num_kv_heads']}"
        color = COLORS[(series["dtype"], series["num_kv_heads"])]
        xs = [p[key] for p in series["points"]]
        top.plot(xs, [p["rate_median"] for p in series["points"]], "o-", color=color,
                 label=f"paged {label}")
        read = series["read_bandwidth"]["rate_median"]
        top.plot(xs, [read] * len(xs), "--", color=color, alpha=0.7,
                 label=f"read BW (same rounds as {label})")
        if key == "context":
            for p in series["points"]:
                if p["batch"] != BATCH:
                    top.annotate(f"B={p['batch']}", (p[key], p["rate_median"]), fontsize=7,
                                 color=color, textcoords="offset points", xytext=(3, -10))
            bottom.plot(xs, [p["pct_paired"] for p in series["points"]], "o-", color=color,
                        label=label)
        else:
            bottom.plot(xs, [p["pct_of_best"] for p in series["points"]], "o-", color=color,
                        label=label)
    if key == "context":
        if long is not None:
            t = long["threads"]
            for row in long["rows"]:
                if (row["dtype"], row["num_kv_heads"]) in COLORS:
                    color = COLORS[(row["dtype"], row["num_kv_heads"])]
                    m = row[f"threads_{t}"]
                    top.plot([LONG_CONTEXT], [m["rate_median"]], "*", color=color, markersize=13)
                    bottom.plot([LONG_CONTEXT], [m["pct_paired"]], "*", color=color, markersize=13)
            top.plot([], [], "*", color="gray", markersize=13, label="B=1, 32k")
        for value, style in ((80, "-"), (70, ":")):
            bottom.axhline(value, color="black", linestyle=style, linewidth=1,
                           label=f"target {value}% ({'fp32' if value == 80 else '16-bit, B=1'})")
        bottom.set_ylabel("paged % of read BW (paired, same rounds)")
        bottom.set_xlabel("context (tokens); B=16 unless marked")
    else:
        bottom.axhline(BLOCK_TARGET, color="black", linestyle=":", linewidth=1,
                       label="target 70% (block size >= 8)")
        bottom.axvspan(0.8, 6, color="gray", alpha=0.15)
        bottom.set_ylabel("% of the series' best block size")
        bottom.set_xlabel("block size (tokens); shaded: below 8, no target")
    top.set_ylabel("GB/s (effective KV, median)")
    top.set_title(title)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    xs = [p[key] for p in series_list[0]["points"]]
    bottom.set_xticks(xs)
    bottom.set_xticklabels([str(x) for x in xs])
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads value")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the PNGs from the JSON at --out")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.replot:
        write_plots(json.loads(args.out.read_text()), args.out.parent)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    machine = machine_info()
    print(", ".join(f"{k}={v}" for k, v in machine.items()) + f", loadavg={load()}", flush=True)
    mem = allocate()
    memory = memory_info(mem)
    print(f"memory: {memory}", flush=True)

    sections: Dict[str, float] = {}
    report: Dict[str, object] = {"machine": machine | {"loadavg_at_start": load()}, "memory": memory,
                                 "plan": asdict(plan) | {"quick": args.quick}}

    def section(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        report[name] = fn()
        sections[name] = round(time.perf_counter() - t0, 1)
        print(f"[{name}: {sections[name]} s]\n", flush=True)

    section("decode", lambda: bench_decode(mem, plan))
    section("context_sweep", lambda: bench_context_sweep(mem, plan))
    section("long_context", lambda: bench_long_context(mem, plan, args.threads))
    section("block_sweep", lambda: bench_block_sweep(mem, plan))
    section("cache_resident", lambda: bench_cache_resident(mem, plan))
    section("multi_token", lambda: bench_multi_token(mem, plan))
    section("cache_ops", lambda: bench_cache_ops(mem, plan))
    report["targets"] = evaluate(report)
    report["section_seconds"] = sections
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    print_targets(report["targets"])

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if not args.no_plots:
        write_plots(report, args.out.parent)
    print(f"total {report['total_seconds']} s")


def write_plots(report: Dict[str, object], directory: Path) -> None:
    for key, name, title in (
            ("context", "cpu_perf_context.png",
             "Paged decode vs context (H=32, D=128, block 16), beside read bandwidth"),
            ("block_size", "cpu_perf_block_size.png",
             "Paged decode vs block size (B=16, ctx 2048, H=32, D=128), beside read bandwidth")):
        path = directory / name
        sweep = report["context_sweep" if key == "context" else "block_sweep"]
        plot_sweep(sweep, key, path, title, report["long_context"] if key == "context" else None)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
