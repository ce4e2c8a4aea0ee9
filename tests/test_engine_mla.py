"""The engine keeps an MLA model's latent rows: one row of ``kv_lora_rank + qk_rope_head_dim``
values per token and layer, stored through the packed forward's ``Cache.update`` and read with
``kv_b_proj`` absorbed. Tokens equal eager ``generate`` (greedy, sampled n > 1, beams) for
DeepSeek-V2-, DeepSeek-V3- and Kimi-K2-shaped models through prefix hits and both preemption
modes; the pool holds latent rows, as the memory calculator counts them; what the rows cannot
serve is refused when the engine is created."""

import copy
import dataclasses
import random

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from paged_attention_ext.engine import (EngineConfig, LLMEngine, Request, SamplingParams,
                                        generate_reference)
from paged_attention_ext.engine.hf_runner import HFModelRunner
from paged_attention_ext.engine.sequence import GroupStatus
from paged_attention_ext.hf import latent_prefill
from paged_attention_ext.testing import random_pair
from paged_attention_ext.tools.memory import PRESETS, kv_report

from engine_loop import serve_to_completion

BLOCK = 4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              pad_token_id=0, bos_token_id=None, eos_token_id=None,
              initializer_range=0.2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
              first_k_dense_replace=1, n_shared_experts=1)


def yarn(factor: int, beta_fast: float, mscale_all_dim: float) -> dict:
    """YaRN scaling from position 16 on (real models: 4096), so these short runs cross it;
    the positions it stretches to, ``factor`` times that, are the model's."""
    return dict(max_position_embeddings=16 * factor, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=float(factor),
        original_max_position_embeddings=16, beta_fast=beta_fast, beta_slow=1.0, mscale=1.0,
        mscale_all_dim=mscale_all_dim))


