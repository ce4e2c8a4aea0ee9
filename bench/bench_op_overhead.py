"""What one call of a paged op costs besides its kernel, two builds side by side (issue 27).

Usage: ``.venv/bin/python bench/bench_op_overhead.py --baseline DIR [--current DIR]
[--rounds N] [--calls N] [--out PATH]``

``DIR`` is a checkout of this repository with its extension built in place (``git worktree
add DIR COMMIT && cd DIR && python setup.py build_ext --inplace``); ``--current`` defaults to
this checkout. One process cannot load both builds (both register the ``paged`` op
namespace), so each round runs one worker process per build, back to back, in alternating
order (as ``ab_kernels.py`` does). Each worker runs in ``/`` with ``PYTHONPATH=<its
checkout>`` and records the ``paged_attention_ext`` it loaded; the run stops if that is not
its checkout's.

Tiny calls (the entry dominates): ``torch.ops.paged.attention`` (decode: 1 sequence of 20
tokens, 8 query / 2 KV heads, head size 64, 4 blocks of 16), ``write_kv`` (1 token) and
``copy_blocks`` (1 layer, 1 pair), each with inputs that do not require grad, under three
modes: grad enabled, ``torch.no_grad()`` and ``torch.inference_mode()`` (the mode is entered
once per chunk of ``--chunk`` calls; the per-call time is the chunk's over ``--chunk``). All
op x mode candidates are timed round-robin (``common/timing.py``), ``--calls`` calls each
per worker after ``--warmup`` calls; a tiny ``torch.add`` is timed beside them as a
reference for the two workers' machine state. Realistic decode (B=16, 32 / 8 heads, head
size 128, context 2048, block 16, huge-page caches in random block order, fp32 and bf16)
shows the same entry against real work.

The summary gives per row each build's median over rounds of its per-worker median, the
difference current - baseline, current / baseline, and the median over rounds of the
per-round ratio (``ratio_paired``). Writes ``bench/results/stable_abi_op_overhead.json``.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, ContextManager, Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "stable_abi_op_overhead.json"
MODES: Dict[str, Callable[[], ContextManager]] = {
    "grad": lambda: torch.enable_grad(),
    "no_grad": lambda: torch.no_grad(),
    "inference_mode": lambda: torch.inference_mode(),
}
DECODE_MODES = ("grad", "inference_mode")
DECODE_DTYPES = ("fp32", "bf16")


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
        "torch.add (reference)": lambda: torch.add(a, b),
    }


def chunked(fn: Callable[[], object], mode: str, chunk: int) -> Callable[[], None]:
    """``chunk`` calls of ``fn`` inside one entry of ``mode``."""
    enter = MODES[mode]

    def run() -> None:
        with enter():
            for _ in range(chunk):
                fn()
    return run


def worker(calls: int, warmup: int, chunk: int, decode_reps: int) -> Dict[str, object]:
    """Times every row with the paged_attention_ext found on sys.path."""
    import paged_attention_ext as pa
    from common.environment import machine_info
    from common.timing import time_interleaved_samples
    from cpu_perf.config import BATCH, BLOCK_SIZE, CONTEXT, DTYPES, HEAD_SIZE
    from cpu_perf.decode import decode_case
    from cpu_perf.machine import Pool, random_pattern

    result: Dict[str, object] = {"library": pa.__file__, "loadavg_start": os.getloadavg(),
                                 **machine_info()}
    # Tiny calls: every op x mode round-robin, the reference once (grad mode).
    fns = tiny_calls()
    candidates = {f"{op} | {mode}": chunked(fn, mode, chunk)
                  for op, fn in fns.items() if op != "torch.add (reference)" for mode in MODES}
    candidates["torch.add (reference) | grad"] = chunked(fns["torch.add (reference)"], "grad", chunk)
    s = time_interleaved_samples(candidates, max(1, warmup // chunk), max(1, calls // chunk))
    result["tiny_us"] = {k: statistics.median(s[k]) / chunk * 1e6 for k in candidates}
    with torch.inference_mode():
        fns["attention"]()
    result["tiny_attention_checksum"] = float(fns["attention"]().double().sum())

    # Realistic decode: B=16, 32 query / 8 KV heads, from DRAM.
    kv_heads = 8
    pool_bytes = BATCH * CONTEXT * kv_heads * HEAD_SIZE * 4  # fp32, the larger dtype
    k_pool, v_pool = Pool(pool_bytes, huge=True), Pool(pool_bytes, huge=True)
    torch.manual_seed(0)  # the same block order and query in both workers
    decode_ms: Dict[str, float] = {}
    checksums: Dict[str, float] = {}
    for name in DECODE_DTYPES:
        k_pool.fill(random_pattern(DTYPES[name], 1))
        v_pool.fill(random_pattern(DTYPES[name], 2))
        case = decode_case(k_pool, v_pool, name, BATCH, kv_heads, CONTEXT, BLOCK_SIZE)
        call = lambda c=case: torch.ops.paged.attention(c.query, c.key_cache, c.value_cache,
                                                        c.block_tables, c.seq_lens, HEAD_SIZE**-0.5)
        cands = {f"decode {name} 32/{kv_heads} | {mode}": chunked(call, mode, 1) for mode in DECODE_MODES}
        s = time_interleaved_samples(cands, 2, decode_reps)
        decode_ms.update({k: statistics.median(v) * 1e3 for k, v in s.items()})
        checksums[name] = float(call().double().sum())
    result["decode_ms"] = decode_ms
    result["decode_checksums"] = checksums
    result["loadavg_end"] = os.getloadavg()
    return result


def run_worker(tree: Path, args: argparse.Namespace) -> Dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, __file__, "--worker", "--calls", str(args.calls), "--warmup",
           str(args.warmup), "--chunk", str(args.chunk), "--decode-reps", str(args.decode_reps)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd="/")
    result = json.loads(out.stdout)
    if not Path(result["library"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the worker for {tree} loaded {result['library']}")
    return result


def summarize(rounds: List[Dict[str, Dict[str, object]]], field: str, unit: str) -> Dict[str, object]:
    """Per row: both builds' medians over rounds, their difference and ratios."""
    rows = {}
    for key in rounds[0]["current"][field]:
        cur = [r["current"][field][key] for r in rounds]
        base = [r["baseline"][field][key] for r in rounds]
        c, b = statistics.median(cur), statistics.median(base)
        rows[key] = {f"baseline_{unit}": b, f"current_{unit}": c, f"difference_{unit}": c - b,
                     "ratio": c / b, "ratio_paired": statistics.median(x / y for x, y in zip(cur, base)),
                     f"baseline_{unit}_range": [min(base), max(base)],
                     f"current_{unit}_range": [min(cur), max(cur)]}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="checkout with the baseline build")
    parser.add_argument("--current", type=Path, default=ROOT, help="checkout with the current build")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per row and worker")
    parser.add_argument("--warmup", type=int, default=1000, help="untimed calls per row first")
    parser.add_argument("--chunk", type=int, default=100, help="calls per timed sample")
    parser.add_argument("--decode-reps", type=int, default=30, help="timed decode steps per row")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.calls, args.warmup, args.chunk, args.decode_reps)))
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    trees = {"current": args.current, "baseline": args.baseline}
    rounds = []
    for i in range(args.rounds):
        order = ["current", "baseline"] if i % 2 == 0 else ["baseline", "current"]
        rounds.append({build: run_worker(trees[build], args) for build in order})
        print(f"round {i + 1}/{args.rounds} done", flush=True)
    for field in ("tiny_attention_checksum", "decode_checksums"):
        if len({json.dumps(r[b][field]) for r in rounds for b in trees}) != 1:
            print(f"warning: {field} differs between builds or rounds", flush=True)
    tiny = summarize(rounds, "tiny_us", "us")
    decode = summarize(rounds, "decode_ms", "ms")
    print(f"{'op | mode':32s} {'baseline us':>11s} {'current us':>11s} {'diff us':>8s} {'ratio':>6s}")
    for key, row in tiny.items():
        print(f"{key:32s} {row['baseline_us']:11.2f} {row['current_us']:11.2f} "
              f"{row['difference_us']:8.2f} {row['ratio']:6.2f}")
    for key, row in decode.items():
        print(f"{key:32s} {row['baseline_ms']:9.3f}ms {row['current_ms']:9.3f}ms "
              f"{row['difference_ms'] * 1e3:6.0f}us {row['ratio']:6.3f}")
    first = rounds[0]["current"]
    report = {
        "environment": {"cpu_model_lscpu": lscpu_model(), "cpu_model": first["cpu_model"],
                        "cpu_isa": first["paged_cpu_isa"], "torch_version": first["torch_version"],
                        "torch_threads": first["torch_threads"], "nproc": first["nproc"]},
        "builds": {b: {"tree": str(trees[b]), "source": rounds[0][b]["source"],
                       "library": rounds[0][b]["library"], "cpu_isa": rounds[0][b]["paged_cpu_isa"]}
                   for b in trees},
        "settings": {"rounds": args.rounds, "calls": args.calls, "warmup": args.warmup,
                     "chunk": args.chunk, "decode_reps": args.decode_reps},
        "units": "tiny: microseconds per call; decode: milliseconds per call",
        "tiny": tiny, "decode": decode, "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
