"""Decode speed of the per-token int8 / int4 caches against bf16, on the same CPU kernel.

Usage: ``.venv/bin/python bench/bench_token_formats.py [--rows ROW ...] [--reps N] [--threads N] [--out PATH]``

One decode step of ``paged.attention`` (B=16 sequences, heads of 128, blocks of 16, a bf16
query) over a bf16 cache, an int8 cache and an int4 cache, for each row of the shape set:
contexts 2048 and 32768 tokens, 32 query heads on 8 and on 32 KV heads (``--rows`` picks some,
e.g. ``2048x8``). The three formats of a row are timed in interleaved rounds
(``common/timing.py``: a fresh random order each round), and each format's ratio to bf16 is
the median over rounds of its time over bf16's in the same round (a shared, noisy machine
moves all three alike within a round); the report also counts the rounds in which the format
was faster than bf16 (a sign test) and the spread of the ratios.

Physical pools: a row's logical blocks (B x context / 16) of bf16 K+V reach 8.6 GB at
32768 tokens on 32 KV heads, more than the machine holds. So each format gets a physical pool
of at most ``POOL_BYTES`` (512 MiB) of K+V (or its logical blocks, when fewer), and a row's
block tables are drawn at random over that pool: a permutation when the pool holds every
logical block, with repeats otherwise. A pool that size is far past the last-level cache, so
each read still comes from DRAM, while the kernel does the full row's work. The caches hold
random stored values (bf16 Gaussians, int8 in [-127, 127], int4 bytes with scales as from
Gaussian rows): the kernel's speed does not depend on the values. One row's caches are built,
timed and freed before the next. Writes ``bench/results/token_formats.json``.

``--widen-peak PATH``: the output of ``bench/microbench/widen_peak.cpp`` built for the kernel
measured, whose ``int8_vdpbf16ps`` (keys) and ``int8_value_pairs`` (values) loops at G query
heads per KV head are the int8 rows' inner loops alone, in L1 on one core. A row's
arithmetic limit is head_size / keys + head_size / values per (token, KV head); the report
gives each int8 row's time as a percentage of it (median call, and best call against the
best of widen_peak's runs).
"""

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Callable, Dict, List

import torch

import paged_attention_ext as pa
from common.environment import machine_info
from common.timing import summarize, time_interleaved_samples
from common.token_caches import random_cache, random_scales
from paged_attention_ext.token_quantization import stored_head_size

BATCH, HEADS, HEAD_SIZE, BLOCK = 16, 32, 128, 16
ROWS = {"2048x8": (2048, 8), "2048x32": (2048, 32), "32768x8": (32768, 8), "32768x32": (32768, 32)}
FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
POOL_BYTES = 512 << 20
OUT = Path(__file__).resolve().parent / "results" / "token_formats.json"


def row_bytes(cache_dtype: torch.dtype) -> int:
    """Bytes of one (token, KV head) row of K or V, its scales included."""
    if cache_dtype == torch.bfloat16:
        return 2 * HEAD_SIZE
    return stored_head_size(cache_dtype, HEAD_SIZE) + 4 * (1 if cache_dtype == torch.int8 else 2)


