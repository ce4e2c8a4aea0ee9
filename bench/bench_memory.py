"""Memory-simulator tables and plots: utilisation per strategy, block-size sweep, sharing savings.

Usage: ``.venv/bin/python bench/bench_memory.py [--quick] [--out-dir DIR]``

Method (details and definitions in docs/memory.md)
-------------------------------------------------
* Workloads: the synthetic ShareGPT- and Alpaca-like traces of
  ``paged_attention_ext.tools.workloads`` (seed 0), max_len 2048.
* Utilisation: ``simulator.replay`` of REPLAY_REQUESTS requests per workload through each
  strategy with a pool of POOL_TOKENS token slots and block size 16.
* Block-size sweep: for each block size, ``simulator.internal_waste`` (empty slots of a
  finished sequence and its block-table length) on both workloads and on a trace of
  uniformly distributed lengths, and the paged replay's utilisation.
* Sharing: ``parallel_sampling_savings`` and ``beam_search_savings`` on the first
  SHARING_REQUESTS requests of each workload for group widths 1..6, and the beam model's
  sensitivity to its switch probability at width 4.

Writes ``memory.json`` and three PNG plots into the output directory (default
``bench/results``) and prints the tables in Markdown for docs/memory.md.
"""

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from paged_attention_ext.tools import simulator, workloads  # noqa: E402
from paged_attention_ext.tools.workloads import Request, Trace  # noqa: E402

MAX_LEN = 2048
POOL_TOKENS = 32768
BLOCK_SIZE = 16
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
WIDTHS = [1, 2, 3, 4, 5, 6]
SWITCH_PROBS = [0.02, 0.05, 0.1, 0.2, 0.5]
BEAM_SWITCH_PROB = 0.1
SEED = 0
DEFAULT_OUT = Path(__file__).resolve().parent / "results"

# Kwon et al., SOSP 2023. Fig. 2: share of KV-cache memory holding token states in the
# paper's experiment (Orca variants vs vLLM). Sec. 6.3 / Fig. 15: memory saved by sharing
# on OPT-13B, over parallel sizes / beam widths 2 to 6.
PAPER = {
    "utilisation": {"max_len": 0.204, "pow2": 0.268, "oracle": 0.382, "paged": 0.963},
    "parallel_sampling": {"alpaca": (0.061, 0.098), "sharegpt": (0.162, 0.305)},
    "beam_search": {"alpaca": (0.376, 0.552), "sharegpt": (0.443, 0.663)},
}
COLORS = {"sharegpt": "tab:blue", "alpaca": "tab:orange", "uniform": "tab:green", "paper": "tab:gray"}


