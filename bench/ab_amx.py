"""Two builds of the amx kernel side by side on the shapes it takes (issue 25).

Usage: ``.venv/bin/python bench/ab_amx.py --baseline DIR [--rounds N] [--reps N] [--out PATH]``
on a CPU with AMX.

``DIR`` is another checkout with its extension built in place (as for ``ab_kernels.py``).
Each round runs one worker process per build, in alternating order
(``common/ab.py``); a worker, with ``PAGED_ATTENTION_CPU_ISA=amx`` and two threads, times
bf16 and e4m3 caches (bf16 queries, unit scales, random block order, head size 128,
block 16) on ``bench_amx.py``'s grouped decode shapes (16/8, 32/8 at context 2048; 32/4,
32/1 at 8192; B=16) and its causal multi-token case (512 queries at the end of 4096 tokens,
32/8), round-robin, best of ``--reps`` calls: KV GB/s for decode, GFLOP/s for multi-token.
The summary gives each build's median over rounds and the median of the per-round ratios.
``AB_AMX_CASES=bf16,decode`` keeps the cases whose names contain every listed word;
``AB_AMX_HUGE_PAGES=1`` puts the caches on huge pages (as ``PagedCache`` allocates them)
instead of torch's 4 KiB pages; ``AB_AMX_ISA=avx512_vbmi`` times these shapes on another
kernel.
Correctness is the tests' job (``test_amx_tiles``, the ISA-parametrised attention tests).
"""

import os
from pathlib import Path
from typing import Dict

from common.ab import ab_parser, ab_rounds, paired, write_report
from common.environment import cpu_model, source_revision
from common.timing import time_interleaved_samples

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu_amx_ab.json"
HEAD, BLOCK = 128, 16
DECODE = [(16, 8, 2048), (32, 8, 2048), (32, 4, 8192), (32, 1, 8192)]


def worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from paged_attention_ext.host_memory import zeros_huge_pages

    torch.set_num_threads(2)
    caches = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
    shapes = [(f"decode {h}/{kv} ctx {n}", h, kv, [n] * 16, [1] * 16) for h, kv, n in DECODE]
    shapes.append(("multi-token 32/8 512/4096", 32, 8, [4096], [512]))
    gen = torch.Generator().manual_seed(0)
    huge = os.environ.get("AB_AMX_HUGE_PAGES") == "1"

    def pool(values: torch.Tensor) -> torch.Tensor:
        return zeros_huge_pages(values.shape, values.dtype).copy_(values) if huge else values
    calls, work = {}, {}
    for cache, dtype in caches.items():
        for label, heads, kv_heads, lens, q_lens in shapes:
            blocks = sum(-(-n // BLOCK) for n in lens)
            shape = (blocks, kv_heads, BLOCK, HEAD)
            k = pool(torch.randn(shape, generator=gen).to(dtype))
            v = pool(torch.randn(shape, generator=gen).to(dtype))
            table = torch.randperm(blocks, generator=gen).to(torch.int32).view(len(lens), -1)
            q = torch.randn(sum(q_lens), heads, HEAD, generator=gen).to(torch.bfloat16)
            kwargs = {} if dtype == torch.bfloat16 else {"k_scale": torch.tensor(1.0),
                                                         "v_scale": torch.tensor(1.0)}
            if max(q_lens) > 1:
                starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
                kwargs["query_start_loc"] = torch.tensor(starts, dtype=torch.int32)
            args = (q, k, v, table, torch.tensor(lens, dtype=torch.int32), HEAD ** -0.5)
            name = f"{cache} {label}"
            calls[name] = lambda args=args, kwargs=kwargs: pa.attention(*args, **kwargs)
            if max(q_lens) > 1:
                pairs = sum(sum(n - m + i + 1 for i in range(m)) for n, m in zip(lens, q_lens))
                work[name] = (4 * heads * HEAD * pairs, "GFLOP/s")
            else:
                work[name] = (2 * k.numel() * k.element_size(), "GB/s")
    words = [w for w in os.environ.get("AB_AMX_CASES", "").split(",") if w]
    calls = {name: call for name, call in calls.items() if all(w in name for w in words)}
    samples = time_interleaved_samples(calls, warmup=1, reps=reps)
    return {"isa": pa.cpu_isa(), "library": pa.__file__,
            "rates": {name: work[name][0] / min(t) / 1e9 for name, t in samples.items()},
            "units": {name: work[name][1] for name in calls}}


def main() -> None:
    parser = ab_parser(__doc__.splitlines()[0], default_reps=5, default_out=DEFAULT_OUT)
    args = parser.parse_args()
    isa = os.environ.get("AB_AMX_ISA", "amx")
    os.environ["PAGED_ATTENTION_CPU_ISA"] = isa
    rounds = ab_rounds(parser, args, Path(__file__), worker)
    if rounds is None:
        return
    if rounds[0]["current"]["isa"] != isa:
        raise SystemExit(f"this CPU's kernel is {rounds[0]['current']['isa']}: no {isa} to measure")
    summary = {}
    print(f"{'case':42s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}")
    for name, unit in rounds[0]["current"]["units"].items():
        row = {"unit": unit, **paired(rounds, lambda w: w["rates"][name])}
        summary[name] = row
        low, high = row["speedup_range"]
        print(f"{name:42s} {row['baseline']:9.1f} {row['current']:9.1f} {row['speedup_paired']:7.2f}x"
              f"  ({low:.2f}-{high:.2f}) {unit}")
    report = {"cpu": cpu_model(), "isa": rounds[0]["current"]["isa"], "source": source_revision(),
              "baseline": str(args.baseline), "rounds": rounds, "summary": summary}
    write_report(args.out, report)


if __name__ == "__main__":
    main()
