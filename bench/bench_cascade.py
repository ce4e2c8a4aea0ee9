"""Cascade attention: shared prefixes read once. Op time and engine throughput.

Usage: ``.venv/bin/python bench/bench_cascade.py [--quick] [--out PATH] [--threads N]``

Method
------
* **Op**: one decode step of 8 sequences sharing a 4096-token prompt (256 blocks of 16)
  with 64 tokens of their own each, head size 128, 32/32 and 32/8 heads, bf16 and fp32:
  ``paged.attention`` over the whole tables (plain) against the cascade plan's three ops
  (``paged_attention_ext.cascade``: shared-prefix op, suffix attention, merge), timed
  interleaved in one run (bench/common/timing.py). Goal: >= 4x. Then 2 sequences sharing 256
  tokens, where the default threshold keeps the plain op (the heuristic's choice, timed
  through the same planning call), and the forced split for comparison; and a sweep of
  the saved key reads ((sharers - 1) x prefix) at which the split starts to pay, which
  sets ``DEFAULT_MIN_SAVED_TOKENS``. The roofline line gives the fp32 multiply-add rate
  each path reached (the split is compute-bound, the plain op bandwidth-bound).
* **Engine**: ``LLMEngine`` (eager steps) on a random-weight Llama shaped so that attention
  is most of a decode step at 2k context (4 layers, hidden 512, 8 heads of 128, MHA,
  intermediate 512, fp32): parallel sampling (2 requests, n = 8, 2048-token prompts, 128
  new tokens each, the prompts' prefill included) and a common system prompt (32 requests, a 2048-token shared prefix already
  in the prefix cache, 32 tokens of their own, 32 new tokens). Tokens/s with the split
  (default threshold) against ``cascade_min_saved_tokens=None``, the same workload in the
  same run: three back-to-back pairs, the order alternated, the median of the pairs'
  ratios (the machine is shared: single runs vary by up to 1.7x). The attention share is the time spent in the attention calls
  (timed around them) over the step time, plain path. Goal: >= 1.8x.

Results are printed and written as JSON (default ``bench/results/cascade.json``).
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Dict

import torch
import transformers

from paged_attention_ext import cascade, ops
from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.testing import random_pair
from common.environment import cpu_model
from common.timing import time_interleaved

BLOCK_SIZE = 16


# ---- op -------------------------------------------------------------------------------------

def shared_batch(seqs: int, prefix: int, own: int, heads: int, kv_heads: int, dtype: torch.dtype,
                 head_size: int = 128) -> Dict:
    """Caches, tables (the prompt's blocks shared, the rest each sequence's), a decode query."""
    g = torch.Generator().manual_seed(0)
    prefix_blocks, own_blocks = prefix // BLOCK_SIZE, -(-own // BLOCK_SIZE)
    num_blocks = prefix_blocks + seqs * own_blocks
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head_size)
    physical = torch.randperm(num_blocks, generator=g).tolist()
    shared = physical[:prefix_blocks]
    tables = [shared + physical[prefix_blocks + i * own_blocks:prefix_blocks + (i + 1) * own_blocks]
              for i in range(seqs)]
    return dict(key_cache=torch.randn(shape, generator=g).to(dtype),
                value_cache=torch.randn(shape, generator=g).to(dtype),
                query=torch.randn(seqs, heads, head_size, generator=g).to(dtype),
                tables=tables, seq_lens=[prefix + own] * seqs, scale=head_size ** -0.5)


def candidates(case: Dict, min_saved_tokens: int) -> Dict:
    """plain: the op over the whole tables; chosen: plan (with the threshold) then run;
    split: the plan's ops with the split forced."""
    seqs = len(case["tables"])
    table = torch.tensor(case["tables"], dtype=torch.int32)
    lens = torch.tensor(case["seq_lens"], dtype=torch.int32)
    q, k, v, scale = case["query"], case["key_cache"], case["value_cache"], case["scale"]
    forced = cascade.plan_cascade(case["tables"], case["seq_lens"], [1] * seqs, BLOCK_SIZE,
                                  torch.device("cpu"), min_saved_tokens=1)

    def chosen():
        plan = cascade.plan_cascade(case["tables"], case["seq_lens"], [1] * seqs, BLOCK_SIZE,
                                    torch.device("cpu"), min_saved_tokens)
        if plan is None:
            return ops.attention(q, k, v, table, lens, scale)
        return plan.run(q, k, v, scale)

    return {"plain": lambda: ops.attention(q, k, v, table, lens, scale),
            "chosen": chosen, "split": lambda: forced.run(q, k, v, scale)}


