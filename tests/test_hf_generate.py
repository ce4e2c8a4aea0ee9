"""``model.generate`` with PagedCache matches transformers' own attention and cache.

Tiny randomly initialised fp32 models of several architectures, each built twice with
the same weights: once with ``paged_attention_ext`` and a :class:`PagedCache`, once with
``sdpa`` (``eager`` for Gemma2, whose soft cap sdpa ignores) and the default DynamicCache.
Outputs must be token-identical, the block manager's invariants must hold, identical
rows must share their prompt blocks, and resetting the cache must free every block.
"""

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache

from paged_attention_ext.hf import PagedCache
from paged_attention_ext.testing import random_pair

import hf_prompts

# initializer_range 0.2 (not 0.02) makes scores large enough for the soft cap and the
# window to change the outputs, so the comparisons would catch them being ignored.
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
WINDOW = 6  # shorter than every test's prompt + generated length
ARCHS = {
    "llama": (transformers.LlamaConfig, {}, "sdpa"),
    # GQA (4 query heads per KV head); layer 0 full, layer 1 sliding through Qwen2's
    # use_sliding_window / max_window_layers.
    "qwen2": (transformers.Qwen2Config, dict(num_attention_heads=8, use_sliding_window=True,
                                             sliding_window=WINDOW, max_window_layers=1), "sdpa"),
    "mistral": (transformers.MistralConfig, dict(sliding_window=WINDOW), "sdpa"),
    # Alternating sliding/full layers, attention and final soft caps, query_pre_attn_scalar.
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, sliding_window=WINDOW,
                                               attn_logit_softcapping=1.0,
                                               final_logit_softcapping=3.0,
                                               query_pre_attn_scalar=24), "eager"),
    "phi3": (transformers.Phi3Config, dict(num_key_value_heads=1), "sdpa"),  # MQA
}
BLOCK_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def build_pair(arch: str):
    """(reference model, paged model) with the same random weights."""
    config_class, overrides, reference_impl = ARCHS[arch]
    config = config_class(**{**TINY, **overrides})
    paged, reference = random_pair(config, reference_attention=reference_impl)
    return reference, paged


@pytest.fixture(scope="module", params=sorted(ARCHS))
def models(request):
    return build_pair(request.param)


@pytest.fixture(scope="module")
def llama():
    return build_pair("llama")


def left_padded(lengths, seed=0):
    return hf_prompts.left_padded(lengths, seed, vocab_size=TINY["vocab_size"])


def generate_both(models, ids, mask, seed=None, cascade_min_saved_tokens=None, **kwargs):
    """Reference and paged outputs of the same generate call, plus the PagedCache
    (``cascade_min_saved_tokens``: as PagedCache takes it; None: its default)."""
    reference, paged = models
    outputs = []
    extra_cache = {} if cascade_min_saved_tokens is None else dict(
        cascade_min_saved_tokens=cascade_min_saved_tokens)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, **extra_cache)
    for model, extra in ((reference, {}), (paged, {"past_key_values": cache})):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs, **extra))
    return outputs[0], outputs[1], cache


def check_no_leaks(cache: PagedCache, rows: int):
    manager = cache.manager
    manager.check_invariants()  # every block's count equals its table references
    assert len(manager.tables) == rows == len(cache.rows)
    cache.reset()
    assert manager.device.num_used_blocks == 0


def shared_prefix_blocks(cache: PagedCache, rows):
    """How many leading blocks these rows' tables have in common."""
    tables = [cache.manager.tables[cache.rows[r]][0].blocks for r in rows]
    common = 0
    while all(len(t) > common and t[common] == tables[0][common] for t in tables):
        common += 1
    return common


def test_greedy_left_padded_batch(models):
    ids, mask = left_padded([13, 7, 10])
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=14, do_sample=False)
    assert torch.equal(got, expected)
    check_no_leaks(cache, rows=3)


