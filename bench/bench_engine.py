"""End to end: the paged engine vs transformers ``generate`` and ``generate_batch`` on CPU.

Usage: ``.venv/bin/python bench/bench_engine.py [--quick] [--reps N] [--out PATH] [--threads N]
[--backend inductor] [--compile-options JSON]``

Method
------
* Model: a Qwen2-architecture model (4 layers, hidden 256, 8 query / 2 KV heads of size 32,
  vocabulary 2048), fp32, seeded random weights; the engine's copy uses the
  ``paged_attention_ext`` attention, the others sdpa (``generate_batch`` switches its copy
  to transformers' own paged sdpa).
* Requests: 12 random prompts of 1024 tokens, 32 greedy new tokens each, no EOS, so every
  system produces the same 384 tokens and long contexts make attention a real share of
  the work. All three systems get the same requests at once and must return the same
  tokens (checked).
* Systems:

  - ``engine``: ``LLMEngine`` with 16-token blocks and a pool that holds every request;
  - ``engine_compiled``: the same with ``compile_decode=True`` (``--backend``, inductor by
    default, with ``--compile-options`` if given); the compile happens once, before the
    runs, and is reported apart;
  - ``generate``: one batched ``model.generate`` call with its default cache
    (DynamicCache; equal prompt lengths, so no padding);
  - ``generate_batch``: transformers' continuous batching with 16-token pages and as many
    pages as the engine's pool (it needs ``psutil`` on CPU).

  Each is warmed up on a short request first, then all runs (the three systems and the
  two preemption modes below) repeat ``--reps`` times round-robin, in an order rotated per
  repetition, so machine noise falls on all alike. Throughput is generated tokens over
  the median wall time of the whole call (prefill included); the best run is kept too. KV memory: ``generate``'s is the bytes
  its cache tensors hold at the end (their peak); the engine's is its peak of blocks in
  use times the block size, beside the pool it reserves up front; ``generate_batch``'s is
  the pool it reserves.
* Preemption: the engine under a pool too small for its batch, once per mode (swap to
  host blocks, or free and recompute), on two workloads: the long prompts above with a
  pool that holds a third of the prompts plus one block (so decoding must preempt), and
  the demo's mix (greedy, n = 2-3 samples and beam searches behind a shared system
  prompt; three seeds, 45 requests) with a pool of 48 blocks. Both modes must return the
  tokens of a run without preemption. The mode with the higher geometric mean of the two
  throughputs is the engine's default (docs/engine.md).

Results are printed and written as JSON (default ``bench/results/engine.json``).
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import transformers

from common.environment import machine_info  # the CPU model and the ops' ISA
from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.hf.support import kv_head_shape
from paged_attention_ext.kv_cache import bytes_per_block
from paged_attention_ext.testing import random_pair, tiny_config
from paged_attention_ext.tools import demo

BLOCK_SIZE = 16
MODEL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             max_positions=4096)


def long_prompts(count: int, prompt_len: int, new_tokens: int, vocab: int) -> List[Request]:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens)
    return [Request(f"req_{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
            for i in range(count)]


def mixed_requests(vocab: int) -> List[Request]:
    return [Request(f"{seed}/{r.request_id}", r.prompt, r.params)
            for seed in range(3) for r in demo.make_requests(vocab, demo.EOS, seed)]


def timed(fn: Callable[[], object]):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_engine(model, requests: List[Request], num_blocks: int, mode: str = "swap",
               compile_backend: "str | None" = None, compile_options: "dict | None" = None) -> Dict:
    # No admission watermark: the small pool then fills with prompts exactly and decoding preempts.
    # compile_backend: decode steps compiled (torch reuses the graphs of an earlier engine over
    # the same model, so only the first engine compiles).
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=num_blocks,
                                           num_host_blocks=4 * num_blocks, preemption_mode=mode,
                                           watermark=0.0, compile_decode=compile_backend is not None,
                                           compile_backend=compile_backend or "inductor",
                                           compile_options=compile_options))
    outputs, elapsed = timed(lambda: engine.generate(requests))
    report = engine.report()
    block_bytes = engine.kv_cache.block_bytes
    return {
        "outputs": [outputs[r.request_id] for r in requests],
        "elapsed_s": elapsed,
        "peak_kv_bytes": report["kv_blocks_peak"] * block_bytes,
        "reserved_kv_bytes": num_blocks * block_bytes,
        "preemptions": report["preemptions"],
        "steps": report["steps"],
        "ttft_mean_s": report["ttft_s"]["mean"],
        "per_token_latency_mean_s": report["per_token_latency_s"]["mean"],
    }


def run_generate(model, requests: List[Request], new_tokens: int) -> Dict:
    ids = torch.tensor([r.prompt for r in requests])

    def call():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0, return_dict_in_generate=True)

    out, elapsed = timed(call)
    cache = out.past_key_values
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
    return {"outputs": [[row] for row in out.sequences[:, ids.shape[1]:].tolist()], "elapsed_s": elapsed,
            "peak_kv_bytes": held}


def run_generate_batch(model, requests: List[Request], new_tokens: int, num_blocks: int) -> Dict:
    if importlib.util.find_spec("psutil") is None:  # transformers sizes its CPU cache with it
        return {"skipped": "transformers' generate_batch needs psutil on CPU"}
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=num_blocks, max_batch_tokens=4096,
        max_requests_per_batch=len(requests))
    out, elapsed = timed(lambda: model.generate_batch(
        [r.prompt for r in requests], generation_config=config,
        continuous_batching_config=batching, progress_bar=False))
    text = model.config.get_text_config()
    shape = kv_head_shape(text)
    page_bytes = bytes_per_block(text.num_hidden_layers, shape.num_kv_heads, shape.head_size, BLOCK_SIZE,
                                 model.dtype, shape.head_size_v)
    return {"outputs": [[out[f"req_{i}"].generated_tokens] for i in range(len(requests))],
            "elapsed_s": elapsed, "reserved_kv_bytes": num_blocks * page_bytes}


def summarize(runs: List[Dict], reference: List[List[List[int]]]) -> Dict:
    """One system's repetitions: the median run (its time and latencies), the best time, and
    whether every run returned the reference tokens."""
    if "skipped" in runs[0]:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r["elapsed_s"])
    median, best = ordered[len(ordered) // 2], ordered[0]["elapsed_s"]
    tokens = sum(len(seq) for request in median["outputs"] for seq in request)
    fields = {k: v for k, v in median.items() if k != "outputs"}
    return {**fields, "generated_tokens": tokens, "best_s": best,
            "tokens_per_s": tokens / median["elapsed_s"], "tokens_per_s_best": tokens / best,
            "same_tokens_as_engine": all(r["outputs"] == reference for r in runs)}


def round_robin(runs: Dict[str, Callable[[], Dict]], reps: int) -> Dict[str, List[Dict]]:
    names = list(runs)
    results: Dict[str, List[Dict]] = {name: [] for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(runs[name]())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 long prompts of 256 tokens (smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.json"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend of the engine_compiled system")
    parser.add_argument("--compile-options", type=json.loads, default=None,
                        help="engine_compiled's EngineConfig.compile_options, as JSON (inductor only)")
    args = parser.parse_args()
    options = args.compile_options if args.backend == "inductor" else None
    load_at_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    count, prompt_len, new_tokens = (4, 256, 8) if args.quick else (12, 1024, 32)

    paged, sdpa = random_pair(tiny_config(**MODEL, eos_token_id=demo.EOS), seed=0)
    batching_model, _ = random_pair(tiny_config(**MODEL, eos_token_id=demo.EOS), seed=0)
    batching_model.set_attn_implementation("sdpa")
    requests = long_prompts(count, prompt_len, new_tokens, MODEL["vocab_size"])
    mixed = mixed_requests(MODEL["vocab_size"])
    blocks_needed = count * -(-(prompt_len + new_tokens) // BLOCK_SIZE)
    # Room for a third of the prompts and one block: decoding them must preempt.
    small_pool = max(2, count // 3) * -(-prompt_len // BLOCK_SIZE) + 1
    mixed_pool = 48

    warm = long_prompts(2, 32, 2, MODEL["vocab_size"])
    run_engine(paged, warm, 16)
    compile_s = timed(lambda: run_engine(paged, warm, blocks_needed + 8, compile_backend=args.backend,
                                      compile_options=options))[1]
    run_generate(sdpa, warm, 2)
    generate_batch_warmup = run_generate_batch(batching_model, warm, 2, 16)

    runs = {
        "engine": lambda: run_engine(paged, requests, blocks_needed + 8),
        "engine_compiled": lambda: run_engine(paged, requests, blocks_needed + 8,
                                              compile_backend=args.backend,
                                              compile_options=options),
        "generate": lambda: run_generate(sdpa, requests, new_tokens),
        "generate_batch": lambda: run_generate_batch(batching_model, requests, new_tokens,
                                                     blocks_needed + 8),
        "long/swap": lambda: run_engine(paged, requests, small_pool, "swap"),
        "long/recompute": lambda: run_engine(paged, requests, small_pool, "recompute"),
        "mixed/swap": lambda: run_engine(paged, mixed, mixed_pool, "swap"),
        "mixed/recompute": lambda: run_engine(paged, mixed, mixed_pool, "recompute"),
    }
    if "skipped" in generate_batch_warmup:
        runs["generate_batch"] = lambda: generate_batch_warmup
    measured = round_robin(runs, args.reps)
    reference = {"long": measured["engine"][0]["outputs"],
                 "mixed": run_engine(paged, mixed, 1024)["outputs"]}
    results = {name: summarize(measured[name], reference["long"])
               for name in ("engine", "engine_compiled", "generate", "generate_batch")}
    preemption = {name: summarize(measured[name], reference[name.split("/")[0]])
                  for name in runs if "/" in name}
    speed = {mode: statistics.geometric_mean(preemption[f"{w}/{mode}"]["tokens_per_s"]
                                             for w in ("long", "mixed"))
             for mode in ("swap", "recompute")}
    report = {
        "machine": {**machine_info(), "cpus": os.cpu_count(), "threads": args.threads,
                    "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
                    "load_average_start": load_at_start, "load_average_end": os.getloadavg()},
        "workload": {"requests": count, "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "reps": args.reps, "block_size": BLOCK_SIZE, "model": MODEL, "dtype": "float32"},
        "systems": results,
        "engine_compiled": {"backend": args.backend, "options": options,
                            "compile_and_warmup_s": compile_s,
                            "vs_generate": (results["engine_compiled"]["tokens_per_s"]
                                            / results["generate"]["tokens_per_s"])},
        "preemption": {"pools": {"long": small_pool, "mixed": mixed_pool}, "runs": preemption,
                       "geomean_tokens_per_s": speed, "faster": max(speed, key=speed.get)},
    }
    for name, r in {**results, **{f"engine, {n}": r for n, r in preemption.items()}}.items():
        if "skipped" in r:
            print(f"{name:<28} skipped: {r['skipped']}")
            continue
        kv = r.get("peak_kv_bytes", r.get("reserved_kv_bytes", 0)) / 2**20
        print(f"{name:<28} {r['tokens_per_s']:8.1f} tokens/s (best {r['tokens_per_s_best']:.1f})  "
              f"{r['elapsed_s']:6.2f} s  KV {kv:7.1f} MiB  "
              f"same tokens: {r['same_tokens_as_engine']}  preemptions: {r.get('preemptions', '-')}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"engine_compiled / generate: {report['engine_compiled']['vs_generate']:.2f}x "
          f"(compile + warm-up {compile_s:.1f} s, not in the runs)")
    print("preemption, geometric mean tokens/s: " + ", ".join(f"{m} {v:.1f}" for m, v in speed.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
