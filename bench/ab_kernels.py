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
back to back, since after the read the cache would be cold) and from L2 (tables cycling
over 256 KiB of blocks: the arithmetic alone); multi-token (512 queries over 4096 tokens,
32/8 heads) in fp32 and bf16, in GFLOP/s.
"""

import statistics
from pathlib import Path
from typing import Dict, List

from common.ab import ab_parser, ab_rounds, paired, write_report

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu_kernel_ab.json"
FAST_READ_GBPS = 65.0  # between the host's two read-bandwidth states (~45-55 and ~75-85 GB/s)


def worker(reps: int) -> Dict[str, object]:
    """Measure every configuration with the paged_attention_ext found on sys.path."""
    import torch

    import paged_attention_ext as pa
    from common.environment import source_revision
    from common.timing import time_interleaved_samples
    from cpu_perf.config import (BATCH, BLOCK_SIZE, CONTEXT, DTYPES, HEAD_SIZE, KV_HEADS, L3_CONTEXT,
                                 MT_DTYPES, MT_KV_HEADS, NUM_HEADS)
    from cpu_perf.decode import cache_resident, core_resident, decode_case
    from cpu_perf.machine import Pool, random_pattern
    from cpu_perf.multi_token import multi_token_case
    from paged_attention_ext.host_memory import zeros_huge_pages

    torch.set_num_threads(2)
    pool_bytes = BATCH * CONTEXT * NUM_HEADS * HEAD_SIZE * 4  # fp32 MHA, the largest case
    k_pool, v_pool = Pool(pool_bytes, huge=True), Pool(pool_bytes, huge=True)
    read = zeros_huge_pages((1 << 28,), torch.float32).normal_()
    read_bytes = read.numel() * 4
    results: Dict[str, object] = {"isa": pa.cpu_isa(), "library": pa.__file__, "source": source_revision()}
    def fill(name: str) -> None:
        k_pool.fill(random_pattern(DTYPES[name], 1))
        v_pool.fill(random_pattern(DTYPES[name], 2))

    for name in DTYPES:
        fill(name)
        for kv_heads in KV_HEADS:
            dram = decode_case(k_pool, v_pool, name, BATCH, kv_heads, CONTEXT, BLOCK_SIZE)
            s = time_interleaved_samples({"paged": dram.run, "read": read.sum}, 2, reps)
            paged = [dram.kv_bytes / t / 1e9 for t in s["paged"]]
            ref = [read_bytes / t / 1e9 for t in s["read"]]
            results[f"dram {name} 32/{kv_heads}"] = {
                "gbps": statistics.median(paged), "read_gbps": statistics.median(ref),
                "pct_of_read": 100 * statistics.median(a / b for a, b in zip(paged, ref))}
            # Back to back: after the 1 GiB read the cache would be cold.
            l3 = cache_resident(decode_case(k_pool, v_pool, name, BATCH, kv_heads, L3_CONTEXT,
                                            BLOCK_SIZE))
            for level, case in (("l3", l3), ("l2", core_resident(dram))):
                s = time_interleaved_samples({"paged": case.run}, 2, reps)
                results[f"{level} {name} 32/{kv_heads}"] = {
                    "gbps": statistics.median(case.kv_bytes / t / 1e9 for t in s["paged"])}
    for name in MT_DTYPES:
        fill(name)
        case = multi_token_case(k_pool, v_pool, name)
        s = time_interleaved_samples({"paged": case.run}, 1, max(3, reps // 3))
        results[f"multi-token {name} 32/{MT_KV_HEADS}"] = {
            "gflops": case.flops / statistics.median(s["paged"]) / 1e9}
    return results


def summarize(rounds: List[Dict[str, Dict[str, object]]]) -> Dict[str, object]:
    summary = {}
    for key, first in rounds[0]["current"].items():
        if not isinstance(first, dict):
            continue
        metric = "gflops" if "gflops" in first else "gbps"
        both = paired(rounds, lambda w: w[key][metric])
        row = {f"current_{metric}": both["current"], f"baseline_{metric}": both["baseline"],
               "speedup_paired": both["speedup_paired"]}
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
    parser = ab_parser(__doc__.splitlines()[0], default_reps=12, default_out=DEFAULT_OUT)
    args = parser.parse_args()
    rounds = ab_rounds(parser, args, Path(__file__), worker)
    if rounds is None:
        return
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
    write_report(args.out, report)


if __name__ == "__main__":
    main()
