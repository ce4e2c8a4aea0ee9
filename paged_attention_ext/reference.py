"""Plain-PyTorch reference of every op: the test oracle and executable documentation.

Written for clarity, not speed: gather each sequence's keys and values through its
block table, build the explicit mask, do the math in fp32 (in fp64 for a float64 query
and caches, which the ops do not take: a test oracle one rounding level finer). The
signatures match ``torch.ops.paged`` exactly; shapes and semantics are documented once,
in :mod:`paged_attention_ext.ops`. Caches are read through indexing, so any strided view
(NHD, a joint K/V tensor, see :mod:`paged_attention_ext.layouts`) works as it is.
"""

from typing import Callable, List, Optional, Tuple

import torch

from . import token_quantization
from .quantization import FP8_DTYPES


def dequantize(cache: torch.Tensor, scale: Optional[torch.Tensor],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an fp8 cache holds: ``cache.float() * scale`` per KV head (``scale`` of
    shape [], [1] or [num_kv_heads]); a per-token cache (int8, packed int4) with its scale
    tensor as :mod:`~paged_attention_ext.token_quantization` defines it (int4: unrotated,
    ``head_size`` wide); a float cache (``scale`` None) as it is, in ``dtype``."""
    if token_quantization.is_per_token(cache.dtype):
        return token_quantization.dequantize(cache, scale, dtype)
    if cache.dtype not in FP8_DTYPES:
        return cache.to(dtype)
    return cache.to(dtype) * scale.to(dtype).view(1, -1, 1, 1)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..., num_kv_heads, head_size] stored in fp8 ``dtype``: ``x.float() / scale``
    per head, saturated to the format's largest finite value (NaN stays NaN), rounded to
    nearest even."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale.float().view(-1, 1)).clamp(-limit, limit).to(dtype)


def gather_sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                       first_block: int = 0) -> torch.Tensor:
    """One sequence's cached rows from block ``first_block`` on,
    ``[num_kv_heads, seq_len - first_block * block_size, cache head size]``.

    Only the blocks that hold the sequence's tokens are read (with a sliding window, the
    entries before ``first_block`` may point at freed blocks or at nothing).
    """
    block_size = cache.shape[2]
    num_used = -(-seq_len // block_size)
    blocks = cache[block_table[first_block:num_used].long()]  # [used, kv_heads, block_size, head_size]
    rows = blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], (num_used - first_block) * block_size,
                                              cache.shape[3])
    return rows[:, :seq_len - first_block * block_size]


def query_rows(seq_lens: torch.Tensor, query_start_loc: Optional[torch.Tensor]) -> List[Tuple[int, int]]:
    """(first row, number of rows) of each sequence's queries."""
    if query_start_loc is None:
        return [(i, 1) for i in range(seq_lens.shape[0])]
    starts = query_start_loc.tolist()
    return [(starts[i], starts[i + 1] - starts[i]) for i in range(seq_lens.shape[0])]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            soft_cap: float, bias: Optional[torch.Tensor], visible: torch.Tensor,
            sink: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows ``q`` [q_len, heads, head_size] over ``keys``/``values`` [heads, kv_len, ...]:
    (out [q_len, heads, head_size_v], lse [q_len, heads]); ``visible`` [q_len, kv_len]."""
    q = q.transpose(0, 1)  # [heads, q_len, head_size]
    num_heads, q_len = q.shape[0], q.shape[1]
    scores = scale * (q @ keys.transpose(1, 2))  # [heads, q_len, kv_len]
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~visible, float("-inf"))
    # The sink: one more logit per head in the denominator, with no value.
    sink_column = sink[:, None, None].expand(num_heads, q_len, 1)
    row_lse = torch.logsumexp(torch.cat([scores, sink_column], dim=-1), dim=-1)
    # -inf where a row sees nothing and has no sink.
    probs = torch.exp(scores - row_lse[..., None].clamp_min(torch.finfo(q.dtype).min))
    return (probs @ values).transpose(0, 1), row_lse.transpose(0, 1)


def _start(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
           sinks: Optional[torch.Tensor]):
    """(key values, value values, GQA group, out, lse, sink) before any row is attended:
    the dequantized caches in the compute dtype, and every row as one that sees no key
    (output 0, lse the sink, -inf without sinks)."""
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    keys = dequantize(key_cache, k_scale, compute)
    if token_quantization.is_per_token(key_cache.dtype) and values_in_keys(key_cache, value_cache):
        # Latent rows: the values are the keys' leading columns, quantized (int4: rotated)
        # as part of the whole row.
        values = keys[..., :token_quantization.head_size_of(value_cache)]
    else:
        values = dequantize(value_cache, v_scale, compute)
    num_tokens, num_heads = query.shape[:2]
    out = torch.zeros(num_tokens, num_heads, values.shape[3], dtype=compute, device=query.device)
    no_sink = torch.full((num_heads,), float("-inf"), dtype=compute, device=query.device)
    sink = no_sink if sinks is None else sinks.to(compute)
    lse = sink.expand(num_tokens, num_heads).clone()
    return keys, values, num_heads // keys.shape[1], out, lse, sink


def values_in_keys(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """``value_cache`` is ``key_cache``'s leading columns (MLA latent rows)."""
    return (value_cache.data_ptr() == key_cache.data_ptr()
            and value_cache.shape[:3] == key_cache.shape[:3]
            and value_cache.shape[3] <= key_cache.shape[3]
            and all(value_cache.stride(d) == key_cache.stride(d)
                    for d in range(3) if key_cache.shape[d] > 1))


