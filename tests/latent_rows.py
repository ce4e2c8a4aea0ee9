"""MLA latent caches for the op tests: 576-wide ``[latent | rotary_key]`` rows on one KV
head, written by ``paged.write_latent`` (the CPU kernel; or the writer a test names), in
random block order, with garbage in every byte and scale no token owns and table entries
past a sequence's blocks that name no block, so a kernel that reads where it should not
shows."""

from typing import Callable, Optional, Sequence, Tuple

import torch

import paged_attention_ext as pa
from paged_attention_ext import token_quantization as tq

LORA, ROPE = 512, 64
WIDTH = LORA + ROPE


def latent_cache(num_blocks: int, block_size: int, dtype: torch.dtype, nhd: bool = False,
                 gen: Optional[torch.Generator] = None
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A latent cache [num_blocks, 1, block_size, row bytes] (an NHD view when ``nhd``) and
    its scale tensor (None for a float cache), every byte garbage (drawn from ``gen``, so a
    failure repeats): a read of an unwritten slot shows."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    row = tq.stored_head_size(dtype, WIDTH) if tq.is_per_token(dtype) else WIDTH
    if nhd:
        cache = torch.empty(num_blocks, block_size, 1, row, dtype=dtype).transpose(1, 2)
    else:
        cache = torch.empty(num_blocks, 1, block_size, row, dtype=dtype)
    if dtype.is_floating_point:
        cache.copy_(torch.full(cache.shape, float("nan")).to(dtype))
    else:
        garbage = torch.randint(0, 256, cache.shape, dtype=torch.uint8, generator=gen)
        cache.view(torch.uint8).copy_(garbage)
    if not tq.is_per_token(dtype):
        return cache, None
    scale = torch.full(tq.scale_shape(dtype, num_blocks, 1, block_size), float("nan"))
    scale[..., 0].view(-1)[::3] = 1e30  # huge and NaN scales in slots no token owns
    return cache, scale


def values_of(cache: torch.Tensor) -> torch.Tensor:
    """The value view of a latent cache: its leading 512 columns."""
    return cache[..., :tq.stored_head_size(cache.dtype, LORA) if tq.is_per_token(cache.dtype) else LORA]


def rows_of(gen: torch.Generator, n: int,
            dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` tokens' latents ``[n, 1, 512]`` and rotary keys ``[n, 1, 64]``."""
    latent = torch.randn(n, 1, LORA, generator=gen) * 0.7
    latent[:, :, 7] *= 20  # an outlier channel, as real latents have
    rotary = torch.randn(n, 1, ROPE, generator=gen) * 2
    return latent.to(dtype), rotary.to(dtype)


Rows = Tuple[torch.Tensor, torch.Tensor]  # one sequence's latents [n, 1, 512], rotary keys [n, 1, 64]


def latent_case(lens: Sequence[int], block_size: int, cache_dtype: torch.dtype, seed: int = 3,
                nhd: bool = False, rows: Optional[Sequence[Rows]] = None,
                write: Callable[..., None] = pa.write_latent
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A latent cache (:func:`latent_cache`) holding ``lens`` tokens per sequence in random
    block order, three blocks more than they use, the slots no token owns left garbage:
    ``(cache, scale, block_tables, seq_lens)``, each table a column wider than its longest
    sequence, every entry past a sequence's blocks ``1 << 30`` (no block).

    ``rows``: each sequence's rows, for a test that computes with them (default: drawn by
    :func:`rows_of`); ``write``: the op that stores them, called as ``paged.write_latent``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 3
    cache, scale = latent_cache(num_blocks, block_size, cache_dtype, nhd, gen)
    physical = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(blocks) + 1), 1 << 30, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        tables[i, :nb] = physical[used:used + nb].int()
        used += nb
        positions = torch.arange(n)
        slots = tables[i, positions // block_size].long() * block_size + positions % block_size
        write(*(rows_of(gen, n) if rows is None else rows[i]), cache, slots, scale)
    return cache, scale, tables, torch.tensor(lens, dtype=torch.int32)
