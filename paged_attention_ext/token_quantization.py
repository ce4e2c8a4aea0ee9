"""KV-cache formats with one scale per (token, KV head): ``int8`` and ``int4``.

Each token's key (value) row of each KV head is quantized when it is written, from the
row's own values: nothing is calibrated, an outlier token costs only its own row's
precision. The scales live in a float32 tensor beside each cache, paged like it (the same
block ids, the same block table). The maths here is the formats' definition: the ops'
kernels (``write_kv`` and the attention ops) reproduce it, and the reference ops
(:mod:`paged_attention_ext.reference`) use it.

``int8_per_token_head`` (cache ``torch.int8``, ``[num_blocks, num_kv_heads, block_size,
head_size]``; scales ``[num_blocks, num_kv_heads, block_size]``), symmetric::

    amax  = max_i |x_i|                        (NaN if the row holds one)
    scale = amax / 127
    q_i   = clamp(round_half_even(x_i / scale), -127, 127)   (0 where x_i / scale is NaN)
    x_i  ~= q_i * scale

``int4_per_token_head`` (cache ``torch.uint8``, ``[num_blocks, num_kv_heads, block_size,
head_size // 2]``; scales ``[num_blocks, num_kv_heads, block_size, 2]``), asymmetric on the
rotated row ``r = rotate(x)`` (see below)::

    low   = min_i r_i,  scale = (max_i r_i - low) / 15
    q_i   = clamp(round_half_even((r_i - low) / scale), 0, 15)   (0 where that is NaN)
    byte j of the row = q_(2j) | q_(2j+1) << 4                  (low nibble first)
    scales[..., 0] = scale, scales[..., 1] = low
    r_i  ~= q_i * scale + low,   x = unrotate(r)

A constant row (scale 0) is stored exactly. The rotation is a random Hadamard transform
per block of ``rotation_block(head_size)`` consecutive channels (the largest power of two
dividing the head size, at most 512): ``rotate(x) = H (s * x) / sqrt(n)`` with ``H`` the
Sylvester Hadamard matrix of order ``n`` and ``s`` the fixed signs of :func:`rotation_signs`.
It is orthonormal, so ``q . k = rotate(q) . rotate(k)``: attention over an int4 cache rotates
the query, attends over the rotated values and rotates its output back. Spreading an
outlier channel over the whole block is what makes 4 bits per value workable on real
activations.

Bytes per token and KV head: ``head_size + 4`` (int8), ``head_size / 2 + 8`` (int4), against
``2 * head_size`` for bf16.
"""

import math
from typing import Optional, Tuple

import torch

# Names as vLLM's ``kv_cache_dtype`` spells them, and the cache dtype of each.
TOKEN_FORMATS = {"int8_per_token_head": torch.int8, "int4_per_token_head": torch.uint8}
TOKEN_DTYPES = tuple(TOKEN_FORMATS.values())
INT8_MAX = 127
INT4_MAX = 15
MAX_ROTATION_BLOCK = 512


