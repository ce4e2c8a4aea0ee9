"""The default run's targets (decode, sweeps, multi-token and cache ops against the machine)
evaluated on a report, the target table, and the two sweep plots."""

from pathlib import Path
from typing import Dict, List, Optional

from .config import BATCH, KV_HEADS, LONG_CONTEXT

# The thresholds, in percent (docs/performance.md, "Targets").
DECODE_TARGET = {"fp32": 80.0, "bf16": 70.0, "fp16": 70.0}
LONG_TARGET = 70.0
BLOCK_TARGET = 70.0
MT_TARGET = 50.0
COPY_TARGET = 80.0


def target(name: str, config: str, measured: float, threshold: float, unit: str,
           detail: str) -> Dict[str, object]:
    return {"target": name, "config": config, "measured": round(measured, 1),
            "threshold": threshold, "unit": unit, "pass": measured >= threshold, "detail": detail}


def evaluate(report: Dict[str, object]) -> List[Dict[str, object]]:
    targets = []
    for row in report["decode"]:
        h = row["paged_huge"]
        targets.append(target(
            "decode % of read BW", f"{row['dtype']} 32/{row['num_kv_heads']} B=16 ctx 2048 bs 16",
            h["pct_paired"], DECODE_TARGET[row["dtype"]], "% (paired)",
            f"{h['rate_median']:.1f} GB/s; median/median {h['pct_median']:.0f}%, "
            f"vs best read {h['pct_best']:.0f}%; plain 4K pages {row['paged_plain']['pct_paired']:.0f}%"))
    long = report["long_context"]
    t = long["threads"]
    for row in long["rows"]:
        if row["num_kv_heads"] not in KV_HEADS:
            continue
        many = row[f"threads_{t}"]
        targets.append(target(
            "B=1 ctx 32k % of read BW", f"fp32 32/{row['num_kv_heads']}, {t} threads",
            many["pct_paired"], LONG_TARGET, "% (paired)",
            f"{many['rate_median']:.1f} GB/s; {t} vs 1 thread {row['speedup_paired']:.2f}x"))
    for series in report["block_sweep"]:
        eligible = [p for p in series["points"] if p["block_size"] >= 8]
        worst = min(eligible, key=lambda p: p["pct_of_best"])
        worst_norm = min(p["pct_of_best_read_normalized"] for p in eligible)
        best = max(series["points"], key=lambda p: p["rate_median"])
        targets.append(target(
            "block size >= 8 vs best", f"{series['dtype']} 32/{series['num_kv_heads']}",
            worst["pct_of_best"], BLOCK_TARGET, "% of best",
            f"worst bs {worst['block_size']}, best bs {best['block_size']} "
            f"({best['rate_median']:.1f} GB/s); read-normalized worst {worst_norm:.0f}%"))
    for row in report["multi_token"]:
        p = row["paged"]
        targets.append(target(
            "multi-token % of matmul", f"{row['dtype']} 512 q over 4096, 32/8",
            p["pct_paired"], MT_TARGET, "% (paired)",
            f"{p['rate_median']:.0f} GFLOP/s vs mm {row['matmul']['rate_median']:.0f} GFLOP/s"))
    for row in report["cache_ops"]:
        op = row[row["op"]]
        targets.append(target(
            f"{row['op']} % of copy", f"fp32 {row['payload_bytes'] >> 20} MiB", op["pct_paired"],
            COPY_TARGET, "% (paired)",
            f"{op['rate_median']:.1f} GB/s vs copy {row['copy']['rate_median']:.1f} GB/s"))
    return targets


def print_targets(targets: List[Dict[str, object]]) -> None:
    print("\nTargets (paired = median over rounds of candidate / reference in the same round)")
    for t in targets:
        verdict = "PASS" if t["pass"] else "FAIL"
        print(f"  {verdict}  {t['target']:<26} {t['config']:<34} {t['measured']:6.1f} "
              f"(>= {t['threshold']:g})  {t['detail']}")


COLORS = {("fp32", 32): "tab:blue", ("fp32", 8): "tab:orange", ("bf16", 32): "tab:green",
          ("bf16", 8): "tab:red"}


def plot_sweep(series_list: List[Dict[str, object]], key: str, path: Path, title: str,
               long: Optional[Dict[str, object]] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 9), sharex=True)
    for series in series_list:
        label = f"{series['dtype']} 32/{series['num_kv_heads']}"
        color = COLORS[(series["dtype"], series["num_kv_heads"])]
        xs = [p[key] for p in series["points"]]
        top.plot(xs, [p["rate_median"] for p in series["points"]], "o-", color=color,
                 label=f"paged {label}")
        read = series["read_bandwidth"]["rate_median"]
        top.plot(xs, [read] * len(xs), "--", color=color, alpha=0.7,
                 label=f"read BW (same rounds as {label})")
        if key == "context":
            for p in series["points"]:
                if p["batch"] != BATCH:
                    top.annotate(f"B={p['batch']}", (p[key], p["rate_median"]), fontsize=7,
                                 color=color, textcoords="offset points", xytext=(3, -10))
            bottom.plot(xs, [p["pct_paired"] for p in series["points"]], "o-", color=color,
                        label=label)
        else:
            bottom.plot(xs, [p["pct_of_best"] for p in series["points"]], "o-", color=color,
                        label=label)
    if key == "context":
        if long is not None:
            t = long["threads"]
            for row in long["rows"]:
                if (row["dtype"], row["num_kv_heads"]) in COLORS:
                    color = COLORS[(row["dtype"], row["num_kv_heads"])]
                    m = row[f"threads_{t}"]
                    top.plot([LONG_CONTEXT], [m["rate_median"]], "*", color=color, markersize=13)
                    bottom.plot([LONG_CONTEXT], [m["pct_paired"]], "*", color=color, markersize=13)
            top.plot([], [], "*", color="gray", markersize=13, label="B=1, 32k")
        for value, style in ((80, "-"), (70, ":")):
            bottom.axhline(value, color="black", linestyle=style, linewidth=1,
                           label=f"target {value}% ({'fp32' if value == 80 else '16-bit, B=1'})")
        bottom.set_ylabel("paged % of read BW (paired, same rounds)")
        bottom.set_xlabel("context (tokens); B=16 unless marked")
    else:
        bottom.axhline(BLOCK_TARGET, color="black", linestyle=":", linewidth=1,
                       label="target 70% (block size >= 8)")
        bottom.axvspan(0.8, 6, color="gray", alpha=0.15)
        bottom.set_ylabel("% of the series' best block size")
        bottom.set_xlabel("block size (tokens); shaded: below 8, no target")
    top.set_ylabel("GB/s (effective KV, median)")
    top.set_title(title)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    xs = [p[key] for p in series_list[0]["points"]]
    bottom.set_xticks(xs)
    bottom.set_xticklabels([str(x) for x in xs])
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(report: Dict[str, object], directory: Path) -> None:
    for key, name, title in (
            ("context", "cpu_perf_context.png",
             "Paged decode vs context (H=32, D=128, block 16), beside read bandwidth"),
            ("block_size", "cpu_perf_block_size.png",
             "Paged decode vs block size (B=16, ctx 2048, H=32, D=128), beside read bandwidth")):
        path = directory / name
        sweep = report["context_sweep" if key == "context" else "block_sweep"]
        plot_sweep(sweep, key, path, title, report["long_context"] if key == "context" else None)
        print(f"wrote {path}")

