"""The engine on a DeepSeek-V3-shaped model: concurrent 8k-token requests a fixed pool holds
with latent rows against expanded K/V, and tokens equal to ``generate`` on a short run.

Usage: ``.venv/bin/python bench/bench_engine_mla.py [--quick] [--out PATH] [--threads N] [--rounds N] [--only-steps]``

Method
------
DeepSeek-V3's attention (128 query heads, ``kv_lora_rank`` 512 + RoPE 64,
``qk_nope_head_dim`` 128, ``v_head_dim`` 128, ``q_lora_rank`` 1536) in 2 layers (one dense,
one with 8 routed experts) of its hidden size 7168, random weights.

* Admission (a count, not a timing): the model is built on the meta device in bf16, so the
  engine's pools are sized from its ``ModelSpec`` (``HFModelRunner(model, mla_storage)``)
  but not allocated. A fixed budget of GiB becomes ``budget // block_bytes`` blocks of 16
  tokens; the engine (its real scheduler and block manager) serves requests of 8192 random
  prompt tokens and 16 new tokens through a runner that returns constant logits (an 8k
  prefill of 128 heads is minutes per request on a small CPU). Reported per storage: bytes
  per block, blocks, requests admitted in the first step, the most running at once, and
  preemptions; ``latent / expanded`` of the concurrent requests.
* Tokens: the same attention in float32 with a narrow hidden size (512), on the CPU: the
  engine with each storage against transformers' eager ``generate`` (greedy, sampled n=2,
  beams), short prompts; the wall time of each engine run is recorded for information.
* Step times (information, on a shared machine): that model in bf16 serves 4 requests of
  1024 prompt tokens and 12 new ones with each storage, alternating, twice: the prefill
  step's seconds and the decode steps' median milliseconds, in paired rounds (a fresh order
  each) with a third variant: latent rows whose prefill is read absorbed too (576 + 512
  multiply-adds per head and key against 192 + 128 expanded) instead of expanded
  (hf/latent_prefill.py); the prefill speedups are medians of per-round ratios.
"""

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import transformers

from common.environment import machine_info
from paged_attention_ext.engine import (EngineConfig, LLMEngine, ModelRunner, Request,
                                        SamplingParams, generate_reference)
from paged_attention_ext.engine.hf_runner import HFModelRunner
from paged_attention_ext.engine.scheduler import SchedulerOutput
from paged_attention_ext.hf import ATTN_IMPLEMENTATION, latent_prefill
from paged_attention_ext.testing import random_pair