def test_sampling_rows_share_prompt_blocks(models):
    ids, mask = left_padded([11, 9], seed=1)
    expected, got, cache = generate_both(models, ids, mask, seed=7, max_new_tokens=12,
                                         do_sample=True, num_return_sequences=4)
    assert torch.equal(got, expected)
    # generate feeds each prompt once per returned sequence; the full blocks before the
    # block holding the last prompt token are stored once per prompt.
    # Every row after a prompt's first took those blocks from the prefix cache.
    assert cache.manager.device.cache_hits == sum(3 * ((length - 1) // BLOCK_SIZE) for length in (11, 9))
    if cache.manager.tables[cache.rows[0]][0].sliding_window is None:
        # Still shared at the end (Mistral's only KV group slides: it has freed them by now).
        for prompt, length in enumerate((11, 9)):
            rows = range(prompt * 4, prompt * 4 + 4)
            assert shared_prefix_blocks(cache, rows) == (length - 1) // BLOCK_SIZE
        usage = cache.memory_usage()
        assert usage["blocks_used"] < usage["block_references"]
    check_no_leaks(cache, rows=8)


def test_beam_search(models):
    ids, mask = left_padded([10, 6], seed=2)
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=10, do_sample=False,
                                         num_beams=4, num_return_sequences=3)
    assert torch.equal(got, expected)
    usage = cache.memory_usage()
    assert usage["blocks_used"] < usage["block_references"]  # beams share forked blocks
    check_no_leaks(cache, rows=8)


@pytest.mark.parametrize("search", ["samples", "beams"])
def test_cascade_attention_gives_identical_tokens(models, search):
    # Every decode step reads the shared prompt blocks once per prompt (samples) or per
    # request's beams (forked, their sharing changing each step).
    ids, mask = left_padded([13, 10], seed=3)
    kwargs = (dict(do_sample=True, num_return_sequences=4) if search == "samples"
              else dict(do_sample=False, num_beams=4, num_return_sequences=2))
    expected, got, cache = generate_both(models, ids, mask, seed=5, max_new_tokens=10,
                                         cascade_min_saved_tokens=1, **kwargs)
    assert torch.equal(got, expected)
    sliding_only = all(g.sliding_window is not None for g in cache.kv_groups.groups)
    assert (cache.cascade_forwards == 0) == sliding_only  # Mistral: every layer has a window
    check_no_leaks(cache, rows=8)


def test_chunked_prefill(llama):
    ids, mask = left_padded([12, 3, 9], seed=5)  # row 1's first chunks are all padding
    expected, got, cache = generate_both(llama, ids, mask, max_new_tokens=6, do_sample=False,
                                         prefill_chunk_size=4)
    assert torch.equal(got, expected)
    check_no_leaks(cache, rows=3)


def test_fixed_pool_without_prefix_caching(llama):
    reference, paged = llama
    ids, mask = left_padded([10], seed=3)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, num_blocks=40, enable_prefix_caching=False)
    outputs = []
    for model, extra in ((reference, {}), (paged, {"past_key_values": cache})):
        torch.manual_seed(3)
        outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                      num_return_sequences=3, pad_token_id=0, **extra))
    assert torch.equal(outputs[1], outputs[0])
    usage = cache.memory_usage()
    assert usage["pool_bytes"] == 40 * cache.kv.block_bytes
    assert usage["blocks_used"] == usage["block_references"] == 3 * 5  # 18 tokens per row
    check_no_leaks(cache, rows=3)


def test_reorder_forks_then_copies_on_write(llama):
    reference, paged = llama
    ids = torch.randint(1, TINY["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(4))
    cache, dynamic = PagedCache(paged.config, block_size=BLOCK_SIZE), DynamicCache(config=reference.config)
    with torch.no_grad():
        paged(ids, past_key_values=cache)
        reference(ids, past_key_values=dynamic)
        used = cache.memory_usage()["blocks_used"]
        beam_idx = torch.tensor([2, 0, 2])
        cache.reorder_cache(beam_idx)
        dynamic.reorder_cache(beam_idx)
        tables = [list(cache.manager.tables[s][0].blocks) for s in cache.rows]
        assert tables[0] == tables[2]  # forked, nothing copied
        assert cache.memory_usage()["blocks_used"] == used - 3  # old row 1 freed
        step = torch.tensor([[5], [6], [7]])
        got = paged(step, past_key_values=cache).logits
        expected = reference(step, past_key_values=dynamic).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    after = [cache.manager.tables[s][0].blocks for s in cache.rows]
    assert after[0][:2] == after[2][:2] == tables[0][:2]  # full blocks still shared
    assert after[0][2] != after[2][2]  # the shared partial block was copied on write
    assert cache.memory_usage()["blocks_used"] == used - 3 + 1
    check_no_leaks(cache, rows=3)


def test_unsupported_uses_fail_clearly(llama):
    _, paged = llama
    ids = torch.randint(1, TINY["vocab_size"], (2, 5))
    right_padded = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        with pytest.raises(ValueError, match="left padding only"):
            paged(ids, attention_mask=right_padded, past_key_values=PagedCache(paged.config))
        with pytest.raises(ValueError, match="has neither"):
            paged(ids, use_cache=False)
    with pytest.raises(TypeError, match="tokens_to_remove must be an int"):
        PagedCache(paged.config).crop(1.5)
    chunked = copy.deepcopy(paged.config)
    chunked.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        PagedCache(chunked)
