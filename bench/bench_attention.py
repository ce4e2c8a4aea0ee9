"""CPU benchmark of paged decode attention and the KV-cache ops against plain-PyTorch baselines.

Usage: ``.venv/bin/python bench/bench_attention.py [--quick] [--out PATH] [--threads N]``

Method
------
* Decode attention: B=16 sequences, 32 query heads, head size 128, context 2048, block
  size 16, for 32 and 8 KV heads (MHA and GQA) in fp32 and bf16. Candidates, all on the
  same K/V values:

  - ``paged``: ``paged_attention_ext.attention`` with a block table that is a random
    permutation of the physical blocks;
  - ``sdpa``: ``F.scaled_dot_product_attention`` on K/V laid out contiguously as
    ``[B, kv_heads, ctx, D]`` (GQA through ``enable_gqa=True``, or K/V expanded with
    ``repeat_interleave`` where that torch lacks it), query ``[B, H, 1, D]``;
  - ``gather_sdpa``: the obvious baseline, ``cache[block_tables]`` then permute/reshape into
    new contiguous K/V tensors, then SDPA, timed together;
  - ``gather_sdpa_prealloc``: the same gather into K/V buffers allocated once and reused (as
    a serving loop would). ``gather_sdpa`` allocates twice the KV bytes per call, so its
    time includes first-touch page faults, which are costly where the OS returns freed
    memory to a hypervisor (e.g. microVMs with free page reporting).

  Each candidate's output is checked against ``paged`` before timing. Bandwidth is the
  effective KV bandwidth: bytes of K and V a decode step needs
  (``B * ctx * kv_heads * D * 2 * element_size``) over the per-call time.
* Read bandwidth: ``torch.sum`` over a 1 GiB fp32 tensor (far larger than the last-level
  cache), as bytes read per second, best of its repetitions. It is timed interleaved with
  the attention candidates of every configuration, so it sees the same machine load, and
  ``paged``'s median bandwidth is reported as a percentage of that configuration's best
  (the achievable peak) and, as a check against lucky outliers, of its median.
* Cache ops (fp32, 8 KV heads, block size 16, head size 128): ``write_kv`` of 4096 tokens
  into random slots, ``copy_blocks`` of 256 random pairs in 4 layers and ``swap_blocks``
  (CPU to CPU) of 256 random blocks, each against ``dst.copy_(src)`` of the same payload
  bytes; reported as the percentage of the plain copy's speed.
* Timing (see ``common/timing.py``): warm-up, then interleaved round-robin repetitions; the median
  of per-call wall times is the headline, the minimum is recorded too.

Results are printed and written as JSON (default ``bench/results/cpu_attention.json``).
"""

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import paged_attention_ext as pa
from common.environment import machine_info, sdpa_has_enable_gqa
from common.timing import Candidate, time_interleaved

