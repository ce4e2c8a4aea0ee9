"""Two builds of the CPU kernel side by side: decode bandwidth and multi-token GFLOP/s.

Usage: ``.venv/bin/python bench/ab_kernels.py --baseline DIR [--rounds N] [--out PATH]``

``DIR`` is another checkout of this repository with its extension built in place
(``git worktree add DIR COMMIT && cd DIR && python setup.py build_ext --inplace``). One
process cannot load both builds (both register the ``paged`` op namespace), so each round
runs one worker process per build, back to back, in alternating order; the host's
bandwidth moves in bursts of seconds to minutes, so the two workers of a round usually see
the same state. Each worker times its configurations round-robin against the 1 GiB read
sum (``bench_cpu_perf.py``'s reference) and reports GB/s and % of read. The summary gives,
per configuration, each build's median and the median over rounds of current / baseline,
and for DRAM rows the medians over the rounds in which both workers saw the host's fast
(read > 65 GB/s) or slow read-bandwidth state.

Configurations: decode B=16, 32 query heads, head size 128, context 2048, block 16, on
huge-page pools, fp32 / bf16 / fp16 x 32 / 8 KV heads, from DRAM (random block order,
timed with the read reference) and from L3 (all sequences share 512 tokens of blocks; timed
back to back, since after the read the cache would be cold); multi-token (512 queries over 4096
tokens, 32/8 heads) in fp32 and bf16, in GFLOP/s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu_kernel_ab.json"
HEADS, HEAD_SIZE, BATCH, CONTEXT, BLOCK = 32, 128, 16, 2048, 16
L3_CONTEXT = 512
DECODE = [(dtype, kv) for dtype in ("fp32", "bf16", "fp16") for kv in (32, 8)]
MT_QUERIES, MT_CONTEXT, MT_KV_HEADS = 512, 4096, 8
FAST_READ_GBPS = 65.0  # between the host's two read-bandwidth states (~45-55 and ~75-85 GB/s)


def worker(reps: int) -> Dict[str, object]:
    """Measure every configuration with the paged_attention_ext found on sys.path."""
    import torch

    import paged_attention_ext as pa
    from paged_attention_ext.host_memory import zeros_huge_pages

    sys.path.insert(0, str(ROOT / "bench"))
    from timing import time_interleaved_samples

    torch.set_num_threads(2)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    pool_bytes = BATCH * CONTEXT * HEADS * HEAD_SIZE * 4
    k_pool = zeros_huge_pages((pool_bytes,), torch.uint8)
    v_pool = zeros_huge_pages((pool_bytes,), torch.uint8)
    read = zeros_huge_pages((1 << 28,), torch.float32).normal_()
    read_bytes = read.numel() * 4
    results: Dict[str, object] = {"isa": pa.cpu_isa(), "library": pa.__file__}
    for where, context in (("dram", CONTEXT), ("l3", L3_CONTEXT)):
        for name, kv_heads in DECODE:
            dtype = dtypes[name]
            blocks = BATCH * context // BLOCK
            shape = (blocks, kv_heads, BLOCK, HEAD_SIZE)
            count = blocks * kv_heads * BLOCK * HEAD_SIZE
            k = k_pool.view(dtype)[:count].view(shape)
            v = v_pool.view(dtype)[:count].view(shape)
            k.copy_(torch.randn(shape).to(dtype))
            v.copy_(torch.randn(shape).to(dtype))
            table = torch.randperm(blocks, dtype=torch.int32).view(BATCH, -1)
            if where == "l3":  # every sequence reads the first sequence's blocks
                table = table[:1].expand(BATCH, -1).contiguous()
            query = torch.randn(BATCH, HEADS, HEAD_SIZE).to(dtype)
            lens = torch.full((BATCH,), context, dtype=torch.int32)
            kv_bytes = 2 * BATCH * context * kv_heads * HEAD_SIZE * dtype.itemsize

            def run(q=query, k=k, v=v, t=table, n=lens):
                return pa.attention(q, k, v, t, n, HEAD_SIZE**-0.5)

            if where == "l3":  # back to back: after the 1 GiB read the cache would be cold
                s = time_interleaved_samples({"paged": run}, 2, reps)
                results[f"{where} {name} 32/{kv_heads}"] = {
                    "gbps": statistics.median(kv_bytes / t / 1e9 for t in s["paged"])}
                continue
            s = time_interleaved_samples({"paged": run, "read": read.sum}, 2, reps)
            paged = [kv_bytes / t / 1e9 for t in s["paged"]]
            ref = [read_bytes / t / 1e9 for t in s["read"]]
            results[f"{where} {name} 32/{kv_heads}"] = {
                "gbps": statistics.median(paged), "read_gbps": statistics.median(ref),
                "pct_of_read": 100 * statistics.median(a / b for a, b in zip(paged, ref))}
    for name in ("fp32", "bf16"):
        dtype = dtypes[name]
        blocks = MT_CONTEXT // BLOCK
        k = torch.randn(blocks, MT_KV_HEADS, BLOCK, HEAD_SIZE).to(dtype)
        v = torch.randn(blocks, MT_KV_HEADS, BLOCK, HEAD_SIZE).to(dtype)
        table = torch.randperm(blocks, dtype=torch.int32)[None]
        query = torch.randn(MT_QUERIES, HEADS, HEAD_SIZE).to(dtype)
        starts = torch.tensor([0, MT_QUERIES], dtype=torch.int32)
        lens = torch.tensor([MT_CONTEXT], dtype=torch.int32)
        pairs = sum(MT_CONTEXT - MT_QUERIES + i + 1 for i in range(MT_QUERIES))
        flop = 4 * HEADS * HEAD_SIZE * pairs

        def run_mt(q=query, k=k, v=v, t=table, n=lens, s=starts):
            return pa.attention(q, k, v, t, n, HEAD_SIZE**-0.5, query_start_loc=s)

        s = time_interleaved_samples({"paged": run_mt}, 1, max(3, reps // 3))
        results[f"multi-token {name} 32/{MT_KV_HEADS}"] = {
            "gflops": flop / statistics.median(s["paged"]) / 1e9}
    return results


def run_worker(library_root: Path, reps: int) -> Dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(library_root))
    out = subprocess.run([sys.executable, __file__, "--worker", "--reps", str(reps)], env=env,
                         check=True, capture_output=True, text=True, cwd="/")
    return json.loads(out.stdout)


def summarize(rounds: List[Dict[str, Dict[str, object]]]) -> Dict[str, object]:
    summary = {}
    for key, first in rounds[0]["current"].items():
        if not isinstance(first, dict):
            continue
        metric = "gflops" if "gflops" in first else "gbps"
        cur = [r["current"][key][metric] for r in rounds]
        base = [r["baseline"][key][metric] for r in rounds]
        row = {f"current_{metric}": statistics.median(cur), f"baseline_{metric}": statistics.median(base),
               "speedup_paired": statistics.median(c / b for c, b in zip(cur, base))}
        if "pct_of_read" in first:
            row["current_pct_of_read"] = statistics.median(r["current"][key]["pct_of_read"] for r in rounds)
            row["baseline_pct_of_read"] = statistics.median(r["baseline"][key]["pct_of_read"] for r in rounds)
            # The host's read bandwidth has two states; compare builds within each.
            for state, in_state in (("fast", lambda x: x > FAST_READ_GBPS),
                                    ("slow", lambda x: x <= FAST_READ_GBPS)):
                same = [r for r in rounds
                        if all(in_state(r[b][key]["read_gbps"]) for b in ("current", "baseline"))]
                if same:
                    row[f"{state}_rounds"] = len(same)
                    row[f"{state}_current_gbps"] = statistics.median(r["current"][key]["gbps"] for r in same)
                    row[f"{state}_baseline_gbps"] = statistics.median(r["baseline"][key]["gbps"] for r in same)
        summary[key] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="checkout with the baseline build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=12, help="timed repetitions per worker")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    rounds = []
    for i in range(args.rounds):
        order = ["current", "baseline"] if i % 2 == 0 else ["baseline", "current"]
        result = {}
        for build in order:
            result[build] = run_worker(ROOT if build == "current" else args.baseline.resolve(), args.reps)
        rounds.append(result)
        print(f"round {i + 1}/{args.rounds} done", flush=True)
    summary = summarize(rounds)
    print(f"{'configuration':28s} {'baseline':>10s} {'current':>10s} {'speedup':>8s}   % of read (base -> cur)")
    for key, row in summary.items():
        unit = "gflops" if "current_gflops" in row else "gbps"
        pct = (f"   {row['baseline_pct_of_read']:4.0f}% -> {row['current_pct_of_read']:4.0f}%"
               if "current_pct_of_read" in row else "")
        states = "".join(
            f" | {st} ({row[f'{st}_rounds']}): {row[f'{st}_baseline_gbps']:.1f} -> {row[f'{st}_current_gbps']:.1f}"
            for st in ("fast", "slow") if f"{st}_rounds" in row)
        print(f"{key:28s} {row[f'baseline_{unit}']:10.1f} {row[f'current_{unit}']:10.1f} "
              f"{row['speedup_paired']:7.2f}x{pct}{states}")
    report = {"baseline": str(args.baseline), "rounds": rounds, "summary": summary,
              "units": "gbps = effective KV GB/s; gflops = multi-token GFLOP/s"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
