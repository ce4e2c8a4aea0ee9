"""MLA decode over latent rows: ``torch.ops.paged.attention`` against vLLM's CPU MLA decode
kernel (``torch.ops._C.mla_decode_kvcache``, what vLLM's CPU_MLA backend calls) on the same
cache tensor, in one process.

Usage (in the vLLM environment, ``make .venv-vllm/.installed``)::

    .venv-vllm/bin/python bench/bench_mla_vllm.py [--quick] [--threads N] --out PATH

``PATH`` is per CPU: ``bench/results/mla_vllm_<cpu>.json``.

Method
------
* DeepSeek-V3's absorbed decode: 128 query heads (one rank) or 16 (one of eight), latent
  rows of 512 + 64, scale 192 ** -0.5, bf16 and fp32 caches, block size 16 (the only one
  vLLM's kernel takes), B = 1, 4 and 16, contexts 2048 and 8192, blocks in a random
  physical order.
* Both sides read one tensor: vLLM's ``[num_blocks, 16, 576]`` cache is the same memory as
  the ops' ``[num_blocks, 1, 16, 576]`` key cache, whose ``[..., :512]`` view is the value
  cache. Each writes into an output allocated once (``paged.attention_out`` for ours).
* The outputs are compared first; then the two calls alternate for ``--rounds`` rounds
  after a warm-up, and the speedup is the median over rounds of vLLM's time / ours in the
  same round, with its quartiles.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paged_attention_ext as pa  # noqa: E402
from common.environment import machine_info  # noqa: E402
from common.timing import time_call  # noqa: E402

LORA, ROPE = 512, 64
BLOCK_SIZE = 16
SCALE = 192 ** -0.5


def case(batch: int, context: int, heads: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = context // BLOCK_SIZE
    cache = (torch.randn(batch * blocks, BLOCK_SIZE, LORA + ROPE, generator=gen) * 0.5).to(dtype)
    tables = torch.randperm(batch * blocks, generator=gen).int().view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, LORA + ROPE, generator=gen).to(dtype)
    return cache, tables, lens, query


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True, help="e.g. bench/results/mla_vllm_<cpu>.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    rows: List[Dict[str, object]] = []
    shapes = [(4, 2048, 16)] if args.quick else [
        (b, ctx, h) for h in (16, 128) for ctx in (2048, 8192) for b in (1, 4, 16)
        if b * ctx * h <= 16 * 2048 * 128]
    for batch, context, heads in shapes:
        for name, dtype in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
            cache, tables, lens, query = case(batch, context, heads, dtype)
            ours_cache = cache.view(cache.shape[0], 1, BLOCK_SIZE, LORA + ROPE)
            ours_out = torch.empty(batch, heads, LORA, dtype=dtype)
            vllm_out = torch.empty(batch, heads, LORA, dtype=dtype)

            def ours():
                pa.attention_out(ours_out, query, ours_cache, ours_cache[..., :LORA], tables, lens,
                                 SCALE)

            def vllm():
                torch.ops._C.mla_decode_kvcache(vllm_out, query, cache, SCALE, tables, lens)

            ours(), vllm()
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(ours_out.float(), vllm_out.float(), atol=tolerance, rtol=tolerance)
            ratios = []
            for _ in range(args.rounds):
                ratios.append(time_call(vllm) / time_call(ours))
            ratios.sort()
            row = {"batch": batch, "context": context, "heads": heads, "dtype": name,
                   "speedup_vs_vllm": statistics.median(ratios),
                   "quartiles": [ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]]}
            rows.append(row)
            print(f"B={batch:2d} ctx {context:5d} heads {heads:3d} {name}: ours / vLLM speed "
                  f"{row['speedup_vs_vllm']:.2f}x (quartiles {row['quartiles'][0]:.2f}-{row['quartiles'][1]:.2f})",
                  flush=True)
    Path(args.out).write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
