"""Sliding-window layers in KV groups of their own: memory, capacity, attention time.

Usage: ``.venv/bin/python bench/bench_kv_groups.py [--quick] [--out PATH] [--threads N]``

Method
------
* **Bytes per sequence** (no model): for each preset shape of ``paged-attention memory``
  (Gemma-3, GPT-OSS, Gemma-2, Cohere-2, Mistral v0.1), the block manager places one sequence
  of 4k and 32k tokens and takes one decode step; the blocks each KV group then holds, times
  the page size, against one block table for every layer (the layout before KV groups) and against the
  design's estimate (the full layers' share plus the sliding layers' (window + block) /
  context). Goal: each group within one block of what its tokens need.
* **Capacity**: a tiny Gemma-3-shaped model (6 layers, 5 sliding with window 512 : 1 full,
  random weights, fp32) served by the engine with the same KV-pool bytes twice: KV groups
  (``hybrid_kv_groups=True``) and one table for every layer (``False``). Requests of 8192
  tokens (8160 prompt + 32 generated) all arrive at once; the figure is the most requests
  running at once (the pool's limit; a prompt's blocks are all held while it is prefilled,
  a step later its sliding groups keep only the window). Goal: >= 4x.
* **Attention time**: ``paged.attention`` decode, 8 sequences, 32 query / 16 KV heads of
  128 (Gemma-3-27B), bf16, block 16, window 1024, at contexts of 2k and 32k tokens: the
  sliding layer with its freed entries -1 (its pool holds only the window's blocks) and a
  full layer for contrast; interleaved timing (bench/common/timing.py). Goal: sliding at 32k
  <= 1.2x sliding at 2k.

Results are printed and written as JSON (default ``bench/results/kv_groups.json``).
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Dict

import torch
import transformers

from paged_attention_ext import ops
from paged_attention_ext.block_table import NULL_BLOCK
from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.testing import random_pair
from paged_attention_ext.tools.memory import PRESETS, kv_report
from common.environment import cpu_model
from common.timing import time_interleaved

SHAPES = ["gemma-3-27b", "gemma-3-1b", "gpt-oss-120b", "gemma-2-9b", "cohere-2-7b", "mistral-7b-v0.1"]
BLOCK_SIZE = 16


def bytes_per_sequence() -> Dict:
    rows = {}
    for name in SHAPES:
        shape = PRESETS[name]
        for length in (4096, 32768):
            groups = kv_report(shape, "bfloat16", length, BLOCK_SIZE)["kv_groups"]
            sliding = sum(1 for w in shape.windows() if w) / shape.layers
            estimate = 1 - sliding + sliding * min(1.0, (shape.sliding_window + BLOCK_SIZE) / length)
            within = all(g["blocks_held"] <= -(-min(length, g["sliding_window"] or length)
                                               // BLOCK_SIZE) + 1 for g in groups["groups"])
            rows[f"{name}@{length}"] = {
                "bytes_grouped": groups["bytes_per_sequence"],
                "bytes_single_table": groups["bytes_per_sequence_single_table"],
                "fraction_of_single_table": groups["fraction_of_single_table"],
                "issue_estimate_fraction": estimate, "saving": groups["saving"],
                "groups": len(groups["groups"]), "padded_layers": groups["padded_layers"],
                "each_group_within_one_block": within}
            print(f"{name:16s} {length:6d} tokens: {groups['fraction_of_single_table']:6.1%} of one "
                  f"table (estimate {estimate:6.1%}), {groups['saving']:5.2f}x, within a block: {within}")
    return rows


def gemma3_tiny() -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=512,
        max_position_embeddings=16384, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def capacity(quick: bool) -> Dict:
    length, new_tokens = (2048, 8) if quick else (8192, 32)
    fits_single = 4 if quick else 8  # requests one table per sequence fits
    paged, _ = random_pair(gemma3_tiny())
    del _
    pages_single = fits_single * (-(-length // BLOCK_SIZE) + 1)
    results = {}
    for hybrid in (False, True):
        layers_per_page = 6 if not hybrid else 1  # 6 groups of 1 layer: a sixth of the page
        config = EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=pages_single * 6 // layers_per_page,
                              num_host_blocks=0, enable_prefix_caching=False,
                              preemption_mode="recompute", max_num_batched_tokens=2 * length,
                              hybrid_kv_groups=hybrid)
        engine = LLMEngine(paged, config)
        g = torch.Generator().manual_seed(0)
        count = int(fits_single * 4.5) + 1
        for i in range(count):
            prompt = torch.randint(1, 512, (length - new_tokens,), generator=g).tolist()
            engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=new_tokens)))
        most, start, steps = 0, time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            most = max(most, len(engine.scheduler.running))
        key = "kv_groups" if hybrid else "single_table"
        results[key] = {"pool_bytes": engine.kv_cache.num_blocks * engine.kv_cache.block_bytes,
                        "pool_blocks": engine.kv_cache.num_blocks,
                        "kv_groups": len(engine.kv_cache.kv_groups.groups),
                        "most_running": most, "requests": count, "steps": steps,
                        "wall_s": time.perf_counter() - start,
                        "preemptions": engine.report()["preemptions"]}
        print(f"capacity {key:12s}: {most} requests of {length} tokens at once "
              f"({results[key]['pool_bytes'] / 2**20:.0f} MiB pool, {steps} steps)")
    assert results["kv_groups"]["pool_bytes"] == results["single_table"]["pool_bytes"]
    results["request_tokens"] = length
    results["ratio"] = results["kv_groups"]["most_running"] / results["single_table"]["most_running"]
    print(f"capacity ratio: {results['ratio']:.2f}x")
    return results


def decode_case(context: int, window: int, sliding: bool, seqs: int = 8) -> Dict:
    """Inputs of one decode step; a sliding layer's table has -1 before its window."""
    heads, kv_heads, head_size = 32, 16, 128
    blocks_per_seq = -(-context // BLOCK_SIZE)
    first = max(0, context - window) // BLOCK_SIZE if sliding else 0
    held = blocks_per_seq - first
    g = torch.Generator().manual_seed(0)
    shape = (seqs * held, kv_heads, BLOCK_SIZE, head_size)
    key = torch.randn(shape, generator=g).to(torch.bfloat16)
    value = torch.randn(shape, generator=g).to(torch.bfloat16)
    physical = torch.randperm(seqs * held, generator=g).int().view(seqs, held)
    tables = torch.full((seqs, blocks_per_seq), NULL_BLOCK, dtype=torch.int32)
    tables[:, first:] = physical
    return dict(query=torch.randn(seqs, heads, head_size, generator=g).to(torch.bfloat16),
                key_cache=key, value_cache=value, block_tables=tables,
                seq_lens=torch.full((seqs,), context, dtype=torch.int32), scale=head_size ** -0.5,
                sliding_window=window if sliding else -1)


def attention_time(quick: bool) -> Dict:
    window = 1024
    contexts = (2048, 8192) if quick else (2048, 32768)
    cases = {f"{'sliding' if sliding else 'full'}@{c}": decode_case(c, window, sliding)
             for c in contexts for sliding in (True, False)}
    calls = {name: (lambda a=args: ops.attention(**a)) for name, args in cases.items()}
    timings = time_interleaved(calls, warmup=2, reps=5 if quick else 15)
    short, long = contexts
    result = {name: {"median_s": t.median_s, "min_s": t.min_s} for name, t in timings.items()}
    result["sliding_long_over_short"] = timings[f"sliding@{long}"].median_s / timings[f"sliding@{short}"].median_s
    result["full_long_over_short"] = timings[f"full@{long}"].median_s / timings[f"full@{short}"].median_s
    result["full_over_sliding_at_long"] = timings[f"full@{long}"].median_s / timings[f"sliding@{long}"].median_s
    result.update(window=window, contexts=list(contexts), seqs=8, heads="32/16", head_size=128,
                  dtype="bfloat16", block_size=BLOCK_SIZE)
    for name, t in timings.items():
        print(f"attention {name:14s} {t.median_s * 1e3:8.2f} ms (best {t.min_s * 1e3:.2f})")
    print(f"sliding {long} / {short}: {result['sliding_long_over_short']:.2f}x; "
          f"full: {result['full_long_over_short']:.2f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="bench/results/kv_groups.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()
    report = {
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": args.threads,
                    "cpu_isa": ops.cpu_isa(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "load_average_start": load_at_start},
        "bytes_per_sequence": bytes_per_sequence(),
        "attention_time": attention_time(args.quick),
        "capacity": capacity(args.quick),
    }
    report["machine"]["load_average_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
