"""paged_attention_ext.hf.support: the K/V shape a transformers config asks the pools for."""

import types

import pytest
import transformers

from paged_attention_ext.engine import EngineConfig, LLMEngine
from paged_attention_ext.engine.hf_runner import HFModelRunner
from paged_attention_ext.hf.support import KVHeadShape, kv_head_shape, mla_latent_shape
from paged_attention_ext.testing import TINY, random_pair

# DeepSeek-V3 multi-head latent attention: key head 16 + 8 = 24, value head 16. Its
# num_key_value_heads is left at transformers' default (128), which MLA does not use.
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
           first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=48, n_group=1, topk_group=1)


def test_grouped_query_heads_of_hidden_size_over_heads():
    shape = kv_head_shape(transformers.LlamaConfig(**TINY))  # 4 query / 2 KV heads, hidden 64
    assert shape == KVHeadShape(num_kv_heads=2, head_size=16, head_size_v=16)


def test_explicit_head_dim_wins_over_hidden_size():
    config = transformers.Qwen3Config(**{**TINY, "head_dim": 32})
    assert kv_head_shape(config) == (2, 32, 32)


def test_without_num_key_value_heads_every_head_is_a_kv_head():
    config = types.SimpleNamespace(num_attention_heads=8, hidden_size=256)
    assert kv_head_shape(config) == (8, 32, 32)


def test_tensor_parallel_ranks_hold_their_share_of_the_heads():
    config = transformers.LlamaConfig(**{**TINY, "num_attention_heads": 8, "num_key_value_heads": 4})
    assert kv_head_shape(config, tp_size=2) == (2, 8, 8)
    assert kv_head_shape(config, tp_size=4) == (1, 8, 8)


def test_mla_stores_one_kv_head_per_query_head_with_its_own_sizes():
    tiny = {name: value for name, value in TINY.items() if name != "num_key_value_heads"}
    config = transformers.DeepseekV3Config(**tiny, **MLA)
    assert config.num_key_value_heads != config.num_attention_heads  # what MLA must not use
    assert kv_head_shape(config) == (4, 24, 16)
    assert kv_head_shape(config, tp_size=2) == (2, 24, 16)


@pytest.mark.parametrize("tp_size, match", [(3, "tp_size=3 does not divide the 2 KV heads"),
                                            (0, "tp_size must be an int >= 1"),
                                            (1.0, "tp_size must be an int >= 1")])
def test_bad_tp_size_is_refused(tp_size, match):
    with pytest.raises(ValueError, match=match):
        kv_head_shape(transformers.LlamaConfig(**TINY), tp_size=tp_size)


@pytest.mark.parametrize("config, mla_storage", [
    (transformers.LlamaConfig(**TINY), "latent"),
    (transformers.DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, **MLA), "expanded"),
], ids=["llama", "deepseek_v3_expanded"])
def test_engine_pools_have_this_shape(config, mla_storage):
    paged, _ = random_pair(config)
    runner = HFModelRunner(paged, mla_storage=mla_storage)
    kv = LLMEngine(runner, EngineConfig(block_size=4, num_device_blocks=2)).kv_cache
    shape = kv_head_shape(config)
    assert (kv.num_kv_heads, kv.head_size, kv.head_size_v) == shape
    assert kv.key_caches[0].shape[1:] == (shape.num_kv_heads, 4, shape.head_size)
    assert kv.value_caches[0].shape[-1] == shape.head_size_v


def test_engine_pools_of_an_mla_model_hold_latent_rows():
    config = transformers.DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, **MLA)
    paged, _ = random_pair(config)
    kv = LLMEngine(paged, EngineConfig(block_size=4, num_device_blocks=2)).kv_cache
    latent = mla_latent_shape(config)
    assert tuple(latent) == (1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank)
    assert (kv.num_kv_heads, kv.head_size, kv.head_size_v) == latent
    assert kv.key_caches[0].shape[1:] == (1, 4, latent.head_size)
    # The values are the rows' leading columns, the same memory.
    assert kv.value_caches[0].data_ptr() == kv.key_caches[0].data_ptr()
    assert kv.value_caches[0].shape[-1] == latent.head_size_v
