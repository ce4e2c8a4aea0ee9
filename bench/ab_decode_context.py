"""Two builds of the CPU kernel side by side on decode across context lengths.

Usage: ``.venv/bin/python bench/ab_decode_context.py --baseline DIR [--rounds N] [--reps N] [--out PATH]``

``DIR`` is another checkout with its extension built in place (as for ``ab_kernels.py``).
Each round runs one worker process per build, in alternating order (``common/ab.py``); a
worker (two threads, the CPU's own kernel or ``PAGED_ATTENTION_CPU_ISA``) times bf16 decode,
32/8 heads, head size 128, block 16, with bf16 queries and outputs, at contexts 256, 512,
2048 and 16384 with B = 1 GiB of KV / context: each context its own 1 GiB of huge-page
pools in a random block order, the host's L3 flushed by a 1 GiB read before every call,
the contexts in a rotating order, best of ``--reps`` calls, in GB/s of KV. Short contexts
are many short items, each with its own set-up, output rows and pipeline start: where
per-item and per-call work shows.
"""

from pathlib import Path
from typing import Dict, List

from common.ab import ab_parser, ab_rounds, paired, write_report
from common.environment import cpu_model, source_revision
from common.timing import time_call

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu_decode_context_ab.json"
CONTEXTS = (256, 512, 2048, 16384)
KV_BYTES, HEADS, KV_HEADS, HEAD, BLOCK = 1 << 30, 32, 8, 128, 16


def worker(reps: int) -> Dict[str, object]:
    import torch

    import paged_attention_ext as pa
    from paged_attention_ext.host_memory import zeros_huge_pages

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    tokens = KV_BYTES // (2 * KV_HEADS * HEAD * 2)
    blocks = tokens // BLOCK
    calls = {}
    for context in CONTEXTS:
        batch = tokens // context
        k = zeros_huge_pages((blocks, KV_HEADS, BLOCK, HEAD), torch.bfloat16)
        v = zeros_huge_pages((blocks, KV_HEADS, BLOCK, HEAD), torch.bfloat16)
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, -1)
        q = torch.randn(batch, HEADS, HEAD, generator=gen).to(torch.bfloat16)
        lens = torch.full((batch,), context, dtype=torch.int32)
        calls[context] = lambda q=q, k=k, v=v, table=table, lens=lens: pa.attention(q, k, v, table, lens,
                                                                                    HEAD ** -0.5)
    flush = zeros_huge_pages((KV_BYTES // 4,), torch.float32).fill_(1.0)
    samples: Dict[int, List[float]] = {context: [] for context in CONTEXTS}
    for call in calls.values():
        call()
    for rep in range(reps):
        shift = rep % len(CONTEXTS)
        for context in CONTEXTS[shift:] + CONTEXTS[:shift]:
            flush.sum()
            samples[context].append(time_call(calls[context]))
    return {"isa": pa.cpu_isa(), "rates": {str(c): KV_BYTES / min(t) / 1e9 for c, t in samples.items()}}


def main() -> None:
    parser = ab_parser(__doc__.splitlines()[0], default_reps=8, default_out=DEFAULT_OUT)
    args = parser.parse_args()
    rounds = ab_rounds(parser, args, Path(__file__), worker)
    if rounds is None:
        return
    summary = {}
    print(f"{'context':>8s} {'baseline':>9s} {'current':>9s} {'speedup':>8s}  (GB/s of KV)")
    for context in CONTEXTS:
        row = paired(rounds, lambda w, c=str(context): w["rates"][c])
        summary[str(context)] = row
        low, high = row["speedup_range"]
        print(f"{context:8d} {row['baseline']:9.1f} {row['current']:9.1f} {row['speedup_paired']:7.2f}x"
              f"  ({low:.2f}-{high:.2f})")
    write_report(args.out, {"cpu": cpu_model(), "isa": rounds[0]["current"]["isa"], "source": source_revision(),
                            "baseline": str(args.baseline), "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
