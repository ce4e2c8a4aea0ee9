"""One MLA layer's attention over latent rows for runs of many query rows: absorbed against
expanded (hf/latent_prefill.py), the measurement behind ``latent_prefill.expands``.

Usage: ``.venv/bin/python bench/bench_mla_prefill.py [--quick] [--out PATH] [--threads N]``

Method
------
DeepSeek-V3's attention (``kv_lora_rank`` 512 + RoPE 64, ``qk_nope_head_dim`` 128,
``v_head_dim`` 128), block size 16, bf16 cache and weights, one sequence. A run of ``q``
query rows over a context of ``q`` tokens (a prefill) or ``2048 + q`` (a chunk after a
prefix hit or an earlier chunk), at 16 query heads (one rank of eight) and 128. The same
call, ``latent_prefill.latent_attention``, in both forms:

* ``absorbed``: queries through ``W_UK``, ``paged.attention`` over the 576-wide rows,
  outputs through ``W_UV``;
* ``expanded``: a temporary multi-head cache (keys 192, values 128) of the run's own keys
  and values as transformers hands them over (computed before timing: the model computes
  them in both forms) and the context before the run through ``kv_b_proj``,
  ``paged.attention`` over it with the queries as they are.

Both outputs are compared before timing. Reported: each form's median time, and the
expanded form's speed relative to absorbed, the median of per-round ratios of one
interleaved run (``common/timing.py``) with quartiles.
"""

import argparse
import json
import statistics
import types
from pathlib import Path

import torch

from common.environment import machine_info
from common.timing import time_interleaved_samples
from paged_attention_ext import AttentionMetadata
from paged_attention_ext.hf import latent_prefill

NOPE, ROPE, LORA, V_HEAD, BLOCK_SIZE = 128, 64, 512, 128, 16
PREFIX = 2048


def layer(heads: int, dtype: torch.dtype) -> torch.nn.Module:
    module = torch.nn.Module()
    module.kv_b_proj = torch.nn.Linear(LORA, heads * (NOPE + V_HEAD), bias=False).to(dtype)
    module.config = types.SimpleNamespace(qk_nope_head_dim=NOPE, v_head_dim=V_HEAD,
                                          kv_lora_rank=LORA)
    module.layer_idx = 0
    return module


def case(heads: int, queries: int, context: int, dtype: torch.dtype, reps: int) -> dict:
    torch.manual_seed(0)
    module = layer(heads, dtype)
    blocks = -(-context // BLOCK_SIZE)
    cache = (torch.randn(blocks, 1, BLOCK_SIZE, LORA + ROPE) * 0.5).to(dtype)
    metadata = AttentionMetadata(torch.randperm(blocks, dtype=torch.int32)[None],
                                 torch.tensor([context], dtype=torch.int32),
                                 torch.tensor([0, queries], dtype=torch.int32))
    query = torch.randn(queries, heads, NOPE + ROPE).to(dtype)
    # What transformers hands the attention call besides the queries (computed by the model
    # in either form): the run's own keys and values, expanded from their latent rows.
    rows = cache[metadata.block_tables[0].long()][:, 0].reshape(-1, LORA + ROPE)
    rows = rows.index_select(0, torch.arange(context - queries, context))
    with torch.no_grad():
        per_head = module.kv_b_proj(rows[:, :LORA]).view(queries, heads, NOPE + V_HEAD)
    key = torch.cat((per_head[..., :NOPE], rows[:, None, LORA:].expand(-1, heads, -1)), dim=-1)
    value = per_head[..., NOPE:]

    def run(expand: bool):
        new_kv = (key, value) if expand else (None, None)
        return lambda: latent_prefill.latent_attention(
            module, metadata, query, *new_kv, cache, cache[..., :LORA], (NOPE + ROPE) ** -0.5,
            lambda q: q)

    forms = {"absorbed": run(False), "expanded": run(True)}
    with torch.no_grad():
        latent_prefill.EXPAND_MIN_QUERIES, latent_prefill.EXPANSION_COST = 1, 0.0  # always
        torch.testing.assert_close(forms["expanded"]().float(), forms["absorbed"]().float(),
                                   atol=5e-2, rtol=5e-2)
        samples = time_interleaved_samples(forms, warmup=1, reps=reps)
    ratios = sorted(a / e for a, e in zip(samples["absorbed"], samples["expanded"]))
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    result = dict(heads=heads, queries=queries, context=context,
                  absorbed_ms=statistics.median(samples["absorbed"]) * 1e3,
                  expanded_ms=statistics.median(samples["expanded"]) * 1e3,
                  expanded_speed=statistics.median(ratios), quartiles=[q1, q3])
    print(f"heads {heads:3d}  queries {queries:5d}  context {context:5d}  absorbed "
          f"{result['absorbed_ms']:8.1f} ms  expanded {result['expanded_ms']:8.1f} ms  "
          f"expanded {result['expanded_speed']:.2f}x ({q1:.2f}-{q3:.2f})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--queries", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "mla_prefill.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    queries = [32, 256] if args.quick else args.queries
    reps = 3 if args.quick else 5
    results = [case(heads, q, context, torch.bfloat16, reps)
               for heads in args.heads for q in queries for context in (q, PREFIX + q)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine_info(), threads=args.threads,
                                        results=results), indent=1))


if __name__ == "__main__":
    main()
