"""The transformers behaviours the integration depends on beyond its extension points.

Each test fails when the installed transformers changes the behaviour: the release-dependent
facts in hf/transformers_behaviour.py and the private hooks in hf/hooks/.
"""

import contextlib
import inspect
import warnings

import pytest
import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers import AttentionInterface
from transformers.generation.continuous_batching import continuous_api
from transformers.models.llama4 import modeling_llama4

from paged_attention_ext.hf import ATTN_IMPLEMENTATION, CB_ATTN_IMPLEMENTATION
from paged_attention_ext.hf.hooks import cb_attention_allowlist, llama4_positions
from paged_attention_ext.hf.packed_latents import PackedLatentCache
from paged_attention_ext.hf.transformers_behaviour import STRIPS_PAGED_PREFIX, cache_keyword
from paged_attention_ext.testing import TINY, random_pair


def tiny_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


def test_paged_prefix_is_stripped_exactly_where_expected():
    model = tiny_model()
    with pytest.warns(FutureWarning) if STRIPS_PAGED_PREFIX else contextlib.nullcontext():
        model.set_attn_implementation("paged|" + ATTN_IMPLEMENTATION)
    expected = ATTN_IMPLEMENTATION if STRIPS_PAGED_PREFIX else "paged|" + ATTN_IMPLEMENTATION
    assert model.config._attn_implementation == expected


def test_continuous_batching_name_follows_the_prefix_behaviour():
    assert (CB_ATTN_IMPLEMENTATION == ATTN_IMPLEMENTATION) == STRIPS_PAGED_PREFIX


@pytest.mark.skipif(not STRIPS_PAGED_PREFIX, reason="transformers <= 5.18 runs paged|<name> as is")
def test_allowlist_hook_is_needed_and_installed():
    switch = continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn
    assert getattr(switch, cb_attention_allowlist.HOOKED, False), "the allowlist hook is not installed"
    model = tiny_model()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    # transformers' own switch still refuses the name: the hook is still needed.
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        switch.__wrapped__(object.__new__(continuous_api.ContinuousBatchingManager), model, False)
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate_batch([[1, 2, 3]], generation_config=config,
                               continuous_batching_config=ContinuousBatchingConfig(
                                   page_size=8, num_blocks=16, max_batch_tokens=16))
    assert [o.error for o in out.values()] == [None]
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


@pytest.mark.skipif(STRIPS_PAGED_PREFIX, reason="the hook is for transformers >= 5.19")
def test_no_hook_before_the_allowlist():
    switch = continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn
    assert not getattr(switch, cb_attention_allowlist.HOOKED, False)


@pytest.mark.skipif(not STRIPS_PAGED_PREFIX, reason="the hook is for transformers >= 5.19")
def test_allowlist_hook_warns_instead_of_failing_when_transformers_drops_the_method(monkeypatch):
    """A release without the method loses continuous batching with this name, nothing else."""
    monkeypatch.delattr(continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn")
    with pytest.warns(RuntimeWarning, match=r"changed continuous batching \(.*switch_to_cb_friendly"
                                            r"_attn is gone"):
        assert not cb_attention_allowlist.install(ATTN_IMPLEMENTATION)


def test_cache_keyword_is_the_one_the_forward_takes_without_a_warning():
    """transformers renames a forward's ``past_key_values`` to ``cache`` (the old name then
    warns); the engine's packed forward of an MLA model passes its cache by the name in force."""
    config = transformers.DeepseekV3Config(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=None, first_k_dense_replace=1,
        pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model, _ = random_pair(config)
    keyword = cache_keyword(model)
    assert keyword in inspect.signature(model.forward).parameters
    cache = PackedLatentCache(model)
    assert cache.keyword == keyword
    stored = []
    cache.update = lambda latent, rotary_key, layer_idx, *args, **kwargs: (
        stored.append((layer_idx, latent.shape[-1], rotary_key.shape[-1])) or (latent, rotary_key))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # No paged batch: the attention refuses, after the layer's update got the latents.
        with pytest.raises(ValueError, match="has neither"):
            model(torch.tensor([[1, 2]]), use_cache=False, **{keyword: cache})
    assert stored == [(0, 16, 4)]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid",
                                    "kimi_linear"])
