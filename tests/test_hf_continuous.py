"""transformers' continuous batching with ``paged|paged_attention_ext``.

``model.generate_batch`` on tiny random models generates exactly the greedy tokens of
``paged|sdpa`` (transformers' own gather-then-SDPA path on the same cache), through
chunked prefill, mixed prefill/decode batches and prefix sharing; the ops really run
(counted); what the ops cannot address fails the requests with our error instead of
producing tokens.
"""

import re
import types
from pathlib import Path

import pytest
import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from paged_attention_ext import attention_metadata, ops, reference
from paged_attention_ext.hf import ATTN_IMPLEMENTATION, CB_ATTN_IMPLEMENTATION
from paged_attention_ext.hf import continuous_batching as cb
from paged_attention_ext.testing import TINY
from paged_attention_ext.versions import release

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 8
# Lengths 1, PAGE - 1, PAGE, PAGE + 1; one prompt longer than a batch (chunked prefill);
# two prompts sharing 3 full pages (prefix sharing: a fresh request with cached keys).
SHARED = list(range(3, 3 + 3 * PAGE))
PROMPT_LENGTHS = (1, PAGE - 1, PAGE, PAGE + 1, 45)


def prompts(vocab_size):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    return rows + [SHARED + [5, 6], SHARED + [7]]


def cb_config(**overrides):
    # max_batch_tokens < the longest prompt: chunked prefill, and batches that mix
    # prefill chunks with decode rows.
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=96, max_batch_tokens=32, **overrides)


def generate(model, implementation, rows, max_new_tokens=5, sampling=None, **cb_overrides):
    model.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling is not None,
                              eos_token_id=None, pad_token_id=0, **(sampling or {}))
    out = model.generate_batch(rows, generation_config=config,
                               continuous_batching_config=cb_config(**cb_overrides))
    return [out[request_id] for request_id in sorted(out)]  # forks included


@pytest.fixture(params=["kernel", "reference"])
def counted_ops(request, monkeypatch):
    """The ops the attention function calls (the kernels, or the pure-PyTorch reference,
    which checks the cache mapping independently of the kernels), with a call count."""
    backend = ops if request.param == "kernel" else reference
    calls = {"attention": 0}

    def attention(*args):
        calls["attention"] += 1
        return backend.attention(*args)

    counted = types.SimpleNamespace(attention=attention, write_kv=backend.write_kv)
    monkeypatch.setattr(cb, "ops", counted)
    monkeypatch.setattr(attention_metadata, "ops", counted)  # the forward's AttentionMetadata.run
    return calls


ARCHITECTURES = {
    # GQA 4:2
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)),
    # MQA 4:1, biased projections
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**TINY, "num_key_value_heads": 1}, use_sliding_window=False)),
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_greedy_tokens_equal_paged_sdpa(architecture, counted_ops, monkeypatch):
    torch.manual_seed(0)
    model = ARCHITECTURES[architecture]().eval()
    rows = prompts(model.config.vocab_size)
    want = generate(model, "sdpa", rows)
    prefix_hits = []
    search = PagedAttentionCache.search_prefix_match
    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", lambda self, *args: (
        prefix_hits.append(search(self, *args)) or prefix_hits[-1]))
    got = generate(model, CB_ATTN_IMPLEMENTATION, rows)
    assert max(prefix_hits) >= PAGE  # a request started on another's cached pages
    assert [o.error for o in got] == [None] * len(rows)
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    assert all(len(o.generated_tokens) == 5 for o in got)
    assert counted_ops["attention"] > 0


def test_sampled_forks_equal_paged_sdpa(counted_ops):
    """num_return_sequences forks each request in transformers' cache (shared full pages,
    copied partial ones); seeded sampling then draws the same tokens as paged|sdpa."""
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]().eval()
    rows = prompts(model.config.vocab_size)
    sampling = dict(num_return_sequences=2, top_k=0)
    want = generate(model, "sdpa", rows, sampling=sampling, seed=3)
    got = generate(model, CB_ATTN_IMPLEMENTATION, rows, sampling=sampling, seed=3)
    assert [o.error for o in got] == [None] * 2 * len(rows)
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    assert len({tuple(o.generated_tokens) for o in got}) > len(rows)  # forks drew their own


SLIDING = {
    # Every layer sliding: transformers' sliding allocator (a ring buffer) only.
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=6)),
    # Sliding and full layers, attention sinks (s_aux).
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    # 5 sliding : 1 full.
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 6}, head_dim=16, sliding_window=6)),
    # 3 sliding : 1 full, QK norms.
    "olmo3": lambda: transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
        **{**TINY, "num_hidden_layers": 4}, sliding_window=6)),
    "exaone4": lambda: transformers.Exaone4ForCausalLM(transformers.Exaone4Config(
        **{**TINY, "num_hidden_layers": 4}, sliding_window=6)),
}


