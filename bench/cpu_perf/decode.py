"""Decode: the main rows (huge-page and plain pools, bf16 also on the kernel without bf16 dot
products), batch 1 at 32k with 1 and N threads, and the cache-resident diagnostic (L3, L2)."""

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

import paged_attention_ext as pa
from paged_attention_ext import reference

from common.timing import Candidate, time_interleaved_samples

from .config import (BATCH, BLOCK_SIZE, CONTEXT, DTYPES, HEAD_SIZE, KV_HEADS, L3_CONTEXT,
                     LONG_CONTEXT, LONG_KV_HEADS, NUM_HEADS, POOL_BYTES, READ_BYTES, TOLERANCE,
                     Plan)
from .machine import (Memory, Pool, lower_isa, rate_summary, ratios, read_candidate, regimes,
                      with_isa, with_threads)

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