def test_packed_linear_attention_finds_each_linear_module_and_its_cache_parameter(family):
    """What the engine's linear-attention hook relies on, on every served family: one module
    per linear layer (``layer_idx``) whose forward takes (hidden_states, the Cache,
    attention_mask) and keeps its states in that Cache."""
    from test_hf_hybrid_linear import MODELS
    from paged_attention_ext.hf.hooks import packed_linear_attention
    from paged_attention_ext.hf.linear_step import probe_states
    from paged_attention_ext.hf.support import check_config
    model = transformers.AutoModelForCausalLM.from_config(MODELS[family](),
                                                          attn_implementation=ATTN_IMPLEMENTATION)
    layer_types = check_config(model.config, model.config.get_text_config())
    linear = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
    modules = packed_linear_attention.linear_modules(model, linear)
    assert sorted(modules) == linear
    for layer_idx, module in modules.items():
        assert packed_linear_attention.cache_parameter(module) in ("cache_params", "cache")
        states = probe_states(packed_linear_attention.module_call(module), layer_idx,
                              model.config.hidden_size, torch.float32, torch.device("cpu"))
        assert {key[1] for key, _, _ in states} == {"conv", "recurrent"}


def test_packed_linear_attention_names_a_changed_signature():
    class Changed(torch.nn.Module):
        layer_idx = 0

        def forward(self, hidden_states, past_key_values=None, attention_mask=None):
            return hidden_states

    from paged_attention_ext.hf.hooks import packed_linear_attention
    with pytest.raises(NotImplementedError, match="now takes.*changed what the engine's"):
        packed_linear_attention.install(torch.nn.Sequential(Changed()), [0])
    with pytest.raises(NotImplementedError, match="expected one module with layer_idx=1"):
        packed_linear_attention.install(torch.nn.Sequential(Changed()), [1])


def llama4_model(**overrides):
    """Layers 0-2 with RoPE, layer 3 NoPE with the attention temperature (floor_scale 4)."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_local_experts=2, attention_chunk_size=64, floor_scale=4, attn_scale=0.5,
        layer_types=["full_attention"] * 4, **overrides)
    return transformers.Llama4ForCausalLM(config).eval()


def test_llama4_temperature_reads_the_positions_the_hook_feeds():
    """Llama4TextAttention still computes its NoPE layers' query positions as the token's index
    plus the cache's get_seq_length(layer_idx): inside RealPositions.at, the queries reaching
    the attention function are scaled at position_ids' positions (the formula below is
    transformers'), outside it at each token's index, before and after."""
    llama4_positions.check()
    model = llama4_model()
    queries = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 3:
            queries.append(query)
        return torch.zeros_like(query).transpose(1, 2), None

    AttentionInterface.register("capture_queries", capture)
    model.set_attn_implementation("capture_queries")
    assert llama4_positions.tempered_layers(model) == [model.model.layers[3].self_attn]
    ids = torch.tensor([[5, 9, 3, 17, 2, 40]])
    positions = torch.tensor([[0, 1, 2, 30, 31, 9]])  # three sequences packed in one row
    hook = llama4_positions.installed(model)
    assert llama4_positions.installed(model) is hook  # installed once
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
        with hook.at(positions):
            model(input_ids=ids, position_ids=positions, use_cache=False)
        model(input_ids=ids, position_ids=positions, use_cache=False)
    plain, tempered, after = queries
    torch.testing.assert_close(after, plain)

    def scale(p):
        return torch.log1p(torch.floor((p.float() + 1.0) / 4)) * 0.5 + 1.0
    index = torch.arange(6)
    torch.testing.assert_close(tempered, plain / scale(index)[:, None] * scale(positions[0])[:, None],
                               rtol=1e-6, atol=1e-6)
    assert not torch.allclose(tempered, plain)
    assert len(model.model.layers[3].self_attn._forward_pre_hooks) == 1


def test_llama4_hook_refuses_a_changed_release(monkeypatch):
    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        positions = kwargs["position_ids"]  # a release reading real positions another way
        return positions
    monkeypatch.setattr(modeling_llama4.Llama4TextAttention, "forward", forward)
    with pytest.raises(NotImplementedError, match="no longer has .*positions = torch.arange"):
        llama4_positions.check()


def cache_argument(model) -> str:
    """The name of the model's cache argument (transformers 5.25 renamed it)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def test_llama4_hook_refuses_a_layer_given_a_cache():
    """The hook stands in for an empty cache only: a forward with a real one is refused."""
    model = llama4_model()
    hook = llama4_positions.installed(model)
    cache = {cache_argument(model): transformers.DynamicCache(config=model.config)}
    with pytest.raises(RuntimeError, match="layer 3: expected one empty cache argument"):
        with torch.no_grad(), hook.at(torch.tensor([[4, 5, 6]])):
            model(input_ids=torch.tensor([[5, 9, 3]]), **cache)
    fresh = {cache_argument(model): transformers.DynamicCache(config=model.config)}
    with torch.no_grad():  # outside the engine's forwards the hook lets a cache through
        model(input_ids=torch.tensor([[5, 9, 3]]), **fresh)
