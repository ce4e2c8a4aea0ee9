"""Cache layouts of other engines as views the paged ops take, without copies.

The ops take each cache in the logical shape ``[num_blocks, num_kv_heads, block_size,
head_size]`` (HND) with any strides on the first three dimensions, as long as the head
dimension is contiguous (``stride(3) == 1``) and the view does not overlap itself. These
helpers build such views from the layouts vLLM, FlashInfer and transformers use:

* NHD, ``[num_blocks, block_size, num_kv_heads, head_size]`` (vLLM, transformers'
  continuous batching): :func:`from_nhd`.
* One joint tensor for K and V, ``[2, num_blocks, block_size, num_kv_heads, head_size]``
  (vLLM) or ``[2, num_blocks, num_kv_heads, block_size, head_size]``: :func:`split_kv`.
* A per-token cache's scale tensor laid out like its NHD cache, ``[num_blocks,
  block_size, num_kv_heads(, 2)]``: :func:`scales_from_nhd` (a joint scale tensor:
  ``scales.unbind(0)``, each through it).

Writes through the views (:func:`paged_attention_ext.ops.write_kv`,
:func:`~paged_attention_ext.ops.copy_blocks`) land in the original tensor. HND stays the
fastest layout for the CPU kernel (a head's rows of a block are adjacent); docs/ops.md
gives what NHD costs.

Example::

    >>> import torch, paged_attention_ext as pa
    >>> from paged_attention_ext.layouts import split_kv
    >>> kv = torch.randn(2, 4, 16, 2, 64)          # vLLM: [2, blocks, block_size, kv_heads, head]
    >>> key_cache, value_cache = split_kv(kv)       # views, [4, 2, 16, 64] each
    >>> key_cache.shape, key_cache.data_ptr() == kv.data_ptr()
    (torch.Size([4, 2, 16, 64]), True)
    >>> query = torch.randn(1, 4, 64)
    >>> tables, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    >>> out = pa.attention(query, key_cache, value_cache, tables, lens, 0.125)
    >>> want = pa.attention(query, key_cache.contiguous(), value_cache.contiguous(), tables, lens,
    ...                     0.125)
    >>> torch.testing.assert_close(out, want)
"""

from typing import Tuple

import torch

__all__ = ["from_nhd", "scales_from_nhd", "split_kv"]


def from_nhd(cache: torch.Tensor) -> torch.Tensor:
    """The HND-shaped view of an NHD cache ``[num_blocks, block_size, num_kv_heads,
    head_size]``: ``cache.transpose(1, 2)``, the same memory.

    Example::

        >>> import torch
        >>> from paged_attention_ext.layouts import from_nhd
        >>> nhd = torch.zeros(8, 16, 2, 64)
        >>> view = from_nhd(nhd)
        >>> view.shape, view.stride()
        (torch.Size([8, 2, 16, 64]), (2048, 64, 128, 1))
    """
    if cache.dim() != 4:
        raise ValueError("from_nhd: argument 'cache' must be 4-D [num_blocks, block_size, "
                         f"num_kv_heads, head_size], got shape {tuple(cache.shape)}")
    return cache.transpose(1, 2)


def scales_from_nhd(scales: torch.Tensor) -> torch.Tensor:
    """The HND-shaped view of a per-token cache's NHD scale tensor ``[num_blocks, block_size,
    num_kv_heads]`` (int8) or ``[num_blocks, block_size, num_kv_heads, 2]`` (int4), laid
    out like its NHD cache: ``scales.transpose(1, 2)``, the same memory.

    Example::

        >>> import torch
        >>> from paged_attention_ext.layouts import scales_from_nhd
        >>> view = scales_from_nhd(torch.zeros(8, 16, 2))
        >>> view.shape, view.stride()
        (torch.Size([8, 2, 16]), (32, 1, 2))
    """
    if scales.dim() not in (3, 4):
        raise ValueError("scales_from_nhd: argument 'scales' must be 3-D [num_blocks, block_size, "
                         "num_kv_heads] or 4-D [num_blocks, block_size, num_kv_heads, 2], got shape "
                         f"{tuple(scales.shape)}")
    return scales.transpose(1, 2)


def split_kv(kv_cache: torch.Tensor, layout: str = "NHD") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(key_cache, value_cache)`` views of a joint K/V tensor of shape ``[2, num_blocks,
    block_size, num_kv_heads, head_size]`` (``layout="NHD"``, vLLM's) or ``[2, num_blocks,
    num_kv_heads, block_size, head_size]`` (``layout="HND"``), each in the ops' logical
    shape ``[num_blocks, num_kv_heads, block_size, head_size]``.

    Example::

        >>> import torch
        >>> from paged_attention_ext.layouts import split_kv
        >>> kv = torch.zeros(2, 8, 2, 16, 64)
        >>> k, v = split_kv(kv, layout="HND")
        >>> k.shape, k.is_contiguous(), v.data_ptr() - k.data_ptr() == kv[1].numel() * 4
        (torch.Size([8, 2, 16, 64]), True, True)
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("split_kv: argument 'kv_cache' must be 5-D with a leading dimension of "
                         f"2 (key, value), got shape {tuple(kv_cache.shape)}")
    if layout not in ("NHD", "HND"):
        raise ValueError(f"split_kv: argument 'layout' must be 'NHD' or 'HND', got {layout!r}")
    key, value = kv_cache.unbind(0)
    if layout == "NHD":
        return from_nhd(key), from_nhd(value)
    return key, value
