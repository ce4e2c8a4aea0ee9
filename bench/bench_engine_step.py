"""Where a decode step's time goes: cProfile of the engine on a model whose forward is cheap.

The demo's tiny model (4 layers, hidden 128) decodes a batch of requests from a large pool
(12k blocks, as a serving pool would be), so what is not the forward (scheduler, block
manager, the step's checkpoints, metadata, sampling, metrics) shows. Time per decode step
is split by the function each cumulative share is charged to:

  forward     the model call (attention ops, matmuls) without the metadata building
  metadata    lists -> tensors: the step's inputs (step_inputs.py, step_buffers.py)
  sampling    sampler and beam search
  checkpoint  the step's transactions (BlockSpaceManager.checkpoint)
  scheduler   preempt + schedule (block manager placement included)
  metrics     EngineMetrics.on_step / on_tokens
  other       the remainder of step()

The time per step is the process's CPU time (less sensitive to a loaded machine than wall
time; the forward runs on one thread), best of three runs without the profiler.

Usage: python bench/bench_engine_step.py [--quick] [--compile-decode] [--stub-forward] [--out FILE]
"""

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path
from typing import Dict

import torch
import transformers

from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.testing import random_pair, tiny_config

# Functions whose cumulative time is one category (file suffix, function name).
CATEGORIES = {
    "checkpoint": [("block_manager.py", "checkpoint")],
    "scheduler": [("scheduler.py", "preempt"), ("scheduler.py", "schedule")],
    "metadata": [("hf_runner.py", "_inputs"), ("hf_compiled_decode.py", "_stage")],
    "forward": [("module.py", "_call_impl"), ("hf_compiled_decode.py", "_call")],
    "sampling": [("engine.py", "_choose_all"), ("engine.py", "_choose")],
    "metrics": [("metrics.py", "on_step"), ("metrics.py", "on_tokens")],
}


def requests(count: int, prompt_len: int, new_tokens: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=new_tokens)
    return [Request(f"r{i}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
            for i in range(count)]


def categorize(stats: pstats.Stats) -> Dict[str, float]:
    totals = {name: 0.0 for name in CATEGORIES}
    for (path, _, func), (_, _, _, cumulative, _) in stats.stats.items():
        for name, keys in CATEGORIES.items():
            if any(path.endswith(suffix) and func == fn for suffix, fn in keys):
                totals[name] += cumulative
    return totals


def decode_run(engine: LLMEngine, reqs, profile: "cProfile.Profile | None") -> "tuple[int, float]":
    """Prefill `reqs` in one step, then time the decode steps to the end."""
    for request in reqs:
        engine.add_request(request)
    engine.step()  # the prefill
    steps, start = 0, time.process_time()
    if profile is not None:
        profile.enable()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    if profile is not None:
        profile.disable()
    return steps, time.process_time() - start


class StubModel(torch.nn.Module):
    """Constant logits for the rows asked for: the step without any model work."""

    def __init__(self, model: torch.nn.Module, vocab: int) -> None:
        super().__init__()
        self.config, self.dtype, self.device = model.config, model.dtype, model.device
        self.logits = torch.randn(1, 4096, vocab)

    def forward(self, input_ids, logits_to_keep=None, **kwargs):
        rows = input_ids.shape[1] if logits_to_keep is None else logits_to_keep.numel()
        return transformers.modeling_outputs.CausalLMOutput(logits=self.logits[:, :rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, 16 decode steps")
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument("--blocks", type=int, default=12288)
    parser.add_argument("--stub-forward", action="store_true",
                        help="constant logits instead of the model: the engine's own cost per step")
    parser.add_argument("--out", default=None, help="JSON file for the breakdown")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    count, prompt_len, new_tokens = (8, 32, 16) if args.quick else (32, 128, 64)
    config = tiny_config(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2)
    model, _ = random_pair(config, seed=0)
    if args.stub_forward:
        model = StubModel(model, config.vocab_size)
    extra = dict(compile_decode=True) if args.compile_decode else {}
    engine = LLMEngine(model, EngineConfig(num_device_blocks=args.blocks, num_host_blocks=0, **extra))
    engine.generate(requests(2, 8, 4, 1024))  # warm-up
    reqs = requests(count, prompt_len, new_tokens, 1024)
    best = min(decode_run(engine, reqs, None)[1] for _ in range(3))  # no profiler: wall time
    profile = cProfile.Profile()
    steps, _ = decode_run(engine, reqs, profile)
    stats = pstats.Stats(profile)
    step_total = sum(c for (p, _, f), (_, _, _, c, _) in stats.stats.items()
                     if p.endswith("engine.py") and f == "step")
    parts = categorize(stats)
    parts["other"] = step_total - sum(parts.values())
    per_step_ms = {k: 1e3 * v / steps for k, v in parts.items()}
    report = {"steps": steps, "batch": count, "blocks": args.blocks,
              "compile_decode": args.compile_decode, "stub_forward": args.stub_forward, "step_ms_cpu": 1e3 * best / steps,
              "step_ms_profiled": 1e3 * step_total / steps, "per_step_ms_profiled": per_step_ms}
    print(f"{steps} decode steps of {count} sequences, pool {args.blocks} blocks: "
          f"{report['step_ms_cpu']:.2f} ms CPU/step (best of 3), "
          f"{report['step_ms_profiled']:.2f} ms/step under cProfile:")
    for name, ms in sorted(per_step_ms.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<11} {ms:7.3f} ms")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
