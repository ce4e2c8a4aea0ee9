"""Architectures beyond test_hf_generate.py: attention sinks (GPT-OSS), different key and
value head sizes (DeepSeek-V2/V3 multi-head latent attention), a sweep of decoder
architectures, and the architectures PagedCache refuses.

Tiny random fp32 models, built twice with the same weights: once with ``eager`` and the
default DynamicCache, once with ``paged_attention_ext`` and a PagedCache. Outputs must be
token-identical.
"""

import copy

import pytest
import torch
import transformers

from paged_attention_ext import ops
from paged_attention_ext.hf import PagedCache, self_check, support
from paged_attention_ext.testing import random_pair

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=None, eos_token_id=None, initializer_range=0.2)
BLOCK_SIZE = 4


MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
           num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1)
# name -> config. GPT-OSS: learned sinks, alternating sliding (window 6) and full
# layers. DeepSeek: key head 16 + 8 = 24, value head 16 (real models: 128 + 64 and 128).
MODELS = {
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=6),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**COMMON, **MLA, q_lora_rank=48, n_group=1,
                                                         topk_group=1),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(**COMMON, **MLA, q_lora_rank=None),
}
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, num_return_sequences=3),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def build_pair(config, reference_impl="eager"):
    """(reference model, paged model) with the same random weights."""
    paged, reference = random_pair(config, reference_attention=reference_impl)
    return reference, paged


def left_padded_prompts(seed=0):
    ids = torch.randint(1, COMMON["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    return ids, mask


def generate_both(pair, max_new_tokens=12, seed=5, cache_options=None, **kwargs):
    ids, mask = left_padded_prompts()
    outputs = []
    cache = PagedCache(pair[1].config, block_size=BLOCK_SIZE, **(cache_options or {}))
    for model, extra in ((pair[0], {}), (pair[1], {"past_key_values": cache})):
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          pad_token_id=0, **kwargs, **extra))
    return outputs[0], outputs[1], cache


@pytest.fixture(scope="module", params=sorted(MODELS))
def special(request):
    return request.param, build_pair(MODELS[request.param]())


@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_sinks_and_latent_attention_equal_eager(special, decoding):
    name, pair = special
    expected, got, cache = generate_both(pair, **DECODING[decoding])
    assert torch.equal(got, expected), f"{name} {decoding}"
    cache.manager.check_invariants()
    if name.startswith("deepseek"):
        key_pool, value_pool = cache.kv.layer(0)
        # One row per token shared by the 4 heads: latent 32 + rotary key 8; the values are
        # the rows' first 32 columns, the same memory.
        assert key_pool.shape[1:] == (1, BLOCK_SIZE, 40) and value_pool.shape[1:] == (1, BLOCK_SIZE, 32)
        assert value_pool.data_ptr() == key_pool.data_ptr()
    cache.reset()
    assert cache.memory_usage()["blocks_used"] == 0


@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_mla_expanded_storage_equals_eager(decoding):
    pair = build_pair(MODELS["deepseek_v3"]())
    expected, got, cache = generate_both(pair, cache_options={"mla_storage": "expanded"},
                                         **DECODING[decoding])
    assert torch.equal(got, expected), decoding
    key_pool, value_pool = cache.kv.layer(0)
    # Per head: key qk_nope + qk_rope, value v_head_dim.
    assert key_pool.shape[1:] == (4, BLOCK_SIZE, 24) and value_pool.shape[1:] == (4, BLOCK_SIZE, 16)


def mistral4_pair():
    """Mistral-4 (MLA with interleaved RoPE and Llama-4-style query scaling, which grows here
    from position 4 on; real models: 8192). Its causal-LM class is not in
    AutoModelForCausalLM on every release, so the pair is built from the class."""
    config = transformers.Mistral4Config(**COMMON, **MLA, q_lora_rank=48, rope_parameters=dict(
        type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=4,
        beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.5))
    models = []
    for implementation in ("eager", "paged_attention_ext"):
        torch.manual_seed(0)
        models.append(transformers.Mistral4ForCausalLM._from_config(
            copy.deepcopy(config), attn_implementation=implementation, dtype=torch.float32).eval())
    models[1].load_state_dict(models[0].state_dict())
    return tuple(models)