@pytest.mark.parametrize("architecture", sorted(SLIDING))
def test_sliding_window_models_equal_generate(architecture, counted_ops):
    """Sliding-window layers live in transformers' ring buffer: read back through its cache
    and attended with the window (sinks applied), continuous batching gives the greedy
    tokens of eager ``generate`` per request, over prompts and outputs several windows long."""
    torch.manual_seed(0)
    model = SLIDING[architecture]().eval()
    rows = prompts(model.config.vocab_size)
    got = generate(model, CB_ATTN_IMPLEMENTATION, rows, max_new_tokens=12)
    assert [o.error for o in got] == [None] * len(rows)
    model.set_attn_implementation("eager")
    for row, out in zip(rows, got):
        with torch.no_grad():
            want = model.generate(torch.tensor([row]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(row):].tolist()
        assert out.generated_tokens == want
    assert counted_ops["attention"] > 0


MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
           num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=48,
           n_group=1, topk_group=1)


def test_latent_attention_model_equals_paged_sdpa_or_is_refused():
    """A DeepSeek-V3-like model (MLA): from transformers 5.24 continuous batching hands the
    attention the expanded K/V and the tokens equal paged|sdpa's; before, its pages cannot
    hold them and every request fails with our refusal (never other tokens)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY, **MLA, "num_key_value_heads": 4})).eval()
    rows = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13]]
    got = generate(model, CB_ATTN_IMPLEMENTATION, rows, max_new_tokens=4)
    if release(transformers.__version__) >= (5, 24):
        want = generate(model, "paged|sdpa", rows, max_new_tokens=4)
        assert [o.error for o in got] == [None, None]
        assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    else:
        assert all("needs transformers 5.24 or later" in o.error for o in got), got


def test_sliding_window_of_another_length_is_refused():
    allocator = types.SimpleNamespace(sliding_window=8, supports_block_table=False)
    cache = types.SimpleNamespace(layer_to_allocator={0: allocator})
    layer = types.SimpleNamespace(layer_idx=0)
    with pytest.raises(NotImplementedError, match="window 8"):
        cb._layer_allocator(cache, layer, 4)
    full = types.SimpleNamespace(supports_block_table=True)
    with pytest.raises(NotImplementedError, match="full-attention"):
        cb._layer_allocator(types.SimpleNamespace(layer_to_allocator={0: full}), layer, 4)


def test_outside_continuous_batching_raises():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.set_attn_implementation(CB_ATTN_IMPLEMENTATION)
    # From transformers 5.19 the name is generate's too, whose error names the PagedCache.
    expected = ("attends over a PagedCache or a PagedBatch" if CB_ATTN_IMPLEMENTATION == ATTN_IMPLEMENTATION
                else "runs inside transformers' continuous batching")
    with pytest.raises(ValueError, match=expected):
        model(torch.tensor([[1, 2, 3]]))


def test_layout_refuses_indices_block_tables_cannot_reproduce():
    cu = torch.tensor([0, 6], dtype=torch.int32)
    rows = torch.arange(16, 22)  # pages 4 and 5 (page size 4): contiguous, accepted
    layout = cb.derive_layout(rows, rows, cu, cu, 4)
    assert layout.attention.block_tables.tolist() == [[4, 5]]
    assert layout.attention.seq_lens.tolist() == [6]
    # Padded batches (compiled / CUDA-graph continuous batching): empty fake sequences and
    # trailing query rows that write to the trash page; attention skips both.
    padded_cu = torch.tensor([0, 6, 6, 6], dtype=torch.int32)
    trash = torch.tensor([99, 99])
    layout = cb.derive_layout(torch.cat([rows, trash]), torch.cat([rows, trash]), padded_cu,
                              padded_cu, 4)
    assert layout.attention.seq_lens.tolist() == [6, 0, 0] and layout.num_query_tokens == 6
    assert layout.attention.query_start_loc.tolist() == [0, 6, 6, 6]
    scattered = torch.tensor([16, 17, 18, 19, 30, 21])  # token 4 not at its page's offset 0
    with pytest.raises(ValueError, match="not page-contiguous"):
        cb.derive_layout(scattered, scattered, cu, cu, 4)
    with pytest.raises(ValueError, match="empty read index with cached keys"):
        cb.derive_layout(torch.empty(0, dtype=torch.int64), rows[:2], torch.tensor([0, 2]), cu, 4)


def test_arguments_that_would_change_the_result_are_refused():
    layer = torch.nn.Module()
    layer.layer_idx = 0
    cb._refuse_unsupported(layer, None, 0.0, None, {"position_ids": torch.zeros(1),
                                                    "output_attentions": False, "s_aux": None})
    for mask, dropout, block_table, kwargs, match in [
            (torch.zeros(1), 0.0, None, {}, "attention mask"),
            (None, 0.1, None, {}, "dropout"),
            (None, 0.0, torch.zeros(1, 1, 1), {}, "decode block_table"),
            (None, 0.0, None, {"s_aux": torch.zeros(4)}, r"\['s_aux'\]"),
            (None, 0.0, None, {"output_attentions": True}, "output_attentions")]:
        with pytest.raises(NotImplementedError, match=match):
            cb._refuse_unsupported(layer, mask, dropout, block_table, kwargs)


def test_integrations_doc_examples_run():
    """docs/integrations.md's continuous-batching examples run as written (the tensor-parallel
    one needs torchrun: tests/test_hf_tensor_parallel.py runs the same steps)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    section = text.split("## transformers' continuous batching")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3
    exec(compile("".join(blocks), "integrations.md example", "exec"), {})