CONFIGS = {
    # DeepSeek-V2-Lite: no query compression, YaRN whose mscale_all_dim rescales the softmax.
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        **yarn(40, 32.0, 0.707)),
    # DeepSeek-V3: query compression, interleaved RoPE, grouped expert routing.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, n_group=2,
        topk_group=1, rope_interleave=True, **yarn(40, 32.0, 1.0)),
    # Kimi-K2 (a DeepSeek-V3 architecture): half the heads per hidden size, one expert group,
    # YaRN factor 32 with beta_fast 1, RoPE halves not interleaved.
    "kimi_k2": lambda: transformers.DeepseekV3Config(
        **COMMON, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=48, n_group=1,
        topk_group=1, rope_interleave=False, **yarn(32, 1.0, 1.0)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    paged, reference = random_pair(CONFIGS[request.param](), reference_attention="eager")
    return request.param, paged, reference


def requests():
    """Greedy, sampled (n = 2) and beam requests; four share a two-block prompt prefix."""
    rng = random.Random(0)
    system = [rng.randrange(1, 128) for _ in range(2 * BLOCK)]
    kinds = [SamplingParams(max_new_tokens=8),
             SamplingParams(max_new_tokens=7, temperature=0.8, top_k=30, n=2, seed=3),
             SamplingParams(max_new_tokens=6, num_beams=3, num_return_sequences=2)]
    return [Request(f"r{i}", (system if i < 4 else []) + [rng.randrange(1, 128) for _ in range(3 + i)],
                    kinds[i % 3]) for i in range(6)]


def serve(runner, reqs, **config):
    """Run to completion, checking the engine deeply after every step."""
    engine = LLMEngine(runner, EngineConfig(block_size=BLOCK, record_block_contents=True, **config))
    for request in reqs:
        engine.add_request(request)
    return engine, serve_to_completion(engine)


def expected(reference, reqs):
    return {r.request_id: generate_reference(reference, r) for r in reqs}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_latent_rows_equal_eager_through_prefix_hits_and_preemption(pair, mode):
    name, paged, reference = pair
    reqs = requests()
    engine, outputs = serve(paged, copy.deepcopy(reqs), num_device_blocks=14, num_host_blocks=64,
                            preemption_mode=mode)
    assert outputs == expected(reference, reqs)
    report = engine.report()
    assert report["preemptions"][mode] > 0 and report["prefix_cache_hit_rate"] > 0
    # One latent row of 32 + 8 values per token and layer: the values are its first 32 columns.
    rows, values = engine.kv_cache.layer(1)
    assert rows.shape == (14, 1, BLOCK, 40) and values.shape == (14, 1, BLOCK, 32)
    assert values.data_ptr() == rows.data_ptr()
    assert engine.kv_cache.block_bytes == 2 * BLOCK * 40 * 4 == report["kv_bytes_per_block"]


def test_long_query_runs_expanded_equal_eager_beside_absorbed_decodes(pair, monkeypatch):
    """With a threshold of 3 query rows, prefills and the rest of a prompt after a prefix hit
    are expanded, in steps that pack decodes (absorbed) beside them."""
    name, paged, reference = pair
    monkeypatch.setattr(latent_prefill, "EXPAND_MIN_QUERIES", 3)
    monkeypatch.setattr(latent_prefill, "EXPANSION_COST", 0.0)  # any context
    forms = []
    expanded, absorbed = latent_prefill._run_expanded, latent_prefill._run_absorbed
    monkeypatch.setattr(latent_prefill, "_run_expanded",
                        lambda *args: forms.append("expanded") or expanded(*args))
    monkeypatch.setattr(latent_prefill, "_run_absorbed",
                        lambda *args: forms.append("absorbed") or absorbed(*args))
    # Which runs expand is decided once per step, from the step's host lists, for every layer.
    asked, decided = [], []
    step_runs, decide = latent_prefill.step_runs, latent_prefill.LatentRuns.__init__
    monkeypatch.setattr(latent_prefill, "step_runs",
                        lambda batch, *args: asked.append(batch) or step_runs(batch, *args))
    monkeypatch.setattr(latent_prefill.LatentRuns, "__init__",
                        lambda self, *args: decided.append(self) or decide(self, *args))
    monkeypatch.setattr(latent_prefill.LatentRuns, "read",
                        lambda *args: pytest.fail("the step's lengths read back from tensors"))
    reqs = requests()
    engine, outputs = serve(paged, copy.deepcopy(reqs), num_device_blocks=14, num_host_blocks=64,
                            preemption_mode="recompute")
    assert outputs == expected(reference, reqs)
    assert engine.report()["prefix_cache_hit_rate"] > 0
    assert {"expanded", "absorbed"} <= set(forms)
    layers = paged.config.num_hidden_layers
    assert len(decided) == len({id(batch) for batch in asked}) > 0
    assert len(asked) == layers * len(decided)


def test_expanded_storage_keeps_per_head_keys_and_values(pair):
    name, paged, reference = pair
    reqs = requests()
    runner = HFModelRunner(paged, mla_storage="expanded")
    engine, outputs = serve(runner, copy.deepcopy(reqs), num_device_blocks=64, num_host_blocks=0)
    assert outputs == expected(reference, reqs)
    heads = paged.config.num_attention_heads
    keys, values = engine.kv_cache.layer(0)
    assert keys.shape[1:] == (heads, BLOCK, 24) and values.shape[1:] == (heads, BLOCK, 16)
    assert engine.kv_cache.block_bytes == 2 * heads * BLOCK * (24 + 16) * 4


def test_latent_pool_is_the_memory_calculators():
    """The engine allocates what `paged-attention memory` reports for the deepseek-v3 preset
    (three of its layers), latent and expanded, for a model of DeepSeek-V3's attention (128
    heads, latent 512 + 64, heads 128 + 64 and 128) built on the meta device."""
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=3, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="paged_attention_ext", dtype=torch.bfloat16)
    shape = dataclasses.replace(PRESETS["deepseek-v3"], layers=3)
    report = kv_report(shape, "bfloat16", max_len=16, block_size=16)
    for storage, per_block in (("latent", report["bytes_per_block"]),
                               ("expanded", report["bytes_per_token_expanded"] * 16)):
        runner = HFModelRunner(model, mla_storage=storage)
        assert runner.spec.values_in_keys == (storage == "latent")
        engine = LLMEngine(runner, EngineConfig(block_size=16, num_device_blocks=1,
                                                num_host_blocks=0))
        assert engine.kv_cache.block_bytes == per_block == engine.report()["kv_bytes_per_block"]


