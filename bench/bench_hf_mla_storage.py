"""PagedCache decode of an MLA model: latent rows against expanded K/V, bytes and time.

Usage: ``.venv/bin/python bench/bench_hf_mla_storage.py [--quick] [--out PATH] [--threads N]``

Method
------
A DeepSeek-V2-Lite-shaped attention (16 query heads, ``kv_lora_rank`` 512 + RoPE 64,
``qk_nope_head_dim`` 128, ``v_head_dim`` 128) in a 2-layer model with a narrow hidden size
and dense MLPs (random weights), so that at long contexts the step's time is mostly
attention (``kv_b_proj``, 8 MiB in fp32, is read by both forms: by transformers to expand
the new tokens, and by the latent form to absorb it). Two ``PagedCache``\\ s, one per
``mla_storage``, are prefilled with the same B prompts of P tokens; then decode steps
(one new token per row, the same token for both caches) alternate between them in a
random order per round. Reported per (dtype, B, P): bytes per token of the pools, the
median step time of each, and ``expanded / latent``: the median of the per-round ratios
(with quartiles), i.e. the latent form's speed-up. Both forms' greedy next tokens are
checked equal first (fp32).
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import transformers

from common.environment import machine_info
from paged_attention_ext.hf import PagedCache
from paged_attention_ext.testing import random_pair

CONFIG = dict(vocab_size=1024, hidden_size=512, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=16384,
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              q_lora_rank=None, first_k_dense_replace=2, pad_token_id=0, bos_token_id=None,
              eos_token_id=None)
BLOCK_SIZE = 16


def run_case(model, dtype, batch: int, prompt: int, rounds: int) -> dict:
    ids = torch.randint(1, CONFIG["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(1))
    caches = {name: PagedCache(model.config, block_size=BLOCK_SIZE, mla_storage=name,
                               max_seq_len=prompt + rounds + 8) for name in ("latent", "expanded")}
    with torch.no_grad():
        nexts = {name: model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                 for name, cache in caches.items()}
        same_next = torch.equal(nexts["latent"], nexts["expanded"])
        step = nexts["latent"]
        times = {name: [] for name in caches}
        order = random.Random(0)
        for _ in range(rounds):
            names = list(caches)
            order.shuffle(names)
            for name in names:
                start = time.perf_counter()
                model(step, past_key_values=caches[name])
                times[name].append(time.perf_counter() - start)
    ratios = sorted(e / l for e, l in zip(times["expanded"], times["latent"]))
    quartile = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))]
    return {
        "dtype": str(dtype).replace("torch.", ""), "batch": batch, "prompt": prompt,
        "bytes_per_token": {name: cache.kv.block_bytes // BLOCK_SIZE for name, cache in caches.items()},
        "step_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "latent_speedup": {"median": statistics.median(ratios), "q1": quartile(0.25), "q3": quartile(0.75)},
        "same_greedy_next_token": same_next,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, few rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hf_mla_storage.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paged, _ = random_pair(transformers.DeepseekV2Config(**CONFIG))
    cases = [(4, 1024)] if args.quick else [(1, 8192), (4, 4096)]
    rounds = 5 if args.quick else 15
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = paged.to(dtype)
        for batch, prompt in cases:
            row = run_case(model, dtype, batch, prompt, rounds)
            print(f"{row['dtype']} B={batch} P={prompt}: bytes/token latent {row['bytes_per_token']['latent']} "
                  f"expanded {row['bytes_per_token']['expanded']}; step ms latent "
                  f"{row['step_ms']['latent']:.2f} expanded {row['step_ms']['expanded']:.2f}; "
                  f"latent speed-up {row['latent_speedup']['median']:.2f}x "
                  f"[{row['latent_speedup']['q1']:.2f}, {row['latent_speedup']['q3']:.2f}]"
                  f"{'' if row['same_greedy_next_token'] else ' (next tokens differ)'}")
            results.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine_info(), "config": CONFIG, "block_size": BLOCK_SIZE,
                                    "rounds": rounds, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
