"""Serving-shaped load: the engine (compiled decode) against what transformers users run today.

Requests get ShareGPT-like prompt and output lengths (``paged_attention_ext.tools.workloads``:
clipped log-normals with the vLLM paper's means, 161 prompt / 338 output tokens, capped at
``--max-len``); ``--burst`` of them arrive together at t = 0 and ``--later`` more arrive one
every ``--later-every`` seconds. No end-of-sequence token: every system generates exactly
each request's output length. The workload runs twice, all greedy and all sampled
(temperature 0.8, top-k 50), through the same random Qwen2 model (bench_engine.py's: 4
layers, hidden 256, 8/2 heads, vocabulary 2048; fp32) in

* ``engine``: ``LLMEngine`` with ``compile_decode=True`` (inductor; compiled before the clock
  starts, the compile time is reported apart), fed each request at its arrival time;
* ``engine_eager``: the same engine without the compiled decode;
* ``generate``: ``model.generate`` (sdpa) in fixed batches of ``--batch-size`` in arrival
  order, left-padded; a batch starts when its last request has arrived and the previous
  batch is done, and runs to its longest request's output length;
* ``generate_batch``: transformers' continuous batching (``init_continuous_batching``,
  the manager behind ``generate_batch``; ``paged|sdpa`` attention), each request added at
  its arrival time with its own ``max_new_tokens``.

For each: useful tokens/s (each request's own output tokens over the time from the first
arrival to the last token), time to first token (from the request's arrival) and
per-token latency (gaps between a request's consecutive tokens), mean and p50/p90.
Target: the engine >= 2x the better transformers path.

One thread by default, everywhere: transformers' continuous batching runs its model in a
background thread, whose OpenMP thread count is not the one torch.set_num_threads gives the
main thread, so OMP_NUM_THREADS is set (unless given) before torch loads; and on a shared
2-core machine, two OpenMP threads per small op mostly wait for each other (we measured the
engine's forward 10x slower with 2 threads than with 1 under load).

    python bench/bench_serving.py [--quick] [--threads N] [--out FILE]
"""

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: threads other than main too
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from common.environment import machine_info  # the CPU model and the ops' ISA
from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.testing import random_pair, tiny_config
from paged_attention_ext.tools.workloads import synthetic_trace

BLOCK_SIZE = 16
MODEL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             max_positions=4096)
SAMPLING = dict(temperature=0.8, top_k=50)


@dataclass
class Item:
    request_id: str
    prompt: List[int]
    new_tokens: int
    arrival: float  # seconds after the start


def workload(trace_name: str, burst: int, later: int, later_every: float, max_len: int,
             seed: int) -> List[Item]:
    trace = synthetic_trace(trace_name, burst + later, seed=seed, max_len=max_len)
    g = torch.Generator().manual_seed(seed)
    return [Item(f"req_{i}", torch.randint(0, MODEL["vocab_size"], (r.prompt_len,), generator=g).tolist(),
                 r.output_len, 0.0 if i < burst else (i - burst + 1) * later_every)
            for i, r in enumerate(trace)]


def wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# ---- the systems: each returns {request_id: [time of each generated token]} and t0 --------
def run_engine(model, items: List[Item], sampled: bool, backend: Optional[str], pool: int) -> Dict:
    """``backend`` None: eager decode."""
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=pool,
                                           num_host_blocks=pool, compile_decode=backend is not None,
                                           compile_backend=backend or "inductor"))
    params = {item.request_id: SamplingParams(max_new_tokens=item.new_tokens, seed=i,
                                              **(SAMPLING if sampled else {}))
              for i, item in enumerate(items)}
    times: Dict[str, List[float]] = {item.request_id: [] for item in items}
    pending = sorted(items, key=lambda it: it.arrival)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival <= now:
            item = pending.pop(0)
            engine.add_request(Request(item.request_id, item.prompt, params[item.request_id]))
        if not engine.has_unfinished():
            wait_until(t0 + pending[0].arrival)
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [stamp] * sum(map(len, out.new_tokens))
    return {"t0": t0, "times": times}


