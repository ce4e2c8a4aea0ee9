"""A transformers release newer than the tested ones runs: one warning, then each architecture
checks itself on a tiny random twin (paged against eager) before its first paged forward,
and a hook that broke under the new release is refused with the difference, not run."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import transformers
from transformers import AttentionInterface

from paged_attention_ext import versions
from paged_attention_ext.hf import ATTN_IMPLEMENTATION, PagedCache
from paged_attention_ext.hf import attention, self_check
from paged_attention_ext.testing import ARCHS, TINY

FUTURE = "5.99.0"
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
           num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1)
# Architectures of real models, at their real widths and depths (the twin shrinks them).
FULL_SIZE = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096,
                                              num_attention_heads=32, num_key_value_heads=8),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(num_hidden_layers=12, sliding_window=512),
    "gpt_oss": lambda: transformers.GptOssConfig(num_hidden_layers=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(num_hidden_layers=4, n_group=1, topk_group=1),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def future_release(monkeypatch):
    """transformers 5.99 as the self-check sees it (the whole import path is faked in a
    process of its own below)."""
    monkeypatch.setattr(self_check, "_release", lambda: FUTURE)
    monkeypatch.delenv("PAGED_ATTENTION_SKIP_SELF_CHECK", raising=False)
    self_check.forget_verdicts()
    yield
    self_check.forget_verdicts()


def test_release_policy():
    tested = versions.TRANSFORMERS_TESTED
    last = f"{tested[1][0]}.{tested[1][1]}"
    assert versions.refusal("transformers", f"{last}.0", tested) == ""
    assert versions.refusal("transformers", FUTURE, tested) == ""
    for older_or_other_major in ("5.17.2", "6.0.0", "4.57.1"):
        message = versions.refusal("transformers", older_or_other_major, tested)
        assert f"found {older_or_other_major}" in message and "'transformers>=5.18,<6'" in message
    assert versions.is_untested(FUTURE, tested) and not versions.is_untested(f"{last}.1", tested)


def test_a_newer_release_warns_once():
    version = "5.98.0"  # a version no other test warns about
    with pytest.warns(versions.UntestedReleaseWarning, match=rf"tested with transformers up to "
                      rf"5\.\d+; transformers {version} is newer"):
        assert versions.warn_if_untested("transformers", version, versions.TRANSFORMERS_TESTED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert versions.warn_if_untested("transformers", version, versions.TRANSFORMERS_TESTED)
        assert not versions.warn_if_untested("transformers", transformers.__version__,
                                             versions.TRANSFORMERS_TESTED)


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_the_twin_is_tiny_and_keeps_the_layer_types(name):
    config = FULL_SIZE[name]()
    twin = self_check.twin_config(config)
    assert type(twin) is type(config) and twin.num_hidden_layers == 2
    assert twin.hidden_size == 64 and twin.num_attention_heads == 4
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    assert set(getattr(twin, "layer_types", None) or ["full_attention"]) == kinds
    if getattr(config, "kv_lora_rank", None):
        assert twin.kv_lora_rank == 32


def test_a_tested_release_runs_no_self_check():
    self_check.forget_verdicts()
    PagedCache(ARCHS["llama"]())
    assert self_check._verdicts == {}


TWINS = {**{f"tiny_{name}": build for name, build in ARCHS.items()},
         **{f"full_size_{name}": build for name, build in FULL_SIZE.items()}}


@pytest.mark.parametrize("name", sorted(TWINS))
def test_each_architecture_passes_its_self_check(future_release, name):
    config = TWINS[name]()
    PagedCache(config)
    assert self_check._verdicts == {type(config): None}
    print(f"{name}: self-check {self_check._elapsed[type(config)] * 1e3:.0f} ms")
    PagedCache(config)  # verified once per config class
    assert len(self_check._elapsed) == 1


# Default (full-size) configs of the architectures the integration serves: on a newer release
# none may be refused over its twin (a lockout); a twin eager cannot run only warns.
DEFAULT_CONFIGS = ("LlamaConfig", "Qwen2Config", "Qwen3Config", "Qwen3MoeConfig", "MixtralConfig",
                   "MistralConfig", "Gemma2Config", "Gemma3TextConfig", "Cohere2Config",
                   "Olmo2Config", "GraniteConfig", "StableLmConfig", "GPTNeoXConfig",
                   "Starcoder2Config", "GPT2Config", "OPTConfig", "GptOssConfig", "DeepseekV2Config",
                   "DeepseekV3Config", "Phi3Config", "GlmConfig", "Glm4MoeConfig", "Qwen2MoeConfig",
                   "GemmaConfig", "PhiConfig")


@pytest.mark.parametrize("name", DEFAULT_CONFIGS)
def test_no_served_architecture_is_refused_over_its_twin(future_release, name):
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PagedCache(config_class())
    [verdict] = self_check._verdicts.values()  # verified, or a twin eager could not run (warned)
    assert verdict is None or isinstance(verdict, self_check.Inconclusive), verdict


@pytest.mark.skipif(not hasattr(transformers, "Mistral4ForCausalLM"), reason="no Mistral-4 here")
def test_a_causal_lm_outside_the_auto_mapping_is_checked_through_its_named_class(future_release):
    """Mistral-4's causal-LM class is not in AutoModelForCausalLM on every release; its
    checkpoints name it in ``architectures``."""
    config = transformers.Mistral4Config(**{**TINY, "num_key_value_heads": 4}, kv_lora_rank=32, qk_rope_head_dim=8,
                                         qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=48,
                                         n_routed_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         architectures=["Mistral4ForCausalLM"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UntestedReleaseWarning)  # not inconclusive
        PagedCache(config)
    assert self_check._verdicts == {transformers.Mistral4Config: None}


def test_skipping_the_self_check(future_release, monkeypatch):
    monkeypatch.setenv("PAGED_ATTENTION_SKIP_SELF_CHECK", "1")
    PagedCache(ARCHS["llama"]())
    assert self_check._verdicts == {}


def _break_attention(monkeypatch, **overrides):
    """Replace the registered attention function by one that changes its arguments, as a
    transformers release that passed them differently would."""
    registered = AttentionInterface._global_mapping[ATTN_IMPLEMENTATION]

    def broken(module, query, key, value, attention_mask, **kwargs):
        return registered(module, query, key, value, attention_mask, **{**kwargs, **overrides})

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, broken)


def test_a_dropped_scale_is_refused(future_release, monkeypatch):
    _break_attention(monkeypatch, scaling=1.0)
    config = ARCHS["llama"]()
    for _ in range(2):  # the verdict is remembered
        with pytest.raises(NotImplementedError, match=r"transformers 5\.99\.0 .*'llama' architecture "
                           r"failed its self-check .*logits differ by up to"):
            PagedCache(config)


def test_a_wrong_mask_is_refused(future_release, monkeypatch):
    """A window narrower than the model's (3 of 6): every guard passes, the logits differ."""
    _break_attention(monkeypatch, sliding_window=3)
    with pytest.raises(NotImplementedError, match=r"'mistral' architecture failed its self-check "
                       r".*logits differ by up to"):
        PagedCache(ARCHS["mistral"]())


