"""The amx kernel against the avx512_bf16 kernel it extends, side by side.

Usage: ``.venv/bin/python bench/bench_amx.py [--rounds N] [--out PATH]`` on a CPU with AMX.

Method: for bf16 and e4m3 caches (bf16 queries, scales 1) and each shape below, one cache
in a random physical block order, checked against the reference once, then the call with
the kernel selected as ``avx512_bf16`` and as ``amx`` (``pa.select_cpu_isa``) alternating, ``--rounds`` rounds of
one call each after a warm-up; the speedup is the median over rounds of the paired time
ratio (avx512_bf16 / amx in the same round). Shapes (head size 128, block 16):

* decode, B=16: query heads / KV heads 32/32, 16/8, 32/8 (context 2048) and 32/4, 64/4,
  32/1 (context 8192): one to 32 queries per KV head;
* causal multi-token: 512 queries at the end of 4096 tokens, 32/8 heads.

Rates are KV GB/s for decode and GFLOP/s (4 x heads x head size per visible query-key
pair) for multi-token. The JSON records the CPU, its flags and the torch threads.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paged_attention_ext as pa  # noqa: E402
from common.environment import cpu_details, machine_info  # noqa: E402
from paged_attention_ext import reference  # noqa: E402

HEAD, BLOCK = 128, 16
CACHES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
DECODE = [(32, 32, 2048), (16, 8, 2048), (32, 8, 2048), (32, 4, 8192), (64, 4, 8192), (32, 1, 8192)]
ISAS = ("avx512_bf16", "amx")


def case(cache: str, heads: int, kv_heads: int, lens: List[int], q_lens: List[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dtype = CACHES[cache]
    blocks = [-(-n // BLOCK) for n in lens]
    shape = (sum(blocks), kv_heads, BLOCK, HEAD)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(sum(blocks), generator=gen).to(torch.int32).view(len(lens), -1)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, HEAD, generator=gen).to(torch.bfloat16)
    kwargs = {} if dtype == torch.bfloat16 else {"k_scale": torch.tensor(1.0),
                                                 "v_scale": torch.tensor(1.0)}
    if max(q_lens) > 1:
        kwargs["query_start_loc"] = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                                 dtype=torch.int32)
    args = (query, key_cache, value_cache, tables, seq_lens, HEAD ** -0.5)

    def run() -> torch.Tensor:
        return pa.attention(*args, **kwargs)

    want = reference.attention(query.double() if dtype != torch.bfloat16 else query,
                               key_cache, value_cache, tables, seq_lens, HEAD ** -0.5, **kwargs)
    for isa in ISAS:
        pa.select_cpu_isa(isa)
        torch.testing.assert_close(run().float(), want.float(), atol=3e-2, rtol=3e-2)
    kv_bytes = key_cache.numel() * key_cache.element_size() * 2
    flops = 4 * heads * HEAD * sum(sum(n - q + i + 1 for i in range(q)) for n, q in zip(lens, q_lens))
    return run, kv_bytes, flops


def time_isas(run: Callable[[], torch.Tensor], rounds: int) -> Dict[str, List[float]]:
    seconds: Dict[str, List[float]] = {isa: [] for isa in ISAS}
    for isa in ISAS:
        pa.select_cpu_isa(isa)
        run()
    for _ in range(rounds):
        for isa in ISAS:
            pa.select_cpu_isa(isa)
            t0 = time.perf_counter()
            run()
            seconds[isa].append(time.perf_counter() - t0)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="bench/results/cpu_amx.json")
    args = parser.parse_args()
    if pa.cpu_isa() != "amx":
        raise SystemExit(f"this CPU's kernel is {pa.cpu_isa()}: no AMX to measure")
    shapes = [("decode", h, kv, [ctx] * 16, [1] * 16) for h, kv, ctx in DECODE]
    shapes.append(("multi-token", 32, 8, [4096], [512]))
    rows = []
    for cache in CACHES:
        for kind, heads, kv_heads, lens, q_lens in shapes:
            run, kv_bytes, flops = case(cache, heads, kv_heads, lens, q_lens)
            seconds = time_isas(run, args.rounds)
            ratios = [b / a for b, a in zip(seconds["avx512_bf16"], seconds["amx"])]
            medians = {isa: statistics.median(s) for isa, s in seconds.items()}
            unit, work = ("GFLOP/s", flops) if kind == "multi-token" else ("GB/s", kv_bytes)
            row = {"case": kind, "cache": cache, "heads": heads, "kv_heads": kv_heads,
                   "context": lens[0], "queries": sum(q_lens), "unit": unit,
                   **{f"{isa}_rate": round(work / medians[isa] / 1e9, 1) for isa in ISAS},
                   "amx_speedup": round(statistics.median(ratios), 3),
                   "amx_speedup_range": [round(min(ratios), 3), round(max(ratios), 3)]}
            rows.append(row)
            print(f"{kind:<11} {cache:<4} {heads}/{kv_heads:<3} ctx {lens[0]:<5} "
                  f"avx512_bf16 {row['avx512_bf16_rate']:7.1f} {unit}  amx {row['amx_rate']:7.1f} {unit}  "
                  f"{row['amx_speedup']:.2f}x ({row['amx_speedup_range'][0]:.2f}-"
                  f"{row['amx_speedup_range'][1]:.2f})", flush=True)
            del run
    pa.select_cpu_isa()
    report = {"what": __doc__.splitlines()[0], "machine": machine_info(), "cpu": cpu_details(),
              "threads": torch.get_num_threads(), "loadavg": [round(x, 2) for x in os.getloadavg()],
              "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