def is_per_token(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is one of the per-token formats (int8, packed int4)."""
    return dtype in TOKEN_DTYPES


def stored_head_size(dtype: torch.dtype, head_size: int) -> int:
    """The cache's last dimension for rows of ``head_size`` values (int4: two a byte)."""
    if dtype == torch.uint8:
        if head_size % 2:
            raise ValueError(f"an int4 cache packs two values a byte: head_size {head_size} "
                             "must be even")
        return head_size // 2
    return head_size


def head_size_of(cache: torch.Tensor) -> int:
    """The head size a cache's rows hold (int4: twice its last dimension)."""
    return cache.shape[-1] * 2 if cache.dtype == torch.uint8 else cache.shape[-1]


def scale_shape(dtype: torch.dtype, num_blocks: int, num_kv_heads: int,
                block_size: int) -> Tuple[int, ...]:
    """Shape of the float32 scale tensor beside a per-token cache."""
    if dtype == torch.int8:
        return (num_blocks, num_kv_heads, block_size)
    if dtype == torch.uint8:
        return (num_blocks, num_kv_heads, block_size, 2)
    raise ValueError(f"{dtype} is not a per-token cache dtype ({', '.join(map(str, TOKEN_DTYPES))})")


def bytes_per_token_head(dtype: torch.dtype, head_size: int) -> int:
    """Bytes one token of one KV head takes, its scales included."""
    if dtype == torch.int8:
        return head_size + 4
    if dtype == torch.uint8:
        return stored_head_size(dtype, head_size) + 8
    raise ValueError(f"{dtype} is not a per-token cache dtype")


# ---- the rotation ----------------------------------------------------------------------

def rotation_block(head_size: int) -> int:
    """Channels per Hadamard block: the largest power of two dividing ``head_size``
    (at most 512)."""
    return min(head_size & -head_size, MAX_ROTATION_BLOCK)


def rotation_signs(head_size: int) -> torch.Tensor:
    """The fixed signs (fp32, +-1) the rotation applies before the Hadamard transform:
    channel ``i`` is negated when bit 31 of ``(i * 2654435761) mod 2**32`` is set (a
    Fibonacci hash: random-looking, and the same in every kernel without a stored table)."""
    i = torch.arange(head_size, dtype=torch.int64)
    bit = ((i * 2654435761) % (1 << 32)) >> 31
    return 1.0 - 2.0 * bit.to(torch.float32)


def _hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard transform of each block of ``n`` channels, in fp32,
    butterflies at distance 1, 2, 4, ... (the kernels' order: the same sums, bit for bit)."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // n, n)
    h = 1
    while h < n:
        y = y.reshape(y.shape[0], y.shape[1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(shape)


def rotation_norm(n: int) -> float:
    """The fp32 factor that makes the Hadamard block of order ``n`` orthonormal."""
    return float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32))


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_size] rotated (fp32): signs, Hadamard blocks, ``1 / sqrt(n)``."""
    head_size = x.shape[-1]
    n = rotation_block(head_size)
    signed = x.float() * rotation_signs(head_size).to(x.device)
    return _hadamard(signed, n) * rotation_norm(n)


def unrotate(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rotate` (fp32): Hadamard blocks, ``1 / sqrt(n)``, signs."""
    head_size = x.shape[-1]
    n = rotation_block(head_size)
    return _hadamard(x.float(), n) * rotation_norm(n) * rotation_signs(head_size).to(x.device)


# ---- quantize / dequantize --------------------------------------------------------------

def _rounded(ratio: torch.Tensor, low: int, high: int) -> torch.Tensor:
    return torch.nan_to_num(torch.round(ratio), nan=0.0).clamp(low, high)


def quantize_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_size] as int8 rows and their fp32 scales [...]."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    q = _rounded(x / scale[..., None], -INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[..., None]


def quantize_int4(x: torch.Tensor, rotated: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_size] as packed int4 rows [..., head_size // 2] (uint8) and their
    fp32 ``(scale, low)`` pairs [..., 2]. ``rotated=False`` skips the rotation: not a cache
    format, only for measuring what the rotation buys."""
    stored_head_size(torch.uint8, x.shape[-1])
    r = rotate(x) if rotated else x.float()
    low = r.amin(dim=-1)
    scale = (r.amax(dim=-1) - low) / INT4_MAX
    q = _rounded((r - low[..., None]) / scale[..., None], 0, INT4_MAX).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, torch.stack((scale, low), dim=-1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, rotated: bool = True,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a packed int4 row holds (unrotated), in ``dtype`` (fp32 maths; float64
    keeps the fp32 values exactly)."""
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).float()
    r = q * scales[..., 0, None].float() + scales[..., 1, None].float()
    return (unrotate(r) if rotated else r).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_size] in the per-token format of cache dtype ``dtype``: (rows, scales)."""
    if dtype == torch.int8:
        return quantize_int8(x)
    if dtype == torch.uint8:
        return quantize_int4(x)
    raise ValueError(f"{dtype} is not a per-token cache dtype")


def dequantize(cache: torch.Tensor, scales: torch.Tensor,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The values a per-token cache (or any slice of its rows) holds, with its scales."""
    dtype = dtype or torch.float32
    if cache.dtype == torch.int8:
        return dequantize_int8(cache, scales, dtype)
    if cache.dtype == torch.uint8:
        return dequantize_int4(cache, scales, dtype=dtype)
    raise ValueError(f"{cache.dtype} is not a per-token cache dtype")