@pytest.mark.skipif(not hasattr(transformers, "Mistral4ForCausalLM"), reason="no Mistral-4 here")
@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_mistral4_equals_eager(decoding):
    expected, got, cache = generate_both(mistral4_pair(), **DECODING[decoding])
    assert torch.equal(got, expected), decoding
    key_pool, value_pool = cache.kv.layer(0)  # latent rows: latent 32 + rotary key 8
    assert key_pool.shape[1:] == (1, BLOCK_SIZE, 40) and value_pool.shape[1:] == (1, BLOCK_SIZE, 32)


# MLA families beyond the checked ones, which run because their tiny twins equal eager
# (support.check_config -> self_check.verify_variant); each is checked here at test sizes too.
MLA_VARIANTS = {
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(**COMMON, **MLA, q_lora_rank=48, n_group=1,
                                                            topk_group=1),
    "minicpm3": lambda: transformers.MiniCPM3Config(**COMMON, num_key_value_heads=4, head_dim=8,
                                                    kv_lora_rank=32, qk_rope_head_dim=8,
                                                    qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=48),
    "youtu": lambda: transformers.YoutuConfig(**COMMON, **MLA, q_lora_rank=48),
    "axk1": lambda: transformers.AXK1Config(**COMMON, **MLA, q_lora_rank=48, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("name", sorted(MLA_VARIANTS))
def test_mla_variant_runs_once_its_twin_equals_eager(name):
    make_config = MLA_VARIANTS[name]
    if make_config().model_type in support.MLA_TESTED:
        pytest.skip("on the checked list")
    expected, got, cache = generate_both(build_pair(make_config()), **DECODING["greedy"])
    assert torch.equal(got, expected), name
    cache.manager.check_invariants()


def test_mla_variant_whose_twin_differs_is_refused(monkeypatch):
    self_check.forget_verdicts()
    monkeypatch.setattr(self_check, "compare_on_twin", lambda text_config: "logits differ by 0.5")
    with pytest.raises(NotImplementedError, match=r"'minicpm3' architecture: multi-head latent "
                       r"attention .* not cover .* does not reproduce eager attention: logits differ"):
        PagedCache(MLA_VARIANTS["minicpm3"]())
    self_check.forget_verdicts()


def test_mla_variant_whose_twin_cannot_run_is_refused(monkeypatch):
    def inconclusive(text_config):
        raise self_check.Inconclusive("RuntimeError: sizes")
    self_check.forget_verdicts()
    monkeypatch.setattr(self_check, "compare_on_twin", inconclusive)
    with pytest.raises(NotImplementedError, match=r"'minicpm3' architecture: .* could not be run "
                       r"with eager attention to check it \(RuntimeError: sizes\)"):
        PagedCache(MLA_VARIANTS["minicpm3"]())
    self_check.forget_verdicts()


def test_sinks_change_the_output():
    """The comparison above would catch sinks being dropped: eager with zeroed-out sink
    logits (a sink of -inf is no sink) generates differently."""
    reference, _ = build_pair(MODELS["gpt_oss"]())
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        with_sinks = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        for layer in reference.model.layers:
            layer.self_attn.sinks.fill_(-float("inf"))
        without = reference.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert not torch.equal(with_sinks, without)


# ---- a sweep: greedy decoding of a left-padded batch, fp32 identical to eager -------------------
SWEEP = {
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                                     num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_key_value_heads=2, num_local_experts=4),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, num_key_value_heads=2, head_dim=16,
                                                         sliding_window=6),
    "cohere2": lambda: transformers.Cohere2Config(**COMMON, num_key_value_heads=2, sliding_window=6),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, num_key_value_heads=2),
    "granite": lambda: transformers.GraniteConfig(**COMMON, num_key_value_heads=2),
    "stablelm": lambda: transformers.StableLmConfig(**COMMON, num_key_value_heads=2),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**COMMON),
    "starcoder2": lambda: transformers.Starcoder2Config(**COMMON, num_key_value_heads=2, sliding_window=6),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=256, bos_token_id=None, eos_token_id=None,
                                            pad_token_id=0, initializer_range=0.2),
    "opt": lambda: transformers.OPTConfig(**{k: v for k, v in COMMON.items() if k != "intermediate_size"},
                                          ffn_dim=128, word_embed_proj_dim=64),
}


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_greedy_equals_eager(name):
    expected, got, cache = generate_both(build_pair(SWEEP[name]()), max_new_tokens=10,
                                         do_sample=False)
    assert torch.equal(got, expected)
    cache.manager.check_invariants()


