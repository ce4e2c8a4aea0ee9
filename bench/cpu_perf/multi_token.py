"""Multi-token: a 512-token causal chunk over 4096 cached tokens against torch.mm."""

from dataclasses import dataclass
from typing import Dict, List

import torch

import paged_attention_ext as pa
from paged_attention_ext import reference

from common.timing import time_interleaved_samples

from .config import (BLOCK_SIZE, DTYPES, HEAD_SIZE, MATMUL_N, MT_DTYPES, MT_KV_HEADS, MT_QUERIES,
                     MT_SEQ_LEN, NUM_HEADS, TOLERANCE, Plan)
from .machine import Memory, Pool, rate_summary, ratios

def visible_pairs(seq_len: int, queries: int) -> int:
    """Causal query-key pairs of the last ``queries`` positions of a ``seq_len`` sequence."""
    return sum(p + 1 for p in range(seq_len - queries, seq_len))


@dataclass
class MultiTokenCase:
    """A 512-token chunk over 4096 cached tokens (32/8 heads), causal."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    out: torch.Tensor

    @property
    def flops(self) -> int:
        return 4 * NUM_HEADS * HEAD_SIZE * visible_pairs(MT_SEQ_LEN, MT_QUERIES)

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                HEAD_SIZE**-0.5, self.query_start_loc)

    def run(self) -> torch.Tensor:
        return pa.attention_out(self.out, *self.args())


def multi_token_case(key_pool: Pool, value_pool: Pool, dtype_name: str) -> MultiTokenCase:
    dtype = DTYPES[dtype_name]
    num_blocks = MT_SEQ_LEN // BLOCK_SIZE
    shape = (num_blocks, MT_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    query = torch.randn(MT_QUERIES, NUM_HEADS, HEAD_SIZE).to(dtype)
    return MultiTokenCase(query, key_pool.tensor(dtype, shape), value_pool.tensor(dtype, shape),
                          torch.randperm(num_blocks, dtype=torch.int32).view(1, -1),
                          torch.tensor([MT_SEQ_LEN], dtype=torch.int32),
                          torch.tensor([0, MT_QUERIES], dtype=torch.int32), torch.empty_like(query))


def bench_multi_token(mem: Memory, plan: Plan) -> List[Dict[str, object]]:
    """A 512-token chunk over 4096 tokens (32/8 heads) against torch.mm, same dtype."""
    rows = []
    for dtype_name in MT_DTYPES:
        dtype = DTYPES[dtype_name]
        mem.fill(dtype_name)
        case = multi_token_case(mem.key, mem.value, dtype_name)
        expected = reference.attention(*case.args())
        error = (case.run().float() - expected.float()).abs().max().item()
        if error > 10 * TOLERANCE[dtype_name]:
            raise AssertionError(f"multi-token {dtype_name} differs from reference by {error:.3g}")
        a = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        b = torch.randn(MATMUL_N, MATMUL_N).to(dtype)
        c = torch.empty(MATMUL_N, MATMUL_N, dtype=dtype)
        flops = case.flops
        mm_flops = 2 * MATMUL_N**3
        s = time_interleaved_samples({"paged": case.run, "matmul": lambda: torch.mm(a, b, out=c)},
                                     plan.warmup, plan.mt_reps)
        rows.append({"dtype": dtype_name, "seq_len": MT_SEQ_LEN, "queries": MT_QUERIES,
                     "num_heads": NUM_HEADS, "num_kv_heads": MT_KV_HEADS, "head_size": HEAD_SIZE,
                     "block_size": BLOCK_SIZE, "flops": flops, "matmul_n": MATMUL_N,
                     "max_abs_error": error, "paged": rate_summary(s["paged"], flops)
                     | ratios(s["paged"], flops, s["matmul"], mm_flops),
                     "matmul": rate_summary(s["matmul"], mm_flops)})
        print_multi_token(rows[-1])
    return rows


def print_multi_token(row: Dict[str, object]) -> None:
    p, m = row["paged"], row["matmul"]
    print(f"multi-token {row['dtype']}: {p['median_s'] * 1e3:.1f} ms {p['rate_median']:.0f} GFLOP/s "
          f"vs mm {m['rate_median']:.0f} GFLOP/s: {p['pct_paired']:.0f}% (err {row['max_abs_error']:.2g})",
          flush=True)
