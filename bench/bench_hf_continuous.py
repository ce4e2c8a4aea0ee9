"""transformers' continuous batching: ``paged_attention_ext`` vs transformers' ``sdpa`` on CPU.

Usage: ``.venv/bin/python bench/bench_hf_continuous.py [--quick] [--requests N] [--reps N] [--out PATH]
[--threads N]``

Method
------
* Model and requests: those of bench/bench_engine.py: a Qwen2-architecture model (4 layers,
  hidden 256, 8 query / 2 KV heads of size 32, vocabulary 2048), fp32, seeded random
  weights; 12 random prompts of 1024 tokens, 32 greedy new tokens each, no EOS
  (``--quick``: 4 prompts of 256 tokens, 8 new tokens).
* Systems: one model, ``model.generate_batch`` with the same ContinuousBatchingConfig
  (16-token pages, a cache that holds every request, 4096 batch tokens, every request in
  one batch), switched between transformers' ``sdpa`` (``paged|sdpa`` up to 5.18: write
  with ``index_copy_``, gather the history with ``index_select``, SDPA under a dense mask)
  and ``CB_ATTN_IMPLEMENTATION`` (``paged.write_kv`` and ``paged.attention`` on the same
  cache up to transformers 5.23; from 5.24 the model's ``cache.update`` writes and gathers,
  and ``paged.attention`` attends over the gathered K/V). Both must return the same tokens
  (checked, recorded).
* Each is warmed up on a short batch, then the two alternate ``--reps`` times in an order
  rotated per repetition, so machine noise falls on both alike. Throughput is generated
  tokens over the median wall time of the whole call (prefill included); the best run is
  kept too, and the ratio of the medians is the result.

Results are printed and written as JSON (default ``bench/results/hf_continuous.json``).
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
from paged_attention_ext.hf import CB_ATTN_IMPLEMENTATION
from paged_attention_ext.testing import tiny_config

BLOCK_SIZE = 16
MODEL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             max_positions=4096)
SYSTEMS = ("sdpa", CB_ATTN_IMPLEMENTATION)


def prompts(count: int, length: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, MODEL["vocab_size"], (length,), generator=g).tolist() for _ in range(count)]


def run(model, implementation: str, rows: List[List[int]], new_tokens: int) -> Dict:
    model.set_attn_implementation(implementation)
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    pages = len(rows) * -(-(len(rows[0]) + new_tokens) // BLOCK_SIZE) + 8
    batching = transformers.ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=pages, max_batch_tokens=4096,
        max_requests_per_batch=len(rows))
    start = time.perf_counter()
    out = model.generate_batch(rows, generation_config=config, continuous_batching_config=batching,
                               progress_bar=False)
    elapsed = time.perf_counter() - start
    results = [out[f"req_{i}"] for i in range(len(rows))]
    errors = sorted({r.error for r in results if r.error})
    if errors:
        raise RuntimeError(f"{implementation}: requests failed: {errors}")
    return {"outputs": [r.generated_tokens for r in results], "elapsed_s": elapsed}


def summarize(runs: List[Dict], reference: List[List[int]]) -> Dict:
    ordered = sorted(runs, key=lambda r: r["elapsed_s"])
    median, best = ordered[len(ordered) // 2]["elapsed_s"], ordered[0]["elapsed_s"]
    tokens = sum(len(seq) for seq in runs[0]["outputs"])
    return {"generated_tokens": tokens, "median_s": median, "best_s": best,
            "tokens_per_s": tokens / median, "tokens_per_s_best": tokens / best,
            "same_tokens_as_sdpa": all(r["outputs"] == reference for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts of 256 tokens (smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_continuous.json"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, help="number of prompts (default 12, --quick 4)")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    count, prompt_len, new_tokens = (4, 256, 8) if args.quick else (12, 1024, 32)
    count = args.requests or count

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(**MODEL), attn_implementation="sdpa", dtype=torch.float32).eval()
    rows = prompts(count, prompt_len)
    for implementation in SYSTEMS:
        run(model, implementation, prompts(2, 32), 2)

    measured: Dict[str, List[Dict]] = {name: [] for name in SYSTEMS}
    for rep in range(args.reps):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for name in order:
            measured[name].append(run(model, name, rows, new_tokens))
    reference = measured["sdpa"][0]["outputs"]
    systems = {name: summarize(measured[name], reference) for name in SYSTEMS}
    report = {
        "machine": {"cpus": os.cpu_count(), "threads": args.threads, "cpu_isa": ops.cpu_isa(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "load_average_start": load_at_start, "load_average_end": os.getloadavg()},
        "workload": {"requests": count, "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "reps": args.reps, "page_size": BLOCK_SIZE, "model": MODEL, "dtype": "float32"},
        "systems": systems,
        "speedup_vs_sdpa": (systems[CB_ATTN_IMPLEMENTATION]["tokens_per_s"]
                            / systems["sdpa"]["tokens_per_s"]),
    }
    for name, result in systems.items():
        print(f"{name:28s} {result['tokens_per_s']:8.1f} tokens/s (best "
              f"{result['tokens_per_s_best']:.1f}), same tokens: {result['same_tokens_as_sdpa']}")
    print(f"speedup vs sdpa: {report['speedup_vs_sdpa']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
