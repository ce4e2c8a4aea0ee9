"""The tiny Llama configuration the Hugging Face tests build random models from, and their
left-padded prompts."""

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.2)


def left_padded(lengths, seed=0):
    """A left-padded batch of random prompts with these lengths."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, TINY["vocab_size"], (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask
