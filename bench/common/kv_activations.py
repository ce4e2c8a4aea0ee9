"""Synthetic attention inputs for KV-cache accuracy measurements, and the attention and
error they are measured with.

``outliers``: the shape real models' K/V have. KIVI (Liu et al., 2024) and KVQuant (Hooper
et al., 2024) find a few fixed key channels of much larger magnitude than the rest in every
layer, their outliers consistent across tokens and most structured before RoPE (KVQuant
quantizes keys before RoPE for that reason), while values have no such channel pattern;
QuaRot (Ashkboos et al., 2024) removes the key outliers with a Hadamard rotation before
4-bit quantization. So, per KV head:

* keys before RoPE: ``g_t * z`` (``z`` standard normal) except in ``head_size // 32``
  outlier channels, fixed per head, where the key is ``g_t * a_c * (s_c + z / 2)``: a
  magnitude ``a_c`` uniform in [10, 50] and a sign ``s_c``, both fixed per channel (a large
  mean of one sign, as in the papers' plots, with some spread). ``g_t``: the token's
  magnitude, log-normal (``exp(0.3 z)``). Then RoPE (Llama's rotate-half pairs, theta
  10000) at positions 0, 1, ...: it spreads each outlier over its channel pair, varying
  with the position;
* values: ``g'_t * b_c * z`` with ``b_c`` = 1 except ``head_size // 64`` channels with
  ``b_c`` uniform in [3, 5] (milder outliers), ``g'_t`` log-normal as above;
* queries: standard normal before RoPE at their own positions, times
  ``QUERY_SCALE``, which keeps the softmax over a few dozen tokens rather than one or two
  (real heads' attention is peaked, not one-hot); ``effective_tokens`` reports it.

``outlier_keys``: the same without the values' outlier channels (all ``b_c`` = 1): what a
rotation of the values buys depends on them. ``gaussian``: keys, values and queries
standard normal, no RoPE: the contrast.

K/V are rounded to bf16 (what a bf16 model writes into its cache); errors are measured
against float64 attention over those bf16 values, so they are what a format adds over a
bf16 cache.
"""

from typing import Dict, Tuple

import torch

ROPE_THETA = 10000.0
QUERY_SCALE = 0.5
KINDS = ("outliers", "outlier_keys", "gaussian")


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half pairs ``i``, ``i + head_size / 2``) of
    ``x [..., tokens, head_size]`` at ``positions [tokens]``."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = positions.double()[:, None] * inv_freq[None]
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.double() * cos + rotated_half.double() * sin).to(x.dtype)


def _token_magnitude(shape: Tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.exp(0.3 * torch.randn(*shape, 1, generator=gen))


def activations(kind: str, batch: int, kv_heads: int, heads: int, context: int, queries: int,
                head_size: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, context, head_size]`` (bf16) and queries
    ``[batch, heads, queries, head_size]`` (fp32) at the last ``queries`` positions."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, kv_heads, context, head_size)
    z = torch.randn(*shape, generator=gen)
    if kind == "gaussian":
        keys, values = z, torch.randn(*shape, generator=gen)
        query = torch.randn(batch, heads, queries, head_size, generator=gen)
        return {"keys": keys.bfloat16(), "values": values.bfloat16(), "query": query}
    positions = torch.arange(context)
    mean = torch.zeros(kv_heads, head_size)
    spread = torch.ones(kv_heads, head_size)
    value_scale = torch.ones(kv_heads, head_size)
    for h in range(kv_heads):
        channels = torch.randperm(head_size, generator=gen)
        outliers = channels[:max(1, head_size // 32)]
        magnitude = 10 + 40 * torch.rand(len(outliers), generator=gen)
        sign = torch.randint(0, 2, (len(outliers),), generator=gen) * 2.0 - 1.0
        mean[h, outliers], spread[h, outliers] = magnitude * sign, magnitude / 2
        mild = channels[-max(1, head_size // 64):]
        if kind == "outliers":
            value_scale[h, mild] = 3 + 2 * torch.rand(len(mild), generator=gen)
    pre_rope = (mean[:, None] + spread[:, None] * z) * _token_magnitude(shape[:-1], gen)
    keys = rope(pre_rope, positions)
    values = torch.randn(*shape, generator=gen) * value_scale[:, None] * _token_magnitude(shape[:-1], gen)
    query = torch.randn(batch, heads, queries, head_size, generator=gen) * QUERY_SCALE
    query = rope(query, positions[context - queries:])
    return {"keys": keys.bfloat16(), "values": values.bfloat16(), "query": query}


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal float64 attention of the last ``queries`` positions over ``context`` K/V
    (grouped-query heads), scale ``head_size ** -0.5``: (output ``[batch, heads, queries,
    head_size]``, the probabilities)."""
    heads, queries, context = query.shape[1], query.shape[2], keys.shape[2]
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * query.shape[-1] ** -0.5
    position = torch.arange(context - queries, context)[:, None]
    scores = scores.masked_fill(torch.arange(context)[None] > position, float("-inf"))
    probs = scores.softmax(-1)
    return probs @ v, probs


def effective_tokens(probs: torch.Tensor) -> float:
    """exp(entropy) of the attention rows, averaged: how many tokens a query reads."""
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
    return entropy.exp().mean().item()


def output_error(got: torch.Tensor, want: torch.Tensor) -> Dict[str, float]:
    """Relative L2 error of the whole output, its distribution over rows (one query of one
    head), and the largest absolute error."""
    diff = (got.double() - want).flatten(0, -2)
    want = want.flatten(0, -2)
    rows = diff.norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-300)
    return {"rel_l2": (diff.norm() / want.norm()).item(), "row_rel_l2_mean": rows.mean().item(),
            "row_rel_l2_p99": torch.quantile(rows, 0.99).item(), "row_rel_l2_max": rows.max().item(),
            "max_abs": diff.abs().max().item()}
