"""The transformers behaviours the integration depends on beyond its extension points.

Each test fails when the installed transformers changes the behaviour: the release-dependent
facts in hf/transformers_behaviour.py and the private hooks in hf/hooks/.
"""

import contextlib
import inspect

import pytest
import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers import AttentionInterface
from transformers.generation.continuous_batching import continuous_api
from transformers.models.llama4 import modeling_llama4

from paged_attention_ext.hf import ATTN_IMPLEMENTATION, CB_ATTN_IMPLEMENTATION
from paged_attention_ext.hf.hooks import cb_attention_allowlist, llama4_positions
from paged_attention_ext.hf.transformers_behaviour import STRIPS_PAGED_PREFIX
from paged_attention_ext.testing import TINY


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
    plus the cache's get_seq_length(layer_idx): inside real_positions, the queries reaching
    the attention function are scaled at position_ids' positions (the formula below is
    transformers'), outside it at each token's index."""
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
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)
        with llama4_positions.real_positions(llama4_positions.tempered_layers(model), positions):
            model(input_ids=ids, position_ids=positions, use_cache=False)
    plain, tempered = queries

    def scale(p):
        return torch.log1p(torch.floor((p.float() + 1.0) / 4)) * 0.5 + 1.0
    index = torch.arange(6)
    torch.testing.assert_close(tempered, plain / scale(index)[:, None] * scale(positions[0])[:, None],
                               rtol=1e-6, atol=1e-6)
    assert not torch.allclose(tempered, plain)
    assert not model.model.layers[3].self_attn._forward_pre_hooks  # removed on exit


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
    layers = llama4_positions.tempered_layers(model)
    cache = {cache_argument(model): transformers.DynamicCache(config=model.config)}
    with pytest.raises(RuntimeError, match="layer 3: expected one empty cache argument"):
        with torch.no_grad(), llama4_positions.real_positions(layers, torch.tensor([[4, 5, 6]])):
            model(input_ids=torch.tensor([[5, 9, 3]]), **cache)
