"""``paged-attention demo``: serve a mixed batch with the engine and check it against transformers.

Offline by default: a small Qwen2 model (grouped-query attention) with seeded random
weights. The batch mixes greedy requests, parallel sampling and beam search behind a
shared system prompt, under a KV pool small enough that groups get preempted; every
request's tokens are then compared with transformers' ``generate`` on an sdpa twin of
the same weights.

``--kv-cache-dtype fp8_e4m3`` (or ``fp8_e5m2``) stores K/V in 8 bits: the pool keeps the
bytes of ``--blocks`` blocks of the model's dtype and holds correspondingly more tokens
(the report shows both, from the engine's own accounting). fp8 rounding changes some of
the random-weight model's tokens, so the report then counts the requests that still match
transformers instead of failing on them.
"""

import argparse
import random
import sys
import time
from typing import Callable, Dict, List

import torch

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import Request, RequestOutput

BLOCK_SIZE = 16
EOS = 2  # the built-in model's end-of-sequence token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local checkpoint to load instead of the built-in model")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the built-in model's weights and of the requests (default "
                             "%(default)s)")
    parser.add_argument("--blocks", type=int, default=40,
                        help="KV blocks of 16 tokens on the device (small on purpose; default "
                             "%(default)s)")
    parser.add_argument("--preemption-mode", choices=("swap", "recompute"),
                        help="default: the engine's (swap, see docs/engine.md)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="turn off the engine's prefix caching (reuse of the shared system "
                             "prompt's blocks)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3", "fp8_e5m2",
                                                     "int8_per_token_head", "int4_per_token_head"),
                        default="auto",
                        help="auto: the model's dtype; fp8: 8-bit K/V in the same bytes as --blocks "
                             "model-dtype blocks, scales calibrated from the first step (docs/fp8.md); "
                             "int8/int4 per token: scales per token and KV head, in the blocks")
    parser.add_argument("--compile-decode", nargs="?", const="inductor", metavar="BACKEND",
                        help="decode steps through torch.compile with BACKEND (default inductor; "
                             "compiled before serving, docs/engine.md)")


def make_requests(vocab_size: int, eos: int, seed: int) -> List["Request"]:
    """Greedy, sampled (n > 1) and beam-search requests sharing a 48-token system prompt."""
    from ..engine import Request, SamplingParams

    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(3 * BLOCK_SIZE)]

    def prompt() -> List[int]:
        return system + [rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 40))]

    eos_ids = (eos,)
    requests = [Request(f"greedy-{i}", prompt(), SamplingParams(max_new_tokens=rng.randint(16, 40),
                                                                 eos_token_ids=eos_ids))
                for i in range(8)]
    requests += [Request(f"sample-{i}", prompt(), SamplingParams(
        max_new_tokens=rng.randint(16, 32), temperature=0.8, top_k=50, top_p=0.95, n=2 + i % 2,
        seed=seed + i, eos_token_ids=eos_ids)) for i in range(4)]
    requests += [Request(f"beam-{i}", prompt(), SamplingParams(
        max_new_tokens=rng.randint(12, 24), num_beams=3 + i % 2, num_return_sequences=2,
        eos_token_ids=eos_ids)) for i in range(3)]
    rng.shuffle(requests)
    return requests


