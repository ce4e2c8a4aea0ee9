"""Assisted and prompt-lookup decoding with a PagedCache: the rejected candidates' K/V are
cropped (whole blocks freed, the partial one kept) and the tokens equal the default cache's."""

import pytest
import torch
import transformers

from paged_attention_ext.block_manager import BlockSpaceManager
from paged_attention_ext.hf import PagedCache
from paged_attention_ext.testing import TINY, random_pair

BLOCK_SIZE = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    paged, reference = random_pair(transformers.LlamaConfig(**TINY))
    # A weaker assistant (other weights, sdpa): some candidates are rejected, so crop runs.
    _, assistant = random_pair(transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1}), seed=1)
    return reference, paged, assistant


def prompt(seed=0, length=11):
    # Repeated n-grams give prompt-lookup decoding candidates to propose.
    ids = torch.randint(1, TINY["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, ids[:, :6], ids], dim=1)


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_candidate_decoding_equals_the_default_cache(models, mode, monkeypatch):
    reference, paged, assistant = models
    extra = ({"assistant_model": assistant} if mode == "assistant"
             else {"prompt_lookup_num_tokens": 3})
    ids = prompt()
    crops = []
    truncate = BlockSpaceManager.truncate
    monkeypatch.setattr(BlockSpaceManager, "truncate",
                        lambda self, seq, n: crops.append((seq, n)) or truncate(self, seq, n))
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=24, do_sample=False, **extra)
        cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
        got = paged.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache, **extra)
    assert torch.equal(got, want)
    assert crops, "no candidate was rejected: the test would not exercise crop"
    cache.manager.check_invariants()
    # Every block holds tokens; the last one may be partial (waste under one block).
    held = cache.manager.num_tokens(cache.rows[0])
    assert len(cache.manager.block_ids(cache.rows[0], 0)) == -(-held // BLOCK_SIZE)


def test_crop_frees_whole_blocks_and_keeps_the_partial_one(models):
    _, paged, _ = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with torch.no_grad():
        paged(prompt(length=8), past_key_values=cache)  # 22 tokens: 6 blocks
    seq = cache.rows[0]
    assert cache.manager.num_tokens(seq) == 22 and len(cache.manager.block_ids(seq, 0)) == 6
    cache.crop(-6)
    assert cache.get_seq_length() == 16 and cache.manager.num_tokens(seq) == 16
    assert len(cache.manager.block_ids(seq, 0)) == 4
    cache.crop(12)  # the older form: the length to keep
    assert cache.get_seq_length() == 12 and len(cache.manager.block_ids(seq, 0)) == 3
    cache.crop(0)
    assert cache.get_seq_length() == 12
    with pytest.raises(ValueError, match="cannot remove 13"):
        cache.crop(-13)
    assert cache.get_seq_length() == 12
    cache.manager.check_invariants()


def test_a_cropped_prompt_block_leaves_the_prefix_cache(models):
    """The block a crop leaves partial will have its free slots written by the next tokens,
    so it must not be served to another prompt as the old full block."""
    _, paged, _ = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with torch.no_grad():
        paged(prompt(length=8), past_key_values=cache)  # 22 tokens
    manager = cache.manager
    seq = cache.rows[0]
    named = manager.named_blocks()
    partial = manager.block_ids(seq, 0)[2]
    assert partial in named
    cache.crop(-12)  # 10 tokens: block 2 becomes partial
    assert partial not in manager.named_blocks()
    assert all(b in manager.named_blocks() for b in manager.block_ids(seq, 0)[:2])
    manager.check_invariants()
