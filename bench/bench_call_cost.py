"""A tiny decode call's fixed cost against vLLM's CPU attention op, in one process.

Usage (in the vLLM environment, ``make .venv-vllm/.installed``)::

    .venv-vllm/bin/python bench/bench_call_cost.py [--rounds N] [--calls N] [--threads N] [--out PATH]

The call is what an engine runs per layer at the smallest step: decode, B=1, context 16,
32 query / 8 KV heads, head size 128, one block of 32 (vLLM's vector kernel takes blocks of
multiples of 32), bf16 and fp32, under ``torch.inference_mode()``. Its KV is 64 or 128 KiB,
so the time is mostly the call path: Python, the dispatcher, argument checks, planning.
Candidates, on the same keys and values (outputs compared first):

* ``attention``: ``pa.attention`` (a new output per call);
* ``attention_out``: ``pa.attention_out`` into a buffer allocated once;
* ``vllm``: ``torch.ops._C.cpu_attention_with_kv_cache`` into a buffer allocated once, its
  scheduler metadata built once (vLLM builds it once per step for every layer);
* ``torch.add`` of the query to itself: the machine's state, a reference.

Each timed sample is ``--calls`` calls of one candidate; the candidates run round-robin in
a fresh random order per round (``common/timing.py``). Per row: each candidate's median
per-call time over rounds, and ours / vLLM as the median (and range) of the per-round
ratio. ``--threads`` (default 1) sets torch's threads: with more, vLLM's op opens an OpenMP
region on every call, which on a shared host can wait milliseconds for a core; the paged
ops run calls this small on one thread whatever the setting. Run it with
``PYTHONPATH=<checkout>`` to measure another build (the JSON records which one loaded).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paged_attention_ext as pa  # noqa: E402
from common.environment import machine_info  # noqa: E402
from common.timing import time_interleaved_samples  # noqa: E402

HEAD, HEADS, KV_HEADS, BLOCK, CONTEXT = 128, 32, 8, 32, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "call_cost.json"


def candidates(dtype: torch.dtype) -> Dict[str, Callable[[], object]]:
    import vllm._custom_ops as vllm_ops

    gen = torch.Generator().manual_seed(0)
    num_blocks, scale = 4, HEAD ** -0.5
    block_tables = torch.tensor([[2]], dtype=torch.int32)
    seq_lens = torch.tensor([CONTEXT], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
    query = torch.randn(1, HEADS, HEAD, generator=gen).to(dtype)
    key_cache = torch.zeros(num_blocks, KV_HEADS, BLOCK, HEAD, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    # vLLM's cache: [num_blocks, kv_heads, block_size, 2 * head] viewed as keys then values.
    joint = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD, dtype=dtype)
    vllm_key, vllm_value = joint.view(num_blocks, KV_HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    key = torch.randn(CONTEXT, KV_HEADS, HEAD, generator=gen).to(dtype)
    value = torch.randn(CONTEXT, KV_HEADS, HEAD, generator=gen).to(dtype)
    slots = block_tables[0, 0].long() * BLOCK + torch.arange(CONTEXT)
    pa.write_kv(key, value, key_cache, value_cache, slots)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, vllm_key, vllm_value, slots, "vec")
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
        isa="vec", enable_kv_split=True)
    ours_out, vllm_out = torch.empty_like(query), torch.empty_like(query)
    vllm_attention = torch.ops._C.cpu_attention_with_kv_cache.default

    def vllm() -> torch.Tensor:
        vllm_attention(query, vllm_key, vllm_value, vllm_out, query_start_loc, seq_lens, scale,
                       True, None, -1, block_tables, 0.0, metadata, None, None)
        return vllm_out

    calls = {
        "attention": lambda: pa.attention(query, key_cache, value_cache, block_tables, seq_lens, scale),
        "attention_out": lambda: pa.attention_out(ours_out, query, key_cache, value_cache,
                                                  block_tables, seq_lens, scale),
        "vllm": vllm,
        "torch.add": lambda: torch.add(query, query),
    }
    with torch.inference_mode():
        want = vllm().float()
        for name in ("attention", "attention_out"):
            torch.testing.assert_close(calls[name]().float(), want, atol=2e-2, rtol=2e-2)
    return calls


def chunk(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()
    return run


def measure(dtype: torch.dtype, rounds: int, calls: int) -> Dict[str, object]:
    fns = candidates(dtype)
    with torch.inference_mode():
        samples = time_interleaved_samples({k: chunk(f, calls) for k, f in fns.items()}, 2, rounds)
    per_call = {k: [t / calls * 1e6 for t in s] for k, s in samples.items()}
    row: Dict[str, object] = {f"{k}_us": round(statistics.median(v), 2) for k, v in per_call.items()}
    for name in ("attention", "attention_out"):
        ratios = [a / b for a, b in zip(per_call[name], per_call["vllm"])]
        row[f"{name}_over_vllm"] = round(statistics.median(ratios), 3)
        row[f"{name}_over_vllm_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=500, help="calls per timed sample")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows: List[Dict[str, object]] = []
    for name, dtype in DTYPES.items():
        row = {"dtype": name, **measure(dtype, args.rounds, args.calls)}
        rows.append(row)
        print(f"{name}: attention {row['attention_us']:.2f} us, attention_out {row['attention_out_us']:.2f} us, "
              f"vLLM {row['vllm_us']:.2f} us, torch.add {row['torch.add_us']:.2f} us; ours / vLLM "
              f"{row['attention_over_vllm']:.2f} / {row['attention_out_over_vllm']:.2f}", flush=True)
    import vllm
    report = {"what": __doc__.splitlines()[0], "library": pa.__file__, "vllm_version": vllm.__version__,
              "machine": machine_info(), "rounds": args.rounds, "calls": args.calls,
              "shape": {"batch": 1, "context": CONTEXT, "heads": HEADS, "kv_heads": KV_HEADS,
                        "head_size": HEAD, "block_size": BLOCK},
              "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