ATTENTION = dict(num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
MODEL = dict(vocab_size=1024, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
             num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
             max_position_embeddings=16384, pad_token_id=0, bos_token_id=None, eos_token_id=None)
BLOCK_SIZE = 16
STORAGES = ("latent", "expanded")


class ConstantLogits(ModelRunner):
    """The model's spec, and logits that pick token 1: the scheduler and block manager run
    as they would, without the forward."""

    def forward(self, step: SchedulerOutput) -> List[torch.Tensor]:
        logits = []
        for group in step.groups:
            rows = torch.zeros(len(group.live_seqs), self.spec.vocab_size)
            rows[:, 1] = 1.0
            logits.append(rows)
        return logits


def admission(budget_gib: float, prompt: int, new_tokens: int) -> Dict[str, Dict]:
    config = transformers.DeepseekV3Config(**MODEL, **ATTENTION, hidden_size=7168,
                                           intermediate_size=18432, moe_intermediate_size=2048)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.bfloat16)
    budget = int(budget_gib * (1 << 30))
    rng = random.Random(0)
    results = {}
    for storage in STORAGES:
        spec = HFModelRunner(model, mla_storage=storage).spec
        probe = LLMEngine(ConstantLogits(spec), EngineConfig(block_size=BLOCK_SIZE,
                                                             num_device_blocks=1, num_host_blocks=0))
        block_bytes = probe.kv_cache.block_bytes
        blocks = budget // block_bytes
        engine = LLMEngine(ConstantLogits(spec), EngineConfig(
            block_size=BLOCK_SIZE, num_device_blocks=blocks, num_host_blocks=0,
            max_num_batched_tokens=1 << 30, preemption_mode="recompute"))
        per_request = -(-(prompt + new_tokens) // BLOCK_SIZE)
        offered = blocks // per_request + 2  # more than the pool can hold at once
        for i in range(offered):
            engine.add_request(Request(f"r{i}", [rng.randrange(2, 1024) for _ in range(prompt)],
                                       SamplingParams(max_new_tokens=new_tokens)))
        first, most = None, 0
        while engine.has_unfinished():
            engine.step()
            running = len(engine.scheduler.running)
            first = running if first is None else first
            most = max(most, running)
        results[storage] = {"pool_shape": list(engine.kv_cache.layer(0)[0].shape[1:]),
                            "bytes_per_block": block_bytes, "blocks": blocks,
                            "requests_offered": offered, "admitted_first_step": first,
                            "most_running": most, "preemptions": engine.report()["preemptions"]}
        print(f"{storage}: {block_bytes} bytes/block, {blocks} blocks in {budget_gib} GiB: "
              f"{first} requests of {prompt} tokens admitted at once (most running {most})")
    return results


def token_equality(quick: bool) -> Dict[str, Dict]:
    config = transformers.DeepseekV3Config(**MODEL, **ATTENTION, hidden_size=512,
                                           intermediate_size=512, moe_intermediate_size=128,
                                           initializer_range=0.05)
    paged, reference = random_pair(config, reference_attention="eager")
    rng = random.Random(1)
    system = [rng.randrange(2, 1024) for _ in range(2 * BLOCK_SIZE)]
    kinds = [SamplingParams(max_new_tokens=8),
             SamplingParams(max_new_tokens=8, temperature=0.8, top_k=50, n=2, seed=5),
             SamplingParams(max_new_tokens=6, num_beams=2, num_return_sequences=2)]
    requests = [Request(f"r{i}", system + [rng.randrange(2, 1024) for _ in range(5 + 3 * i)],
                        kinds[i % 3]) for i in range(3 if quick else 6)]
    want = {r.request_id: generate_reference(reference, r) for r in requests}
    results = {}
    for storage in STORAGES:
        engine = LLMEngine(HFModelRunner(paged, mla_storage=storage), EngineConfig(
            block_size=BLOCK_SIZE, num_device_blocks=64, num_host_blocks=0))
        start = time.perf_counter()
        got = engine.generate(copy.deepcopy(requests))
        results[storage] = {"tokens_equal_generate": got == want,
                            "wall_s": time.perf_counter() - start,
                            "bytes_per_block": engine.kv_cache.block_bytes}
        print(f"{storage}: tokens equal generate: {got == want} "
              f"({results[storage]['wall_s']:.1f} s)")
    return results


# The step-time variants: storage, and whether long query runs over latent rows are expanded
# (hf/latent_prefill.py; "absorbed prefill" reads them absorbed, as before that existed).
VARIANTS = {"latent": ("latent", True), "latent, absorbed prefill": ("latent", False),
            "expanded": ("expanded", True)}


def step_times(quick: bool, rounds: int) -> Dict:
    config = transformers.DeepseekV3Config(**MODEL, **ATTENTION, hidden_size=512,
                                           intermediate_size=512, moe_intermediate_size=128,
                                           initializer_range=0.05)
    paged = random_pair(config)[0].to(torch.bfloat16)
    rng = random.Random(2)
    prompt = 256 if quick else 1024
    requests = [Request(f"r{i}", [rng.randrange(2, 1024) for _ in range(prompt)],
                        SamplingParams(max_new_tokens=12)) for i in range(4)]
    rows = []
    order = random.Random(0)
    min_queries = latent_prefill.EXPAND_MIN_QUERIES
    for round_ in range(rounds):
        names = list(VARIANTS)
        order.shuffle(names)  # paired rounds in a fresh order: the machine is shared
        for name in names:
            storage, expand = VARIANTS[name]
            latent_prefill.EXPAND_MIN_QUERIES = min_queries if expand else sys.maxsize
            engine = LLMEngine(HFModelRunner(paged, mla_storage=storage), EngineConfig(
                block_size=BLOCK_SIZE, num_device_blocks=400, num_host_blocks=0))
            for request in copy.deepcopy(requests):
                engine.add_request(request)
            times = []
            while engine.has_unfinished():
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            rows.append({"variant": name, "round": round_, "prompt_tokens": prompt,
                         "requests": len(requests), "prefill_step_s": times[0],
                         "decode_step_ms_median": 1e3 * statistics.median(times[1:])})
            print(f"{name}: prefill step {times[0]:.1f} s, decode step median "
                  f"{rows[-1]['decode_step_ms_median']:.0f} ms", flush=True)
    latent_prefill.EXPAND_MIN_QUERIES = min_queries
    prefill = {name: [r["prefill_step_s"] for r in rows if r["variant"] == name] for name in VARIANTS}
    speedups = {f"latent over {name}": statistics.median(
        b / a for a, b in zip(prefill["latent"], prefill[name]))
        for name in ("latent, absorbed prefill", "expanded")}
    print(f"prefill step, median of per-round ratios: {speedups}")
    return {"rows": rows, "prefill_speedups": speedups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller budget, fewer requests")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds of step times")
    parser.add_argument("--only-steps", action="store_true",
                        help="the step times alone (no admission count, no token check)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "engine_mla.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = step_times(args.quick, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.only_steps:
        args.out.write_text(json.dumps({"machine": machine_info(), "attention": ATTENTION,
                                        "step_times_bf16": steps}, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    budget_gib, prompt, new_tokens = (2.0 if args.quick else 8.0), 8192, 16
    counts = admission(budget_gib, prompt, new_tokens)
    ratio = counts["latent"]["most_running"] / max(1, counts["expanded"]["most_running"])
    print(f"latent / expanded concurrent 8k requests: {ratio:.1f}x")
    tokens = token_equality(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine_info(),
        "attention": ATTENTION, "model": MODEL, "block_size": BLOCK_SIZE,
        "admission": {"budget_gib": budget_gib, "prompt_tokens": prompt, "new_tokens": new_tokens,
                      "dtype": "bfloat16", **counts, "latent_over_expanded": ratio},
        "tokens": tokens, "step_times_bf16": steps}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
