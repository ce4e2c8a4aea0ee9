"""Decode steps: the engine's compiled forward against its eager one, in one run.

For each model (the demo's tiny Qwen2, and a random model of Qwen2-0.5B's shape: 24
layers, hidden 896, 14/2 heads, vocabulary 151936, tied embeddings), dtype (fp32, bf16),
context (512, 2048 tokens) and batch (1, 8, 32), one decode step of ``batch`` sequences
whose cache holds ``context`` tokens runs through

* eager: the engine's packed forward (``HFModelRunner._packed``, what every step ran before),
* compiled: :class:`paged_attention_ext.engine.hf_compiled_decode.CompiledDecode` (torch.compile,
  inductor; on CUDA also one CUDA graph per padded batch size),
* frozen (CPU, inductor): the same with ``EngineConfig.compile_options``
  ``{"freezing": True}``: weights folded into the graph and prepacked for oneDNN (bf16) or
  MKL (fp32) linear kernels,
* weight read (CPU, batch 1): a sum over a buffer as large as the model's weights, the
  floor of a batch-1 step (every weight is read once), so ``eager / weight read`` bounds
  what any compiled forward can gain there,

in rotating order, and the median step time gives decode tokens/s. The K/V pool is random data
and each sequence's blocks a random set (decode cost depends on the lengths, not on the
values), so no prefill is needed. Compile and warm-up time (building ``CompiledDecode``:
tracing, inductor, graph capture) is reported separately, once per model, dtype and path.
The largest difference between each compiled path's logits and eager's is a sanity check.

Targets: on CPU compiled >= 1.3x eager at batch 1 for the 0.5B shape and never
slower at batch 32; on CUDA with graphs >= 2x at batch 1.

    python bench/bench_compiled_decode.py [--quick] [--device cpu|cuda] [--backend B]
        [--models tiny qwen2-0.5b] [--dtypes fp32 bf16] [--out FILE]

On CUDA the defaults are bf16 and the eager backend (dynamo capture, no inductor) under
CUDA graphs, so the whole run fits bench/gpu_check.sh's 90 s.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Dict, List

import torch
import transformers

from common.environment import machine_info  # the CPU model and the ops' ISA
from paged_attention_ext.engine import EngineConfig
from paged_attention_ext.engine.hf_compiled_decode import CompiledDecode
from paged_attention_ext.engine.hf_runner import HFModelRunner
from paged_attention_ext.step_inputs import StepPlan
from paged_attention_ext.hf import ATTN_IMPLEMENTATION
from paged_attention_ext.kv_cache import PagedKVCache

BLOCK_SIZE = 16
MODELS = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       tie_word_embeddings=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FROZEN = {"freezing": True}


def build_model(name: str, dtype: torch.dtype, device: str, max_positions: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**MODELS[name], max_position_embeddings=max_positions,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype)
    return model.to(device).eval()


def decode_batch(batch: int, context: int, num_blocks: int, vocab: int, seed: int) -> Dict:
    """Metadata of one decode step: each sequence's random blocks, its last token's slot
    (slots and tables per KV group, as the runner takes them: one group here)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK_SIZE)
    blocks = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq).tolist()
    last = context - 1
    return dict(ids=torch.randint(0, vocab, (batch,), generator=g).tolist(),
                positions=[last] * batch,
                slots=[[t[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE for t in blocks]],
                tables=[blocks], seq_lens=[context] * batch)


def timed_step(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_model(name: str, dtype_name: str, args) -> Dict:
    dtype, device = DTYPES[dtype_name], args.device
    max_context = max(args.contexts)
    model = build_model(name, dtype, device, max_context + 64)
    text = model.config
    num_blocks = max(args.batches) * -(-max_context // BLOCK_SIZE) + 8
    kv = PagedKVCache(text.num_hidden_layers, text.num_key_value_heads,
                      text.hidden_size // text.num_attention_heads, BLOCK_SIZE, dtype=dtype,
                      device=device, num_blocks=num_blocks)
    for cache in kv.key_caches + kv.value_caches:
        cache.normal_(0, 0.5)
    eager = HFModelRunner(model)
    eager.bind(kv, EngineConfig(cascade_min_saved_tokens=None))  # plain attention, eager
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # The floor of a batch-1 step is timed on CPU only (CUDA graphs are measured apart).
    weight_buffer = torch.ones(weight_bytes // 4) if device == "cpu" else None
    width = -(-(max_context + 64) // BLOCK_SIZE)
    paths, build = {}, {}
    variants = [("compiled", None)] + ([("frozen", FROZEN)] if args.frozen else [])
    for label, options in variants:
        start = time.perf_counter()
        paths[label] = CompiledDecode(model, kv, width, max(args.batches), backend=args.backend,
                                      options=options)
        build[label] = {"compile_and_warmup_s": time.perf_counter() - start}
    cells = []
    for context in args.contexts:
        for batch in args.batches:
            meta = decode_batch(batch, context, num_blocks, text.vocab_size, seed=context + batch)
            plan = StepPlan(meta["tables"], meta["slots"], meta["seq_lens"], [1] * batch)
            runs = {"eager": lambda: eager._packed(meta["ids"], meta["positions"], plan)}
            for label, compiled in paths.items():
                runs[label] = (lambda c: lambda: c.run(meta["ids"], meta["positions"], plan))(compiled)
            if batch == 1 and device == "cpu":
                # The floor of a batch-1 step: reading the weights' bytes once (a sum over a
                # buffer of that size), timed in the same rotation.
                runs["weight_read"] = weight_buffer.sum
            with torch.no_grad():
                reference = runs["eager"]().float()
                diffs = {label: (runs[label]().float() - reference).abs().max().item()
                         for label in paths}
            times: Dict[str, List[float]] = {label: [] for label in runs}
            order = list(runs)
            with torch.no_grad():
                for _ in range(args.warmup):
                    for fn in runs.values():
                        fn()
                for i in range(args.iters):  # rotate, so load changes hit every path alike
                    for label in order[i % len(order):] + order[:i % len(order)]:
                        times[label].append(timed_step(runs[label], device))
            step = {k: statistics.median(v) for k, v in times.items()}
            cell = {"context": context, "batch": batch,
                    "eager_tokens_per_s": batch / step["eager"], "eager_step_ms": 1e3 * step["eager"]}
            for label in paths:
                cell[f"{label}_tokens_per_s"] = batch / step[label]
                cell[f"{label}_step_ms"] = 1e3 * step[label]
                cell[f"{label}_speedup"] = step["eager"] / step[label]
                cell[f"{label}_max_abs_logit_diff"] = diffs[label]
            if "weight_read" in step:
                cell["weight_read_ms"] = 1e3 * step["weight_read"]
                cell["weight_read_gb_per_s"] = weight_buffer.nbytes / step["weight_read"] / 1e9
                # The most any compiled forward could gain here over eager: eager / floor.
                cell["eager_over_weight_read"] = step["eager"] / step["weight_read"]
            cells.append(cell)
            floor = (f", weight read {cell['weight_read_gb_per_s']:.1f} GB/s: eager/floor "
                     f"{cell['eager_over_weight_read']:.2f}x" if "weight_read_ms" in cell else "")
            ratios = ", ".join(f"{label} {batch / step[label]:8.1f} ({cell[label + '_speedup']:.2f}x,"
                               f" |diff| {diffs[label]:.1e})" for label in paths)
            print(f"{name:<11} {dtype_name:<5} context {context:5d} batch {batch:3d}: eager "
                  f"{cell['eager_tokens_per_s']:8.1f} tokens/s, {ratios}{floor}", flush=True)
    return {"model": name, "dtype": dtype_name, "build": build,
            "parameters": sum(p.numel() for p in model.parameters()), "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model only, contexts 64/256, batches 1/8, few iterations")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default: inductor on CPU; eager on CUDA, where "
                             "the CUDA graphs remove the launch overhead and nothing waits on inductor)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES),
                        help="default: fp32 and bf16 on CPU, bf16 on CUDA")
    parser.add_argument("--no-frozen", dest="frozen", action="store_false",
                        help="skip the frozen path (CPU inductor only)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help="default bench/results/compiled_decode[_cuda].json")
    args = parser.parse_args()
    args.contexts, args.batches = [512, 2048], [1, 8, 32]
    cuda = args.device == "cuda"
    args.backend = args.backend or ("eager" if cuda else "inductor")
    args.dtypes = args.dtypes or (["bf16"] if cuda else list(DTYPES))
    args.frozen = args.frozen and not cuda and args.backend == "inductor"
    if args.quick:
        args.models, args.contexts, args.batches, args.iters = ["tiny"], [64, 256], [1, 8], 4
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    load_at_start = os.getloadavg()
    default = f"compiled_decode{'_cuda' if cuda else ''}{'_quick' if args.quick else ''}.json"
    out = Path(args.out or Path(__file__).parent / "results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: List[Dict] = []
    for model_name in args.models:
        for dtype_name in args.dtypes:
            runs.append(run_model(model_name, dtype_name, args))
            # Written after every model, so a run stopped by a time limit keeps what it measured.
            report = {
                "machine": {**machine_info(), "device": args.device, "cpus": os.cpu_count(),
                            "threads": args.threads,
                            "gpu": torch.cuda.get_device_name() if cuda else None,
                            "torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "load_average_start": load_at_start,
                            "load_average_end": os.getloadavg()},
                "settings": {"backend": args.backend, "block_size": BLOCK_SIZE, "iters": args.iters,
                             "contexts": args.contexts, "batches": args.batches, "quick": args.quick},
                "runs": runs,
            }
            out.write_text(json.dumps(report, indent=2) + "\n")
    for run in runs:
        for label, built in run["build"].items():
            speedups = ", ".join(f"b{c['batch']}/c{c['context']} {c[label + '_speedup']:.2f}x"
                                 for c in run["cells"])
            print(f"summary {run['model']} {run['dtype']} {label}: compile + warm-up "
                  f"{built['compile_and_warmup_s']:.1f} s; vs eager {speedups}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