def uniform_trace(num_requests: int, seed: int) -> Trace:
    """Total lengths uniform in [2, MAX_LEN]: the case where (bs - 1) / 2 holds for every bs."""
    totals = np.random.default_rng(seed).integers(2, MAX_LEN + 1, size=num_requests)
    return [Request(int(n) // 2, int(n) - int(n) // 2) for n in totals]


def utilisation(traces: Dict[str, Trace]) -> Dict:
    return {name: {s: asdict(simulator.replay(trace, simulator.make_strategy(
                s, POOL_TOKENS, MAX_LEN, BLOCK_SIZE))) for s in simulator.STRATEGIES}
            for name, trace in traces.items()}


def block_size_sweep(traces: Dict[str, Trace], uniform: Trace) -> Dict:
    sweep: Dict[str, List[Dict]] = {}
    for name, trace in {**traces, "uniform": uniform}.items():
        rows = []
        for bs in BLOCK_SIZES:
            row = {**asdict(simulator.internal_waste(trace, bs)), "theory_waste": (bs - 1) / 2}
            if name != "uniform":
                row["utilisation"] = simulator.replay(
                    trace, simulator.make_strategy("paged", POOL_TOKENS, MAX_LEN, bs)).utilisation
            rows.append(row)
        sweep[name] = rows
    return sweep


def sharing(traces: Dict[str, Trace], num_requests: int) -> Dict:
    result = {}
    for name, trace in traces.items():
        head = trace[:num_requests]
        result[name] = {
            "parallel_sampling": [asdict(simulator.parallel_sampling_savings(head, n, BLOCK_SIZE))
                                  for n in WIDTHS],
            "beam_search": [asdict(simulator.beam_search_savings(head, n, BLOCK_SIZE, BEAM_SWITCH_PROB,
                                                                 SEED)) for n in WIDTHS],
            "beam_switch_sensitivity": [
                {"switch_prob": p, **asdict(simulator.beam_search_savings(head, 4, BLOCK_SIZE, p, SEED))}
                for p in SWITCH_PROBS],
        }
    return result


# ---- plots ----------------------------------------------------------------------------------

def plot_utilisation(util: Dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4))
    groups = {**{name: [util[name][s]["utilisation"] for s in simulator.STRATEGIES] for name in util},
              "paper": [PAPER["utilisation"][s] for s in simulator.STRATEGIES]}
    width = 0.8 / len(groups)
    x = np.arange(len(simulator.STRATEGIES))
    for i, (name, values) in enumerate(groups.items()):
        label = "vLLM paper, Fig. 2 (Orca / vLLM)" if name == "paper" else f"{name} (ours)"
        bars = ax.bar(x + (i - (len(groups) - 1) / 2) * width, [100 * v for v in values], width,
                      label=label, color=COLORS[name])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(x, [f"{s}" for s in simulator.STRATEGIES])
    ax.set_ylabel("reserved KV memory holding tokens (%)")
    ax.set_ylim(0, 110)
    ax.set_title(f"Time-averaged KV utilisation (pool {POOL_TOKENS} slots, block size {BLOCK_SIZE})")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_block_size(sweep: Dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(BLOCK_SIZES, [(bs - 1) / 2 for bs in BLOCK_SIZES], "k--", label="theory (bs - 1) / 2")
    for name, rows in sweep.items():
        left.plot(BLOCK_SIZES, [r["mean_waste"] for r in rows], "o-", color=COLORS[name], label=name,
                  markersize=4)
    left.set_xscale("log", base=2)
    left.set_yscale("symlog", linthresh=1)  # block size 1 wastes nothing: keep 0 on the axis
    left.set_ylim(bottom=0)
    left.set_xlabel("block size (tokens)")
    left.set_ylabel("empty slots per finished sequence")
    left.set_title("Internal waste per sequence")
    left.legend(fontsize=8)
    for name, rows in sweep.items():
        if name == "uniform":
            continue
        table = [r["mean_table_len"] for r in rows]
        wasted = [100 * (1 - r["utilisation"]) for r in rows]
        right.plot(table, wasted, "o-", color=COLORS[name], label=name, markersize=4)
        for r, xv, yv in zip(rows, table, wasted):
            right.annotate(str(r["block_size"]), (xv, yv), textcoords="offset points", xytext=(4, 3),
                           fontsize=7)
    right.set_xscale("log")
    right.set_xlabel("block-table entries per finished sequence (log)")
    right.set_ylabel("reserved memory not holding tokens (%)")
    right.set_title("Waste vs block-table size (labels: block size)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sharing(share: Dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode, title in ((axes[0], "parallel_sampling", "Parallel sampling"),
                            (axes[1], "beam_search", f"Beam search (switch prob {BEAM_SWITCH_PROB})")):
        for name, modes in share.items():
            rows = modes[mode]
            ax.plot([r["width"] for r in rows], [100 * r["saved_fraction"] for r in rows], "o-",
                    color=COLORS[name], label=f"{name} (ours)")
            low, high = PAPER[mode][name]
            ax.plot([2, 6], [100 * low, 100 * high], "s--", color=COLORS[name], alpha=0.5,
                    markerfacecolor="none", label=f"{name} (paper range, widths 2-6)")
        ax.set_xlabel("samples / beam width")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- markdown ---------------------------------------------------------------------------------

def print_tables(result: Dict) -> None:
    util = result["utilisation"]
    print("\n| strategy | " + " | ".join(f"{w} util. | {w} at peak | {w} requests fit" for w in util)
          + " | paper (Fig. 2) |")
    print("|---" * (1 + 3 * len(util) + 1) + "|")
    for s in simulator.STRATEGIES:
        cells = []
        for w in util:
            st = util[w][s]
            cells += [f"{st['utilisation']:.1%}", f"{st['utilisation_at_peak']:.1%}",
                      "all" if st["mean_batch"] is None else f"{st['mean_batch']:.1f}"]
        print(f"| {s} | " + " | ".join(cells) + f" | {PAPER['utilisation'][s]:.1%} |")

    sweep = result["block_size_sweep"]
    print("\n| block size | theory (bs-1)/2 | " + " | ".join(f"{w} waste" for w in sweep)
          + " | sharegpt table len | alpaca table len | sharegpt util. | alpaca util. |")
    print("|---" * (2 + len(sweep) + 4) + "|")
    for i, bs in enumerate(BLOCK_SIZES):
        row = [str(bs), f"{(bs - 1) / 2:.1f}"] + [f"{sweep[w][i]['mean_waste']:.2f}" for w in sweep]
        row += [f"{sweep[w][i]['mean_table_len']:.1f}" for w in ("sharegpt", "alpaca")]
        row += [f"{sweep[w][i]['utilisation']:.1%}" for w in ("sharegpt", "alpaca")]
        print("| " + " | ".join(row) + " |")

    share = result["sharing"]
    print("\n| width | " + " | ".join(f"{w} parallel | {w} beam" for w in share) + " |")
    print("|---" * (1 + 2 * len(share)) + "|")
    for i, n in enumerate(WIDTHS):
        cells = []
        for w in share:
            cells += [f"{share[w]['parallel_sampling'][i]['saved_fraction']:.1%}",
                      f"{share[w]['beam_search'][i]['saved_fraction']:.1%}"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n| switch prob (width 4) | " + " | ".join(share) + " |")
    print("|---" * (1 + len(share)) + "|")
    for i, p in enumerate(SWITCH_PROBS):
        print(f"| {p} | " + " | ".join(f"{share[w]['beam_switch_sensitivity'][i]['saved_fraction']:.1%}"
                                      for w in share) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small traces: a smoke run, not results")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    replay_requests, sharing_requests, uniform_requests = (200, 30, 200) if args.quick else (2000, 300, 2000)

    start = time.perf_counter()
    traces = {name: workloads.synthetic_trace(name, replay_requests, SEED, MAX_LEN)
              for name in ("sharegpt", "alpaca")}
    result = {
        "config": {"max_len": MAX_LEN, "pool_tokens": POOL_TOKENS, "block_size": BLOCK_SIZE,
                   "seed": SEED, "replay_requests": replay_requests,
                   "sharing_requests": sharing_requests, "uniform_requests": uniform_requests,
                   "beam_switch_prob": BEAM_SWITCH_PROB, "lengths": {
                       name: {"mean_prompt_len": mean(r.prompt_len for r in t),
                              "mean_output_len": mean(r.output_len for r in t),
                              **asdict(workloads.WORKLOADS[name])} for name, t in traces.items()}},
        "paper": PAPER,
        "utilisation": utilisation(traces),
        "block_size_sweep": block_size_sweep(traces, uniform_trace(uniform_requests, SEED)),
        "sharing": sharing(traces, sharing_requests),
    }
    result["seconds"] = time.perf_counter() - start

    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_utilisation(result["utilisation"], args.out_dir / "memory_utilisation.png")
    plot_block_size(result["block_size_sweep"], args.out_dir / "memory_block_size.png")
    plot_sharing(result["sharing"], args.out_dir / "memory_sharing.png")
    print_tables(result)
    print(f"\nwrote {args.out_dir}/memory.json and 3 PNG plots ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