def _sequences(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: Optional[torch.Tensor], group: int,
               first_block: Callable[[int, int], int]):
    """Each sequence with queries and keys: (first row, q_len, kv_len, first key position,
    keys, values), its cached rows from block ``first_block(kv_len, q_len)`` on, repeated
    for the query heads of each KV head."""
    for i, (row, q_len) in enumerate(query_rows(seq_lens, query_start_loc)):
        kv_len = int(seq_lens[i])
        if q_len == 0 or kv_len == 0:
            continue
        first = first_block(kv_len, q_len)
        keys = gather_sequence_kv(key_cache, block_tables[i], kv_len, first)
        values = gather_sequence_kv(value_cache, block_tables[i], kv_len, first)
        yield (row, q_len, kv_len, first * key_cache.shape[2],
               keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0))


def attention_with_lse(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_start_loc: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: int = -1,
    soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache, group, out, lse, sink = _start(query, key_cache, value_cache, k_scale,
                                                           v_scale, sinks)

    def first_block(kv_len: int, q_len: int) -> int:
        # Blocks wholly before the first query's window are never read.
        if sliding_window <= 0:
            return 0
        return max(0, kv_len - q_len - sliding_window + 1) // key_cache.shape[2]

    for row, q_len, kv_len, start, keys, values in _sequences(
            key_cache, value_cache, block_tables, seq_lens, query_start_loc, group, first_block):
        if sliding_window > 0:
            # Keys before the first query's window are seen by no query: dropped, so that
            # whatever their slots hold (NaN, inf) stays out, as in the kernels.
            skip = max(0, kv_len - q_len - sliding_window + 1) - start
            keys, values, start = keys[:, skip:], values[:, skip:], start + skip
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        k_pos = torch.arange(start, kv_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window > 0:
            visible &= k_pos > q_pos - sliding_window
        bias = None
        if alibi_slopes is not None:
            bias = alibi_slopes.to(out.dtype)[:, None, None] * (k_pos - q_pos)
        out[row:row + q_len], lse[row:row + q_len] = _attend(
            query[row:row + q_len].to(out.dtype), keys, values, scale, soft_cap, bias, visible, sink)
    return out.to(query.dtype), lse


def attention(*args, **kwargs) -> torch.Tensor:
    """:func:`attention_with_lse`'s output alone (the same arguments)."""
    return attention_with_lse(*args, **kwargs)[0]


def shared_prefix_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    soft_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    key_cache, value_cache, group, out, lse, sink = _start(query, key_cache, value_cache, k_scale,
                                                           v_scale, sinks)
    for row, q_len, prefix_len, _, keys, values in _sequences(
            key_cache, value_cache, block_tables, seq_lens, query_start_loc, group,
            lambda kv_len, q_len: 0):
        # Every query of the group comes after the whole prefix: no mask.
        visible = torch.ones(q_len, prefix_len, dtype=torch.bool, device=query.device)
        out[row:row + q_len], lse[row:row + q_len] = _attend(
            query[row:row + q_len].to(out.dtype), keys, values, scale, soft_cap, None, visible, sink)
    return out.to(query.dtype), lse


def merge_attention_states(outputs: List[torch.Tensor],
                           lses: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    compute = torch.float64 if outputs[0].dtype == torch.float64 else torch.float32
    lse = torch.stack([l.to(compute) for l in lses])  # [parts, tokens, heads]
    merged_lse = torch.logsumexp(lse, dim=0)
    seen = merged_lse > float("-inf")
    weights = torch.where(seen, torch.exp(lse - merged_lse.where(seen, 0)), 0)
    out = torch.zeros(outputs[0].shape, dtype=compute, device=outputs[0].device)
    for w, o in zip(weights, outputs):
        # A part that saw nothing (weight 0) is not read: its output may be anything.
        out += torch.where(w[..., None] > 0, w[..., None] * o.to(compute), 0)
    out = out.masked_fill(merged_lse.isnan()[..., None], float("nan"))  # a NaN lse stays visible
    return out.to(outputs[0].dtype), merged_lse.to(torch.float32)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """Per-token caches also store each row's scales into ``k_scale`` / ``v_scale``."""
    block_size = key_cache.shape[2]
    per_token = token_quantization.is_per_token(key_cache.dtype)
    if per_token:
        (key, key_scales), (value, value_scales) = (token_quantization.quantize(key, key_cache.dtype),
                                                    token_quantization.quantize(value, value_cache.dtype))
    elif key_cache.dtype in FP8_DTYPES:
        key, value = quantize(key, k_scale, key_cache.dtype), quantize(value, v_scale, key_cache.dtype)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, :, offset] = key[token]
        value_cache[block, :, offset] = value[token]
        if per_token:
            k_scale[block, :, offset] = key_scales[token]
            v_scale[block, :, offset] = value_scales[token]


def write_latent(latent: torch.Tensor, rotary_key: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
    """Each token's ``[latent | rotary_key]`` row stored whole: cast into a float cache,
    quantized with ``scale`` into an fp8 one, quantized as one row into a per-token one
    (its scales into ``scale``)."""
    rows = torch.cat((latent, rotary_key), dim=-1)
    per_token = token_quantization.is_per_token(cache.dtype)
    if per_token:
        rows, row_scales = token_quantization.quantize(rows, cache.dtype)
    elif cache.dtype in FP8_DTYPES:
        rows = quantize(rows, scale, cache.dtype)
    else:
        rows = rows.to(cache.dtype)
    block_size = cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        cache[block, :, offset] = rows[token]
        if per_token:
            scale[block, :, offset] = row_scales[token]


def copy_blocks(key_caches: List[torch.Tensor], value_caches: List[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    for src, dst in block_mapping.tolist():
        for cache in list(key_caches) + list(value_caches):
            cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)
