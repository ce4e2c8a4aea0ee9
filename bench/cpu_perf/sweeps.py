"""Decode sweeps: context length 512..32k and block size 1..256, each series in one
round-robin with the read sum."""

from typing import Dict, List, Tuple

from common.timing import time_interleaved_samples

from .config import (BATCH, BLOCK_SIZE, BLOCK_SIZES, CONTEXT, CONTEXTS, DTYPES, HEAD_SIZE,
                     READ_BYTES, SWEEP_SERIES, Plan)
from .decode import DecodeCase, check_decode, decode_case, fit_batch
from .machine import Memory, rate_summary, ratios, read_candidate

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


def print_sweep(series: Dict[str, object], key: str) -> None:
    r = series["read_bandwidth"]
    print(f"{key} sweep {series['dtype']} 32/{series['num_kv_heads']}: read {r['rate_median']:.1f} "
          f"GB/s (best {r['rate_best']:.1f})", flush=True)
    for p in series["points"]:
        extra = f" {p['pct_of_best']:4.0f}% of best" if "pct_of_best" in p else ""
        print(f"  {key}={p[key]:<6} B={p['batch']:<2} {p['median_s'] * 1e3:7.2f} ms "
              f"{p['rate_median']:5.1f} GB/s {p['pct_paired']:4.0f}% of read{extra}", flush=True)
