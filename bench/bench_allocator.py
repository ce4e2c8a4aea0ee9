"""Cost of one decode step's block bookkeeping vs the attention op of the same step.

256 running sequences in 64 groups of 4 (parallel samples / beams) append one token
each; every step some beams are dropped and replaced by forks of survivors, so
copy-on-write copies happen as in beam search. The same step's attention (one layer,
32 query / 8 KV heads, head size 128, bf16) is timed on the resulting block tables.
Both are measured in one run, interleaved, and reported as a ratio. Last, the cost of
admitting one prompt with prefix caching (naming its blocks, asking, allocating).

    python bench/bench_allocator.py [--steps N] [--out bench/results/allocator.json]
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import paged_attention_ext as pa
from paged_attention_ext.block_manager import BlockSpaceManager
from paged_attention_ext.block_table import block_hashes

GROUPS, SEQS_PER_GROUP, BLOCK_SIZE, PROMPT = 64, 4, 16, 500
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128


def build_manager(rng: random.Random) -> BlockSpaceManager:
    mgr = BlockSpaceManager(num_device_blocks=GROUPS * SEQS_PER_GROUP * 48, num_host_blocks=0,
                            block_size=BLOCK_SIZE)
    for g in range(GROUPS):
        mgr.allocate(g, g * 1000, [rng.randrange(32000) for _ in range(PROMPT)])
        for child in range(1, SEQS_PER_GROUP):
            mgr.fork(g * 1000, g * 1000 + child)
    return mgr


def bookkeeping_step(mgr: BlockSpaceManager, rng: random.Random, next_seq: list) -> int:
    """Beam-style step: drop one beam in a quarter of the groups, fork a survivor, append."""
    copies = 0
    for g, seqs in list(mgr.groups.items()):
        if rng.random() < 0.25:
            mgr.free_seq(seqs[-1])
            mgr.fork(seqs[0], next_seq[0])
            next_seq[0] += 1
        step = mgr.append_group(g, {s: 1 for s in mgr.groups[g]})
        copies += sum(len(placed.copies) for placed in step.values())
    return copies


def admission_us(rng: random.Random, rounds: int) -> float:
    """Median cost of admitting one prompt with prefix caching, as the engine's scheduler does.

    The engine names a prompt's blocks once (``block_hashes``), asks ``can_allocate`` and
    then ``allocate`` with those names. Prompts of PROMPT tokens share a 256-token system
    prompt; each round admits GROUPS of them and frees them again, so later rounds hit.
    """
    mgr = BlockSpaceManager(num_device_blocks=GROUPS * 48, num_host_blocks=0,
                            block_size=BLOCK_SIZE, enable_prefix_caching=True)
    system = [rng.randrange(32000) for _ in range(256)]
    prompts = [system + [rng.randrange(32000) for _ in range(PROMPT - 256)] for _ in range(GROUPS)]
    times = []
    for _ in range(rounds):
        for g, prompt in enumerate(prompts):
            start = time.perf_counter()
            names = block_hashes(prompt, BLOCK_SIZE)
            assert mgr.can_allocate(len(prompt), names=names)
            mgr.allocate(g, g, len(prompt), names=names)
            times.append(time.perf_counter() - start)
        for g in range(GROUPS):
            mgr.free_group(g)
    return statistics.median(times) * 1e6


def attention_inputs(mgr: BlockSpaceManager, cache_k: torch.Tensor):
    tables = [t.blocks for t, in mgr.tables.values()]  # one KV group
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([t.num_tokens for t, in mgr.tables.values()], dtype=torch.int32)
    query = torch.randn(len(tables), NUM_HEADS, HEAD_SIZE).bfloat16()
    return query, block_tables, seq_lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="bench/results/allocator.json")
    args = parser.parse_args()
    rng = random.Random(0)
    mgr = build_manager(rng)
    num_blocks = mgr.device.num_blocks
    key_cache = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE).bfloat16()
    value_cache = torch.randn_like(key_cache)
    next_seq = [10 ** 6]

    book, attn, copies = [], [], 0
    for _ in range(args.steps):
        start = time.perf_counter()
        copies += bookkeeping_step(mgr, rng, next_seq)
        book.append(time.perf_counter() - start)
        query, tables, lens = attention_inputs(mgr, key_cache)
        start = time.perf_counter()
        pa.attention(query, key_cache, value_cache, tables, lens, HEAD_SIZE ** -0.5)
        attn.append(time.perf_counter() - start)
    mgr.check_invariants()
    admission = admission_us(rng, rounds=5)

    seqs = len(mgr.tables)
    book_s, attn_s = statistics.median(book), statistics.median(attn)
    result = {
        "sequences": seqs,
        "steps": args.steps,
        "copy_on_write_copies_per_step": copies / args.steps,
        "bookkeeping_s_median": book_s,
        "bookkeeping_us_per_sequence": book_s / seqs * 1e6,
        "attention_one_layer_s_median": attn_s,
        "bookkeeping_over_attention_one_layer": book_s / attn_s,
        "admission_us_per_prompt_median": admission,
        "torch_threads": torch.get_num_threads(),
        "cpu_isa": pa.cpu_isa(),
    }
    print(f"{seqs} sequences, {copies / args.steps:.1f} copy-on-write copies per step")
    print(f"bookkeeping: {book_s * 1e3:.2f} ms per step = {result['bookkeeping_us_per_sequence']:.1f} us "
          f"per sequence")
    print(f"attention (one layer, bf16, ctx ~{PROMPT}): {attn_s * 1e3:.2f} ms per step")
    print(f"bookkeeping / attention of ONE layer = {book_s / attn_s:.2f} "
          f"(a 32-layer model runs the attention 32 times per step)")
    print(f"admission with prefix caching (name, can_allocate, allocate; {PROMPT}-token prompt): "
          f"{admission:.0f} us")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
