"""Tiny models for tests, demos and benches: random-weight configurations and model pairs
(a paged-attention model and a stock twin with the same weights).

Scaffolding, not the product: only the ``paged-attention`` demo (``tools/demo.py``),
``bench/`` and ``tests/`` import it.
"""

import copy
from typing import Tuple

import torch
import transformers

from .hf import ATTN_IMPLEMENTATION

Model = torch.nn.Module

# Keyword arguments of the tiny configurations the Hugging Face tests (and
# bench/bench_fp8_accuracy.py) build random models from.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
# Three architectures over TINY: Llama (GQA 4/2), GQA 8/2 Qwen2 whose layer 1 slides over a
# window of 6, Mistral sliding every layer.
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**{**TINY, "num_attention_heads": 8},
                                              use_sliding_window=True, sliding_window=6,
                                              max_window_layers=1),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=6),
}


def tiny_config(vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 2048,
                eos_token_id: "int | None" = None) -> transformers.PretrainedConfig:
    """A small Qwen2 (grouped-query attention) configuration for offline runs."""
    return transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, tie_word_embeddings=False)


def random_pair(config: transformers.PretrainedConfig, seed: int = 0,
                reference_attention: str = "sdpa") -> Tuple[Model, Model]:
    """(paged model, twin with ``reference_attention``) with seeded random weights, float32,
    in eval mode."""
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=reference_attention, dtype=torch.float32).eval()
    # from_config sets config._attn_implementation, so each model gets its own copy.
    paged = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32).eval()
    paged.load_state_dict(reference.state_dict())
    return paged, reference


def pretrained_pair(name_or_path: str) -> Tuple[Model, Model]:
    """(paged model, sdpa twin) of a checkpoint, float32."""
    load = transformers.AutoModelForCausalLM.from_pretrained
    paged = load(name_or_path, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32).eval()
    reference = load(name_or_path, attn_implementation="sdpa", dtype=torch.float32).eval()
    return paged, reference
