"""``paged-attention demo``: serve a mixed batch with the engine and check it against transformers.

Offline by default: a small Qwen2 model (grouped-query attention) with seeded random
weights. The batch mixes greedy requests, parallel sampling and beam search behind a
shared system prompt, under a KV pool small enough that groups get preempted; every
request's tokens are then compared with transformers' ``generate`` on an sdpa twin of
the same weights.
"""

import argparse
import random
import sys
import time
from typing import Callable, Dict, List

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import Request, RequestOutput

BLOCK_SIZE = 16
EOS = 2  # the built-in model's end-of-sequence token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local checkpoint to load instead of the built-in model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=40,
                        help="KV blocks of 16 tokens on the device (small on purpose)")
    parser.add_argument("--preemption-mode", choices=("swap", "recompute"),
                        help="default: the engine's (swap, see docs/engine.md)")
    parser.add_argument("--no-prefix-caching", action="store_true")


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
    from ..engine import EngineConfig, LLMEngine, Request, SamplingParams
    from ..engine.models import pretrained_pair, random_pair, tiny_config
    from ..engine.reference import generate_reference

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
    config = EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=args.blocks, num_host_blocks=256,
                          enable_prefix_caching=not args.no_prefix_caching,
                          preemption_mode=args.preemption_mode or EngineConfig.preemption_mode)
    # The first forwards pay one-time setup (thread pools, kernel selection): not the engine's cost.
    LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=4)).generate(
        [Request("warm-up", [3, 4, 5], SamplingParams(max_new_tokens=2))])
    engine = LLMEngine(paged, config)
    outputs = engine.generate(requests, on_output=_progress(len(requests)))
    engine.manager.check_invariants()
    stats = engine.report()
    mismatched = [r.request_id for r in requests if generate_reference(reference, r) != outputs[r.request_id]]
    report = {
        "ok": not mismatched,
        "model": model_name,
        "requests": len(requests),
        "tokens_per_s": stats["tokens_per_s"],
        "kv_utilization": stats["kv_utilization"],
        "sharing_saved_pct": stats["sharing_saved_pct"],
        "preemptions": stats["preemptions"],
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "matches_reference": not mismatched,
        "mismatched_requests": mismatched,
        "engine": stats,
        "wall_s": time.perf_counter() - started,
    }
    _print_report(report, requests)
    return report


def _print_report(report: Dict, requests: List["Request"]) -> None:
    s = report["engine"]
    kinds = {k: sum(r.request_id.startswith(k) for r in requests) for k in ("greedy", "sample", "beam")}
    ms = 1000.0
    lines = [
        f"paged-attention demo: {report['model']}",
        f"  batch             {report['requests']} requests ({kinds['greedy']} greedy, {kinds['sample']} "
        f"sampled with n = 2-3, {kinds['beam']} beam searches), one shared 48-token system prompt",
        f"  KV pool           {s['kv_blocks_total']} blocks of {s['config']['block_size']} tokens, "
        f"preemption by {s['config']['preemption_mode']}",
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
        f"  prefix cache      {100 * s['prefix_cache_hit_rate']:.1f}% of cacheable prompt blocks hit",
        "  reference         " + ("every request's tokens equal transformers generate (sdpa twin)"
                                   if report["matches_reference"] else
                                   f"MISMATCH with transformers generate: {report['mismatched_requests']}"),
        f"  wall time         {report['wall_s']:.1f} s including the reference runs",
    ]
    print("\n".join(lines))
