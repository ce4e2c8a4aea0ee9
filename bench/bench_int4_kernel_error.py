"""The CPU kernel's own output error over int4 caches, in place against widened.

Usage: ``.venv/bin/python bench/bench_int4_kernel_error.py [--isa ISA] [--out PATH]``

bench_kv_accuracy.py's activations (``common/kv_activations.py``: keys with outlier channels,
values with and without, Gaussians; 2 sequences, 32 query heads on 8 KV heads, head sizes 128
and 64, contexts 128, 512 and 2048, decode) written into int4 caches by ``paged.write_kv``,
then ``paged.attention`` with a bf16 query (rows read in place by ``vdpbf16ps`` on
``avx512_bf16``) and with the same query in fp32 (rows widened to fp32 rows, the path a bf16
query took before), the fp32 output rounded to bf16 as the bf16 caller's is. Each against
float64 attention over the bf16 K/V (the format's error and the kernel's) and against the
float64 reference over the dequantized cache (the kernel's alone): relative L2 error of the
whole output. Writes ``bench/results/int4_kernel_error.json``.
"""

import argparse
import json
from pathlib import Path

import torch

import paged_attention_ext as pa
from common.kv_activations import KINDS, activations, attention, output_error
from paged_attention_ext import reference as ref
from paged_attention_ext.token_quantization import scale_shape, stored_head_size

BLOCK, KV_HEADS, HEADS = 16, 8, 32
OUT = Path(__file__).resolve().parent / "results" / "int4_kernel_error.json"


def case(kind: str, head_size: int, context: int) -> dict:
    a = activations(kind, batch=2, kv_heads=KV_HEADS, heads=HEADS, context=context, queries=1,
                    head_size=head_size, seed=0)
    query = a["query"][:, :, 0].bfloat16()
    exact, _ = attention(query.float()[:, :, None], a["keys"], a["values"])
    blocks = 2 * context // BLOCK
    shape = (blocks, KV_HEADS, BLOCK, stored_head_size(torch.uint8, head_size))
    key_cache, value_cache = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    scales = {name: torch.zeros(scale_shape(torch.uint8, blocks, KV_HEADS, BLOCK)) for name in ("k_scale", "v_scale")}
    rows = lambda x: x.permute(0, 2, 1, 3).reshape(-1, KV_HEADS, head_size).float()
    pa.write_kv(rows(a["keys"]), rows(a["values"]), key_cache, value_cache,
                torch.arange(blocks * BLOCK), scales["k_scale"], scales["v_scale"])
    tables = torch.arange(blocks, dtype=torch.int32).view(2, -1)
    lens = torch.full((2,), context, dtype=torch.int32)
    args = (key_cache, value_cache, tables, lens, head_size ** -0.5)
    fmt, _ = ref.attention_with_lse(query.double(), *args, **scales)
    result = {"kind": kind, "head_size": head_size, "context": context}
    for name, q in (("in_place", query), ("widened", query.float())):
        out = pa.attention(q, *args, **scales).bfloat16().double()
        result[name] = {"vs_exact": output_error(out, exact[:, :, 0])["rel_l2"],
                        "vs_format": output_error(out, fmt)["rel_l2"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isa", default="avx512_bf16")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    pa.select_cpu_isa(args.isa)
    results = []
    for kind in KINDS:
        for head_size in (128, 64):
            for context in (128, 512, 2048):
                r = case(kind, head_size, context)
                results.append(r)
                print(f"{kind:12s} {head_size:3d} {context:5d}: in place {r['in_place']['vs_exact']:.5f} "
                      f"(kernel {r['in_place']['vs_format']:.2e}), widened {r['widened']['vs_exact']:.5f} "
                      f"(kernel {r['widened']['vs_format']:.2e})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu_isa": pa.cpu_isa(), "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
