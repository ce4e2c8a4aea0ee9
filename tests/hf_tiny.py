"""The tiny configurations the Hugging Face tests (and bench/bench_fp8_accuracy.py) build
random models from, and their left-padded prompts."""

import torch
import transformers

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.2)
# Three architectures over TINY: Llama (GQA 4/2), GQA 8/2 Qwen2 whose layer 1 slides over a
# window of 6, Mistral sliding every layer.
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**{**TINY, "num_attention_heads": 8},
                                              use_sliding_window=True, sliding_window=6,
                                              max_window_layers=1),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=6),
}


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