# ---- refused at PagedCache creation, with the architecture and the reason -----------------------
REFUSED = {
    "bloom": (lambda: transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
              "ALiBi"),
    "falcon": (lambda: transformers.FalconConfig(**COMMON), "FALCON_ATTENTION_CLASSES"),
    "mpt": (lambda: transformers.MptConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4), "ALiBi"),
    "llama4": (lambda: transformers.Llama4Config(text_config=COMMON),
               r"run its text model: Llama4ForCausalLM\(config.text_config\)"),
    "jamba": (lambda: transformers.JambaConfig(**COMMON), r"\['linear_attention'\]"),
    "bamba": (lambda: transformers.BambaConfig(**COMMON), r"\['linear_attention'\]"),
    "zamba2": (lambda: transformers.Zamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                 layers_block_type=["mamba", "hybrid"]), r"'hybrid'"),
    "nemotron_h": (lambda: transformers.NemotronHConfig(**COMMON), r"'linear_attention'"),
    "falcon_h1": (lambda: transformers.FalconH1Config(**COMMON), r"'hybrid'"),
    "recurrent_gemma": (lambda: transformers.RecurrentGemmaConfig(**COMMON), "recurrent"),
    "deepseek_v32": (lambda: transformers.DeepseekV32Config(**COMMON), "sparse attention"),
    "gemma3n_text": (lambda: transformers.Gemma3nTextConfig(**COMMON), "num_kv_shared_layers"),
    "t5": (lambda: transformers.T5Config(vocab_size=128, d_model=64, num_layers=2, num_heads=4),
           "encoder-decoder"),
    "diffllama": (lambda: transformers.DiffLlamaConfig(**COMMON), "differential attention"),
    "doge": (lambda: transformers.DogeConfig(**COMMON), "learned mask"),
    "mllama": (lambda: transformers.MllamaConfig(), "cross-attention"),
    "jetmoe": (lambda: transformers.JetMoeConfig(**COMMON), "repeat the K/V heads"),
    "hrm_text": (lambda: transformers.HrmTextConfig(**COMMON), "other cache layer indices"),
    "glm_moe_dsa": (lambda: transformers.GlmMoeDsaConfig(**COMMON), "sparse attention"),
}


# Architectures whose attention transformers routed through the attention interface in a
# later release (5.24 for both): refused before, equal to eager from then on.
ROUTED_LATER = {
    "codegen": (lambda: transformers.CodeGenConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                   rotary_dim=8, bos_token_id=1, eos_token_id=2),
                transformers.CodeGenForCausalLM),
    "gptj": (lambda: transformers.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                             bos_token_id=1, eos_token_id=2),
             transformers.GPTJForCausalLM),
}


@pytest.mark.parametrize("name", sorted(ROUTED_LATER))
def test_refused_until_routed_through_the_interface(name):
    make_config, model_class = ROUTED_LATER[name]
    if not getattr(model_class, "_supports_attention_backend", False):
        with pytest.raises(NotImplementedError, match="does not route its attention"):
            PagedCache(make_config())
        return
    expected, got, cache = generate_both(build_pair(make_config()), max_new_tokens=10,
                                         do_sample=False)
    assert torch.equal(got, expected)
    cache.manager.check_invariants()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_at_cache_creation(name):
    make_config, reason = REFUSED[name]
    config = make_config()
    with pytest.raises(NotImplementedError, match=rf"paged_attention_ext does not support the '[\w]+' "
                                                  rf"architecture: .*{reason}"):
        PagedCache(config)