def op_time(quick: bool) -> Dict:
    results = {}
    reps = 5 if quick else 15
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kv_heads in ((32, 32), (32, 8)):
            case = shared_batch(8, 4096, 64, heads, kv_heads, dtype)
            calls = candidates(case, cascade.DEFAULT_MIN_SAVED_TOKENS)
            got, want = calls["chosen"]().float(), calls["plain"]().float()
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            timings = time_interleaved({"plain": calls["plain"], "cascade": calls["chosen"]},
                                       warmup=2, reps=reps)
            macs = 8 * heads * (4096 + 64) * 2 * 128
            name = f"{str(dtype).replace('torch.', '')}-{heads}/{kv_heads}"
            plain, split = timings["plain"].median_s, timings["cascade"].median_s
            results[name] = {"plain_ms": plain * 1e3, "cascade_ms": split * 1e3,
                             "speedup": plain / split,
                             "plain_gmacs": macs / plain / 1e9, "cascade_gmacs": macs / split / 1e9,
                             "kv_bytes_plain": 8 * (4096 + 64) * kv_heads * 128 * 2 * dtype.itemsize,
                             "kv_bytes_cascade": (4096 + 8 * 64) * kv_heads * 128 * 2 * dtype.itemsize}
            print(f"op {name:14s} plain {plain * 1e3:7.2f} ms  cascade {split * 1e3:7.2f} ms  "
                  f"{plain / split:5.2f}x  ({macs / plain / 1e9:5.1f} vs {macs / split / 1e9:5.1f} GMAC/s)")
    # Two sequences sharing 256 tokens: the threshold keeps the plain op.
    case = shared_batch(2, 256, 64, 32, 8, torch.bfloat16)
    calls = candidates(case, cascade.DEFAULT_MIN_SAVED_TOKENS)
    timings = time_interleaved(calls, warmup=5, reps=5 * reps)
    results["bfloat16-32/8-two-share-256"] = {
        "plain_ms": timings["plain"].median_s * 1e3, "chosen_ms": timings["chosen"].median_s * 1e3,
        "forced_split_ms": timings["split"].median_s * 1e3,
        "chosen_over_plain": timings["chosen"].median_s / timings["plain"].median_s,
        "heuristic_picks_split": cascade.plan_cascade(case["tables"], case["seq_lens"], [1, 1],
                                                      BLOCK_SIZE, torch.device("cpu")) is not None}
    print(f"op two sequences sharing 256: plain {timings['plain'].median_s * 1e6:.0f} us, chosen "
          f"{timings['chosen'].median_s * 1e6:.0f} us, forced split {timings['split'].median_s * 1e6:.0f} us")
    return results


def threshold_sweep(quick: bool) -> Dict:
    """Forced split over plain, 2 and 4 sequences (32/8 heads, bf16) sharing P tokens: the
    saved reads (sharers - 1) x P at which the split breaks even set the default threshold."""
    rows = {}
    for seqs in (2, 4):
        for prefix in (256, 512, 1024, 2048, 4096):
            case = shared_batch(seqs, prefix, 32, 32, 8, torch.bfloat16)
            calls = candidates(case, 1)
            timings = time_interleaved({"plain": calls["plain"], "split": calls["split"]},
                                       warmup=3, reps=10 if quick else 40)
            row = {"sequences": seqs, "prefix": prefix, "saved_key_reads": (seqs - 1) * prefix,
                   "plain_us": timings["plain"].median_s * 1e6,
                   "split_us": timings["split"].median_s * 1e6,
                   "speedup": timings["plain"].median_s / timings["split"].median_s}
            rows[f"{seqs}x{prefix}"] = row
            print(f"sweep {seqs} sequences sharing {prefix:5d} (saves {row['saved_key_reads']:5d}): "
                  f"plain {row['plain_us']:8.0f} us  split {row['split_us']:8.0f} us  "
                  f"{row['speedup']:.2f}x")
    return rows


# ---- engine ---------------------------------------------------------------------------------

def attention_heavy_llama() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)