def test_a_dropped_window_is_refused(future_release, monkeypatch):
    """Every key visible to a sliding layer: caught whichever way it shows."""
    _break_attention(monkeypatch, sliding_window=None)
    monkeypatch.setattr(attention, "_check_window", lambda *args: None)
    with pytest.raises(NotImplementedError, match=r"'mistral' architecture failed its self-check"):
        PagedCache(ARCHS["mistral"]())


def test_a_hook_that_raises_is_refused_with_its_error(future_release, monkeypatch):
    def fails(*args, **kwargs):
        raise KeyError("cache_position")

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, fails)
    with pytest.raises(NotImplementedError, match=r"failed its self-check .*: the check raised "
                       r"KeyError: 'cache_position'"):
        PagedCache(ARCHS["llama"]())


def test_a_twin_that_eager_cannot_run_warns_and_does_not_refuse(future_release, monkeypatch):
    """The check proves nothing then; refusing would lock the architecture out over the twin."""
    def unbuildable(text_config):
        raise TypeError("unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'")

    monkeypatch.setattr(self_check, "twin_config", unbuildable)
    with pytest.warns(versions.UntestedReleaseWarning, match=r"could not self-check the 'llama' "
                      r"architecture .*running it without the check"):
        PagedCache(ARCHS["llama"]())
    assert isinstance(self_check._verdicts[transformers.LlamaConfig], self_check.Inconclusive)
    with warnings.catch_warnings():
        warnings.simplefilter("error", versions.UntestedReleaseWarning)  # warned once per class
        PagedCache(ARCHS["llama"]())


def test_a_faked_newer_release_imports_warns_self_checks_and_generates():
    """The whole path in a fresh process: import under a faked 5.99, generate equals eager."""
    script = textwrap.dedent(f"""
        import warnings
        import torch, transformers
        transformers.__version__ = {FUTURE!r}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from paged_attention_ext.hf import PagedCache, self_check
        from paged_attention_ext.versions import UntestedReleaseWarning
        assert [w for w in caught if issubclass(w.category, UntestedReleaseWarning)], caught
        from paged_attention_ext.testing import ARCHS, random_pair
        config = ARCHS["qwen2"]()
        paged, reference = random_pair(config, reference_attention="eager")
        cache = PagedCache(paged.config, block_size=4)
        assert list(self_check._verdicts.values()) == [None], self_check._verdicts
        ids = torch.randint(1, {TINY["vocab_size"]}, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=6, do_sample=False)
            got = paged.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
        assert torch.equal(got, want)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_continuous_batching_self_checks_the_model(future_release):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from paged_attention_ext.hf import CB_ATTN_IMPLEMENTATION
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(ARCHS["llama"]()).eval()
    model.set_attn_implementation(CB_ATTN_IMPLEMENTATION)
    out = model.generate_batch(
        [[3, 4, 5, 6, 7], [8, 9]],
        generation_config=GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None,
                                           pad_token_id=0),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=16,
                                                            max_batch_tokens=16))
    assert [o.error for o in out.values()] == [None, None]
    assert self_check._verdicts == {type(model.config): None}
