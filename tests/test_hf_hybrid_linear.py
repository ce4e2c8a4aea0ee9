"""Hybrid models with linear-attention layers (gated DeltaNet, KDA) under ``PagedCache``.

Qwen3-Next, Qwen3.5 (dense and MoE), OLMo-hybrid and Kimi-Linear (MLA full layers): the
full-attention layers' K/V in paged blocks, the linear layers' conv and recurrent states in
state pools, one slot per row. Tiny random fp32 models, eager ``generate`` with
transformers' DynamicCache as the reference: token-equal for greedy, beam search and
sampling (left padding included); the pools hold exactly the states DynamicCache holds;
prompt-lookup decoding where transformers' linear layers restore their states (5.25); what
is not served (assisted decoding on 5.18, a compiled first forward, transformers' continuous
batching) is refused. Compile mode (CompiledPagedCache): decode steps in one graph.
"""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from paged_attention_ext.hf import CB_ATTN_IMPLEMENTATION, CompiledPagedCache, PagedCache
from paged_attention_ext.hf.linear_states import LinearStates
from paged_attention_ext.hf.transformers_behaviour import LINEAR_LAYERS_ROLL_BACK
from paged_attention_ext.testing import random_pair

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=None, eos_token_id=None, initializer_range=0.2)
# Gated DeltaNet: 4 value heads over 2 key heads of 16, conv window 4.
DELTANET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
ALTERNATING = ["linear_attention", "full_attention"] * 2
# Kimi-Linear: KDA layers 1 and 3, MLA (latent 32, no RoPE part of 8) on layers 2 and 4.
KIMI = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None,
            num_key_value_heads=4, moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
            num_shared_experts=1, first_k_dense_replace=1,
            linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16,
                                "num_heads": 4, "short_conv_kernel_size": 4})
MODELS = {
    # Three linear layers, then a full one (Qwen3-Next's 3:1).
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON, **DELTANET, **MOE, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **COMMON, **DELTANET, num_key_value_heads=2, head_dim=16, layer_types=ALTERNATING),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(
        **COMMON, **DELTANET, **MOE, num_key_value_heads=2, head_dim=16, layer_types=ALTERNATING),
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(**COMMON, num_key_value_heads=2),
    "kimi_linear": lambda: transformers.KimiLinearConfig(**COMMON, **KIMI),
}
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, num_return_sequences=3),
}
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    """(name, paged model, eager twin with the same weights)."""
    paged, reference = random_pair(MODELS[request.param](), reference_attention="eager")
    return request.param, paged, reference


def prompts(rows=2, length=11, seed=0):
    """Random prompts, the second left-padded by 4."""
    ids = torch.randint(1, COMMON["vocab_size"], (rows, length),
                        generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    return ids, mask


def generate_both(paged, reference, cache, ids, mask, seed=5, max_new_tokens=10, **kwargs):
    outputs = []
    for model, extra in ((reference, {}), (paged, {"past_key_values": cache})):
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          pad_token_id=0, **kwargs, **extra))
    return outputs


def linear_layers(config):
    return [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]


@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_token_equal_to_eager(pair, decoding):
    name, paged, reference = pair
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    expected, got = generate_both(paged, reference, cache, *prompts(), **DECODING[decoding])
    assert torch.equal(got, expected), name
    cache.manager.check_invariants()
    assert cache.is_linear == [kind == "linear_attention" for kind in paged.config.layer_types]
    # Only the full layers hold K/V: the pools have one tensor pair per full layer.
    assert len(cache.kv.key_caches) == len(paged.config.layer_types) - len(linear_layers(paged.config))


def test_the_pools_hold_the_states_dynamic_cache_holds(pair):
    """After a prefill and two decode steps, each row's slot holds exactly the conv and
    recurrent states transformers' DynamicCache holds for that row."""
    name, paged, reference = pair
    ids, mask = prompts()
    caches = [transformers.DynamicCache(config=reference.config), PagedCache(paged.config, block_size=BLOCK_SIZE)]
    for model, cache in zip((reference, paged), caches):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           pad_token_id=0, past_key_values=cache)
    dynamic, cache = caches
    slots = torch.tensor(cache._placement.state_slots())
    pools = cache._linear.pools.device
    for layer in linear_layers(paged.config):
        for kind, states in (("conv", dynamic.layers[layer].conv_states),
                             ("recurrent", dynamic.layers[layer].recurrent_states)):
            torch.testing.assert_close(pools[(layer, kind, 0)][slots], states[0], rtol=1e-5,
                                       atol=1e-5, msg=f"{name} layer {layer} {kind}")
    usage = cache.memory_usage()
    assert usage["state_used_bytes"] == 2 * cache._linear.slot_bytes > 0
    assert usage["state_pool_bytes"] == 4 * cache._linear.slot_bytes  # 2 rows, 2 slots each


