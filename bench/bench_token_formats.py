"""Decode speed of the per-token int8 / int4 caches against bf16, on the same CPU kernel.

Usage: ``.venv/bin/python bench/bench_token_formats.py [--reps N] [--threads N] [--out PATH]``

One decode step of ``paged.attention`` (B=16 sequences of 2048 tokens, 32 query heads on 8
KV heads of 128, blocks of 16 in a random physical order, a bf16 query) over a bf16 cache,
an int8 cache and an int4 cache holding the same K/V (the per-token ones written by
``paged.write_kv``, with their scale tensors). The three are timed in interleaved rounds
(``common/timing.py``: a fresh random order each round), and each format's ratio to bf16 is
the median over rounds of its time over bf16's in the same round (a shared, noisy machine
moves all three alike within a round). Writes ``bench/results/token_formats.json``.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

import paged_attention_ext as pa
from common.environment import machine_info
from common.timing import summarize, time_interleaved_samples
from paged_attention_ext.token_quantization import scale_shape, stored_head_size

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 16, 2048, 32, 8, 128, 16
OUT = Path(__file__).resolve().parent / "results" / "token_formats.json"


def decode_step(cache_dtype: torch.dtype, key: torch.Tensor, value: torch.Tensor,
                tables: torch.Tensor, lens: torch.Tensor, query: torch.Tensor):
    """A call of paged.attention over ``key`` / ``value`` [tokens, kv_heads, head] stored
    in ``cache_dtype`` at the slots the tables give."""
    num_blocks = tables.numel()
    stored = stored_head_size(cache_dtype, HEAD_SIZE) if cache_dtype in (torch.int8, torch.uint8) else HEAD_SIZE
    shape = (num_blocks, KV_HEADS, BLOCK, stored)
    key_cache, value_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    slots = (tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)
    scales = {}
    if cache_dtype in (torch.int8, torch.uint8):
        scales = {name: torch.zeros(scale_shape(cache_dtype, num_blocks, KV_HEADS, BLOCK))
                  for name in ("k_scale", "v_scale")}
        pa.write_kv(key, value, key_cache, value_cache, slots, scales["k_scale"], scales["v_scale"])
    else:
        pa.write_kv(key.to(cache_dtype), value.to(cache_dtype), key_cache, value_cache, slots)
    return lambda: pa.attention(query, key_cache, value_cache, tables, lens, HEAD_SIZE ** -0.5,
                                **scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = CONTEXT // BLOCK
    tables = torch.randperm(BATCH * blocks_per_seq, generator=gen).to(torch.int32).view(BATCH, -1)
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    key = torch.randn(BATCH * CONTEXT, KV_HEADS, HEAD_SIZE, generator=gen)
    value = torch.randn(BATCH * CONTEXT, KV_HEADS, HEAD_SIZE, generator=gen)
    query = torch.randn(BATCH, HEADS, HEAD_SIZE, generator=gen).bfloat16()
    formats = {"bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
    calls = {name: decode_step(dtype, key, value, tables, lens, query) for name, dtype in formats.items()}
    del key, value
    samples = time_interleaved_samples(calls, warmup=5, reps=args.reps)
    report = {"machine": machine_info(), "cpu_isa": pa.cpu_isa(), "threads": args.threads,
              "shape": dict(batch=BATCH, context=CONTEXT, heads=HEADS, kv_heads=KV_HEADS,
                            head_size=HEAD_SIZE, block_size=BLOCK), "formats": {}}
    for name in formats:
        timing = summarize(samples[name])
        ratios = [t / b for t, b in zip(samples[name], samples["bf16"])]
        report["formats"][name] = {"median_ms": timing.median_s * 1e3, "min_ms": timing.min_s * 1e3,
                                   "paired_ratio_to_bf16": statistics.median(ratios)}
        print(f"{name}: median {timing.median_s * 1e3:.2f} ms, best {timing.min_s * 1e3:.2f} ms, "
              f"x{statistics.median(ratios):.2f} of bf16 (median of paired ratios)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