def _progress(total: int) -> Callable[["RequestOutput"], None]:
    """Finished requests on stderr: a tqdm bar when tqdm is installed, else a counter line."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar = tqdm(total=total, unit="req", desc="serving", file=sys.stderr) if tqdm else None
    done = 0

    def update(output: "RequestOutput") -> None:
        nonlocal done
        if not output.finished:
            return
        done += 1
        if bar is not None:
            bar.update(1)
            if done == total:
                bar.close()
        else:
            print(f"\rserving: {done}/{total} requests", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)

    return update


def run(args: argparse.Namespace) -> Dict:
    # Imported here: transformers takes seconds to load, and other subcommands don't need it.
    from ..engine import EngineConfig, LLMEngine, Request, SamplingParams, generate_reference
    from ..quantization import kv_cache_dtype
    from ..testing import pretrained_pair, random_pair, tiny_config

    started = time.perf_counter()
    if args.model:
        paged, reference = pretrained_pair(args.model)
        eos = paged.generation_config.eos_token_id
        eos = (eos[0] if isinstance(eos, list) else eos) if eos is not None else EOS
        model_name = args.model
    else:
        config = tiny_config(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=8,
                             num_kv_heads=2, eos_token_id=EOS)
        paged, reference = random_pair(config, seed=args.seed)
        eos, model_name = EOS, f"built-in Qwen2 (4 layers, GQA 8/2 heads, random weights, seed {args.seed})"
    requests = make_requests(paged.config.get_text_config().vocab_size, eos, args.seed)
    # The pool's bytes are those of --blocks blocks in the model's dtype, whatever it stores.
    pool_bytes = args.blocks * _block_bytes(paged, paged.dtype)
    blocks = pool_bytes // _block_bytes(paged, kv_cache_dtype(args.kv_cache_dtype, paged.dtype))
    config = EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=blocks, num_host_blocks=256,
                          enable_prefix_caching=not args.no_prefix_caching,
                          preemption_mode=args.preemption_mode or EngineConfig.preemption_mode,
                          kv_cache_dtype=args.kv_cache_dtype,
                          compile_decode=args.compile_decode is not None,
                          compile_backend=args.compile_decode or EngineConfig.compile_backend)
    # The first forwards pay one-time setup (thread pools, kernel selection): not the engine's cost.
    LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=4)).generate(
        [Request("warm-up", [3, 4, 5], SamplingParams(max_new_tokens=2))])
    engine = LLMEngine(paged, config)
    outputs = engine.generate(requests, on_output=_progress(len(requests)))
    engine.scheduler.manager.check_invariants()
    stats = engine.report()
    mismatched = [r.request_id for r in requests if generate_reference(reference, r) != outputs[r.request_id]]
    kv = engine.kv_cache
    report = {
        # fp8 K/V is not bit-exact: the check is then the engine's invariants (above).
        "ok": not mismatched or kv.is_quantized,
        "model": model_name,
        "requests": len(requests),
        "tokens_per_s": stats["tokens_per_s"],
        "kv_utilization": stats["kv_utilization"],
        "sharing_saved_pct": stats["sharing_saved_pct"],
        "preemptions": stats["preemptions"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "kv_pool": _pool_report(paged, kv),
        "matches_reference": not mismatched,
        "mismatched_requests": mismatched,
        "engine": stats,
        "wall_s": time.perf_counter() - started,
    }
    _print_report(report, requests)
    return report


def _block_bytes(model, dtype) -> int:
    """One block's K/V bytes, all layers, as the engine's PagedKVCache counts them."""
    from ..hf.support import kv_head_shape
    from ..kv_cache import bytes_per_block

    text = model.config.get_text_config()
    shape = kv_head_shape(text)
    return bytes_per_block(text.num_hidden_layers, shape.num_kv_heads, shape.head_size, BLOCK_SIZE,
                           dtype, shape.head_size_v)


def _pool_report(model, kv) -> Dict:
    """Tokens the engine's pool holds, and what its bytes would hold in the model's dtype."""
    from ..quantization import dtype_label

    pool_bytes = kv.num_blocks * kv.block_bytes
    model_dtype_tokens = pool_bytes // _block_bytes(model, model.dtype) * BLOCK_SIZE
    return {"dtype": dtype_label(kv.dtype),
            "model_dtype": str(model.dtype).replace("torch.", ""),
            "bytes": pool_bytes, "blocks": kv.num_blocks, "tokens": kv.num_blocks * kv.block_size,
            "model_dtype_tokens": model_dtype_tokens,
            "bfloat16_tokens": pool_bytes // _block_bytes(model, torch.bfloat16) * BLOCK_SIZE,
            "capacity_ratio": kv.num_blocks * kv.block_size / model_dtype_tokens}


def _print_report(report: Dict, requests: List["Request"]) -> None:
    s, pool = report["engine"], report["kv_pool"]
    kinds = {k: sum(r.request_id.startswith(k) for r in requests) for k in ("greedy", "sample", "beam")}
    ms = 1000.0
    lines = [
        f"paged-attention demo: {report['model']}",
        f"  batch             {report['requests']} requests ({kinds['greedy']} greedy, {kinds['sample']} "
        f"sampled with n = 2-3, {kinds['beam']} beam searches), one shared 48-token system prompt",
        f"  KV pool           {s['kv_blocks_total']} blocks of {s['config']['block_size']} tokens, "
        f"preemption by {s['config']['preemption_mode']}",
        f"  KV capacity       {pool['tokens']} tokens in {pool['bytes'] / 1024:.0f} KiB of {pool['dtype']}"
        + (f": {pool['capacity_ratio']:.1f}x the {pool['model_dtype_tokens']} tokens of a "
           f"{pool['model_dtype']} cache, {pool['tokens'] / pool['bfloat16_tokens']:.1f}x the "
           f"{pool['bfloat16_tokens']} of a bfloat16 one in the same bytes"
           if pool["dtype"] != pool["model_dtype"] else ""),
        f"  throughput        {s['tokens_per_s']:.0f} tokens/s ({s['generated_tokens']} tokens in "
        f"{s['elapsed_s']:.2f} s, {s['steps']} steps)",
        f"  latency           time to first token {s['ttft_s']['mean'] * ms:.0f} ms mean, "
        f"{s['ttft_s']['max'] * ms:.0f} ms max; per token {s['per_token_latency_s']['mean'] * ms:.1f} ms mean",
        f"  KV blocks used    peak {s['kv_blocks_peak']}, mean {s['kv_blocks_mean']:.1f}; contiguous "
        f"max-length allocation would reserve peak {s['contiguous_blocks_peak']}, "
        f"mean {s['contiguous_blocks_mean']:.1f}",
        f"  slots filled      {100 * s['kv_utilization']:.1f}% of the slots in used blocks hold a token",
        f"  sharing           {s['sharing_saved_pct']:.1f}% of block references needed no block "
        f"of their own (shared prompt, samples, beams)",
        f"  preemptions       {s['preemptions']['swap']} by swap, {s['preemptions']['recompute']} by recompute",
        *([_compiled_line(s)] if s["compiled_decode"] else []),
        f"  prefix cache      {100 * s['prefix_cache_hit_rate']:.1f}% of cacheable prompt blocks hit",
        "  reference         " + _reference_line(report, pool),
        f"  wall time         {report['wall_s']:.1f} s including the reference runs",
    ]
    print("\n".join(lines))


def _compiled_line(stats: Dict) -> str:
    compiled = stats["compiled_decode"]
    # fp8 caches calibrate in the first prefill and compile at the first decode step after it.
    seconds = compiled["compile_and_warmup_s"]
    when = "never compiled" if seconds is None else f"compiled in {seconds:.1f} s"
    return f"  compiled decode   {compiled['steps']} of {stats['steps']} steps, {when}"


def _reference_line(report: Dict, pool: Dict) -> str:
    if report["matches_reference"]:
        return "every request's tokens equal transformers generate (sdpa twin)"
    if pool["dtype"] != pool["model_dtype"] and pool["dtype"].startswith("float8"):
        same = report["requests"] - len(report["mismatched_requests"])
        return (f"{same} of {report['requests']} requests token-identical to transformers generate "
                f"({pool['model_dtype']} K/V); fp8 rounding changed the others' tokens (docs/fp8.md)")
    return f"MISMATCH with transformers generate: {report['mismatched_requests']}"
