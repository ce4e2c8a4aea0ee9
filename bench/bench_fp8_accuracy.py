"""fp8 KV cache accuracy and capacity: the op, tiny models, and the pool's tokens.

Usage: ``.venv/bin/python bench/bench_fp8_accuracy.py [--quick] [--out PATH] [--threads N]``

Method
------
1. **The op** (``paged.attention``, decode, fp32 queries): Gaussian K/V with magnitudes
   from 0.25 to 4 across KV heads, with and without a few key channels 10x larger (the
   outlier channels real models' keys have, which make the softmax peaked); stored with ``paged.write_kv`` into fp8 caches with scales
   calibrated from the data (``quantization.calibrate``, per layer or per KV head), and
   into fp32 and bf16 caches. Two comparisons, each against a float64 attention:

   * ``vs_dequantized``: reference over the fp8 cache dequantized exactly
     (``float(stored) * scale``): the op must match it to fp32 rounding, taken as at most
     4x the fp32 cache's error against its own float64 reference (``fp32_cache_baseline``;
     ``within_fp32_rounding``).
   * ``vs_unquantized``: reference over the original fp32 K/V: the error fp8 storage
     costs, as max / mean / p50 / p90 / p99 of the absolute error and of the error
     relative to the RMS of the reference row (one query head's output), beside the same
     numbers for a bf16 cache.

2. **Models**: the random-weight architectures of the HF tests (paged_attention_ext.testing: Llama;
   Qwen2 with GQA 8/2 and a sliding-window layer; Mistral with GQA 4/2 and a window),
   in bf16, with a PagedCache. Greedy tokens with the bf16 cache (the model's dtype) are
   the baseline; for each format and calibration: the fraction of greedy tokens equal to
   the baseline run (free-running, and the number of tokens before the first difference),
   and teacher-forced over the baseline's tokens: the fraction of positions whose argmax
   is unchanged and the logit error (max, mean; relative to the logits' std). Controls:
   the same numbers for an fp16 and an fp32 cache, i.e. how far these random models'
   tokens move under any small change of K/V.

3. **Capacity**: an ``LLMEngine`` per cache dtype over the same pool bytes (the bytes of
   40 bf16 blocks of a 4-layer bench model): tokens the pool holds, from the engine's own
   accounting (``engine.kv_cache.usage``), and the demo's batch (15 requests: greedy,
   n = 2-3 samples, beams, behind a shared 48-token prompt) served through it: steps and
   preemptions; and the same accounting for published model shapes in 16 GiB
   (``kv_cache.bytes_per_block``).

Results are printed and written as JSON (default ``bench/results/fp8_accuracy.json``).
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Dict, List

import torch
import transformers

from paged_attention_ext import ops
from paged_attention_ext import quantization as q
from paged_attention_ext.engine import EngineConfig, LLMEngine
from paged_attention_ext.hf import PagedCache
from paged_attention_ext.kv_cache import bytes_per_block
from paged_attention_ext.reference import dequantize
from paged_attention_ext.testing import ARCHS, TINY, random_pair  # the HF tests' architectures
from paged_attention_ext.tools.demo import make_requests
from paged_attention_ext.tools.memory import PRESETS

FORMATS = ("fp8_e4m3", "fp8_e5m2")
CALIBRATIONS = ("per_layer", "per_head")
PERCENTILES = (0.5, 0.9, 0.99)
GIB = 1 << 30


# ---- 1. the op ---------------------------------------------------------------------------------

def synthetic_kv(tokens: int, kv_heads: int, head_size: int, outliers: bool, gen: torch.Generator):
    """Gaussian K/V with per-head magnitudes; ``outliers``: a few key channels 10x larger."""
    magnitude = torch.logspace(-2, 2, kv_heads, base=2.0).view(1, kv_heads, 1)  # 0.25 .. 4
    keys = torch.randn(tokens, kv_heads, head_size, generator=gen) * magnitude
    if outliers:
        keys[:, :, torch.randperm(head_size, generator=gen)[:max(1, head_size // 32)]] *= 10
    values = torch.randn(tokens, kv_heads, head_size, generator=gen) * magnitude.flip(1)
    return keys, values


def float64_attention(query, keys, values, lens, scale) -> torch.Tensor:
    """Decode attention in float64 over contiguous per-sequence K/V ``[seq][tokens, kvh, hs]``."""
    out = []
    for i, n in enumerate(lens):
        k, v = keys[i][:n].double(), values[i][:n].double()
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", query[i].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def error_stats(got: torch.Tensor, want: torch.Tensor) -> Dict:
    """Absolute error and error relative to each output row's (one head's) RMS."""
    err = (got.double() - want).abs()
    rms = want.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
    stats = {}
    for name, x in (("abs", err.flatten()), ("rel_rms", (err / rms).flatten())):
        sample = x if x.numel() <= 1 << 20 else x[torch.randint(x.numel(), (1 << 20,))]
        quantiles = torch.quantile(sample, torch.tensor(PERCENTILES, dtype=x.dtype))
        stats[name] = {"max": x.max().item(), "mean": x.mean().item(),
                       **{f"p{round(p * 100)}": v.item() for p, v in zip(PERCENTILES, quantiles)}}
    return stats


def paged_layout(lens: List[int], block_size: int, gen: torch.Generator):
    """Block tables in random physical order and the slot of every token."""
    per_seq = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(per_seq), generator=gen)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    slots, start = [], 0
    for i, (n, nb) in enumerate(zip(lens, per_seq)):
        tables[i, :nb] = order[start:start + nb].int()
        start += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    return tables, slots, sum(per_seq)


def op_accuracy(batch: int, context: int, heads: int, kv_heads: int, head_size: int, outliers: bool,
                block_size: int = 16, seed: int = 0) -> Dict:
    gen = torch.Generator().manual_seed(seed)
    lens = [context - (i * context) // (2 * batch) for i in range(batch)]  # varied, up to context
    tables, slots, num_blocks = paged_layout(lens, block_size, gen)
    kv = [synthetic_kv(n, kv_heads, head_size, outliers, gen) for n in lens]
    keys, values = [k for k, _ in kv], [v for _, v in kv]
    query = torch.randn(batch, heads, head_size, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_size ** -0.5
    all_keys, all_values, all_slots = torch.cat(keys), torch.cat(values), torch.cat(slots)
    shape = (num_blocks, kv_heads, block_size, head_size)

    def run(dtype, k_scale=None, v_scale=None):
        key_cache = torch.zeros(shape, dtype=dtype)
        value_cache = torch.zeros(shape, dtype=dtype)
        extra = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        cast = (lambda x: x) if k_scale is not None else (lambda x: x.to(dtype))
        ops.write_kv(cast(all_keys), cast(all_values), key_cache, value_cache, all_slots, **extra)
        out = ops.attention(query.to(torch.float32 if k_scale is not None else dtype), key_cache,
                           value_cache, tables, seq_lens, scale, **extra)
        return out, key_cache, value_cache

    def per_seq(cache):  # contiguous [tokens, kvh, hs] per sequence, from the paged cache
        return [cache[tables[i, :-(-n // block_size)].long()].permute(0, 2, 1, 3)
                .reshape(-1, kv_heads, head_size)[:n] for i, n in enumerate(lens)]

    exact = float64_attention(query, keys, values, lens, scale)
    fp32_out, key32, value32 = run(torch.float32)
    bf16_out, _, _ = run(torch.bfloat16)
    result = {"shape": dict(batch=batch, context=context, heads=heads, kv_heads=kv_heads,
                            head_size=head_size, block_size=block_size, key_outliers=outliers),
              "fp32_cache_baseline": error_stats(fp32_out, float64_attention(
                  query, per_seq(key32), per_seq(value32), lens, scale)),
              "bf16_cache_vs_unquantized": error_stats(bf16_out, exact), "formats": {}}
    for name in FORMATS:
        dtype = q.FP8_FORMATS[name]
        for calibration in CALIBRATIONS:
            per_head = calibration == "per_head"
            k_scale, v_scale = q.calibrate(all_keys, dtype, per_head), q.calibrate(all_values, dtype, per_head)
            out, key_cache, value_cache = run(dtype, k_scale, v_scale)
            dequantized = float64_attention(query, per_seq(dequantize(key_cache, k_scale)),
                                            per_seq(dequantize(value_cache, v_scale)), lens, scale)
            vs_dequantized = error_stats(out, dequantized)
            baseline = result["fp32_cache_baseline"]["rel_rms"]["max"]
            result["formats"][f"{name}/{calibration}"] = {
                "vs_dequantized": vs_dequantized,
                # "to fp32 rounding": no worse than 4x the fp32 cache's error against float64.
                "within_fp32_rounding": vs_dequantized["rel_rms"]["max"] <= 4 * baseline,
                "vs_unquantized": error_stats(out, exact),
                # Stored keys against the originals (the first sequence's: enough samples).
                "key_roundtrip": error_stats(per_seq(dequantize(key_cache, k_scale))[0],
                                             keys[0].double()),
            }
    return result


# ---- 2. models -----------------------------------------------------------------------------------

def teacher_forced(model, tokens, prompt_len, **cache_options) -> torch.Tensor:
    """fp32 logits ``[rows, steps, vocab]`` of the prompt's last position and of each later
    token fed one at a time through a PagedCache."""
    cache = PagedCache(model.config, block_size=16, **cache_options)
    with torch.no_grad():
        logits = [model(tokens[:, :prompt_len], past_key_values=cache).logits[:, -1]]
        for i in range(prompt_len, tokens.shape[1] - 1):
            logits.append(model(tokens[:, i:i + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(logits, dim=1).float()


def model_accuracy(arch: str, rows: int, prompt_len: int, new_tokens: int, dtype: torch.dtype) -> Dict:
    model, _ = random_pair(ARCHS[arch](), seed=0)
    model = model.to(dtype)
    ids = torch.randint(1, TINY["vocab_size"], (rows, prompt_len), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        base = model.generate(ids, past_key_values=PagedCache(model.config, block_size=16), **greedy)
    base_logits = teacher_forced(model, base, prompt_len)
    result = {}
    # Controls: a cache of another 16-bit (fp16) or of a wider float (fp32) shows how much
    # these random models' greedy tokens move under any small change of K/V.
    runs = {f"{name}/{calibration}": dict(kv_cache_dtype=name, kv_scale_calibration=calibration)
            for name in FORMATS for calibration in CALIBRATIONS}
    runs.update({"float16 (control)": dict(kv_cache_dtype=torch.float16),
                 "float32 (control)": dict(kv_cache_dtype=torch.float32)})
    for run_name, options in runs.items():
        with torch.no_grad():
            run = model.generate(ids, past_key_values=PagedCache(model.config, block_size=16,
                                                                **options), **greedy)
        same = run[:, prompt_len:] == base[:, prompt_len:]
        first_diff = [int(row.logical_not().nonzero()[0]) if not row.all() else new_tokens
                      for row in same]
        logits = teacher_forced(model, base, prompt_len, **options)
        err = (logits - base_logits).abs()
        result[run_name] = {
            "greedy_tokens_equal": same.float().mean().item(),
            "tokens_before_first_difference": first_diff,
            "teacher_forced_argmax_equal": (logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item(),
            "logit_abs_err_max": err.max().item(), "logit_abs_err_mean": err.mean().item(),
            "logit_err_mean_over_std": (err.mean() / base_logits.std()).item(),
        }
    return result


# ---- 3. capacity ---------------------------------------------------------------------------------

def capacity(pool_blocks: int) -> Dict:
    config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 4})
    model, _ = random_pair(config, seed=0)
    model = model.to(torch.bfloat16)
    text = model.config
    block_size = 16
    head_size = text.hidden_size // text.num_attention_heads
    pool_bytes = pool_blocks * bytes_per_block(text.num_hidden_layers, text.num_key_value_heads,
                                               head_size, block_size, torch.bfloat16)
    engines = {}
    for name in ("auto",) + FORMATS:
        block = bytes_per_block(text.num_hidden_layers, text.num_key_value_heads, head_size, block_size,
                                q.kv_cache_dtype(name, model.dtype))
        engine = LLMEngine(model, EngineConfig(block_size=block_size, num_device_blocks=pool_bytes // block,
                                               num_host_blocks=256, kv_cache_dtype=name))
        usage = engine.kv_cache.usage(0)
        # The demo's batch (greedy, n = 2-3 samples, beams behind a shared prompt) through it.
        engine.generate(make_requests(text.vocab_size, eos=2, seed=0))
        report = engine.report()
        engines["bfloat16" if name == "auto" else name] = {
            "dtype": usage["dtype"], "pool_bytes": usage["device_bytes"],
            "blocks": engine.kv_cache.num_blocks, "tokens": usage["device_tokens"],
            "block_bytes": engine.kv_cache.block_bytes,
            "demo_batch": {k: report[k] for k in ("steps", "generated_tokens", "preemptions",
                                                  "kv_blocks_peak")}}
    presets = {}
    for name in ("llama-3-8b", "llama-2-7b", "qwen2-7b"):
        shape = PRESETS[name]
        tokens = {}
        for dtype in (torch.bfloat16,) + q.FP8_DTYPES[:1]:
            block = bytes_per_block(shape.layers, shape.kv_heads, shape.head_size, block_size, dtype)
            tokens[str(dtype).replace("torch.", "")] = 16 * GIB // block * block_size
        presets[name] = tokens
    return {"engine_pool_bytes": pool_bytes, "engine": engines, "presets_16GiB_tokens": presets}


# ---- driver --------------------------------------------------------------------------------------

def summarize(results: Dict) -> None:
    for op in results["op"]:
        s = op["shape"]
        print(f"op: B={s['batch']} context {s['context']} heads {s['heads']}/{s['kv_heads']} head size "
              f"{s['head_size']}, key outlier channels: {s['key_outliers']}  (rel: error / RMS of the "
              "output row)")
        base = op["fp32_cache_baseline"]["rel_rms"]["max"]
        print(f"  fp32 cache vs float64 of itself: max rel {base:.2e};  bf16 cache vs unquantized: "
              f"max rel {op['bf16_cache_vs_unquantized']['rel_rms']['max']:.2e}, mean "
              f"{op['bf16_cache_vs_unquantized']['rel_rms']['mean']:.2e}")
        for name, r in op["formats"].items():
            d, u = r["vs_dequantized"]["rel_rms"], r["vs_unquantized"]["rel_rms"]
            ok = "ok" if r["within_fp32_rounding"] else "FAIL"
            print(f"  {name:<20} vs dequantized max rel {d['max']:.2e} ({ok}) | vs unquantized rel: max "
                  f"{u['max']:.2e} mean {u['mean']:.2e} p50 {u['p50']:.2e} p99 {u['p99']:.2e}")
    for arch, formats in results["models"].items():
        for name, r in formats.items():
            print(f"model {arch:<8} {name:<20} greedy tokens equal {r['greedy_tokens_equal']:.2f} "
                  f"(first difference after {r['tokens_before_first_difference']}), teacher-forced "
                  f"argmax equal {r['teacher_forced_argmax_equal']:.2f}, logit err max "
                  f"{r['logit_abs_err_max']:.3f} mean {r['logit_abs_err_mean']:.4f} "
                  f"({r['logit_err_mean_over_std']:.3f} std)")
    cap = results["capacity"]
    for name, e in cap["engine"].items():
        demo = e["demo_batch"]
        print(f"capacity {name:<9} {e['tokens']} tokens ({e['blocks']} blocks of {e['block_bytes']} "
              f"bytes) in {e['pool_bytes']} bytes; the demo batch: {demo['steps']} steps, "
              f"preemptions {demo['preemptions']}, peak {demo['kv_blocks_peak']} blocks")
    for name, tokens in cap["presets_16GiB_tokens"].items():
        print(f"capacity {name} in 16 GiB: {tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--out", default="bench/results/fp8_accuracy.json")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.quick:
        shapes = [dict(batch=2, context=100, heads=4, kv_heads=2, head_size=64, outliers=o)
                  for o in (False, True)]
        model_runs = dict(rows=2, prompt_len=12, new_tokens=12)
    else:
        shapes = [dict(batch=16, context=2048, heads=32, kv_heads=kv_heads, head_size=128, outliers=o)
                  for kv_heads in (32, 8) for o in (False, True)]
        model_runs = dict(rows=4, prompt_len=16, new_tokens=32)
    results = {
        "quick": args.quick,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "cpu_isa": ops.cpu_isa(),
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "op": [op_accuracy(**s) for s in shapes],
        "models": {arch: model_accuracy(arch, dtype=torch.bfloat16, **model_runs) for arch in ARCHS},
        "capacity": capacity(pool_blocks=40),
    }
    results["wall_s"] = time.perf_counter() - started
    summarize(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
