"""The engine's packed forward: ``model(input_ids=[1, T], position_ids, paged_batch=...)``.

All sequences of a step are packed into one row; the attention function writes their K/V
with ``paged.write_kv`` and attends with the multi-token form. Logits must match the same
model with ``sdpa`` run on each sequence alone: prefill, a decode step, and a prefill
after a prefix-cache hit.
"""


import pytest
import torch
import transformers

from paged_attention_ext.block_manager import BlockSpaceManager
from paged_attention_ext.hf import PagedBatch
from paged_attention_ext.kv_cache import PagedKVCache
from paged_attention_ext.step_inputs import StepInputs, StepPlan
from paged_attention_ext.testing import random_pair

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2)
BLOCK_SIZE, NUM_BLOCKS = 4, 32


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "mistral"])
def engine(request):
    """Reference model, paged model, their KV pools and a prefix-caching block manager."""
    config = (transformers.LlamaConfig(**TINY) if request.param == "llama"
              else transformers.MistralConfig(**TINY, sliding_window=5))
    paged, reference = random_pair(config)
    kv = PagedKVCache(2, 2, 16, BLOCK_SIZE, torch.float32, num_blocks=NUM_BLOCKS)
    manager = BlockSpaceManager(NUM_BLOCKS, 0, BLOCK_SIZE, enable_prefix_caching=True)
    return reference, paged, kv, manager


def packed_forward(paged, kv, manager, seqs, tokens, starts, slots):
    """One packed step: ``tokens[i]`` of sequence ``seqs[i]`` begin at position ``starts[i]``."""
    tables = [manager.tables[s][0] for s in seqs]
    plan = StepPlan([[t.blocks for t in tables]], [slots], [t.num_tokens for t in tables],
                    [len(t) for t in tokens])
    batch = PagedBatch(kv, StepInputs.from_plan(plan, kv))
    ids = torch.tensor([sum(tokens, [])])
    positions = torch.tensor([[start + i for start, t in zip(starts, tokens) for i in range(len(t))]])
    with torch.no_grad():
        logits = paged(input_ids=ids, position_ids=positions, paged_batch=batch, use_cache=False).logits[0]
    return list(torch.split(logits, [len(t) for t in tokens]))


def reference_logits(reference, tokens):
    with torch.no_grad():
        return reference(input_ids=torch.tensor([tokens])).logits[0]


def test_prefill_decode_and_prefix_hit(engine):
    reference, paged, kv, manager = engine
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    slots = []
    for seq, prompt in enumerate(prompts):
        placed, _ = manager.allocate(seq, seq, prompt)
        slots += placed.slots[0]
    prefill = packed_forward(paged, kv, manager, [0, 1], prompts, [0, 0], slots)
    for prompt, got in zip(prompts, prefill):
        torch.testing.assert_close(got, reference_logits(reference, prompt), atol=1e-5, rtol=1e-5)

    # Decode: one new token per sequence, written at its next slot.
    new = [[40], [41]]
    slots = manager.append(0, new[0]).slots[0] + manager.append(1, new[1]).slots[0]
    decode = packed_forward(paged, kv, manager, [0, 1], new, [7, 3], slots)
    for prompt, token, got in zip(prompts, new, decode):
        expected = reference_logits(reference, prompt + token)[-1:]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # A prompt sharing sequence 0's first block: only the tokens after it are computed.
    prompt = prompts[0][:BLOCK_SIZE] + [30, 31]
    placed, num_cached = manager.allocate(2, 2, prompt)
    assert num_cached == BLOCK_SIZE
    [got] = packed_forward(paged, kv, manager, [2], [prompt[num_cached:]], [num_cached], placed.slots[0])
    torch.testing.assert_close(got, reference_logits(reference, prompt)[num_cached:], atol=1e-5, rtol=1e-5)
    manager.check_invariants()
    for group in list(manager.groups):
        manager.free_group(group)
