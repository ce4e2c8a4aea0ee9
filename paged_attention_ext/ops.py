"""Typed wrappers over ``torch.ops.paged``.

Layouts (see docs/ops.md):

* KV cache, per layer, HND: ``key_cache`` is ``[num_blocks, num_kv_heads, block_size,
  head_size]`` and ``value_cache`` ``[num_blocks, num_kv_heads, block_size, head_size_v]``,
  contiguous; ``head_size_v`` is usually ``head_size`` (MLA models as transformers runs
  them use e.g. 192 and 128).
* ``block_tables`` int32 ``[num_seqs, max_blocks_per_seq]``: row i lists the
  physical blocks of sequence i in logical order; entries past the sequence's
  last block are never read.
* ``seq_lens`` int32 ``[num_seqs]``: KV tokens of each sequence, including the
  query tokens of this step (already written with :func:`write_kv`).
* Slots: ``slot = block * block_size + offset_in_block`` (int64); negative = padding.

The wrappers add no work: they exist for signatures, defaults and docs, and each
is a single op call that ``torch.compile`` traces without a graph break.
"""

from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "attention",
    "attention_with_lse",
    "attention_out",
    "write_kv",
    "copy_blocks",
    "swap_blocks",
    "cpu_isa",
]


def attention(
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
) -> torch.Tensor:
    """Attention of ``query`` over each sequence's paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, fp32/fp16/bf16, last dim contiguous.
        key_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``, dtype of ``query``;
            ``num_heads % num_kv_heads == 0`` (GQA/MQA), query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``.
        value_cache: ``[num_blocks, num_kv_heads, block_size, head_size_v]``, like
            ``key_cache`` but for its head size. Head sizes are multiples of 8 up to 256.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: int32 ``[num_seqs]``; 0 marks a padded row (its output is zeros).
        scale: multiplies ``q . k`` (usually ``head_size ** -0.5``).
        query_start_loc: None for decode (``num_tokens == num_seqs``, one query per
            sequence at position ``seq_len - 1``). Otherwise int32 ``[num_seqs + 1]``,
            cumulative: sequence i owns rows ``[qsl[i], qsl[i+1])``, its last ``q_len``
            positions, with bottom-right aligned causal masking.
        alibi_slopes: fp32 ``[num_heads]``; adds ``slope[h] * (j - p)`` to the score of key
            position ``j`` for the query at position ``p``.
        sliding_window: ``W > 0`` lets the query at ``p`` see keys ``p - W < j <= p``;
            -1 disables it.
        soft_cap: ``c > 0`` maps each score ``s`` to ``c * tanh(s / c)``; 0 disables it.
        sinks: fp32 ``[num_heads]`` attention sinks (GPT-OSS): one more logit per head
            in the softmax denominator that contributes no value, so
            ``out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j))``. None: no sink.

    Returns:
        ``[num_tokens, num_heads, head_size_v]`` in the dtype of ``query``; zeros for a
        row that sees no key.
    """
    return torch.ops.paged.attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                     query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks)


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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` plus the log-sum-exp of each row's scores.

    Returns:
        ``(out, lse)``: ``out`` as in :func:`attention`; ``lse`` fp32
        ``[num_tokens, num_heads]``, natural log of the softmax denominator: the
        log-sum-exp of the row's visible scores and, when given, its head's sink. A row
        that sees no key gets the sink (``-inf`` without sinks). Two partial attentions
        over disjoint keys (without sinks) merge exactly with it (cascade attention,
        split prefill).
    """
    return torch.ops.paged.attention_with_lse(query, key_cache, value_cache, block_tables, seq_lens,
                                              scale, query_start_loc, alibi_slopes, sliding_window,
                                              soft_cap, sinks)


def attention_out(
    out: torch.Tensor,
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
    lse: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`attention` writing into caller-owned buffers (fixed addresses for CUDA graphs).

    Args:
        out: ``[num_tokens, num_heads, head_size_v]``, dtype of ``query``, last dim contiguous.
        lse: optional fp32 ``[num_tokens, num_heads]`` that receives the log-sum-exp
            (as in :func:`attention_with_lse`).
        The other arguments as in :func:`attention`.

    Returns:
        ``out``.
    """
    torch.ops.paged.attention_out(out, lse, query, key_cache, value_cache, block_tables, seq_lens,
                                  scale, query_start_loc, alibi_slopes, sliding_window, soft_cap,
                                  sinks)
    return out


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's key and value into its cache slot, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]`` and value ``[num_tokens,
            num_kv_heads, head_size_v]`` (last dims contiguous; e.g. views into a fused
            QKV projection), dtype of the caches.
        key_cache, value_cache: the layer's caches, modified in place.
        slot_mapping: int64 ``[num_tokens]``; ``slot = block * block_size + offset``;
            negative slots are padding and are skipped. Slots must be distinct.
    """
    torch.ops.paged.write_kv(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every layer, copy block ``src`` to block ``dst`` for each ``(src, dst)`` row.

    One call serves copy-on-write and fork copies of all layers. Layer ``l``'s
    ``key_caches[l]`` and ``value_caches[l]`` have one dtype and one block layout but
    may differ in head size; every layer has the same ``num_blocks``. ``block_mapping``
    is int64 ``[num_pairs, 2]``; a destination may appear once and may not also be a
    source.
    """
    torch.ops.paged.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks ``src[s] -> dst[d]`` for each ``(s, d)`` row of int64 ``block_mapping``.

    ``src`` and ``dst`` are pools with the same block shape and dtype (any leading
    ``num_blocks``), e.g. a device cache and its host swap space.
    """
    torch.ops.paged.swap_blocks(src, dst, block_mapping)


def cpu_isa() -> str:
    """The instruction set the CPU attention kernel uses: ``avx512_bf16`` (AVX-512 with bf16
    dot products), ``avx512``, ``avx2`` or ``generic``.

    ``PAGED_ATTENTION_CPU_ISA`` may lower it (for testing every path).
    """
    return torch.ops.paged.cpu_isa()