def test_beam_reorder_copies_states_and_forks_blocks(pair):
    """reorder_cache forks the chosen rows: each new row's state is one copy of its parent's,
    its K/V blocks the parent's by reference (no block copied)."""
    _, paged, _ = pair
    ids = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with torch.no_grad():
        paged(ids, past_key_values=cache, use_cache=True)
    pools = cache._linear.pools.device
    before = {key: pool[torch.tensor(cache._placement.state_slots())].clone()
              for key, pool in pools.items()}
    blocks = cache.manager.num_used_device_blocks
    tables = [cache.manager.block_ids(s, 0) for s in cache.rows]
    cache.reorder_cache(torch.tensor([2, 0, 2]))
    after = torch.tensor(cache._placement.state_slots())
    for key, pool in pools.items():
        torch.testing.assert_close(pool[after], before[key][[2, 0, 2]], rtol=0, atol=0)
    assert cache.manager.num_used_device_blocks == blocks - len(tables[1])  # row 1's freed, none copied
    assert [cache.manager.block_ids(s, 0) for s in cache.rows] == [tables[2], tables[0], tables[2]]
    assert cache.manager.states.num_used == 3
    cache.manager.check_invariants()


def test_eight_samples_share_the_prompt_blocks_and_hold_eight_states():
    """num_return_sequences=8: the repeated prompt's full blocks are stored once (prefix hits
    inside the forward, which still computes every row's states), each row has its own state."""
    # Dense (a MoE's expert batching may make a row's prompt K/V differ in the last bit,
    # and only identical K/V is shared).
    paged, reference = random_pair(MODELS["qwen3_5_text"](), reference_attention="eager")
    ids = torch.randint(1, 128, (1, 13), generator=torch.Generator().manual_seed(2))
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    expected, got = generate_both(paged, reference, cache, ids, torch.ones_like(ids), max_new_tokens=4,
                                  do_sample=True, num_return_sequences=8)
    assert torch.equal(got, expected)
    usage = cache.memory_usage()
    # 13 prompt + 3 stored new tokens = 16 tokens = 4 blocks a row; 3 full prompt blocks shared.
    assert usage["block_references"] == 8 * 4 and usage["blocks_used"] == 3 + 8
    assert cache.manager.states.num_used == 8


def test_fixed_pool(pair):
    name, paged, reference = pair
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, num_blocks=20)
    expected, got = generate_both(paged, reference, cache, *prompts(), **DECODING["beam"])
    assert torch.equal(got, expected), name


# ---- refusals -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_next():
    return random_pair(MODELS["qwen3_next"](), reference_attention="eager")


LOOKUP_PROMPT = torch.tensor([[5, 6, 7, 8] * 3 + [5, 6]])


def prompt_lookup(model, cache=None, **kwargs):
    extra = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        return model.generate(LOOKUP_PROMPT, max_new_tokens=30, do_sample=False, pad_token_id=0,
                              prompt_lookup_num_tokens=3, **kwargs, **extra)


def assert_slots_hold_the_states(cache, config, name, recording=False):
    """Each row's slot holds its linear layers' states (while recording past states, a
    conv state's last kernel columns: the recording keeps more)."""
    states = cache._linear
    for layer_idx in linear_layers(config):
        layer = cache.layers[layer_idx]
        for kind, held in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            for state_idx, tensor in held.items():
                if tensor is not None:
                    pool = states.pools.device[(layer_idx, kind, state_idx)]
                    want = tensor[..., -pool.shape[-1]:] if recording and kind == "conv" else tensor
                    assert torch.equal(pool.index_select(0, states._slots), want), (name, layer_idx)


@pytest.mark.skipif(not LINEAR_LAYERS_ROLL_BACK, reason="transformers refuses these models")
def test_prompt_lookup_decoding_token_equal_to_eager(pair, monkeypatch):
    """Verification forwards of 3 candidates, rejected ones cropped: transformers' linear
    layers record their states' past and restore it on crop, the slots take the restored
    states, the blocks past the new end are freed; token-equal to eager prompt lookup."""
    name, paged, reference = pair
    removed = []
    monkeypatch.setattr(PagedCache, "crop", lambda self, n, _crop=PagedCache.crop: (
        removed.append(self._tokens_to_crop(n)), _crop(self, n))[1])
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert cache.is_croppable
    assert torch.equal(prompt_lookup(paged, cache), prompt_lookup(reference)), name
    assert max(removed) > 0, name  # candidates were rejected
    assert all(cache.is_recording_past(i) for i in linear_layers(paged.config))
    cache.manager.check_invariants()
    # The slots hold what the layers restored (a recording window's last kernel columns).
    assert_slots_hold_the_states(cache, paged.config, name, recording=True)