class AttentionTimer:
    """Wall time spent inside the attention calls (plain op and cascade plans)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._attention, self._run = ops.attention, cascade.CascadePlan.run

    def __enter__(self):
        def timed(fn):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return call
        ops.attention = timed(self._attention)
        cascade.CascadePlan.run = timed(self._run)
        return self

    def __exit__(self, *exc) -> None:
        ops.attention, cascade.CascadePlan.run = self._attention, self._run


def workload(kind: str, quick: bool, rng: torch.Generator):
    """(warm requests served first, then the measured ones)."""
    prefix = 1024 if quick else 2048
    if kind == "parallel_sampling":
        reqs = [Request(f"s{i}", torch.randint(1, 1000, (prefix,), generator=rng).tolist(),
                        SamplingParams(max_new_tokens=16 if quick else 128, n=8, temperature=1.0,
                                       seed=i)) for i in range(2)]
        return [], reqs
    system = torch.randint(1, 1000, (prefix,), generator=rng).tolist()
    count = 8 if quick else 32
    reqs = [Request(f"c{i}", system + torch.randint(1, 1000, (32,), generator=rng).tolist(),
                    SamplingParams(max_new_tokens=8 if quick else 32)) for i in range(count)]
    warm = [Request("warm", system + [1], SamplingParams(max_new_tokens=1))]
    return warm, reqs


def serve(model, kind: str, quick: bool, cascade_on: bool) -> Dict:
    config = EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=1024, num_host_blocks=0,
                          max_num_batched_tokens=8192,
                          cascade_min_saved_tokens=(cascade.DEFAULT_MIN_SAVED_TOKENS if cascade_on
                                                    else None))
    engine = LLMEngine(model, config)
    warm, reqs = workload(kind, quick, torch.Generator().manual_seed(1))
    for r in warm:  # the shared system prompt is in the prefix cache before the clock starts
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    tokens, outputs = 0, {}
    with AttentionTimer() as timer:
        start = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            for out in engine.step():
                tokens += sum(len(t) for t in out.new_tokens)
                if out.finished:
                    outputs[out.request_id] = out.outputs
        wall = time.perf_counter() - start
    report = engine.report()
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "attention_share": timer.seconds / wall, "cascade": report["cascade"],
            "outputs": outputs}


def engine_throughput(quick: bool) -> Dict:
    paged, _ = random_pair(attention_heavy_llama())
    results = {}
    for kind in ("parallel_sampling", "common_system_prompt"):
        pairs = []
        for rep in range(1 if quick else 3):  # back-to-back pairs, the order alternated
            order = (False, True) if rep % 2 == 0 else (True, False)
            runs = {on: serve(paged, kind, quick, on) for on in order}
            pairs.append(runs)
        same = all(p[on]["outputs"] == pairs[0][False]["outputs"] for p in pairs for on in p)
        ratios = [p[True]["tokens_per_s"] / p[False]["tokens_per_s"] for p in pairs]
        plain = statistics.median(p[False]["tokens_per_s"] for p in pairs)
        split = statistics.median(p[True]["tokens_per_s"] for p in pairs)
        results[kind] = {"plain_tokens_per_s": plain, "cascade_tokens_per_s": split,
                         "speedup_median_of_pairs": statistics.median(ratios), "pair_speedups": ratios,
                         "same_tokens": same,
                         "attention_share_plain": statistics.median(p[False]["attention_share"] for p in pairs),
                         "attention_share_cascade": statistics.median(p[True]["attention_share"] for p in pairs),
                         "cascade_steps": pairs[0][True]["cascade"]["steps"],
                         "runs": [{"cascade": on, **{k: v for k, v in p[on].items() if k != "outputs"}}
                                  for p in pairs for on in p]}
        print(f"engine {kind:22s} plain {plain:7.1f} tok/s  cascade {split:7.1f} tok/s  pairs "
              f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x)  "
              f"attention share (plain) {results[kind]['attention_share_plain']:.0%}, same tokens: {same}")
    results["model"] = {"layers": 4, "hidden": 512, "heads": "8/8", "head_size": 128,
                        "intermediate": 512, "dtype": "float32", "block_size": BLOCK_SIZE}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="bench/results/cascade.json")
    parser.add_argument("--only", choices=["op", "sweep", "engine"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": args.threads,
                          "cpu_isa": ops.cpu_isa(), "torch": torch.__version__,
                          "transformers": transformers.__version__,
                          "python": platform.python_version(), "load_average_start": os.getloadavg()},
              "default_min_saved_tokens": cascade.DEFAULT_MIN_SAVED_TOKENS}
    if args.only in (None, "op"):
        report["op"] = op_time(args.quick)
    if args.only in (None, "sweep"):
        report["threshold_sweep"] = threshold_sweep(args.quick)
    if args.only in (None, "engine"):
        report["engine"] = engine_throughput(args.quick)
    report["machine"]["load_average_end"] = os.getloadavg()
    out = Path(args.out)
    if args.only and out.exists():  # one phase again: keep the file's other phases
        report = {**json.loads(out.read_text()), **report,
                  "machine_" + args.only: report["machine"]}
        report["machine"] = json.loads(out.read_text())["machine"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
