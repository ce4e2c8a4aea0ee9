"""Accuracy of the KV-cache formats: attention-output error and greedy-token agreement.

Usage: ``.venv/bin/python bench/bench_kv_accuracy.py [--quick] [--out PATH] [--threads N]``

Everything runs in plain PyTorch over the formats' definitions (``token_quantization``;
the kernels reproduce them: int8 bit for bit, int4 up to rounding ties), so the numbers
are the formats', not a kernel's. Formats and anchors: ``bench/common/kv_formats.py``
(the per-token int8 / int4 formats; int4 without the rotation and with the keys' rotation
only, to measure what the rotation buys; fp8 e4m3 with one calibrated scale per tensor;
llama.cpp's q8_0 / q4_0 / q4_1, q4_0 over rotated rows, and KIVI's 4-bit, from their
published definitions).

Method
------
1. **Attention output** (``bench/common/kv_activations.py`` says how the activations are
   generated: keys with fixed outlier channels of 10-50x before RoPE, per-token magnitudes,
   values with milder outlier channels or without, and plain Gaussian ones). bf16 K/V,
   2 sequences, 32 query heads over 8 KV heads, head sizes 128 and 64, contexts 128, 512
   and 2048; decode (one query, the last position) and a prefill-like case (the last 64
   positions, causal). Each format's K/V round trip against float64 attention over the
   bf16 K/V: the relative L2 error of the output (whole tensor; per row of one query and
   head: mean, p99, max) and the largest absolute error, and the relative L2 error of the
   stored keys and values themselves.

2. **Greedy tokens**: random-weight models of the tests' architectures
   (``paged_attention_ext.testing``: Llama with 4/4 and 4/2 heads, Qwen2 with 8/2 heads and a
   sliding-window layer) with head size 64 (the tests' 16 is below llama.cpp's 32-value
   blocks), fp32. transformers' ``generate`` with a ``DynamicCache`` whose ``update``
   stores the format's round trip of every new token, once, as a cache writes it (KIVI:
   keys per channel once a group of 32 tokens is complete; fp8: one scale per layer and
   tensor from the prompt). Against the fp32 cache: the fraction of prompts whose tokens
   are all identical, the mean length of the common prefix, the fraction of positions
   equal; teacher-forced over the fp32 run's tokens (one token a step through the same
   cache): the fraction of positions whose argmax is unchanged and the logits' error.
   Random-weight models have flat logits: the fp32 run's top-1 margins (top-1 minus
   top-2 logit) say how sensitive they are, and a bf16 cache is the control.

Results are printed and written as JSON (default ``bench/results/kv_accuracy.json``).
"""

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import transformers
from transformers import DynamicCache

from common.environment import machine_info
from common.kv_activations import KINDS, activations, attention, effective_tokens, output_error
from common.kv_formats import BF16, FORMATS, Format, fp8_scale
from paged_attention_ext.hf.transformers_behaviour import cache_keyword
from paged_attention_ext.testing import ARCHS, TINY, random_pair

MARGIN_QUANTILES = (0.01, 0.05, 0.1, 0.5)


# ---- 1. attention output -----------------------------------------------------------------------

def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def op_case(kind: str, head_size: int, context: int, queries: int, kv_heads: int, heads: int,
            seed: int) -> Dict:
    a = activations(kind, batch=2, kv_heads=kv_heads, heads=heads, context=context,
                    queries=queries, head_size=head_size, seed=seed)
    want, probs = attention(a["query"], a["keys"], a["values"])
    result = {"kind": kind, "head_size": head_size, "context": context, "queries": queries,
              "kv_heads": kv_heads, "heads": heads, "effective_tokens": effective_tokens(probs),
              "formats": {}}
    for name, fmt in FORMATS.items():
        keys, values = fmt.keys(a["keys"], None), fmt.values(a["values"], None)
        got, _ = attention(a["query"], keys, values)
        result["formats"][name] = {**output_error(got, want), "bits_per_value": fmt.bits(head_size),
                                   "key_rel_l2": relative(keys, a["keys"]),
                                   "value_rel_l2": relative(values, a["values"])}
    return result


# ---- 2. greedy tokens --------------------------------------------------------------------------

class RoundingCache(DynamicCache):
    """A DynamicCache that stores a format's round trip of K/V: each token once, when it is
    written (KIVI's keys: per channel, once their group of tokens is complete)."""

    def __init__(self, config: transformers.PretrainedConfig, fmt: Format):
        super().__init__(config=config)
        self.format = fmt
        self.scales: Dict[int, tuple] = {}
        self.pending: Dict[int, int] = {}  # newest keys not rounded yet (KIVI's residual)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        fmt = self.format
        if fmt.calibrated and layer_idx not in self.scales:  # the first write: the prompt
            self.scales[layer_idx] = (fp8_scale(key_states), fp8_scale(value_states))
        k_scale, v_scale = self.scales.get(layer_idx, (None, None))
        value_states = fmt.values(value_states, v_scale).to(value_states.dtype)
        if not fmt.key_token_group:
            key_states = fmt.keys(key_states, k_scale).to(key_states.dtype)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._round_complete_groups(layer_idx, key_states.shape[-2])
        return keys, values

    def _round_complete_groups(self, layer_idx: int, new: int) -> None:
        # The stored keys are the returned ones (or a view of them: a sliding layer), so
        # rounding in place rounds what this forward attends over too. A sliding layer keeps
        # fewer tokens than a group: its keys stay in full precision, as KIVI's residual.
        stored = self.layers[layer_idx].keys
        pending = min(self.pending.get(layer_idx, 0) + new, stored.shape[-2])
        group = self.format.key_token_group
        done = pending // group * group
        if done:
            start = stored.shape[-2] - pending
            rows = stored[..., start:start + done, :]
            rows.copy_(self.format.keys(rows, None))
        self.pending[layer_idx] = pending - done


