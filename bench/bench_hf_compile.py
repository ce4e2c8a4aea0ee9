"""HF ``generate`` decode speed: PagedCache vs StaticCache, each compiled and eager, one run.

For every (model, dtype, batch, context) the four candidates generate greedily from the
same random prompts (``batch`` rows of ``context`` tokens, no padding) with the same
weights; PagedCache runs ``paged_attention_ext`` attention in compile mode
(``max_cache_len``), StaticCache runs ``sdpa``. "compiled" is transformers' own compile
path for generate (``compile_config``, inductor; on CPU it needs
``compile_config._compile_all_devices = True``): eager prefill, compiled decode steps.

Decode tokens/s = ``batch / t_step``: ``t_step`` is the median time of one decode step
(forward and token selection), the interval between two of generate's eager
``prepare_inputs_for_generation`` calls, over every decode step of every timed call. The
timed generate calls of the candidates are interleaved (bench/common/timing.py), so the ratios
compare runs under the same machine load. Before them each candidate runs once on a
16-token prompt with the same ``max_cache_len`` (so the same decode graph): that warm-up
(dynamo + inductor compile for the compiled candidates) is reported separately.
``--max-prefill-tflop`` skips shapes whose prefill alone would take minutes on a CPU.
Peak KV bytes: the pool (and the blocks in use) for PagedCache, the key/value tensors for
StaticCache, read after the generate call (both are allocated once, up front).

    python bench/bench_hf_compile.py --quick        # a minute: checks that everything runs
    python bench/bench_hf_compile.py                # the full grid (see --help), long
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.environment import machine_info  # noqa: E402
from common.timing import time_interleaved_samples  # noqa: E402

from paged_attention_ext.hf import CompiledPagedCache, PagedCache  # noqa: E402
from paged_attention_ext.testing import random_pair, tiny_config  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BLOCK_SIZE = 16


def qwen2_05b_config() -> transformers.PretrainedConfig:
    """Qwen2-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads of 64), random."""
    return transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)


MODELS: Dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "tiny": lambda: tiny_config(max_positions=4096),
    "qwen2-0.5b": qwen2_05b_config,
}


def compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None)
    config._compile_all_devices = True  # generate compiles only on accelerators otherwise
    return config


def kv_bytes(cache) -> Dict[str, int]:
    if isinstance(cache, PagedCache):
        usage = cache.memory_usage()
        return {"kv_bytes": usage["pool_bytes"], "kv_used_bytes": usage["used_bytes"]}
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers
               for t in (layer.keys, layer.values))
    return {"kv_bytes": held, "kv_used_bytes": held}


def run_shape(paged, static, batch: int, context: int, new: int, reps: int) -> Dict:
    """All four candidates at one shape; dynamo starts empty (compile time is this shape's)."""
    torch._dynamo.reset()
    counters.clear()
    for model in (paged, static):
        model.__dict__.pop("_compiled_call", None)
    gen = torch.Generator().manual_seed(context + batch)
    prompt = torch.randint(1, paged.config.vocab_size, (batch, context), generator=gen)
    # Warm-up: a short prompt with the same max_cache_len compiles the same decode graph
    # (the shapes depend on batch and max_cache_len, not on the prompt) without a long prefill.
    short = prompt[:, :min(context, 16)]
    caches: Dict[str, object] = {}
    steps_s: Dict[str, List[float]] = {}

    def run(name: str, model, compiled: bool, ids: torch.Tensor) -> torch.Tensor:
        marks: List[float] = []
        prepare = type(model).prepare_inputs_for_generation.__get__(model)

        def timed_prepare(*args, **kwargs):  # eager, before every forward
            marks.append(time.perf_counter())
            return prepare(*args, **kwargs)
        if name.startswith("paged"):
            cache = CompiledPagedCache(model.config, max_cache_len=context + new,
                                       max_batch_size=batch, block_size=BLOCK_SIZE)
        else:
            cache = StaticCache(config=model.config, max_cache_len=context + new)
        extra = {"compile_config": compile_config()} if compiled else {"disable_compile": True}
        model.prepare_inputs_for_generation = timed_prepare
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, past_key_values=cache,
                                     **extra)
        finally:
            del model.prepare_inputs_for_generation
        marks.append(time.perf_counter())
        # marks[i] -> marks[i + 1] for i >= 1: one decode step (forward + token selection).
        steps_s.setdefault(name, []).extend(b - a for a, b in zip(marks[1:-1], marks[2:]))
        caches[name] = cache
        return out

    names = {"paged_compiled": (paged, True), "static_compiled": (static, True),
             "paged_eager": (paged, False), "static_eager": (static, False)}
    warmup: Dict[str, float] = {}
    graphs: Dict[str, int] = {}
    for name, (model, compiled) in names.items():
        before = counters["stats"]["unique_graphs"]
        begin = time.perf_counter()
        run(name, model, compiled, short)
        warmup[name] = time.perf_counter() - begin
        graphs[name] = counters["stats"]["unique_graphs"] - before
    steps_s.clear()
    outputs: Dict[str, torch.Tensor] = {}

    def timed(name: str):
        def call():
            outputs[name] = run(name, names[name][0], names[name][1], prompt)
        return call
    samples = time_interleaved_samples({name: timed(name) for name in names}, warmup=0, reps=reps)
    memory = {name: kv_bytes(caches[name]) for name in names}
    result = {"batch": batch, "context": context, "new_tokens": new, "reps": reps}
    for name in names:
        step = statistics.median(steps_s[name])
        result[name] = {
            "decode_tokens_per_s": batch / step, "decode_step_median_s": step,
            "decode_step_min_s": min(steps_s[name]), "decode_steps_timed": len(steps_s[name]),
            "generate_median_s": statistics.median(samples[name]),
            "warmup_short_prompt_s": warmup[name], "graphs_compiled": graphs[name],
            **memory[name]}
    # Recompiles after warm-up (expected 0): graphs dynamo made during the timed calls.
    result["graphs_compiled_while_timed"] = counters["stats"]["unique_graphs"] - sum(graphs.values())
    tps = {name: result[name]["decode_tokens_per_s"] for name in names}
    result["ratios"] = {
        "paged_compiled/static_compiled": tps["paged_compiled"] / tps["static_compiled"],
        "paged_compiled/paged_eager": tps["paged_compiled"] / tps["paged_eager"],
        "static_compiled/static_eager": tps["static_compiled"] / tps["static_eager"],
        "paged_eager/static_eager": tps["paged_eager"] / tps["static_eager"],
    }
    # Same weights: greedy tokens should agree (fp32 exactly; bf16 may diverge).
    result["paged_equals_static"] = bool(torch.equal(outputs["paged_compiled"],
                                                     outputs["static_compiled"]))
    result["compiled_equals_eager"] = bool(torch.equal(outputs["paged_compiled"],
                                                       outputs["paged_eager"]))
    return result