def decode_step(cache_dtype: torch.dtype, context: int, kv_heads: int, query: torch.Tensor,
                gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """A call of paged.attention over this format's pool, with its own random block tables."""
    logical = BATCH * context // BLOCK
    pool = min(logical, math.ceil(POOL_BYTES / (2 * kv_heads * BLOCK * row_bytes(cache_dtype))))
    if pool == logical:
        tables = torch.randperm(logical, generator=gen)
    else:
        tables = torch.randint(0, pool, (logical,), generator=gen)
    tables = tables.to(torch.int32).view(BATCH, -1)
    lens = torch.full((BATCH,), context, dtype=torch.int32)
    stored = HEAD_SIZE if cache_dtype == torch.bfloat16 else stored_head_size(cache_dtype, HEAD_SIZE)
    shape = (pool, kv_heads, BLOCK, stored)
    key_cache, value_cache = random_cache(cache_dtype, shape, gen), random_cache(cache_dtype, shape, gen)
    scales = {}
    if cache_dtype != torch.bfloat16:
        scales = {name: random_scales(cache_dtype, pool, kv_heads, BLOCK, gen) for name in ("k_scale", "v_scale")}
    return lambda: pa.attention(query, key_cache, value_cache, tables, lens, HEAD_SIZE ** -0.5,
                                **scales)


def int8_limits(widen_peak: Path) -> Dict[int, float]:
    """ns per (token, KV head) of the int8 inner loops at each G widen_peak measured."""
    rates: Dict[str, Dict[int, float]] = {"int8_vdpbf16ps": {}, "int8_value_pairs": {}}
    for line in widen_peak.read_text().splitlines():
        match = re.match(r"(\w+) G=(\d+): 1 thread ([\d.]+) G elements/s", line)
        if match and match[1] in rates:
            rates[match[1]][int(match[2])] = float(match[3])
    return {g: HEAD_SIZE / keys + HEAD_SIZE / rates["int8_value_pairs"][g]
            for g, keys in rates["int8_vdpbf16ps"].items()}


def time_row(context: int, kv_heads: int, reps: int, gen: torch.Generator) -> Dict[str, object]:
    query = torch.randn(BATCH, HEADS, HEAD_SIZE, generator=gen).bfloat16()
    calls = {name: decode_step(dtype, context, kv_heads, query, gen) for name, dtype in FORMATS.items()}
    samples = time_interleaved_samples(calls, warmup=max(2, reps // 10), reps=reps)
    rows = BATCH * context * kv_heads
    result: Dict[str, object] = {"context": context, "kv_heads": kv_heads, "rounds": reps, "formats": {}}
    for name, dtype in FORMATS.items():
        timing = summarize(samples[name])
        ratios: List[float] = sorted(t / b for t, b in zip(samples[name], samples["bf16"]))
        result["formats"][name] = {
            "bytes_per_token_head": row_bytes(dtype),
            "median_ms": timing.median_s * 1e3, "min_ms": timing.min_s * 1e3,
            "ns_per_token_head": timing.median_s * 1e9 / rows,
            "paired_ratio_to_bf16": statistics.median(ratios),
            "speed_vs_bf16": 1 / statistics.median(ratios),
            "ratio_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
            "rounds_faster_than_bf16": sum(r < 1 for r in ratios),
        }
        print(f"{context}x{kv_heads} {name}: median {timing.median_s * 1e3:.2f} ms, "
              f"best {timing.min_s * 1e3:.2f} ms, {timing.median_s * 1e9 / rows:.3f} ns/row, "
              f"x{statistics.median(ratios):.3f} of bf16's time "
              f"(quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[(3 * len(ratios)) // 4]:.3f}, "
              f"faster in {sum(r < 1 for r in ratios)}/{reps} rounds)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--reps", type=int, default=60,
                        help="rounds at context 2048; longer contexts take proportionally fewer (at least 8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--widen-peak", type=Path, help="widen_peak's output for this kernel")
    args = parser.parse_args()
    limits = int8_limits(args.widen_peak) if args.widen_peak else {}
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    report = {"machine": machine_info(), "cpu_isa": pa.cpu_isa(), "threads": args.threads,
              "shape": dict(batch=BATCH, heads=HEADS, head_size=HEAD_SIZE, block_size=BLOCK,
                            pool_bytes=POOL_BYTES),
              "int8_arithmetic_limit_ns_by_group": limits, "rows": {}}
    for row in args.rows:
        context, kv_heads = ROWS[row]
        reps = max(8, args.reps * 2048 // context)
        report["rows"][row] = result = time_row(context, kv_heads, reps, gen)
        if HEADS // kv_heads in limits:
            limit = limits[HEADS // kv_heads]
            int8 = result["formats"]["int8"]
            int8["arithmetic_limit_ns"] = limit
            int8["percent_of_limit"] = 100 * limit / int8["ns_per_token_head"]
            # Best against best: a shared machine's load slows the median, not the best call.
            best_ns = int8["min_ms"] * 1e6 / (BATCH * context * kv_heads)
            int8["percent_of_limit_best"] = 100 * limit / best_ns
            print(f"{row} int8: {int8['percent_of_limit']:.0f}% of its arithmetic limit ({limit:.2f} ns/row), "
                  f"best call {int8['percent_of_limit_best']:.0f}%")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
