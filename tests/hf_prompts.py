"""Left-padded prompt batches for the Hugging Face tests (the tiny models they run:
:mod:`paged_attention_ext.testing`), and the greedy decode loop of one's own around a compiled
forward."""

import torch

from paged_attention_ext.testing import TINY


def left_padded(lengths, seed=0, vocab_size=TINY["vocab_size"]):
    """A left-padded batch of random prompts with these lengths (token ids 1..vocab_size-1)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab_size, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def greedy_compiled_loop(paged, cache, step, ids, mask, new_tokens, prepared=None, stepped=None):
    """Greedy tokens of ``paged``: an eager prefill into ``cache`` (a CompiledPagedCache), then
    ``new_tokens`` steps of ``step`` (the compiled forward), each after ``cache.prepare``.
    ``prepared(tokens)`` / ``stepped(tokens)`` run before and after each compiled step. Returns
    the prompt and every chosen token (the last chosen from the last step's logits)."""
    tokens, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = paged(ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache).logits  # eager prefill
        for _ in range(new_tokens):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
            positions = positions[:, -1:] + 1
            cache.prepare(ids.shape[0], 1, mask, dtype=paged.dtype, device=paged.device)
            if prepared is not None:
                prepared(tokens)
            logits = step(next_token, position_ids=positions, past_key_values=cache).logits
            if stepped is not None:
                stepped(tokens)
    return tokens
