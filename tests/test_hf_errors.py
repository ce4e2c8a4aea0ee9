"""PagedCache and the paged_attention_ext attention refuse what they cannot do, and stay
usable after every exception.

Each refusal is checked for its exception type and message, and after it the same cache
(after ``reset()`` where the message asks for it) must still generate exactly what the
reference model generates.
"""


import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

from paged_attention_ext.block_allocator import NoFreeBlocksError
from paged_attention_ext.hf import PagedCache
from paged_attention_ext.hf.handoff import publish_padding_mask
from paged_attention_ext.testing import TINY as TINY_256
from paged_attention_ext.testing import random_pair

TINY = {**TINY_256, "max_position_embeddings": 64}  # small, so tests reach the position limit
BLOCK_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    """(sdpa reference, paged model) with the same weights and separate config objects."""
    paged, reference = random_pair(transformers.LlamaConfig(**TINY))
    return reference, paged


def prompts(rows=2, length=9, seed=0):
    ids = torch.randint(1, TINY["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, do_sample=False, **kwargs)


def assert_generates_like_reference(models, cache, max_new_tokens=6):
    """The cache (after whatever happened to it) still gives the reference's tokens."""
    reference, paged = models
    ids, mask = prompts(seed=11)
    expected = generate(reference, ids, mask, max_new_tokens=max_new_tokens)
    got = generate(paged, ids, mask, max_new_tokens=max_new_tokens, past_key_values=cache)
    assert torch.equal(got, expected)
    cache.manager.check_invariants()
    cache.reset()
    assert cache.memory_usage()["blocks_used"] == 0


# ---- item 1: the cache and the attention implementation must go together ---------------------

def test_cache_refuses_config_of_another_attention(models):
    reference, _ = models
    with pytest.raises(ValueError, match=r"this config says 'sdpa'.*from_config writes"):
        PagedCache(reference.config)


def test_shared_config_switched_by_a_second_model_is_refused():
    """from_config writes attn_implementation into the config object it gets: building an
    sdpa model from the same config switches the paged model to sdpa at run time."""
    config = transformers.LlamaConfig(**TINY)
    paged = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="paged_attention_ext")
    cache = PagedCache(paged.config)  # still paged_attention_ext here
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert paged.config._attn_implementation == "sdpa"  # the first model now runs sdpa
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match="this config says 'sdpa'"):
        generate(paged, ids, mask, max_new_tokens=3, past_key_values=cache)
    assert not cache.is_initialized  # refused before anything was stored
    with pytest.raises(ValueError, match="this config says 'sdpa'"):
        PagedCache(paged.config)


def test_cache_given_to_a_model_with_another_attention_is_refused(models):
    """The config check cannot see a mismatch when the cache was built from another config;
    the cache then finds out at the second update that the attention never read its batch."""
    reference, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match="attention of layer 0 did not read the paged cache"):
        generate(reference, ids, mask, max_new_tokens=3, past_key_values=cache)
    # Refused during the first forward: the cache is as new and works with the right model.
    assert not cache.is_initialized
    assert cache.memory_usage() == {"pool_bytes": 0, "used_bytes": 0, "blocks_used": 0,
                                    "block_references": 0}
    assert_generates_like_reference(models, cache)


def test_refused_on_a_later_forward_until_reset(models):
    """A one-layer model stores layer 0 only: the mismatch shows at the next forward's update."""
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1})
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    cache = PagedCache(transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1}))
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match="did not read the paged cache"):
        generate(sdpa, ids, mask, max_new_tokens=3, past_key_values=cache)
    with pytest.raises(RuntimeError, match="Call reset"):
        with torch.no_grad():
            sdpa(ids, past_key_values=cache)
    cache.reset()
    assert cache.memory_usage()["blocks_used"] == 0 and not cache.is_initialized


def test_paged_attention_without_paged_cache_is_refused(models):
    _, paged = models
    ids, mask = prompts()
    with pytest.raises(ValueError, match="has neither.*not a DynamicCache"):
        generate(paged, ids, mask, max_new_tokens=2)  # generate's default DynamicCache
    with pytest.raises(ValueError, match="has neither"):
        generate(paged, ids, mask, max_new_tokens=2, past_key_values=DynamicCache(config=paged.config))
    with torch.no_grad(), pytest.raises(ValueError, match="has neither"):
        paged(ids, use_cache=False)
    assert_generates_like_reference(models, PagedCache(paged.config, block_size=BLOCK_SIZE))


