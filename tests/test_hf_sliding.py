"""PagedCache on sliding-window models: each KV group has its own block tables,
the sliding groups keep only their window, and generate's tokens equal eager's over
contexts many windows long (greedy, sampled, beams)."""

import pytest
import torch
import transformers

from paged_attention_ext.block_table import NULL_BLOCK
from paged_attention_ext.hf import PagedCache
from paged_attention_ext.testing import random_pair

from hf_prompts import left_padded

WINDOW = 5
BLOCK_SIZE = 4
COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=0, initializer_range=0.2)
SHAPES = {
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, num_hidden_layers=6, head_dim=16,
                                                    sliding_window=WINDOW),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, num_hidden_layers=2, head_dim=16,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=WINDOW),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(SHAPES))
def models(request):
    paged, reference = random_pair(SHAPES[request.param](), reference_attention="eager")
    return reference, paged


def generate_both(models, ids, mask, **kwargs):
    reference, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    torch.manual_seed(3)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)
    torch.manual_seed(3)
    with torch.no_grad():
        got = paged.generate(ids, attention_mask=mask, pad_token_id=0, past_key_values=cache, **kwargs)
    return expected, got, cache


@pytest.mark.parametrize("kwargs", [dict(do_sample=False),
                                    dict(do_sample=True, num_return_sequences=3),
                                    dict(do_sample=False, num_beams=3, num_return_sequences=2)],
                         ids=["greedy", "sampled", "beams"])
def test_tokens_equal_eager_over_many_windows(models, kwargs):
    ids, mask = left_padded([9, 14], seed=4, vocab_size=COMMON["vocab_size"])
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=24, **kwargs)
    assert torch.equal(got, expected)
    cache.manager.check_invariants()


def test_sliding_groups_hold_only_their_window(models):
    ids, mask = left_padded([9, 14], seed=4, vocab_size=COMMON["vocab_size"])
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=40, do_sample=False)
    assert torch.equal(got, expected)
    manager = cache.manager
    windows = cache.kv_groups.windows
    for seq_id in cache.rows:
        tables = manager.tables[seq_id]
        length = tables[0].num_tokens
        for table, window in zip(tables, windows):
            if window is None:
                assert NULL_BLOCK not in table.blocks
            else:  # the window of the last two tokens, and nothing before it
                assert len(table.live_blocks) <= -(-(WINDOW + 1) // BLOCK_SIZE) + 1
                assert table.blocks.count(NULL_BLOCK) >= -(-length // BLOCK_SIZE) - 3
    # Against one table for every layer: each row would hold all its blocks in every group.
    all_blocks = sum(-(-manager.num_tokens(s) // BLOCK_SIZE) for s in cache.rows) * len(windows)
    assert cache.memory_usage()["blocks_used"] < 0.7 * all_blocks


def test_prompt_lookup_crops_sliding_tables(models):
    """Prompt-lookup decoding verifies candidates in multi-token forwards and crops the
    rejected ones: the sliding tables still hold the kept tokens' windows."""
    reference, paged = models
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6]])
    mask = torch.ones_like(ids)
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=30, do_sample=False,
                                         prompt_lookup_num_tokens=3)
    assert torch.equal(got, expected)
    cache.manager.check_invariants()
