"""Cache ops: write_kv, copy_blocks and swap_blocks of 256 MiB against a copy of the same size."""

import math
from typing import Dict, List, Optional

import torch

import paged_attention_ext as pa

from common.timing import Candidate, time_interleaved_samples

from .config import BLOCK_SIZE, CACHE_KV_HEADS, COPY_BYTES, HEAD_SIZE, POOL_BYTES, READ_BYTES, Plan
from .machine import Memory, rate_summary, ratios, read_candidate

def compare_to_copy(mem: Memory, name: str, op: Candidate, payload: int, plan: Plan,
                    extra: Optional[Dict[str, Candidate]] = None) -> Dict[str, object]:
    """Time ``op`` (and ``extra`` diagnostics, same payload) with a copy and the read sum."""
    extra = extra or {}
    s = time_interleaved_samples({name: op, **extra,
                                  "copy": lambda: mem.copy_dst.copy_(mem.copy_src),
                                  "read": read_candidate(mem)}, plan.warmup, plan.cache_op_reps)
    row = {"op": name, "payload_bytes": payload,
           name: rate_summary(s[name], payload) | ratios(s[name], payload, s["copy"], COPY_BYTES),
           "copy": rate_summary(s["copy"], COPY_BYTES),
           "read_bandwidth": rate_summary(s["read"], READ_BYTES)}
    for other in extra:
        row[other] = rate_summary(s[other], payload) | ratios(s[other], payload, s["copy"], COPY_BYTES)
    print_cache_op(row)
    return row


def bench_cache_ops(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """write_kv, copy_blocks, swap_blocks (fp32, 8 KV heads, block 16) of 256 MiB each."""
    mem.fill("fp32")
    block_shape = (CACHE_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    block_bytes = math.prod(block_shape) * 4
    pool_blocks = POOL_BYTES // block_bytes
    key_cache = mem.key.tensor(torch.float32, (pool_blocks, *block_shape))
    value_cache = mem.value.tensor(torch.float32, (pool_blocks, *block_shape))
    rows = []

    # write_kv: COPY_BYTES of K+V for tokens scattered over the 1 GiB pools.
    tokens = COPY_BYTES // (2 * CACHE_KV_HEADS * HEAD_SIZE * 4)
    # The inputs are the copy's source bytes, so both read the same memory.
    key, value = mem.copy_src.view(2, tokens, CACHE_KV_HEADS, HEAD_SIZE)
    slots = torch.randperm(pool_blocks * BLOCK_SIZE)[:tokens]
    sequential = torch.arange(tokens)  # diagnostic: the same op writing consecutive slots
    rows.append(compare_to_copy(mem, "write_kv",
                                lambda: pa.write_kv(key, value, key_cache, value_cache, slots),
                                COPY_BYTES, plan,
                                {"write_kv_sequential_slots": lambda: pa.write_kv(
                                    key, value, key_cache, value_cache, sequential)}))

    # copy_blocks: 4 layers of 256 MiB K and V caches, COPY_BYTES over all of them.
    layers = 4
    layer_blocks = pool_blocks // layers
    key_caches = list(key_cache.split(layer_blocks))
    value_caches = list(value_cache.split(layer_blocks))
    pairs = COPY_BYTES // (block_bytes * 2 * layers)
    src, dst = torch.randperm(layer_blocks)[: 2 * pairs].view(2, pairs)
    mapping = torch.stack([src, dst], dim=1)
    rows.append(compare_to_copy(mem, "copy_blocks",
                                lambda: pa.copy_blocks(key_caches, value_caches, mapping),
                                COPY_BYTES, plan))

    # swap_blocks: COPY_BYTES of random blocks from the K pool to random blocks of the V pool.
    pairs = COPY_BYTES // block_bytes
    mapping = torch.stack([torch.randperm(pool_blocks)[:pairs], torch.randperm(pool_blocks)[:pairs]],
                          dim=1)
    rows.append(compare_to_copy(mem, "swap_blocks",
                                lambda: pa.swap_blocks(key_cache, value_cache, mapping),
                                COPY_BYTES, plan))
    return rows


def print_cache_op(row: Dict[str, object]) -> None:
    o, c = row[row["op"]], row["copy"]
    print(f"{row['op']:<11} {o['median_s'] * 1e3:6.2f} ms {o['rate_median']:5.1f} GB/s vs copy "
          f"{c['rate_median']:5.1f} GB/s: {o['pct_paired']:4.0f}% (median {o['pct_median']:.0f}%)",
          flush=True)
    for other in row:
        if other.startswith(row["op"] + "_"):
            o = row[other]
            print(f"  {other}: {o['rate_median']:5.1f} GB/s, {o['pct_paired']:4.0f}% of copy", flush=True)
