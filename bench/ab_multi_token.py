"""Two builds of the CPU kernel side by side on causal multi-token attention, every cache dtype.

Usage: ``.venv/bin/python bench/ab_multi_token.py --baseline DIR [--rounds N] [--isa ISA] [--out PATH]``

``DIR`` is another checkout with its extension built in place (as for ``ab_kernels.py``,
which times only fp32 and bf16 here). Each round runs one worker process per build, in
alternating order; a worker times 512 causal queries over 4096 tokens (32/8 heads, head
size 128, block 16, random block order) for fp32, bf16, fp16, e4m3 and e5m2 caches (fp8
with a bf16 query and unit scales), round-robin, best of ``--reps`` calls, in GFLOP/s.
The summary gives each build's median over rounds, the median of the per-round ratios,
and each dtype's rate relative to the same worker's fp32 (the "never slower per element
than fp32" target).
"""

import os
import statistics
from pathlib import Path
from typing import Dict

from common.ab import ab_parser, ab_rounds, paired, write_report
from common.environment import cpu_model, source_revision
from common.timing import time_interleaved_samples

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu_multi_token_ab.json"
SEQ_LEN, QUERIES, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4096, 512, 32, 8, 128, 16


def worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa

    torch.set_num_threads(2)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    gen = torch.Generator().manual_seed(0)
    num_blocks = SEQ_LEN // BLOCK
    table = torch.randperm(num_blocks, dtype=torch.int32, generator=gen).view(1, -1)
    lens = torch.tensor([SEQ_LEN], dtype=torch.int32)
    starts = torch.tensor([0, QUERIES], dtype=torch.int32)
    pairs = sum(SEQ_LEN - QUERIES + i + 1 for i in range(QUERIES))
    flops = 4 * HEADS * HEAD_SIZE * pairs
    calls = {}
    for name, dtype in dtypes.items():
        shape = (num_blocks, KV_HEADS, BLOCK, HEAD_SIZE)
        k = torch.randn(shape, generator=gen).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
        q = torch.randn(QUERIES, HEADS, HEAD_SIZE, generator=gen).to(
            torch.bfloat16 if dtype.itemsize == 1 else dtype)
        scales = {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} if dtype.itemsize == 1 else {}
        calls[name] = lambda q=q, k=k, v=v, scales=scales: pa.attention(
            q, k, v, table, lens, HEAD_SIZE ** -0.5, starts, **scales)
    samples = time_interleaved_samples(calls, warmup=1, reps=reps)
    return {"isa": pa.cpu_isa(), "library": pa.__file__,
            "gflops": {name: flops / min(t) / 1e9 for name, t in samples.items()}}


def main() -> None:
    parser = ab_parser(__doc__.splitlines()[0], default_reps=4, default_out=DEFAULT_OUT)
    parser.add_argument("--isa", help="PAGED_ATTENTION_CPU_ISA for both builds (default: the best)")
    args = parser.parse_args()
    if args.isa:
        os.environ["PAGED_ATTENTION_CPU_ISA"] = args.isa
    rounds = ab_rounds(parser, args, Path(__file__), worker)
    if rounds is None:
        return
    summary = {}
    print(f"{'dtype':6s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}  vs fp32 (base -> cur)")
    for name in rounds[0]["current"]["gflops"]:
        def vs_fp32(build: str) -> float:
            return statistics.median(r[build]["gflops"][name] / r[build]["gflops"]["fp32"] for r in rounds)

        both = paired(rounds, lambda w: w["gflops"][name])
        row = {"baseline_gflops": both["baseline"], "current_gflops": both["current"],
               "speedup_paired": both["speedup_paired"],
               "baseline_vs_fp32": vs_fp32("baseline"), "current_vs_fp32": vs_fp32("current")}
        summary[name] = row
        print(f"{name:6s} {row['baseline_gflops']:9.1f} {row['current_gflops']:9.1f} "
              f"{row['speedup_paired']:7.2f}x  {row['baseline_vs_fp32']:.2f}x -> {row['current_vs_fp32']:.2f}x")
    report = {"cpu": cpu_model(), "isa": rounds[0]["current"]["isa"], "source": source_revision(),
              "baseline": str(args.baseline), "rounds": rounds, "summary": summary}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
