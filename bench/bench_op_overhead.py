"""What one call of a paged op costs besides its kernel, two builds side by side.

Usage: ``.venv/bin/python bench/bench_op_overhead.py --baseline DIR [--current DIR]
[--rounds N] [--calls N] [--threads N] [--out PATH]``

``DIR`` is a checkout of this repository with its extension built in place (``git worktree
add DIR COMMIT && cd DIR && python setup.py build_ext --inplace``); ``--current`` defaults to
this checkout. One process cannot load two builds (both register the ``paged`` op
namespace), so each round runs one worker process per variant, back to back, the order
cycling through all permutations (as ``ab.py`` alternates its two builds). The variants:
``baseline``, ``current``, and ``current_no_entry``: the current build with its Python entry
(``op_entry.py``'s kernel) removed after import, which splits current -
baseline into the entry's share and the compiled library's (stable ABI: boxed kernels,
shim calls). Each worker runs in ``/`` with ``PYTHONPATH=<its checkout>`` and records the
``paged_attention_ext`` it loaded; the run stops if that is not its checkout's.

Tiny calls (the entry dominates): ``torch.ops.paged.attention`` (decode: 1 sequence of 20
tokens, 8 query / 2 KV heads, head size 64, 4 blocks of 16), ``write_kv`` (1 token) and
``copy_blocks`` (1 layer, 1 pair), each with inputs that do not require grad, under three
modes: grad enabled, ``torch.no_grad()`` and ``torch.inference_mode()`` (the mode is entered
once per chunk of ``--chunk`` calls; the per-call time is the chunk's over ``--chunk``). All
op x mode candidates are timed round-robin (``common/timing.py``), ``--calls`` calls each
per worker after ``--warmup`` calls; a tiny ``torch.add`` is timed beside them as a
reference for the workers' machine state. Realistic decode (B=16, 32 / 8 heads, head size
128, context 2048, block 16, huge-page caches in random block order, fp32 and bf16) shows
the same entry against real work. ``--threads`` sets torch's thread count in the workers
(default: torch's); with 1 the kernels' ``parallel_for`` runs inline, so the tiny rows are
the call path alone, without an OpenMP region's wake-up (which on a loaded host can cost
milliseconds).

The summary gives per row each variant's median over rounds of its per-worker median, the
difference current - baseline and its two parts (``entry_us`` = current - current_no_entry,
``library_us`` = current_no_entry - baseline), current / baseline, and the median over
rounds of the per-round ratio (``ratio_paired``); for the tiny rows the same again
normalized by the ``torch.add`` reference (``*_norm``, see ``summarize``). Writes
``bench/results/op_overhead.json``.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, ContextManager, Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "op_overhead.json"
MODES: Dict[str, Callable[[], ContextManager]] = {
    "grad": torch.enable_grad,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}
DECODE_MODES = ("grad", "inference_mode")
DECODE_DTYPES = ("fp32", "bf16")
VARIANTS = ("baseline", "current", "current_no_entry")
REFERENCE = "torch.add (reference)"


def lscpu_model() -> str:
    """lscpu's "Model name" ("" without lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return ""


