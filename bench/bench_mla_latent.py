"""CPU decode attention of an MLA model over its latent cache against the expanded K/V.

Usage: ``.venv/bin/python bench/bench_mla_latent.py [--quick] [--out PATH] [--threads N ...]
[--shapes 128x1 ...] [--dtypes bf16 ...] [--contexts 2048 ...]``

Method
------
DeepSeek-V3's attention, decode, block size 16, contexts 2048 and 8192, fp32 and bf16
caches, on one rank of eight (16 of its 128 query heads, B=8) and with all 128 heads on one
rank (B=1); the blocks of each sequence are a random permutation of the pool. Two ways to store the same tokens:

* ``expanded``: K/V as transformers runs the model (and the engine stores it):
  per query head, keys of 192 (128 without RoPE + 64 with it) and values of 128, two
  caches of as many KV heads as query heads; one ``paged.attention`` call.
* ``latent``: one 576-wide row per token (``kv_lora_rank`` 512 + 64 RoPE), the key cache,
  and its view ``[..., :512]`` the value cache. The query is absorbed first
  (``q_nope · W_UK`` per head, a batched matmul, beside ``q_rope``), then one
  ``paged.attention`` call over the latent rows, then the 512-wide result is projected by
  ``W_UV`` (a second batched matmul): the two matmuls are timed with the call.

Both compute the same attention output; the bench checks that before timing (float64
products of the same random weights). Reported per configuration: bytes of cache one
decode step reads per token and layer, median per-call time, ``latent``'s speed
relative to ``expanded``: the median of the per-round ratios of one interleaved run
(``common/timing.py``), with their quartiles, and the rate of the latent attention call
alone (``latent_kernel``, timed in the same rounds): multiply-adds per second, a key row of
576 and a value row of 512 per query head and token. One thread by default; ``--threads 1 2``
runs every configuration at each count.
"""

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

import paged_attention_ext as pa
from common.environment import machine_info
from common.timing import summarize, time_interleaved_samples

NOPE, ROPE, LORA, V_HEAD = 128, 64, 512, 128
# (query heads, batch): one rank of eight (16 of 128 heads), B=8; all 128 heads on one rank, B=1.
SHAPES = ((16, 8), (128, 1))
BLOCK_SIZE = 16
CONTEXTS = (2048, 8192)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCALE = (NOPE + ROPE) ** -0.5


def build(heads: int, batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    """Latent rows, the up-projections, and the expanded caches they imply (same tokens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    latent = torch.randn(num_blocks, 1, BLOCK_SIZE, LORA + ROPE, generator=gen) * 0.5
    w_uk = torch.randn(heads, NOPE, LORA, generator=gen) * LORA ** -0.5
    w_uv = torch.randn(heads, V_HEAD, LORA, generator=gen) * LORA ** -0.5
    # Expanded: k = [W_UK c, k_rope] per head, v = W_UV c.
    c, k_rope = latent[:, 0, :, :LORA], latent[:, 0, :, LORA:]
    k_nope = torch.einsum("hdl,btl->bhtd", w_uk, c)
    key = torch.cat([k_nope, k_rope[:, None].expand(-1, heads, -1, -1)], dim=-1)
    value = torch.einsum("hdl,btl->bhtd", w_uv, c)
    tables = torch.randperm(num_blocks, generator=gen).int().view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, NOPE + ROPE, generator=gen)
    return dict(latent=latent.to(dtype), w_uk=w_uk.to(dtype), w_uv=w_uv.to(dtype),
                key=key.to(dtype).contiguous(), value=value.to(dtype).contiguous(),
                tables=tables, lens=lens, query=query.to(dtype))


def expanded_call(t):
    return pa.attention(t["query"], t["key"], t["value"], t["tables"], t["lens"], SCALE)


def absorb(t):
    q_nope, q_rope = t["query"][..., :NOPE], t["query"][..., NOPE:]
    q_latent = torch.bmm(q_nope.transpose(0, 1), t["w_uk"]).transpose(0, 1)  # [B, H, 512]
    return torch.cat([q_latent, q_rope], dim=-1)


def latent_attention(t, absorbed):
    cache = t["latent"]
    return pa.attention(absorbed, cache, cache[..., :LORA], t["tables"], t["lens"], SCALE)


def latent_call(t):
    out = latent_attention(t, absorb(t))
    return torch.bmm(out.transpose(0, 1), t["w_uv"].transpose(1, 2)).transpose(0, 1)  # [B, H, 128]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="context 2048 only, fewer repetitions")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=None, help="heads x batch, e.g. 128x1")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reps = 15 if args.quick else 40
    rows = []
    shapes, contexts = (SHAPES[:1], CONTEXTS[:1]) if args.quick else (SHAPES, CONTEXTS)
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    contexts = args.contexts or contexts
    for threads, (heads, batch), context in itertools.product(args.threads, shapes, contexts):
        torch.set_num_threads(threads)
        for name in args.dtypes:
            dtype = DTYPES[name]
            t = build(heads, batch, context, dtype)
            got, want = latent_call(t).double(), expanded_call(t).double()
            tolerance = 2e-3 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
            absorbed = absorb(t)
            samples = time_interleaved_samples({"expanded": lambda: expanded_call(t),
                                                "latent": lambda: latent_call(t),
                                                "latent_kernel": lambda: latent_attention(t, absorbed)},
                                               warmup=3, reps=reps)
            timing = {candidate: summarize(times) for candidate, times in samples.items()}
            # Paired rounds: each round's ratio, so load that comes and goes hits both alike.
            ratios = sorted(e / l for e, l in zip(samples["expanded"], samples["latent"]))
            size = torch.finfo(dtype).bits // 8
            macs = batch * heads * context * (LORA + ROPE + LORA)
            row = {
                "threads": threads, "context": context, "dtype": name, "batch": batch, "heads": heads,
                "bytes_per_token": {"expanded": heads * (NOPE + ROPE + V_HEAD) * size,
                                    "latent": (LORA + ROPE) * size},
                "median_ms": {k: v.median_s * 1e3 for k, v in timing.items()},
                "latent_speedup": statistics.median(ratios),
                "latent_speedup_quartiles": [ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]],
                "latent_kernel_gmacs": macs / timing["latent_kernel"].median_s / 1e9,
            }
            rows.append(row)
            print(f"{threads} thread(s) heads {heads:3d} B={batch:2d} ctx {context:5d} {name}: "
                  f"expanded {row['median_ms']['expanded']:.2f} ms, "
                  f"latent {row['median_ms']['latent']:.2f} ms ({row['latent_speedup']:.2f}x, "
                  f"quartiles {row['latent_speedup_quartiles'][0]:.2f}-{row['latent_speedup_quartiles'][1]:.2f}), "
                  f"latent kernel {row['median_ms']['latent_kernel']:.2f} ms = {row['latent_kernel_gmacs']:.1f} GMAC/s, "
                  f"bytes/token {row['bytes_per_token']['expanded']} vs {row['bytes_per_token']['latent']}")
    out = args.out or Path(__file__).parent / "results" / "mla_latent.json"
    out.write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