def parse_list(text: str, kind=int) -> List:
    return [kind(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,qwen2-0.5b")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per row")
    parser.add_argument("--reps", type=int, default=2,
                        help="timed generate calls per candidate (each times every decode step)")
    parser.add_argument("--max-prefill-tflop", type=float, default=10.0,
                        help="skip shapes whose prefill needs more (2 x params x batch x context)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, fp32, batch 1 and 4, context 64, 8 tokens, 1 rep")
    parser.add_argument("--out", default="bench/results/hf_compile.json")
    args = parser.parse_args()
    if args.quick:
        args.models, args.dtypes, args.batches, args.contexts = "tiny", "fp32", "1,4", "64"
        args.new, args.reps = 8, 1
        if args.out == parser.get_default("out"):
            args.out = "bench/results/hf_compile_quick.json"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    # Inductor's one-time start-up (worker pool, code cache) would otherwise be charged to
    # the warm-up of whichever candidate compiles first.
    torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.ones(8))
    results = []
    load_at_start = os.getloadavg()

    def write() -> None:  # after every shape, so a run stopped early keeps what it measured
        report = {
            "command": " ".join(sys.argv),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "machine": machine_info(),
            "load_average_start": load_at_start, "load_average_end": os.getloadavg(),
            "block_size": BLOCK_SIZE, "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    for model_name in parse_list(args.models, str):
        for dtype_name in parse_list(args.dtypes, str):
            paged, static = (m.to(DTYPES[dtype_name]) for m in random_pair(MODELS[model_name]()))
            params = sum(p.numel() for p in paged.parameters())
            for context in parse_list(args.contexts):
                for batch in parse_list(args.batches):
                    tflop = 2 * params * batch * context / 1e12
                    if tflop > args.max_prefill_tflop:
                        results.append(dict(model=model_name, dtype=dtype_name, batch=batch,
                                            context=context, skipped=f"prefill {tflop:.0f} TFLOP "
                                            f"> --max-prefill-tflop {args.max_prefill_tflop}"))
                        print(json.dumps(results[-1]), flush=True)
                        continue
                    row = run_shape(paged, static, batch, context, args.new, args.reps)
                    row.update(model=model_name, dtype=dtype_name)
                    results.append(row)
                    write()
                    print(json.dumps({k: row[k] for k in ("model", "dtype", "batch", "context",
                                                          "ratios")}), flush=True)
            del paged, static
    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
