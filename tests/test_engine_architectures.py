"""The engine on architectures beyond Qwen2: attention sinks (GPT-OSS) and multi-head latent
attention (DeepSeek-V3, Mistral-4, GLM-4-MoE-Lite: latent rows, test_engine_mla.py) equal eager
``generate``; an architecture the ops cannot run is refused when the engine is created."""

import copy

import pytest
import transformers

from paged_attention_ext.engine import (EngineConfig, LLMEngine, Request, SamplingParams,
                                        generate_reference)
from paged_attention_ext.testing import random_pair
from paged_attention_ext.hf import ATTN_IMPLEMENTATION

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=None, eos_token_id=None, initializer_range=0.2)
CONFIGS = {
    # Learned sinks; sliding (window 6) and full layers alternate.
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=6),
    # Key head 16 + 8 = 24, value head 16.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=48, n_group=1, topk_group=1),
    # An MLA family off the checked list, admitted by its tiny twin (hf/self_check.py).
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **COMMON, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=48, n_group=1, topk_group=1),
}
REQUESTS = [
    Request("greedy", [5, 17, 99, 3, 41, 8, 60], SamplingParams(max_new_tokens=10)),
    Request("sampled", [7, 7, 12, 90, 33], SamplingParams(max_new_tokens=8, temperature=0.8,
                                                          top_k=30, n=2, seed=3)),
    Request("beam", [2, 64, 31, 18, 5, 77, 9, 100, 4], SamplingParams(max_new_tokens=6, num_beams=3,
                                                                      num_return_sequences=2)),
]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_equals_eager(name):
    paged, reference = random_pair(CONFIGS[name](), reference_attention="eager")
    # A small pool, the same bytes for all: a GPT-OSS page holds one of its two KV groups.
    engine = LLMEngine(paged, EngineConfig(block_size=4, num_device_blocks=20 if name == "gpt_oss" else 10,
                                           num_host_blocks=32, record_block_contents=True))
    got = engine.generate(copy.deepcopy(REQUESTS))
    for request in REQUESTS:
        assert got[request.request_id] == generate_reference(reference, request), request.request_id
    engine.check_invariants(deep=True)
    if name == "deepseek_v3":  # latent rows of 32 + 8, the values their first 32 columns
        rows, values = engine.kv_cache.layer(0)
        assert rows.shape[1:] == (1, 4, 40) and values.shape[1:] == (1, 4, 32)


@pytest.mark.skipif(not hasattr(transformers, "Mistral4ForCausalLM"), reason="no Mistral-4 here")
def test_engine_equals_eager_on_mistral4():
    """MLA with interleaved RoPE and Llama-4-style query scaling (growing from position 4)."""
    from test_hf_architectures import mistral4_pair
    reference, paged = mistral4_pair()
    engine = LLMEngine(paged, EngineConfig(block_size=4, num_device_blocks=10, num_host_blocks=32,
                                           record_block_contents=True))
    got = engine.generate(copy.deepcopy(REQUESTS))
    for request in REQUESTS:
        assert got[request.request_id] == generate_reference(reference, request), request.request_id
    engine.check_invariants(deep=True)


def test_unsupported_architecture_refused_at_engine_creation():
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation=ATTN_IMPLEMENTATION)
    with pytest.raises(NotImplementedError, match="'bloom' architecture"):
        LLMEngine(model, EngineConfig(num_device_blocks=8, num_host_blocks=0))