def test_attention_arguments_that_would_change_the_result_are_refused(models):
    _, paged = models
    ids, _ = prompts()
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with torch.no_grad(), pytest.raises(NotImplementedError, match=r"\['made_up_bias'\]"):
        paged(ids, past_key_values=cache, made_up_bias=torch.ones(1))
    # The forward stopped inside layer 0's attention: the next update says so, and as no
    # forward had finished, the cache is as new again.
    with torch.no_grad(), pytest.raises(RuntimeError, match="stopped after 1 of 2 layers"):
        paged(ids, past_key_values=cache)
    assert not cache.is_initialized
    custom = torch.ones(2, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="attention_mask tensor"):
        paged(ids, attention_mask=custom, past_key_values=PagedCache(paged.config))
    with torch.no_grad(), pytest.raises(NotImplementedError, match="output_attentions"):
        paged(ids, past_key_values=PagedCache(paged.config), output_attentions=True)
    assert_generates_like_reference(models, PagedCache(paged.config, block_size=BLOCK_SIZE))


def test_training_dropout_is_refused():
    config = transformers.LlamaConfig(**{**TINY, "attention_dropout": 0.5})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="paged_attention_ext")
    model.train()
    ids, _ = prompts()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="dropout 0.5"):
        model(ids, past_key_values=PagedCache(model.config))
    # With grad on, the ops refuse first: they have no backward.
    with pytest.raises(NotImplementedError, match="no backward"):
        model(ids, past_key_values=PagedCache(model.config))


@pytest.mark.parametrize("mask_function, allowed", [
    (causal_mask_function, True),
    (sliding_window_causal_mask_function(4), True),
    (bidirectional_mask_function, False),
    (chunked_causal_mask_function(8, torch.zeros(2, dtype=torch.long)), False),
])
def test_mask_function_accepts_causal_masks_only(mask_function, allowed):
    # The sizes transformers passes with a generate prefill of 20 tokens (longer than the
    # chunk, past the window).
    sizes = dict(batch_size=2, q_length=20, kv_length=20, q_offset=0, kv_offset=0,
                 config=transformers.LlamaConfig(**{**TINY, "sliding_window": 4}))
    padding = torch.ones(2, 20, dtype=torch.bool)
    if allowed:
        assert publish_padding_mask(attention_mask=padding, mask_function=mask_function, **sizes) is None
    else:
        with pytest.raises(NotImplementedError, match="asked for another mask"):
            publish_padding_mask(attention_mask=padding, mask_function=mask_function, **sizes)


# ---- item 5: nothing half-initialised after an exception --------------------------------------

def test_failed_prefill_leaves_the_cache_as_new(models):
    _, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, num_blocks=3)  # 2 rows x 9 tokens: 6
    ids, mask = prompts()
    with pytest.raises(NoFreeBlocksError, match=r"raise PagedCache\(num_blocks=\.\.\.\)"):
        generate(paged, ids, mask, max_new_tokens=2, past_key_values=cache)
    assert cache.memory_usage() == {"pool_bytes": 0, "used_bytes": 0, "blocks_used": 0,
                                    "block_references": 0}
    assert not cache.is_initialized and cache.get_seq_length() == 0
    cache.reset()
    # The same cache object runs a generation that fits.
    small = PagedCache(paged.config, block_size=BLOCK_SIZE, num_blocks=12)
    assert_generates_like_reference(models, small)
    cache.num_blocks = 12
    assert_generates_like_reference(models, cache)


def test_pool_exhausted_while_decoding(models):
    """9 prompt tokens per row take 3 blocks (6 of 7); the 4th token generated needs a 4th
    block in each row, and only one is free."""
    _, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, num_blocks=7, enable_prefix_caching=False)
    ids, mask = prompts()
    with pytest.raises(NoFreeBlocksError, match=r"needs 2 more blocks, the fixed pool \(num_blocks=7\) "
                                                r"has 1 free"):
        generate(paged, ids, mask, max_new_tokens=6, past_key_values=cache)
    # Refused before any change: the state is consistent and readable.
    cache.manager.check_invariants()
    usage = cache.memory_usage()
    assert usage["blocks_used"] == usage["block_references"] == 6
    assert cache.get_seq_length() == 9 + 3  # the refused forward added nothing
    cache.reset()
    assert cache.memory_usage()["blocks_used"] == 0
    cache.num_blocks = 8
    assert_generates_like_reference(models, cache)


