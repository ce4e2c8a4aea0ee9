"""CPU kernels against the machine's limits: bandwidth, FLOP/s and copy speed.

Usage: ``.venv/bin/python bench/bench_cpu_perf.py [--quick] [--out PATH] [--no-plots]``

Every paged-attention configuration is timed round-robin (``common/timing.py``) together with a
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
fp8_layouts (fp8 e4m3/e5m2 and NHD views against the bf16 HND cache, B=16 ctx 2048 and B=1
ctx 32k; ``--sections fp8_layouts`` runs it alone, without the 4 GiB of shared pools),
isa_matrix (every kernel the CPU supports x every cache dtype, 32/32 and 32/8, beside the
read, each row's L2-resident rate, inner-loop limit and paged-read ceiling; pools of its
own like fp8_layouts),
context sweep 512..32k (B=16, or the largest B whose K fits the 1 GiB pool), batch 1 at
32k with 1 and 2 threads, block-size sweep 1..256, a diagnostic with the KV resident in
L3 (the kernel's speed with DRAM out of the way), multi-token GFLOP/s against matmul,
and write_kv / copy_blocks / swap_blocks against a copy. Writes
``bench/results/cpu_perf.json`` and ``cpu_perf_context.png`` / ``cpu_perf_block_size.png``.
Further runs of the same build go into that one file, under ``repeat_runs``: write them
elsewhere with ``--out`` and fold them in with ``--add-repeat``.

The sections live in ``bench/cpu_perf/``: ``config`` (shapes, sizes, plans), ``machine``
(pools, references, statistics), ``decode``, ``fp8_layouts``, ``isa_matrix``, ``sweeps``,
``multi_token``, ``cache_ops``
and ``report`` (targets, plots); this script runs them in order and writes the report.
"""

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict

import torch

from common.environment import machine_info
from cpu_perf.cache_ops import bench_cache_ops
from cpu_perf.config import FULL, QUICK
from cpu_perf.decode import bench_cache_resident, bench_decode, bench_long_context
from cpu_perf.fp8_layouts import bench_fp8_layouts, fp8_targets
from cpu_perf.isa_matrix import bench_isa_matrix
from cpu_perf.machine import allocate, load, memory_info
from cpu_perf.multi_token import bench_multi_token
from cpu_perf.report import evaluate, print_targets, write_plots
from cpu_perf.sweeps import bench_block_sweep, bench_context_sweep

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("decode", "fp8_layouts", "isa_matrix", "context_sweep", "long_context",
            "block_sweep", "cache_resident", "multi_token", "cache_ops")
# Sections with pools of their own (the others share the 4 GiB of `allocate`).
OWN_POOLS = {"fp8_layouts", "isa_matrix"}
DEFAULT_OUT = RESULTS / "cpu_perf.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads value")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="run only these sections (the targets and plots need all of them)")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the PNGs from the JSON at --out")
    parser.add_argument("--add-repeat", type=Path, metavar="RUN_JSON",
                        help="only append another run's JSON to repeat_runs of the JSON at --out")
    return parser.parse_args()


def add_repeat(out: Path, run: Path) -> None:
    """Append the report at ``run`` (less its own repeats) to ``repeat_runs`` of ``out``."""
    report = json.loads(out.read_text())
    repeat = {k: v for k, v in json.loads(run.read_text()).items() if k != "repeat_runs"}
    report.setdefault("repeat_runs", []).append(repeat)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{out}: {len(report['repeat_runs'])} repeat run(s)")


def main() -> None:
    args = parse_args()
    if args.add_repeat:
        add_repeat(args.out, args.add_repeat)
        return
    if args.replot:
        write_plots(json.loads(args.out.read_text()), args.out.parent)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    machine = machine_info()
    print(", ".join(f"{k}={v}" for k, v in machine.items()) + f", loadavg={load()}", flush=True)
    shared_pools = any(name not in OWN_POOLS for name in args.sections)
    mem = allocate() if shared_pools else None
    memory = memory_info(mem) if shared_pools else {}
    print(f"memory: {memory}", flush=True)

    sections: Dict[str, float] = {}
    report: Dict[str, object] = {"machine": machine | {"loadavg_at_start": load()}, "memory": memory,
                                 "plan": asdict(plan) | {"quick": args.quick}}
    runners: Dict[str, Callable[[], object]] = {
        "decode": lambda: bench_decode(mem, plan),
        "fp8_layouts": lambda: bench_fp8_layouts(plan),
        "isa_matrix": lambda: bench_isa_matrix(plan),
        "context_sweep": lambda: bench_context_sweep(mem, plan),
        "long_context": lambda: bench_long_context(mem, plan, args.threads),
        "block_sweep": lambda: bench_block_sweep(mem, plan),
        "cache_resident": lambda: bench_cache_resident(mem, plan),
        "multi_token": lambda: bench_multi_token(mem, plan),
        "cache_ops": lambda: bench_cache_ops(mem, plan),
    }
    for name in SECTIONS:
        if name not in args.sections:
            continue
        t0 = time.perf_counter()
        report[name] = runners[name]()
        sections[name] = round(time.perf_counter() - t0, 1)
        print(f"[{name}: {sections[name]} s]\n", flush=True)
    complete = set(args.sections) == set(SECTIONS)
    report["targets"] = ((evaluate(report) if complete else [])
                         + fp8_targets(report.get("fp8_layouts", [])))
    report["section_seconds"] = sections
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    print_targets(report["targets"])

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if complete and not args.no_plots:
        write_plots(report, args.out.parent)
    print(f"total {report['total_seconds']} s")


if __name__ == "__main__":
    main()