def test_fp8_latent_rows_take_one_scale_per_layer(pair):
    name, paged, reference = pair
    with pytest.raises(ValueError, match="one scale"):
        LLMEngine(paged, EngineConfig(block_size=BLOCK, num_device_blocks=8, num_host_blocks=0,
                                      kv_cache_dtype="fp8_e4m3", k_scale=1.0, v_scale=2.0))
    reqs = requests()[:3]
    engine, outputs = serve(paged, copy.deepcopy(reqs), num_device_blocks=64, num_host_blocks=0,
                            kv_cache_dtype="fp8_e4m3")
    assert sorted(outputs) == [r.request_id for r in reqs]
    assert engine.kv_cache.dtype == torch.float8_e4m3fn
    for layer in range(2):  # calibrated from the first prefill's latents and rotary keys
        scales = engine.kv_cache.scales(layer)
        assert torch.equal(scales["k_scale"], scales["v_scale"]) and scales["k_scale"].numel() == 1


def test_compiled_decode_over_latent_rows():
    """The decode graph stores the latents through the same cache object, given each step's
    batch inside the trace: compiled once at creation, no recompiles as batches change."""
    paged, reference = random_pair(CONFIGS["deepseek_v3"](), reference_attention="eager")
    reqs = requests()
    torch._dynamo.reset()
    counters.clear()
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK, num_device_blocks=64,
                                           num_host_blocks=0, compile_decode=True,
                                           compile_backend="eager"))
    graphs = counters["stats"]["unique_graphs"]
    assert engine.generate(copy.deepcopy(reqs)) == expected(reference, reqs)
    assert engine.report()["compiled_decode"]["steps"] > 5 and engine.kv_cache.values_in_keys
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["recompiles"] and not counters["graph_break"]


class _Quantized(torch.nn.Module):
    """Stands for a quantized projection: not an nn.Linear, so it cannot be absorbed."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def test_unabsorbable_kv_b_proj_is_refused_at_engine_creation(pair):
    name, paged, reference = pair
    model = copy.deepcopy(paged)
    attention = model.model.layers[1].self_attn
    attention.kv_b_proj = _Quantized(attention.kv_b_proj)
    with pytest.raises(NotImplementedError, match="layer 1.*_Quantized.*mla_storage='expanded'"):
        LLMEngine(model, EngineConfig(block_size=BLOCK, num_device_blocks=8, num_host_blocks=0))
    # The expanded form serves it.
    reqs = requests()[:3]
    _, outputs = serve(HFModelRunner(model, mla_storage="expanded"), copy.deepcopy(reqs),
                       num_device_blocks=64, num_host_blocks=0)
    assert outputs == expected(reference, reqs)


def test_a_layer_that_hands_no_latents_to_the_cache_is_refused(pair):
    """A forward that would attend over rows it never wrote raises before any token is chosen."""
    name, paged, reference = pair
    model = copy.deepcopy(paged)
    attention = model.model.layers[1].self_attn
    forward = attention.forward

    def without_cache(*args, **kwargs):
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        return forward(*args, **kwargs)

    attention.forward = without_cache
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK, num_device_blocks=8, num_host_blocks=0))
    engine.add_request(Request("r", [3, 4, 5], SamplingParams(max_new_tokens=2)))
    with pytest.raises(RuntimeError, match=r"layers \[0\], not of every MLA layer \[0, 1\]"):
        engine.step()
    assert engine.status("r") is GroupStatus.WAITING  # the step rolled back


def test_unknown_mla_storage_is_refused(pair):
    with pytest.raises(ValueError, match="HFModelRunner: mla_storage must be one of"):
        HFModelRunner(pair[1], mla_storage="compressed")