def test_exception_after_the_last_update_leaves_a_consistent_cache(models):
    reference, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    ids, mask = prompts()
    mlp = paged.model.layers[1].mlp
    calls = {"n": 0}

    def failing(module, args):
        calls["n"] += 1
        if calls["n"] == 3:  # third forward (second decode step), after layer 1's update
            raise RuntimeError("injected")

    handle = mlp.register_forward_pre_hook(failing)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            generate(paged, ids, mask, max_new_tokens=5, past_key_values=cache)
    finally:
        handle.remove()
    assert cache.memory_usage()["blocks_used"] > 0  # readable
    cache.manager.check_invariants()
    # The forward that failed had stored both layers: the cache is consistent; a forward
    # stopped before its last update is refused (next test). Here the caller decides:
    cache.reset()
    assert_generates_like_reference(models, cache)


def test_forward_stopped_between_layers_is_refused_until_reset(models):
    _, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    ids, mask = prompts()
    layer1 = paged.model.layers[1]
    calls = {"n": 0}

    def failing(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # second forward, after layer 0 stored its K/V
            raise RuntimeError("injected")

    handle = layer1.register_forward_pre_hook(failing, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            generate(paged, ids, mask, max_new_tokens=5, past_key_values=cache)
    finally:
        handle.remove()
    step = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad(), pytest.raises(RuntimeError, match="stopped after 1 of 2 layers.*Call reset"):
        paged(step, past_key_values=cache)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Call reset"):
        paged(step, past_key_values=cache)  # still refused
    assert cache.memory_usage()["blocks_used"] > 0
    cache.reset()
    assert_generates_like_reference(models, cache)


# ---- item 6: the default pool's limit ------------------------------------------------------

def test_generating_past_max_position_embeddings(models):
    reference, paged = models
    ids, mask = prompts(length=60)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match=r"row 0 would hold 65 tokens, more than 64 \(the config's "
                                         r"max_position_embeddings\).*max_seq_len"):
        generate(paged, ids, mask, max_new_tokens=8, past_key_values=cache)
    cache.manager.check_invariants()
    cache.reset()
    # Lifted as the message says: identical to the reference past the limit.
    longer = PagedCache(paged.config, block_size=BLOCK_SIZE, max_seq_len=68)
    expected = generate(reference, ids, mask, max_new_tokens=8)
    assert torch.equal(generate(paged, ids, mask, max_new_tokens=8, past_key_values=longer), expected)
    # The last generated token is never fed back: 60 + 9 stored tokens.
    with pytest.raises(ValueError, match=r"would hold 69 tokens, more than 68 \(max_seq_len\)"):
        generate(paged, ids, mask, max_new_tokens=10, past_key_values=PagedCache(paged.config, max_seq_len=68))


# ---- item 7: constructor arguments ---------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(block_size=0), ValueError, "block_size must be >= 1, got 0"),
    (dict(block_size=-4), ValueError, "block_size must be >= 1"),
    (dict(block_size=4.0), TypeError, "block_size must be an int"),
    (dict(block_size=True), TypeError, "block_size must be an int"),
    (dict(num_blocks=0), ValueError, "num_blocks must be >= 1"),
    (dict(num_blocks="8"), TypeError, "num_blocks must be an int or None"),
    (dict(max_seq_len=0), ValueError, "max_seq_len must be >= 1"),
    (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching must be a bool"),
])
def test_paged_cache_arguments(models, kwargs, error, match):
    _, paged = models
    with pytest.raises(error, match=match):
        PagedCache(paged.config, **kwargs)


def test_paged_cache_needs_a_config():
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig"):
        PagedCache({"num_hidden_layers": 2})


def test_a_second_generate_on_a_used_cache_says_how_to_reuse_it(models):
    """generate drops the prompt tokens its cache already holds: a prompt no longer than
    that leaves no new token, which is reported as the earlier call's cache, with the fix."""
    _, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    ids, mask = prompts()
    generate(paged, ids, mask, max_new_tokens=3, past_key_values=cache)  # 9 + 2 stored
    with pytest.raises(ValueError, match=r"no new tokens: the cache passed to generate already "
                                         r"holds 11 positions per row from an earlier call\. Call "
                                         r"cache\.reset\(\)"):
        generate(paged, ids[:, :5], mask[:, :5], max_new_tokens=3, past_key_values=cache)
    cache.reset()
    assert_generates_like_reference(models, cache)
