"""fp8 KV caches and strided (NHD) layouts against the bf16 HND cache.

Each configuration times, round-robin in the same rounds (``common/timing.py``): the bf16 cache in
HND (the baseline), e4m3 and e5m2 caches in HND (per-layer scales), and the bf16 and e4m3
caches as NHD views (``layouts.from_nhd``). The query is bf16 throughout. Speedups are
paired per round (baseline time / candidate time); the target is fp8 >= 1.5x bf16
(fp8 KV bytes per second >= 75% of bf16's) at B=16, context 2048 and at B=1, context 32k.

Every cache lives in its own huge-page pool (as the engine allocates), filled with random
values (N(0, 1), quantized for fp8 with scale 1), with the blocks in a random physical order;
each candidate is checked against the plain-PyTorch reference first.
"""

import statistics
from typing import Dict, List, Tuple

import torch

import paged_attention_ext as pa
from paged_attention_ext import reference
from paged_attention_ext.layouts import from_nhd

from common.timing import Candidate, time_interleaved_samples

from .config import BATCH, BLOCK_SIZE, CONTEXT, HEAD_SIZE, KV_HEADS, LONG_CONTEXT, NUM_HEADS, Plan
from .machine import Pool, random_pattern, rate_summary
from .report import target

# name -> (cache dtype, layout)
CANDIDATES: Dict[str, Tuple[torch.dtype, str]] = {
    "bf16": (torch.bfloat16, "HND"),
    "e4m3": (torch.float8_e4m3fn, "HND"),
    "e5m2": (torch.float8_e5m2, "HND"),
    "bf16_nhd": (torch.bfloat16, "NHD"),
    "e4m3_nhd": (torch.float8_e4m3fn, "NHD"),
}
BASELINE = "bf16"
FP8_TARGET = 1.5


def make_cache(pool: Pool, dtype: torch.dtype, layout: str, num_blocks: int, kv_heads: int,
               seed: int) -> torch.Tensor:
    pool.fill(random_pattern(dtype, seed))
    if layout == "HND":
        return pool.tensor(dtype, (num_blocks, kv_heads, BLOCK_SIZE, HEAD_SIZE))
    return from_nhd(pool.tensor(dtype, (num_blocks, BLOCK_SIZE, kv_heads, HEAD_SIZE)))


def decode_candidates(batch: int, context: int, kv_heads: int) -> Tuple[Dict[str, Candidate], int]:
    """The candidates of one shape (each checked against the reference on sequence 0) and
    the element count of K and V a decode step reads."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    table = torch.randperm(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_SIZE).bfloat16()
    elements = num_blocks * kv_heads * BLOCK_SIZE * HEAD_SIZE
    candidates: Dict[str, Candidate] = {}
    for name, (dtype, layout) in CANDIDATES.items():
        pools = [Pool(elements * dtype.itemsize, True) for _ in range(2)]
        k, v = (make_cache(p, dtype, layout, num_blocks, kv_heads, seed) for p, seed in zip(pools, (1, 2)))
        scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if dtype.itemsize == 1 else {}

        def run(k=k, v=v, scales=scales, pools=pools):  # the pools live as long as the candidate
            return pa.attention(query, k, v, table, lens, HEAD_SIZE ** -0.5, **scales)

        used = table[0].long()  # sequence 0's blocks only: the reference widens what it gets
        want = reference.attention(query[:1], k[used], v[used],
                                   torch.arange(blocks_per_seq, dtype=torch.int32)[None], lens[:1],
                                   HEAD_SIZE ** -0.5, **scales)
        torch.testing.assert_close(run()[:1].float(), want.float(), atol=2e-2, rtol=2e-2)
        candidates[name] = run
    return candidates, 2 * elements


def summarize_shape(samples: Dict[str, List[float]], elements: int) -> Dict[str, object]:
    base = samples[BASELINE]
    row: Dict[str, object] = {}
    for name, (dtype, layout) in CANDIDATES.items():
        s = samples[name]
        row[name] = rate_summary(s, elements * dtype.itemsize) | {
            "speedup_over_bf16_paired": statistics.median(b / a for a, b in zip(s, base)),
            "dtype": str(dtype).replace("torch.", ""), "layout": layout}
    for fp8 in ("e4m3", "e5m2"):
        row[f"{fp8}_meets_target"] = row[fp8]["speedup_over_bf16_paired"] >= FP8_TARGET
    row["nhd_cost_bf16_paired"] = statistics.median(n / h for n, h in zip(samples["bf16_nhd"], base))
    row["nhd_cost_e4m3_paired"] = statistics.median(
        n / h for n, h in zip(samples["e4m3_nhd"], samples["e4m3"]))
    return row


def bench_fp8_layouts(plan: Plan) -> List[Dict[str, object]]:
    """B=16 at context 2048 and B=1 at 32k, 32/32 and 32/8 heads."""
    rows = []
    for batch, context, reps in ((BATCH, CONTEXT, plan.decode_reps), (1, LONG_CONTEXT, plan.long_reps)):
        for kv_heads in KV_HEADS:
            candidates, elements = decode_candidates(batch, context, kv_heads)
            samples = time_interleaved_samples(candidates, plan.warmup, reps)
            row = {"batch": batch, "context": context, "num_heads": NUM_HEADS,
                   "num_kv_heads": kv_heads, "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE,
                   "query_dtype": "bfloat16", "cpu_isa": pa.cpu_isa(),
                   **summarize_shape(samples, elements), "samples_s": samples}
            rows.append(row)
            print_row(row)
            del candidates
    return rows


def print_row(row: Dict[str, object]) -> None:
    parts = [f"{name} {row[name]['median_s'] * 1e3:7.2f} ms {row[name]['speedup_over_bf16_paired']:.2f}x"
             for name in CANDIDATES]
    print(f"fp8/layouts B={row['batch']} ctx {row['context']} 32/{row['num_kv_heads']:<2} "
          f"[{row['cpu_isa']}] | " + " | ".join(parts)
          + f" | NHD/HND time bf16 {row['nhd_cost_bf16_paired']:.2f}x e4m3 {row['nhd_cost_e4m3_paired']:.2f}x",
          flush=True)


def fp8_targets(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """The fp8 speed target per row and format: fp8 time >= 1.5x faster than bf16's."""
    out = []
    for row in rows:
        for fp8 in ("e4m3", "e5m2"):
            r = row[fp8]
            out.append(target(
                "fp8 speedup over bf16", f"{fp8} 32/{row['num_kv_heads']} B={row['batch']} "
                f"ctx {row['context']}", r["speedup_over_bf16_paired"], FP8_TARGET, "x (paired)",
                f"{r['rate_median']:.1f} GB/s of fp8 vs bf16 {row['bf16']['rate_median']:.1f} GB/s "
                f"[{row['cpu_isa']}]"))
    return out