class _StepClock(BaseStreamer):
    """Records when generate produced each step's tokens (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
        else:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_generate(model, items: List[Item], sampled: bool, batch_size: int) -> Dict:
    order = sorted(items, key=lambda it: it.arrival)
    times: Dict[str, List[float]] = {}
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        wait_until(t0 + max(it.arrival for it in batch))
        width = max(len(it.prompt) for it in batch)
        ids = torch.tensor([[0] * (width - len(it.prompt)) + it.prompt for it in batch])
        mask = torch.tensor([[0] * (width - len(it.prompt)) + [1] * len(it.prompt) for it in batch])
        clock = _StepClock()
        if sampled:
            torch.manual_seed(start)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(it.new_tokens for it in batch),
                           do_sample=sampled, pad_token_id=0, eos_token_id=None, streamer=clock,
                           **(SAMPLING if sampled else {}))
        for it in batch:
            times[it.request_id] = clock.times[:it.new_tokens]
    return {"t0": t0, "times": times}


def run_generate_batch(model, items: List[Item], sampled: bool, pool: int) -> Dict:
    config = transformers.GenerationConfig(
        max_new_tokens=max(it.new_tokens for it in items), do_sample=sampled, eos_token_id=None,
        pad_token_id=0, **(SAMPLING if sampled else {}))
    batching = transformers.ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=pool, max_batch_tokens=4096,
        max_requests_per_batch=len(items))
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=batching)
    manager.start()
    results: Dict[str, object] = {}

    def collect() -> None:
        while len(results) < len(items):
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                results[result.request_id] = result

    collector = threading.Thread(target=collect)
    t0 = time.perf_counter()
    collector.start()
    for item in sorted(items, key=lambda it: it.arrival):
        wait_until(t0 + item.arrival)
        manager.add_request(item.prompt, request_id=item.request_id, max_new_tokens=item.new_tokens,
                            record_timestamps=True)
    collector.join()
    manager.stop(block=True)
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    bad = [r.request_id for r in results.values() if r.error or len(r.generated_tokens) != next(
        it.new_tokens for it in items if it.request_id == r.request_id)]
    if bad:
        raise RuntimeError(f"generate_batch: requests {bad[:5]} failed or returned the wrong length")
    return {"t0": t0, "times": {rid: list(r.timestamps) for rid, r in results.items()}}


# ---- summaries -----------------------------------------------------------------------
def _stats(values: List[float]) -> Dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0}
    ordered = sorted(values)
    return {"mean": statistics.fmean(values), "p50": ordered[len(ordered) // 2],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def summarize(run: Dict, items: List[Item]) -> Dict:
    t0, times = run["t0"], run["times"]
    missing = [it.request_id for it in items if len(times.get(it.request_id, [])) != it.new_tokens]
    if missing:
        raise RuntimeError(f"requests {missing[:5]} got the wrong number of tokens")
    tokens = sum(it.new_tokens for it in items)
    end = max(t for ts in times.values() for t in ts)
    ttft = [times[it.request_id][0] - (t0 + it.arrival) for it in items]
    gaps = [b - a for it in items for a, b in zip(times[it.request_id], times[it.request_id][1:])]
    return {"generated_tokens": tokens, "elapsed_s": end - t0, "tokens_per_s": tokens / (end - t0),
            "ttft_s": _stats(ttft), "per_token_latency_s": _stats(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="12 + 4 Alpaca-like requests up to 128 tokens, the eager backend "
                             "(smoke test)")
    parser.add_argument("--trace", default="sharegpt", choices=["sharegpt", "alpaca"])
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--later", type=int, default=32)
    parser.add_argument("--later-every", type=float, default=0.25)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32, help="generate's fixed batch size")
    parser.add_argument("--systems", nargs="+",
                        default=["engine", "engine_eager", "generate", "generate_batch"])
    parser.add_argument("--backend", default="inductor", help="the engine's torch.compile backend")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = parser.parse_args()
    if args.quick:
        args.burst, args.later, args.later_every, args.max_len, args.batch_size = 12, 4, 0.05, 128, 8
        args.trace = "alpaca"  # ShareGPT's means do not fit in 128 tokens
        args.backend = "eager"
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    load_at_start = os.getloadavg()

    paged, sdpa = random_pair(tiny_config(**MODEL), seed=0)
    batching_model, _ = random_pair(tiny_config(**MODEL), seed=0)
    batching_model.set_attn_implementation("sdpa")
    items = workload(args.trace, args.burst, args.later, args.later_every, args.max_len, args.seed)
    pool = sum(-(-(len(it.prompt) + it.new_tokens) // BLOCK_SIZE) for it in items) + 64

    # Warm-up (and the engine's compile, timed): a few small requests through every system.
    warm = workload("alpaca", 4, 0, 0.0, 64, seed=99)
    start = time.perf_counter()
    LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=pool, compile_decode=True,
                                  compile_backend=args.backend))
    compile_s = time.perf_counter() - start
    systems: Dict[str, Callable[[List[Item], bool], Dict]] = {
        "engine": lambda its, s: run_engine(paged, its, s, args.backend, pool),
        "engine_eager": lambda its, s: run_engine(paged, its, s, None, pool),
        "generate": lambda its, s: run_generate(sdpa, its, s, args.batch_size),
        "generate_batch": lambda its, s: run_generate_batch(batching_model, its, s, pool),
    }
    systems = {name: systems[name] for name in args.systems}
    for name, fn in systems.items():
        fn(warm, False)

    results: Dict[str, Dict[str, Dict]] = {}
    for mode in ("greedy", "sampled"):
        results[mode] = {}
        for name, fn in systems.items():
            results[mode][name] = summarize(fn(items, mode == "sampled"), items)
            r = results[mode][name]
            print(f"{mode:<8} {name:<15} {r['tokens_per_s']:8.1f} tokens/s  {r['elapsed_s']:7.2f} s  "
                  f"TTFT mean {r['ttft_s']['mean']:.3f} s p90 {r['ttft_s']['p90']:.3f} s  "
                  f"per token mean {1e3 * r['per_token_latency_s']['mean']:.1f} ms", flush=True)
        baselines = [results[mode][n]["tokens_per_s"] for n in ("generate", "generate_batch")
                     if n in results[mode]]
        if "engine" in results[mode] and baselines:
            results[mode]["engine_vs_best_transformers"] = (
                results[mode]["engine"]["tokens_per_s"] / max(baselines))
            print(f"{mode:<8} engine / best transformers path: "
                  f"{results[mode]['engine_vs_best_transformers']:.2f}x")
    report = {
        "machine": {**machine_info(), "cpus": os.cpu_count(), "threads": args.threads,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "load_average_start": load_at_start, "load_average_end": os.getloadavg()},
        "workload": {"trace": args.trace, "burst": args.burst, "later": args.later,
                     "later_every_s": args.later_every, "max_len": args.max_len, "seed": args.seed,
                     "prompt_tokens": sum(len(it.prompt) for it in items),
                     "output_tokens": sum(it.new_tokens for it in items),
                     "generate_batch_size": args.batch_size, "kv_pool_blocks": pool,
                     "block_size": BLOCK_SIZE, "model": MODEL, "dtype": "float32",
                     "sampling": SAMPLING, "quick": args.quick},
        "engine_compile_backend": args.backend,
        "engine_compile_and_warmup_s": compile_s,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
