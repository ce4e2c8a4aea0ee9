"""Peak KV-cache memory of ``generate`` with PagedCache vs transformers' DynamicCache.

One long prompt, ``num_return_sequences=8`` sampling: generate repeats the prompt once per
returned sequence, so DynamicCache stores it 8 times; PagedCache stores its full blocks
once (prefix caching) plus each row's own blocks. The same tiny random Llama-style model
(fp32) runs both; the bytes each cache holds are read after every forward (tensor storage
sizes for DynamicCache, pool and used-block bytes for PagedCache) and the peak is reported.

    python bench/bench_hf_memory.py [--prompt 2048] [--new 64] [--out bench/results/hf_memory.json]
"""

import argparse
import copy
import json
from pathlib import Path
from typing import Dict

import torch
import transformers
from transformers import DynamicCache

from paged_attention_ext.hf import PagedCache
from paged_attention_ext.hf.support import kv_head_shape
from paged_attention_ext.kv_cache import bytes_per_block

CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
ROWS, BLOCK_SIZE = 8, 16


def dynamic_cache_bytes(cache: DynamicCache) -> Dict[str, int]:
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)
    return {"bytes": held}


def paged_cache_bytes(cache: PagedCache) -> Dict[str, int]:
    usage = cache.memory_usage()
    return {"bytes": usage["pool_bytes"], "used_bytes": usage["used_bytes"],
            "blocks_used": usage["blocks_used"], "block_references": usage["block_references"]}


def peak_of_generate(model, ids, new_tokens: int, cache, measure) -> Dict[str, int]:
    """Run generate, reading ``measure(cache)`` after each forward; the peak of each field."""
    peak: Dict[str, int] = {}

    def after_forward(module, args, kwargs, output):
        for name, value in measure(output.past_key_values).items():
            peak[name] = max(value, peak.get(name, 0))

    hook = model.register_forward_hook(after_forward, with_kwargs=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                             num_return_sequences=ROWS, past_key_values=cache, pad_token_id=0)
    hook.remove()
    return {**peak, "tokens": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "hf_memory.json")
    args = parser.parse_args()

    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    paged = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="paged_attention_ext").eval()
    paged.load_state_dict(reference.state_dict())
    ids = torch.randint(1, CONFIG["vocab_size"], (1, args.prompt))

    dynamic = peak_of_generate(reference, ids, args.new, DynamicCache(config=config), dynamic_cache_bytes)
    paged_run = peak_of_generate(paged, ids, args.new, PagedCache(paged.config, block_size=BLOCK_SIZE),
                                 paged_cache_bytes)
    same_tokens = torch.equal(dynamic.pop("tokens"), paged_run.pop("tokens"))

    shape = kv_head_shape(config)
    token_bytes = bytes_per_block(config.num_hidden_layers, shape.num_kv_heads, shape.head_size,
                                  1, torch.float32, shape.head_size_v)  # a block of one token
    result = {
        "model": {**CONFIG, "dtype": "float32"},
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "num_return_sequences": ROWS,
        "block_size": BLOCK_SIZE,
        "kv_bytes_per_token": token_bytes,
        "dynamic_cache_peak": dynamic,
        "paged_cache_peak": paged_run,
        "ratio_pool": dynamic["bytes"] / paged_run["bytes"],
        "ratio_used_blocks": dynamic["bytes"] / paged_run["used_bytes"],
        "same_tokens": same_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"prompt {args.prompt} + {args.new} new tokens, num_return_sequences={ROWS}, fp32")
    print(f"DynamicCache peak: {dynamic['bytes'] / 2**20:8.2f} MiB")
    print(f"PagedCache peak:   {paged_run['bytes'] / 2**20:8.2f} MiB pool, "
          f"{paged_run['used_bytes'] / 2**20:.2f} MiB in used blocks "
          f"({paged_run['blocks_used']} blocks for up to {paged_run['block_references']} "
          "table entries)")
    print(f"ratio DynamicCache / PagedCache: {result['ratio_pool']:.2f}x (pool), "
          f"{result['ratio_used_blocks']:.2f}x (used blocks); same tokens: {same_tokens}")


if __name__ == "__main__":
    main()
