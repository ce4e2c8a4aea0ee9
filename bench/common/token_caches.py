"""Random caches of the per-token formats for speed benchmarks: stored values and scales of
the size the kernels meet (the kernels' speed does not depend on the values)."""

import torch

from paged_attention_ext.token_quantization import scale_shape


def random_cache(cache_dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    """bf16 Gaussians, int8 in [-127, 127] or int4 bytes (two values each) of ``shape``."""
    if cache_dtype == torch.bfloat16:
        return torch.randn(shape, generator=gen, dtype=torch.bfloat16)
    if cache_dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def random_scales(cache_dtype: torch.dtype, num_blocks: int, kv_heads: int, block_size: int,
                  gen: torch.Generator) -> torch.Tensor:
    """Scales of the size Gaussian rows of 128 get: int8 amax / 127, int4 (range / 15, min)."""
    scales = torch.empty(scale_shape(cache_dtype, num_blocks, kv_heads, block_size))
    if cache_dtype == torch.int8:
        return scales.uniform_(2.0 / 127, 3.5 / 127, generator=gen)
    scales[..., 0].uniform_(4.0 / 15, 7.0 / 15, generator=gen)
    scales[..., 1].uniform_(-3.5, -2.0, generator=gen)
    return scales