def model_configs() -> Dict[str, transformers.PretrainedConfig]:
    configs = {"llama": ARCHS["llama"](), "llama_gqa": ARCHS["llama"](), "qwen2_gqa": ARCHS["qwen2"]()}
    configs["llama"].num_key_value_heads = configs["llama"].num_attention_heads
    for config in configs.values():
        config.head_dim, config.max_position_embeddings = 64, 1024
    return configs


def teacher_forced(model, tokens: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Logits ``[rows, new tokens, vocab]``: the prompt's last position, then each later
    token fed one at a time through ``cache``."""
    key = cache_keyword(model)
    logits = [model(tokens[:, :prompt_len], **{key: cache}).logits[:, -1]]
    for i in range(prompt_len, tokens.shape[1] - 1):
        logits.append(model(tokens[:, i:i + 1], **{key: cache}).logits[:, -1])
    return torch.stack(logits, dim=1).float()


def model_accuracy(config: transformers.PretrainedConfig, prompts: int, prompt_len: int,
                   new_tokens: int) -> Dict:
    model = random_pair(config, seed=0)[1]
    ids = torch.randint(1, TINY["vocab_size"], (prompts, prompt_len),
                        generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    key = cache_keyword(model)
    base = model.generate(ids, **{key: DynamicCache(config=model.config)}, **greedy)
    base_logits = teacher_forced(model, base, prompt_len, DynamicCache(config=model.config))
    top2 = base_logits.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    result = {"kv_heads": config.num_key_value_heads, "heads": config.num_attention_heads,
              "head_size": config.head_dim, "prompts": prompts, "prompt_len": prompt_len,
              "new_tokens": new_tokens, "logits_std": base_logits.std().item(),
              "top1_margin": {f"p{round(q * 100)}": torch.quantile(margins, q).item()
                              for q in MARGIN_QUANTILES},
              "formats": {}}
    for name, fmt in {**FORMATS, "bf16 (control)": BF16}.items():
        run = model.generate(ids, **{key: RoundingCache(model.config, fmt)}, **greedy)
        same = run[:, prompt_len:] == base[:, prompt_len:]
        prefix = [int(row.logical_not().nonzero()[0]) if not row.all() else new_tokens for row in same]
        logits = teacher_forced(model, base, prompt_len, RoundingCache(model.config, fmt))
        err = (logits - base_logits).abs()
        result["formats"][name] = {
            "prompts_identical": same.all(dim=1).float().mean().item(),
            "common_prefix_mean": sum(prefix) / len(prefix), "common_prefix": prefix,
            "positions_equal": same.float().mean().item(),
            "teacher_forced_argmax_equal": (logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item(),
            "logit_abs_err_mean": err.mean().item(), "logit_abs_err_max": err.max().item(),
        }
    return result


# ---- driver ------------------------------------------------------------------------------------

def summarize(results: Dict) -> None:
    for case in results["attention"]:
        print(f"attention: {case['kind']:<12} head size {case['head_size']:>3} context {case['context']:>4} "
              f"queries {case['queries']:>2} (effective tokens {case['effective_tokens']:.0f})")
        for name, r in case["formats"].items():
            print(f"  {name:<22} rel L2 {r['rel_l2']:.2e} (rows: mean {r['row_rel_l2_mean']:.2e}, p99 "
                  f"{r['row_rel_l2_p99']:.2e}, max {r['row_rel_l2_max']:.2e}) max abs {r['max_abs']:.2e} | "
                  f"K {r['key_rel_l2']:.2e} V {r['value_rel_l2']:.2e} | {r['bits_per_value']:.2f} bits")
    for arch, m in results["models"].items():
        margin = ", ".join(f"{k} {v:.3f}" for k, v in m["top1_margin"].items())
        print(f"model {arch} ({m['heads']}/{m['kv_heads']} heads of {m['head_size']}): logits std "
              f"{m['logits_std']:.3f}, top-1 margin {margin}")
        for name, r in m["formats"].items():
            print(f"  {name:<22} prompts identical {r['prompts_identical']:.2f}, common prefix "
                  f"{r['common_prefix_mean']:.1f} / {m['new_tokens']}, positions equal "
                  f"{r['positions_equal']:.3f}, teacher-forced argmax equal "
                  f"{r['teacher_forced_argmax_equal']:.3f}, logit err mean {r['logit_abs_err_mean']:.4f}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--out", default="bench/results/kv_accuracy.json")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.quick:
        heads, head_sizes, contexts, queries = (8, 2), (128,), (64, 256), (1, 16)
        runs = dict(prompts=2, prompt_len=8, new_tokens=24)
    else:
        heads, head_sizes, contexts, queries = (32, 8), (128, 64), (128, 512, 2048), (1, 64)
        runs = dict(prompts=8, prompt_len=16, new_tokens=240)
    cases = [dict(kind=kind, head_size=d, context=c, queries=q, heads=heads[0], kv_heads=heads[1], seed=i)
             for i, (kind, d, c, q) in enumerate((kind, d, c, q) for kind in KINDS for d in head_sizes
                                                 for c in contexts for q in queries)]
    results = {"quick": args.quick,
               "machine": {**machine_info(), "transformers": transformers.__version__},
               "attention": [op_case(**case) for case in cases]}
    with torch.no_grad():
        results["models"] = {arch: model_accuracy(config, **runs) for arch, config in model_configs().items()}
    results["wall_s"] = time.perf_counter() - started
    summarize(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
