"""Two builds of the extension side by side, for ``bench/ab.py``'s suites.

One process cannot load both builds (both register the ``paged`` op namespace), so each
round runs the suite's worker (``bench/ab.py SUITE --worker``) once per build, back to
back, in alternating order: the host's bandwidth and clock move in bursts of seconds to
minutes, so the two workers of a round usually see the same state.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent.parent


def add_ab_arguments(parser: argparse.ArgumentParser, default_reps: int, default_out: Path) -> None:
    """The arguments every two-build suite takes (a suite adds its own)."""
    parser.add_argument("--baseline", type=Path, help="checkout with its extension built in place")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=default_reps, help="timed repetitions per worker")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run_worker(command: Sequence[str], library_root: Path, reps: int) -> Dict[str, object]:
    """``command --worker`` with ``library_root``'s paged_attention_ext first on the path."""
    env = dict(os.environ, PYTHONPATH=str(library_root))
    out = subprocess.run([sys.executable, *command, "--worker", "--reps", str(reps)], env=env,
                         check=True, capture_output=True, text=True, cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternating_rounds(command: Sequence[str], baseline: Path, rounds: int, reps: int
                       ) -> List[Dict[str, Dict[str, object]]]:
    """Per round {"current": ..., "baseline": ...} worker results; this checkout is current."""
    roots = {"current": ROOT, "baseline": baseline.resolve()}
    results = []
    for i in range(rounds):
        order = ["current", "baseline"] if i % 2 == 0 else ["baseline", "current"]
        results.append({build: run_worker(command, roots[build], reps) for build in order})
        print(f"round {i + 1}/{rounds} done", flush=True)
    return results


def ab_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace, command: Sequence[str],
              worker: Callable[[int], Dict[str, object]]
              ) -> Optional[List[Dict[str, Dict[str, object]]]]:
    """As a worker (``--worker``): print worker(reps) as JSON and return None. Otherwise the
    alternating rounds of this checkout against ``--baseline``, each worker started as
    ``command --worker``."""
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return None
    if args.baseline is None:
        parser.error("--baseline is required")
    return alternating_rounds(command, args.baseline, args.rounds, args.reps)


def write_report(path: Path, report: Dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def paired(rounds: List[Dict[str, Dict[str, object]]],
           value: Callable[[Dict[str, object]], float]) -> Dict[str, object]:
    """value(worker result) per build: each build's median over rounds, and the median and
    range of the per-round ratio current / baseline (both workers of a round saw the same
    host state)."""
    current = [value(r["current"]) for r in rounds]
    baseline = [value(r["baseline"]) for r in rounds]
    ratios = [c / b for c, b in zip(current, baseline)]
    return {"baseline": statistics.median(baseline), "current": statistics.median(current),
            "speedup_paired": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]}