@pytest.mark.skipif(not LINEAR_LAYERS_ROLL_BACK, reason="transformers refuses these models")
def test_prompt_lookup_needs_the_restored_states(qwen3_next, monkeypatch):
    """The test above can fail: linear states left after the rejected candidates generate
    other tokens."""
    paged, reference = qwen3_next
    monkeypatch.setattr(LinearStates, "cropped", lambda self, tokens_to_remove: None)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert not torch.equal(prompt_lookup(paged, cache), prompt_lookup(reference))


@pytest.mark.skipif(not LINEAR_LAYERS_ROLL_BACK, reason="transformers refuses these models")
def test_crop_without_recording_is_refused_before_anything_changes(qwen3_next):
    paged, _ = qwen3_next
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with torch.no_grad():
        paged.generate(LOOKUP_PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       past_key_values=cache)
    length = cache.get_seq_length()
    with pytest.raises(RuntimeError, match="layer 0 records no past states; call "
                                           r"cache.activate_past_recording\(\)"):
        cache.crop(-1)
    assert cache.get_seq_length() == length
    cache.manager.check_invariants()


@pytest.mark.skipif(not LINEAR_LAYERS_ROLL_BACK, reason="transformers refuses these models")
def test_crop_past_what_was_recorded_is_refused_before_anything_changes(qwen3_next):
    paged, _ = qwen3_next
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    cache.activate_past_recording()
    with torch.no_grad():
        paged.generate(LOOKUP_PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       past_key_values=cache)
    layer = cache.layers[0]
    recorded = min(len(h) for h in layer.recurrent_states_history.values())
    states = {k: v.clone() for k, v in layer.recurrent_states.items()}
    length = cache.get_seq_length()
    assert 0 < recorded < length
    with pytest.raises(ValueError, match=f"cannot remove {recorded + 1} tokens: linear-attention "
                                         f"layer 0 recorded the states of the last {recorded} only"):
        cache.crop(-(recorded + 1))
    assert cache.get_seq_length() == length
    assert all(torch.equal(layer.recurrent_states[k], v) for k, v in states.items())
    cache.manager.check_invariants()


@pytest.mark.skipif(LINEAR_LAYERS_ROLL_BACK, reason="transformers restores recurrent states")
def test_assisted_decoding_is_refused_where_states_cannot_roll_back(qwen3_next):
    """Up to 5.18 transformers' linear layers cannot restore a recurrent state: its generate
    refuses assisted decoding for these models, and the cache refuses recording and crops."""
    paged, _ = qwen3_next
    cache = PagedCache(paged.config)
    with pytest.raises(ValueError, match="stateful models"):
        prompt_lookup(paged, cache)
    with pytest.raises(NotImplementedError, match="cannot record past states .* linear-attention "
                                                  "layers on transformers 5.18"):
        PagedCache(paged.config).activate_past_recording()
    with pytest.raises(NotImplementedError, match="cannot crop for a model with linear-attention"):
        cache.crop(-1)
    assert not cache.is_croppable


GRAPHS = []  # one entry per graph dynamo hands to the backend


def counting_backend(gm: torch.fx.GraphModule, example_inputs):
    GRAPHS.append(len(example_inputs))
    return gm.forward


@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_compile_mode_token_equal_to_eager(pair, decoding):
    """CompiledPagedCache through generate's compile_config path: the eager prefill places the
    rows and creates the state pools; every decode step runs in one graph where transformers'
    layers update their working states in place and the graph copies them into the rows'
    slots (a fixed slot tensor). Beam search runs no compiled forward of transformers': its
    reorders gather the working states from the slots in place."""
    name, paged, reference = pair
    config = transformers.CompileConfig(fullgraph=True, backend=counting_backend, mode=None)
    config._compile_all_devices = True  # generate compiles only on accelerators otherwise
    torch._dynamo.reset()
    counters.clear()
    GRAPHS.clear()
    cache = CompiledPagedCache(paged.config, max_cache_len=32, block_size=BLOCK_SIZE)
    try:
        expected, got = generate_both(paged, reference, cache, *prompts(), compile_config=config,
                                      **DECODING[decoding])
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, expected), name
    assert len(GRAPHS) == (0 if decoding == "beam" else 1), GRAPHS
    assert not counters["graph_break"], dict(counters["graph_break"])
    cache.manager.check_invariants()
    # The slots hold the working states (what the next reorder would gather).
    assert_slots_hold_the_states(cache, paged.config, name)