# ---- bf16: as close to the fp32 model as transformers' own bf16 run -------------------------------
# Tokens may diverge in bf16, so the steps are teacher-forced and the logits compared:
# paged bf16 vs eager fp32 must be within 1.5x (plus 1% of the logit range) of eager bf16
# vs eager fp32. DeepSeek's layers are dense here: a bf16 rounding that moves a token's
# expert choice changes its logits by far more than any attention error, and the absorbed
# attention of latent rows rounds differently from transformers' expanded one.
BF16 = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2),
    "qwen3": SWEEP["qwen3"],
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, **{**MLA, "first_k_dense_replace": COMMON["num_hidden_layers"]}, q_lora_rank=48),
    "gpt_oss": MODELS["gpt_oss"],
}


def _logits(model, cache, inputs):
    with torch.no_grad():
        return [model(step, past_key_values=cache).logits.float() for step in inputs]


@pytest.mark.parametrize("name", sorted(BF16))
def test_bf16_logits_close(name):
    reference, paged = build_pair(BF16[name]())
    reference_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    paged.to(torch.bfloat16)
    ids = torch.randint(1, COMMON["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(3))
    steps = torch.randint(1, COMMON["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(4))
    inputs = [ids] + [steps[:, i:i + 1] for i in range(steps.shape[1])]
    exact = _logits(reference, transformers.DynamicCache(config=reference.config), inputs)
    eager = _logits(reference_bf16, transformers.DynamicCache(config=reference.config), inputs)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    got = _logits(paged, cache, inputs)
    assert cache.kv.dtype == torch.bfloat16
    for step, (e, b, g) in enumerate(zip(exact, eager, got)):
        bound = 1.5 * (b - e).abs().max() + 0.01 * e.abs().max()
        assert (g - e).abs().max() <= bound, f"{name} step {step}"


@pytest.mark.parametrize("failing_layer", [0, 1])
@pytest.mark.parametrize("forward", ["prefill", "decode"])
@pytest.mark.parametrize("storage", ["latent", "expanded"])
def test_mla_write_failure_is_never_silently_skipped(storage, failing_layer, forward, monkeypatch):
    """MLA: update() stores the latents (or, expanded, the attention function stores the
    K/V transformers expands from them). If a store fails (out of memory, an interrupt),
    the cache must not carry on as if the layer held its K/V: the next forward raises, and
    after reset() generation equals eager."""
    reference, paged = build_pair(MODELS["deepseek_v3"]())
    ids = torch.randint(1, COMMON["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(2))
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, mla_storage=storage)
    real, calls = ops.write_kv, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == failing_layer + 1:
            raise RuntimeError("injected: out of memory")
        return real(*args)

    with torch.no_grad():
        if forward == "decode":
            paged(ids[:, :8], past_key_values=cache)
        monkeypatch.setattr(ops, "write_kv", flaky)
        step = ids[:, 8:] if forward == "decode" else ids[:, :8]
        with pytest.raises(RuntimeError, match="injected"):
            paged(step, past_key_values=cache)
        monkeypatch.setattr(ops, "write_kv", real)
        if storage == "latent" and forward == "prefill":
            # update() itself failed in the first forward: the cache is as new.
            assert cache.get_seq_length() == 0 and cache.memory_usage()["blocks_used"] == 0
        else:
            with pytest.raises(RuntimeError, match="stopped after|cannot continue"):
                paged(ids[:, 8:], past_key_values=cache)
        cache.reset()
        got = paged(ids, past_key_values=cache).logits
        torch.testing.assert_close(got, reference(ids).logits, atol=1e-4, rtol=1e-4)