def tiny_calls() -> Dict[str, Callable[[], object]]:
    """The tiny op calls, on fresh inputs that do not require grad."""
    ops = torch.ops.paged
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 64, generator=gen)
    key_cache = torch.randn(4, 2, 16, 64, generator=gen)
    value_cache = torch.randn(4, 2, 16, 64, generator=gen)
    block_tables = torch.tensor([[2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    # write_kv and copy_blocks write caches of their own (attention's stay as they are).
    key, value = torch.randn(1, 2, 64, generator=gen), torch.randn(1, 2, 64, generator=gen)
    w_key, w_value = key_cache.clone(), value_cache.clone()
    slot = torch.tensor([37], dtype=torch.int64)
    c_keys, c_values = [key_cache.clone()], [value_cache.clone()]
    pair = torch.tensor([[1, 3]], dtype=torch.int64)
    a, b = torch.zeros(8), torch.ones(8)
    return {
        "attention": lambda: ops.attention(query, key_cache, value_cache, block_tables, seq_lens,
                                           0.125),
        "write_kv": lambda: ops.write_kv(key, value, w_key, w_value, slot),
        "copy_blocks": lambda: ops.copy_blocks(c_keys, c_values, pair),
        REFERENCE: lambda: torch.add(a, b),
    }


def chunked(fn: Callable[[], object], mode: str, chunk: int) -> Callable[[], None]:
    """``chunk`` calls of ``fn`` inside one entry of ``mode``."""
    enter = MODES[mode]

    def run() -> None:
        with enter():
            for _ in range(chunk):
                fn()
    return run


def remove_entry() -> None:
    """Unregisters the current build's Python entry (the ops then go straight to the CPU kernel)."""
    from paged_attention_ext import _library
    _library._ENTRY._destroy()


def worker(args: argparse.Namespace) -> Dict[str, object]:
    """Times every row with the paged_attention_ext found on sys.path."""
    if args.threads:
        torch.set_num_threads(args.threads)
    import paged_attention_ext as pa
    from common.environment import machine_info
    from common.timing import time_interleaved_samples
    from cpu_perf.config import BATCH, BLOCK_SIZE, CONTEXT, DTYPES, HEAD_SIZE
    from cpu_perf.decode import decode_case
    from cpu_perf.machine import Pool, random_pattern

    if args.without_entry:
        remove_entry()
    result: Dict[str, object] = {
        "library": pa.__file__, "loadavg_start": os.getloadavg(), **machine_info(),
        "entry_kernel": "op_entry.py" in torch._C._dispatch_dump("paged::attention")}
    # Tiny calls: every op x mode round-robin, the reference once (grad mode).
    fns = tiny_calls()
    candidates = {f"{op} | {mode}": chunked(fn, mode, args.chunk)
                  for op, fn in fns.items() if op != REFERENCE for mode in MODES}
    candidates[f"{REFERENCE} | grad"] = chunked(fns[REFERENCE], "grad", args.chunk)
    s = time_interleaved_samples(candidates, max(1, args.warmup // args.chunk),
                                 max(1, args.calls // args.chunk))
    result["tiny_us"] = {k: statistics.median(s[k]) / args.chunk * 1e6 for k in candidates}
    result["tiny_attention_checksum"] = float(fns["attention"]().double().sum())

    # Realistic decode: B=16, 32 query / 8 KV heads, from DRAM.
    kv_heads = 8
    pool_bytes = BATCH * CONTEXT * kv_heads * HEAD_SIZE * 4  # fp32, the larger dtype
    k_pool, v_pool = Pool(pool_bytes, huge=True), Pool(pool_bytes, huge=True)
    torch.manual_seed(0)  # the same block order and query in every worker
    decode_ms: Dict[str, float] = {}
    checksums: Dict[str, float] = {}
    for name in DECODE_DTYPES:
        k_pool.fill(random_pattern(DTYPES[name], 1))
        v_pool.fill(random_pattern(DTYPES[name], 2))
        case = decode_case(k_pool, v_pool, name, BATCH, kv_heads, CONTEXT, BLOCK_SIZE)
        call = lambda c=case: torch.ops.paged.attention(c.query, c.key_cache, c.value_cache,
                                                        c.block_tables, c.seq_lens, HEAD_SIZE**-0.5)
        cands = {f"decode {name} 32/{kv_heads} | {mode}": chunked(call, mode, 1) for mode in DECODE_MODES}
        s = time_interleaved_samples(cands, 2, args.decode_reps)
        decode_ms.update({k: statistics.median(v) * 1e3 for k, v in s.items()})
        checksums[name] = float(call().double().sum())
    result["decode_ms"] = decode_ms
    result["decode_checksums"] = checksums
    result["loadavg_end"] = os.getloadavg()
    return result


def run_worker(variant: str, tree: Path, args: argparse.Namespace) -> Dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, __file__, "--worker", "--calls", str(args.calls), "--warmup",
           str(args.warmup), "--chunk", str(args.chunk), "--decode-reps", str(args.decode_reps),
           "--threads", str(args.threads)] + (["--without-entry"] if variant == "current_no_entry" else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd="/")
    result = json.loads(out.stdout)
    if not Path(result["library"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the worker for {tree} loaded {result['library']}")
    return result


def split(med: Dict[str, float], unit: str, suffix: str = "") -> Dict[str, float]:
    """current - baseline and its two parts: the Python entry's and the compiled library's."""
    return {f"difference_{unit}{suffix}": med["current"] - med["baseline"],
            f"entry_{unit}{suffix}": med["current"] - med["current_no_entry"],
            f"library_{unit}{suffix}": med["current_no_entry"] - med["baseline"],
            f"ratio{suffix}": med["current"] / med["baseline"]}


def summarize(rounds: List[Dict[str, Dict[str, object]]], field: str, unit: str,
              reference: str = "") -> Dict[str, object]:
    """Per row: every variant's median over rounds, the differences and ratios.

    With ``reference`` (a row of ``field``) also ``*_norm``: the median over rounds of the
    row / the reference in the same worker, times the reference's median over all workers.
    The host's speed moves between workers in steps (the tiny calls and the reference by
    the same factor, up to ~1.7x), and the medians of 12 workers per variant need not
    sample those states alike; the normalized figures vary ~4% between rounds instead of ~25%.
    """
    rows = {}
    scale = statistics.median(r[v][field][reference] for r in rounds for v in VARIANTS) if reference else 0
    for key in rounds[0]["current"][field]:
        per = {v: [r[v][field][key] for r in rounds] for v in VARIANTS}
        med = {v: statistics.median(x) for v, x in per.items()}
        rows[key] = {
            **{f"{v}_{unit}": med[v] for v in VARIANTS}, **split(med, unit),
            "ratio_paired": statistics.median(c / b for c, b in zip(per["current"], per["baseline"])),
            **{f"{v}_{unit}_range": [min(x), max(x)] for v, x in per.items()},
        }
        if reference and key != reference:
            norm = {v: scale * statistics.median(r[v][field][key] / r[v][field][reference] for r in rounds)
                    for v in VARIANTS}
            rows[key].update({f"{v}_{unit}_norm": norm[v] for v in VARIANTS}, **split(norm, unit, "_norm"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="checkout with the baseline build")
    parser.add_argument("--current", type=Path, default=ROOT, help="checkout with the current build")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (6: every order once)")
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per row and worker")
    parser.add_argument("--warmup", type=int, default=1000, help="untimed calls per row first")
    parser.add_argument("--chunk", type=int, default=100, help="calls per timed sample")
    parser.add_argument("--decode-reps", type=int, default=30, help="timed decode steps per row")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--without-entry", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    trees = {"baseline": args.baseline, "current": args.current, "current_no_entry": args.current}
    orders = list(itertools.permutations(VARIANTS))
    rounds = []
    for i in range(args.rounds):
        rounds.append({v: run_worker(v, trees[v], args) for v in orders[i % len(orders)]})
        print(f"round {i + 1}/{args.rounds} done", flush=True)
    for field in ("tiny_attention_checksum", "decode_checksums"):
        if len({json.dumps(r[v][field]) for r in rounds for v in VARIANTS}) != 1:
            print(f"warning: {field} differs between builds or rounds", flush=True)
    if [rounds[0][v]["entry_kernel"] for v in VARIANTS] != [False, True, False]:
        print("warning: entry kernels not as expected (baseline none, current one, "
              "current_no_entry none)", flush=True)
    tiny = summarize(rounds, "tiny_us", "us", reference=f"{REFERENCE} | grad")
    decode = summarize(rounds, "decode_ms", "ms")
    print(f"{'op | mode':32s} {'baseline':>9s} {'current':>9s} {'no entry':>9s} {'diff':>7s} "
          f"{'entry':>7s} {'library':>7s} {'ratio':>6s}  (us)")
    for key, row in tiny.items():
        print(f"{key:32s} {row['baseline_us']:9.2f} {row['current_us']:9.2f} "
              f"{row['current_no_entry_us']:9.2f} {row['difference_us']:7.2f} {row['entry_us']:7.2f} "
              f"{row['library_us']:7.2f} {row['ratio']:6.2f}")
        if "baseline_us_norm" in row:
            print(f"{'  normalized':32s} {row['baseline_us_norm']:9.2f} {row['current_us_norm']:9.2f} "
                  f"{row['current_no_entry_us_norm']:9.2f} {row['difference_us_norm']:7.2f} "
                  f"{row['entry_us_norm']:7.2f} {row['library_us_norm']:7.2f} {row['ratio_norm']:6.2f}")
    for key, row in decode.items():
        print(f"{key:32s} {row['baseline_ms']:9.3f} {row['current_ms']:9.3f} "
              f"{row['current_no_entry_ms']:9.3f} {row['difference_ms']:7.3f} {row['entry_ms']:7.3f} "
              f"{row['library_ms']:7.3f} {row['ratio']:6.3f}  (ms)")
    first = rounds[0]["current"]
    report = {
        "environment": {"cpu_model_lscpu": lscpu_model(), "cpu_model": first["cpu_model"],
                        "cpu_isa": first["paged_cpu_isa"], "torch_version": first["torch_version"],
                        "torch_threads": first["torch_threads"], "nproc": first["nproc"]},
        "builds": {v: {"tree": str(trees[v]), "source": rounds[0][v]["source"],
                       "library": rounds[0][v]["library"], "cpu_isa": rounds[0][v]["paged_cpu_isa"],
                       "entry_kernel": rounds[0][v]["entry_kernel"]}
                   for v in VARIANTS},
        "settings": {"threads_argument": args.threads, "rounds": args.rounds, "calls": args.calls,
                     "warmup": args.warmup, "chunk": args.chunk, "decode_reps": args.decode_reps},
        "units": "tiny: microseconds per call; decode: milliseconds per call",
        "tiny": tiny, "decode": decode, "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