def test_a_compiled_first_forward_is_refused(qwen3_next):
    """The state pools come from an eager first forward; a compiled prefill says so."""
    paged, _ = qwen3_next
    forward = paged.forward
    torch._dynamo.reset()
    paged.forward = torch.compile(forward, fullgraph=True, backend="eager")
    try:
        cache = CompiledPagedCache(paged.config, max_cache_len=32, block_size=BLOCK_SIZE)
        with pytest.raises(Exception, match="run the prefill eagerly"), torch.no_grad():
            paged.generate(*prompts()[:1], attention_mask=prompts()[1], max_new_tokens=2,
                           pad_token_id=0, past_key_values=cache)
    finally:
        paged.forward = forward
        torch._dynamo.reset()


def test_compiled_cache_refuses_recording(qwen3_next):
    with pytest.raises(NotImplementedError, match="CompiledPagedCache cannot record past states"):
        CompiledPagedCache(qwen3_next[0].config, max_cache_len=32).activate_past_recording()


def test_an_empty_first_row_is_refused_before_anything_changes(qwen3_next):
    paged, _ = qwen3_next
    ids, mask = prompts()
    mask[1] = 0
    cache = PagedCache(paged.config)
    with pytest.raises(ValueError, match="a row without tokens .* linear-attention"):
        with torch.no_grad():
            paged(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.manager is None  # as new


def test_more_rows_than_the_first_forward_is_refused(qwen3_next):
    paged, _ = qwen3_next
    cache = PagedCache(paged.config)
    with torch.no_grad():
        paged(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="keeps state slots for its first forward's rows"):
        cache.batch_repeat_interleave(2)
    assert cache.rows == [0] and cache.manager.states.num_used == 1


def test_mamba_layers_stay_refused():
    """Other 'linear_attention' layers (Mamba in Jamba) keep other states: refused."""
    config = transformers.JambaConfig(**{**COMMON, "num_hidden_layers": 2})
    with pytest.raises(NotImplementedError, match=r"\['linear_attention'\] are not attention"):
        PagedCache(config)


def test_continuous_batching_is_refused(qwen3_next):
    """transformers' continuous batching has no allocator for linear-attention states: the
    model is refused (by transformers' cache, or by the attention function if a release
    lets it through) instead of generating."""
    paged, _ = qwen3_next
    model = transformers.AutoModelForCausalLM.from_config(MODELS["qwen3_next"](), dtype=torch.float32).eval()
    model.set_attn_implementation(CB_ATTN_IMPLEMENTATION)
    config = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(page_size=8, num_blocks=16, max_batch_tokens=32)
    with pytest.raises((ValueError, NotImplementedError), match="linear_attention|linear-attention"):
        model.generate_batch([[1, 2, 3], [4, 5]], generation_config=config,
                             continuous_batching_config=batching)


def test_a_forward_interrupted_between_linear_layers_is_refused_next():
    """Layers [full, linear, linear, linear]: an exception in the last linear layer of a decode
    forward leaves the K/V whole but the states partly updated; the next forward refuses."""
    config = transformers.Qwen3NextConfig(**COMMON, **DELTANET, **MOE, num_key_value_heads=2, head_dim=16,
                                          layer_types=["full_attention"] + ["linear_attention"] * 3)
    paged, _ = random_pair(config, reference_attention="eager")
    cache = PagedCache(paged.config)
    with torch.no_grad():
        paged(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
        mixer = paged.model.layers[3].linear_attn
        forward = mixer.forward
        mixer.forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            paged(torch.tensor([[8]]), past_key_values=cache, use_cache=True)
        mixer.forward = forward
        with pytest.raises(RuntimeError, match="before every linear-attention layer stored"):
            paged(torch.tensor([[8]]), past_key_values=cache, use_cache=True)
    cache.reset()
    with torch.no_grad():
        paged(torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)  # usable again


@pytest.mark.parametrize("config_class", [transformers.Qwen3_5Config, transformers.Qwen3_5MoeConfig])
def test_the_composite_qwen3_5_configs(config_class):
    """The multimodal configs (model_type qwen3_5 / qwen3_5_moe) as a causal LM of their text
    config: the same support, checked through the composite config."""
    text = dict(COMMON, **DELTANET, num_key_value_heads=2, head_dim=16, layer_types=ALTERNATING,
                **(MOE if config_class is transformers.Qwen3_5MoeConfig else {}))
    config = config_class(text_config=text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                               out_hidden_size=64, intermediate_size=32))
    paged, reference = random_pair(config, reference_attention="eager")
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert cache.is_hybrid_linear
    expected, got = generate_both(paged, reference, cache, *prompts(), **DECODING["beam"])
    assert torch.equal(got, expected)