BATCH = 16
NUM_HEADS = 32
HEAD_SIZE = 128
CONTEXT = 2048
BLOCK_SIZE = 16
KV_HEADS = (32, 8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
READ_BYTES = 1 << 30

CACHE_KV_HEADS = 8
WRITE_TOKENS = 4096
WRITE_POOL_BLOCKS = 2048
NUM_PAIRS = 256
NUM_LAYERS = 4
COPY_POOL_BLOCKS = 1024

MIB = 1 << 20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu_attention.json"


@dataclass(frozen=True)
class Plan:
    """Repetition counts of one run."""

    warmup: int
    attention_reps: int
    cache_op_reps: int


FULL = Plan(warmup=3, attention_reps=30, cache_op_reps=100)
QUICK = Plan(warmup=1, attention_reps=5, cache_op_reps=20)


GQA_NATIVE = sdpa_has_enable_gqa()


# --- read bandwidth -------------------------------------------------------------------------


# --- decode attention -----------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeData:
    query: torch.Tensor  # [B, H, D]
    key_cache: torch.Tensor  # [num_blocks, kv_heads, block_size, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, blocks_per_seq], a random permutation
    seq_lens: torch.Tensor  # int32 [B]
    key: torch.Tensor  # contiguous [B, kv_heads, ctx, D], same values as key_cache
    value: torch.Tensor


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Gather a paged cache through the block table into contiguous ``[B, kv_heads, ctx, D]``."""
    blocks = cache[block_tables.long()]  # [B, blocks_per_seq, kv_heads, block_size, D]
    num_seqs, _, num_kv_heads, _, head_size = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, -1, head_size)


def prealloc_gather(cache: torch.Tensor, block_tables: torch.Tensor) -> Callable[[], torch.Tensor]:
    """:func:`gather_kv` into buffers allocated once; each call refills and returns them."""
    num_seqs, blocks_per_seq = block_tables.shape
    _, num_kv_heads, block_size, head_size = cache.shape
    flat_table = block_tables.flatten()
    blocks = cache.new_empty(num_seqs * blocks_per_seq, num_kv_heads, block_size, head_size)
    out = cache.new_empty(num_seqs, num_kv_heads, blocks_per_seq * block_size, head_size)
    seq_blocks = blocks.view(num_seqs, blocks_per_seq, num_kv_heads, block_size, head_size)
    out_blocks = out.view(num_seqs, num_kv_heads, blocks_per_seq, block_size, head_size)

    def gather() -> torch.Tensor:
        torch.index_select(cache, 0, flat_table, out=blocks)
        out_blocks.copy_(seq_blocks.permute(0, 2, 1, 3, 4))
        return out

    return gather


def sdpa_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """SDPA of ``query [B, H, D]`` over ``key``/``value [B, kv_heads, ctx, D]``; ``[B, H, D]``."""
    group = query.shape[1] // key.shape[1]
    if group > 1 and not GQA_NATIVE:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(query.unsqueeze(2), key, value,
                                         enable_gqa=group > 1 and GQA_NATIVE)
    return out.squeeze(2)


def make_decode_data(dtype: torch.dtype, num_kv_heads: int) -> DecodeData:
    num_blocks = BATCH * CONTEXT // BLOCK_SIZE
    cache_shape = (num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_SIZE)
    key_cache = torch.randn(cache_shape, dtype=dtype)
    value_cache = torch.randn(cache_shape, dtype=dtype)
    block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(BATCH, -1)
    return DecodeData(
        query=torch.randn(BATCH, NUM_HEADS, HEAD_SIZE, dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.full((BATCH,), CONTEXT, dtype=torch.int32),
        key=gather_kv(key_cache, block_tables),
        value=gather_kv(value_cache, block_tables),
    )


def decode_candidates(d: DecodeData) -> Dict[str, Candidate]:
    scale = HEAD_SIZE**-0.5  # SDPA's default scale
    gather_key = prealloc_gather(d.key_cache, d.block_tables)
    gather_value = prealloc_gather(d.value_cache, d.block_tables)
    return {
        "paged": lambda: pa.attention(d.query, d.key_cache, d.value_cache, d.block_tables,
                                      d.seq_lens, scale),
        "sdpa": lambda: sdpa_decode(d.query, d.key, d.value),
        "gather_sdpa": lambda: sdpa_decode(d.query, gather_kv(d.key_cache, d.block_tables),
                                           gather_kv(d.value_cache, d.block_tables)),
        "gather_sdpa_prealloc": lambda: sdpa_decode(d.query, gather_key(), gather_value()),
    }


def check_agreement(candidates: Dict[str, Candidate], tolerance: float) -> None:
    """Fail loudly if a candidate computes something other than ``paged`` does."""
    expected = candidates["paged"]().float()
    for name, fn in candidates.items():
        error = (fn().float() - expected).abs().max().item()
        if error > tolerance:
            raise AssertionError(f"{name} differs from paged by {error:.3g} (> {tolerance})")


def bench_decode(dtype_name: str, num_kv_heads: int, plan: Plan,
                 read_data: torch.Tensor) -> Dict[str, object]:
    """Time the decode candidates interleaved with a read-bandwidth sum over ``read_data``."""
    dtype = DTYPES[dtype_name]
    candidates = decode_candidates(make_decode_data(dtype, num_kv_heads))
    check_agreement(candidates, TOLERANCE[dtype_name])
    timings = time_interleaved(candidates | {"read_sum": read_data.sum}, plan.warmup,
                               plan.attention_reps)
    read_bytes = read_data.numel() * read_data.element_size()
    read = {"bytes": read_bytes, **timings.pop("read_sum").summary(read_bytes)}
    kv_bytes = BATCH * CONTEXT * num_kv_heads * HEAD_SIZE * 2 * dtype.itemsize
    results = {name: t.summary(kv_bytes) for name, t in timings.items()}
    paged = timings["paged"].median_s
    return {
        "dtype": dtype_name,
        "batch": BATCH,
        "num_heads": NUM_HEADS,
        "num_kv_heads": num_kv_heads,
        "head_size": HEAD_SIZE,
        "context": CONTEXT,
        "block_size": BLOCK_SIZE,
        "kv_bytes": kv_bytes,
        "results": results,
        "read_bandwidth": read,
        "ratios": {
            "paged_speedup_vs_sdpa": timings["sdpa"].median_s / paged,
            "paged_speedup_vs_gather_sdpa": timings["gather_sdpa"].median_s / paged,
            "paged_speedup_vs_gather_sdpa_prealloc": timings["gather_sdpa_prealloc"].median_s / paged,
            "paged_pct_of_read_bw_best": 100 * results["paged"]["gbps_median"] / read["gbps_best"],
            "paged_pct_of_read_bw_median": 100 * results["paged"]["gbps_median"] / read["gbps_median"],
        },
    }


# --- cache ops ------------------------------------------------------------------------------


def block_pool(num_blocks: int) -> torch.Tensor:
    return torch.randn(num_blocks, CACHE_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)


def random_pairs(num_src_blocks: int, num_dst_blocks: int, same_pool: bool) -> torch.Tensor:
    """int64 ``[NUM_PAIRS, 2]`` of random (src, dst) blocks; in one pool all are distinct."""
    if same_pool:
        src, dst = torch.randperm(num_src_blocks)[: 2 * NUM_PAIRS].view(2, NUM_PAIRS)
    else:
        src = torch.randperm(num_src_blocks)[:NUM_PAIRS]
        dst = torch.randperm(num_dst_blocks)[:NUM_PAIRS]
    return torch.stack([src, dst], dim=1)


def compare_to_copy(name: str, op: Candidate, payload_bytes: int, plan: Plan) -> Dict[str, object]:
    """Time ``op`` interleaved with ``dst.copy_(src)`` of ``payload_bytes``."""
    src = torch.randn(payload_bytes // 4)
    dst = torch.zeros_like(src)
    timings = time_interleaved({name: op, "copy": lambda: dst.copy_(src)}, plan.warmup,
                               plan.cache_op_reps)
    return {
        "op": name,
        "payload_bytes": payload_bytes,
        "results": {n: t.summary(payload_bytes) for n, t in timings.items()},
        "pct_of_copy": 100 * timings["copy"].median_s / timings[name].median_s,
    }


def bench_write_kv(plan: Plan) -> Dict[str, object]:
    key_cache, value_cache = block_pool(WRITE_POOL_BLOCKS), block_pool(WRITE_POOL_BLOCKS)
    key = torch.randn(WRITE_TOKENS, CACHE_KV_HEADS, HEAD_SIZE)
    value = torch.randn_like(key)
    slots = torch.randperm(WRITE_POOL_BLOCKS * BLOCK_SIZE)[:WRITE_TOKENS]
    payload = 2 * key.numel() * key.element_size()
    return compare_to_copy("write_kv", lambda: pa.write_kv(key, value, key_cache, value_cache, slots),
                           payload, plan)


def bench_copy_blocks(plan: Plan) -> Dict[str, object]:
    key_caches = [block_pool(COPY_POOL_BLOCKS) for _ in range(NUM_LAYERS)]
    value_caches = [block_pool(COPY_POOL_BLOCKS) for _ in range(NUM_LAYERS)]
    mapping = random_pairs(COPY_POOL_BLOCKS, COPY_POOL_BLOCKS, same_pool=True)
    block_bytes = key_caches[0][0].numel() * key_caches[0].element_size()
    payload = NUM_PAIRS * block_bytes * 2 * NUM_LAYERS
    return compare_to_copy("copy_blocks", lambda: pa.copy_blocks(key_caches, value_caches, mapping),
                           payload, plan)


def bench_swap_blocks(plan: Plan) -> Dict[str, object]:
    src, dst = block_pool(COPY_POOL_BLOCKS), block_pool(COPY_POOL_BLOCKS)
    mapping = random_pairs(COPY_POOL_BLOCKS, COPY_POOL_BLOCKS, same_pool=False)
    payload = NUM_PAIRS * src[0].numel() * src.element_size()
    return compare_to_copy("swap_blocks", lambda: pa.swap_blocks(src, dst, mapping), payload, plan)


# --- report ---------------------------------------------------------------------------------


def print_decode_table(rows: List[Dict[str, object]]) -> None:
    print(f"\nDecode attention, B={BATCH} H={NUM_HEADS} D={HEAD_SIZE} ctx={CONTEXT} "
          f"block={BLOCK_SIZE}: median ms (effective KV GB/s); paged speedups (median time ratios);")
    print("read = 1 GiB sum GB/s, best/median of its interleaved reps; paged median GB/s as % of each")
    names = ("paged", "sdpa", "gather_sdpa", "gather_sdpa_prealloc")
    ratio_keys = ("paged_speedup_vs_sdpa", "paged_speedup_vs_gather_sdpa",
                  "paged_speedup_vs_gather_sdpa_prealloc")
    print(f"{'dtype':<5} {'kvh':>3} | {'paged':>15} | {'sdpa':>15} | {'gather+sdpa':>15} | "
          f"{'prealloc+sdpa':>15} | {'vs sdpa':>7} {'vs gath':>7} {'vs prea':>7} | "
          f"{'read best/med':>13} {'% best/med':>11}")
    for row in rows:
        res, ratios, read = row["results"], row["ratios"], row["read_bandwidth"]
        cells = [f"{res[n]['median_s'] * 1e3:7.2f} ({res[n]['gbps_median']:4.1f})" for n in names]
        speedups = [f"{ratios[k]:6.2f}x" for k in ratio_keys]
        print(f"{row['dtype']:<5} {row['num_kv_heads']:>3} | " + " | ".join(cells) + " | "
              + " ".join(speedups) + f" | {read['gbps_best']:5.1f} / {read['gbps_median']:5.1f}"
              + f" {ratios['paged_pct_of_read_bw_best']:4.0f}% / {ratios['paged_pct_of_read_bw_median']:3.0f}%")


def print_cache_op_table(rows: List[Dict[str, object]]) -> None:
    print("\nCache ops (fp32), median ms (payload GB/s) vs dst.copy_(src) of the same bytes")
    print(f"{'op':<11} {'MiB':>5} | {'op':>16} | {'copy':>16} | {'% of copy':>9}")
    for row in rows:
        res = row["results"]
        cells = [f"{res[n]['median_s'] * 1e3:7.2f} ({res[n]['gbps_median']:5.1f})"
                 for n in (row["op"], "copy")]
        print(f"{row['op']:<11} {row['payload_bytes'] / MIB:5.0f} | " + " | ".join(cells)
              + f" | {row['pct_of_copy']:8.1f}%")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads value")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plan = QUICK if args.quick else FULL
    machine = machine_info()
    print(", ".join(f"{k}={v}" for k, v in machine.items()))

    # Cache ops first: the decode section allocates and frees gigabytes, and a VM that hands
    # freed memory back to its host does that work for a while afterwards.
    cache_ops = [bench(plan) for bench in (bench_write_kv, bench_copy_blocks, bench_swap_blocks)]
    print_cache_op_table(cache_ops)
    read_data = torch.ones(READ_BYTES // 4)
    decode = [bench_decode(dtype, kvh, plan, read_data) for dtype in DTYPES for kvh in KV_HEADS]
    print_decode_table(decode)

    report = {"machine": machine, "plan": asdict(plan) | {"quick": args.quick},
              "decode_attention": decode, "cache_ops": cache_ops}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
