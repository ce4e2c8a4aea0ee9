"""Left-padded prompt batches for the Hugging Face tests (the tiny models they run:
:mod:`paged_attention_ext.testing`)."""

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
