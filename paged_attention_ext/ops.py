"""The paged ops: typed wrappers over ``torch.ops.paged.*`` and their reference documentation.

These docstrings are the op reference (shapes, dtypes, semantics, errors, an example per
op that the tests run); docs/ops.md tells the design story around them. Each wrapper is
one op call, so ``torch.compile`` traces it without a graph break, and
``torch.ops.paged.<name>`` takes the same arguments positionally.

Layouts
-------
* Per layer, a key cache ``[num_blocks, num_kv_heads, block_size, head_size]`` and a
  value cache ``[num_blocks, num_kv_heads, block_size, head_size_v]`` (HND), of dtype
  fp32/fp16/bf16, fp8 (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) or per-token
  int8 / int4 (``torch.int8``; ``torch.uint8``, two values a byte: its last dim is
  ``head_size // 2``), see below.
  ``head_size_v`` is usually ``head_size``; MLA models as transformers runs them
  (DeepSeek-V2/V3) use key 192 and value 128. Otherwise the two caches match:
  ``num_blocks``, ``num_kv_heads``, ``block_size``, dtype and device. Head sizes are
  multiples of 8 up to 512 (Gemma-4's global layers), keys up to 576: an MLA latent
  cache ``[num_blocks, 1, block_size, 576]`` is passed as the key cache and its view
  ``[..., :512]`` as the value cache (one row per token, read once, never copied); any
  ``block_size >= 1``.
* Strides: a cache may be any view of that logical shape whose head dimension is
  contiguous (``stride(3) == 1``) and which does not overlap itself, so an NHD cache
  ``[num_blocks, block_size, num_kv_heads, head_size]`` is passed as ``c.transpose(1, 2)``
  and vLLM's joint ``kv[2, num_blocks, block_size, num_kv_heads, head_size]`` as
  ``kv[0].transpose(1, 2)``, ``kv[1].transpose(1, 2)``, without copies
  (:mod:`paged_attention_ext.layouts` builds these views). Key and value caches may have
  different strides. The kernels address blocks, heads and tokens by stride; the
  contiguous HND layout is the fastest.
* fp8 caches (``float8_e4m3fn``: max 448, 3 mantissa bits; ``float8_e5m2``: max 57344,
  2 mantissa bits) take fp32 scales ``k_scale`` and ``v_scale`` of shape ``[]``/``[1]``
  (one per layer, vLLM's convention) or ``[num_kv_heads]`` (one per KV head), on the
  device of the other tensors; both are required with fp8 caches and refused with float
  ones. :func:`write_kv` stores ``fp8(saturate(x.float() / scale[h]))``: round to nearest
  even, finite values and infinities beyond the format's largest finite value saturate to
  it, NaN stays NaN. The attention ops read ``float(stored) * scale[h]`` and compute in
  fp32 as with float caches; their query (and output) may be fp32, fp16 or bf16.
* Per-token caches (:mod:`paged_attention_ext.token_quantization`, vLLM's
  ``int8_per_token_head`` and ``int4_per_token_head``) keep one fp32 scale per (token, KV
  head) row in a tensor beside each cache, passed as ``k_scale`` / ``v_scale`` and paged
  like it (same block ids): ``[num_blocks, num_kv_heads, block_size]`` for int8 (``x = q *
  scale``), ``[num_blocks, num_kv_heads, block_size, 2]`` (scale, low) for int4, whose rows
  are rotated by a fixed random Hadamard transform (``r = q * scale + low``, ``x =
  unrotate(r)``); any strides but the pair's. :func:`write_kv` quantizes each row from its
  own values and writes its scales; the attention ops take a query of any float dtype
  (int4: rotated per head, the output rotated back). Both scale tensors are required.
* Token ``t`` of sequence ``i`` lives in block ``block_tables[i, t // block_size]`` at
  offset ``t % block_size``; its slot is ``block * block_size + offset`` (int64).
* ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``, row ``i`` the physical blocks
  of sequence ``i`` in logical order; entries past its last block are never read.
* ``seq_lens``: int32 ``[num_seqs]``, KV tokens of each sequence *including* this step's
  query tokens (already stored with :func:`write_kv`); 0 marks a padded row.
* Block mappings: int64 ``[num_pairs, 2]`` rows ``(src, dst)``, on the host.

Errors
------
Every argument is checked before anything is written, so a rejected call changes nothing.
Messages name the op and the argument (``paged.attention: block_tables[1, 0] = 99 is not
a block of the cache (num_blocks = 8)``):

* ``ValueError``: a wrong rank or shape, a cache whose head dimension is not contiguous or
  that overlaps itself, a missing scale with an fp8 or per-token cache or a scale with a
  float one, a scale of a wrong shape (per-token: not one per slot of its cache), an int4
  cache whose rows are not half the query's (or key's) head size, head counts that do not
  divide (with a hint when the cache looks like NHD: ``layouts.from_nhd(cache)``), an
  unsupported head size, lengths beyond the block table, inconsistent
  ``query_start_loc``, bad ``scale``/``soft_cap``/``sliding_window``, tensors on mixed
  devices (a meta tensor among CPU ones included), a mapping that writes a block twice or
  reads a block it writes.
* ``TypeError``: a wrong dtype (query, float caches and ``out`` of different float types:
  ``query is float16 but key_cache is float32: ...`` names both sides and the fixes;
  key and value caches of different dtypes, metadata not int32/int64, ALiBi slopes, sinks
  or scales not fp32).
* ``IndexError``: a used block id, a slot or a mapping pair outside its pool.
* ``NotImplementedError``: an argument that requires grad while grad mode is on. The ops
  are for inference and have no backward; call them under ``torch.no_grad()`` or
  ``torch.inference_mode()``, or pass detached tensors.

These wrappers raise these types in every mode. A direct ``torch.ops.paged.*`` call raises
them too, except under ``torch.inference_mode()``, which skips the ops' Python entry
(op_entry.py): there it raises ``RuntimeError`` with the type as a tag in front of the same
message (``[paged:ValueError] paged.attention: ...``).
"""

from typing import Optional, Sequence, Tuple

import torch

from .op_entry import raise_typed

__all__ = [
    "attention",
    "attention_with_lse",
    "attention_out",
    "shared_prefix_attention",
    "merge_attention_states",
    "write_kv",
    "write_latent",
    "copy_blocks",
    "swap_blocks",
    "cpu_isa",
    "select_cpu_isa",
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
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of ``query`` over each sequence's paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, dtype of the caches (fp32, fp16 or
            bf16 with fp8 and per-token caches), last dim contiguous (token and head strides
            are free: a view into a fused QKV works).
        key_cache: ``[num_blocks, num_kv_heads, block_size, head_size]`` (int4:
            ``head_size // 2`` bytes), any strides with
            ``stride(3) == 1`` (see Layouts); ``num_heads % num_kv_heads == 0`` (MHA, GQA,
            MQA): query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        value_cache: ``[num_blocks, num_kv_heads, block_size, head_size_v]``, dtype of
            ``key_cache``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: int32 ``[num_seqs]``; 0 marks a padded row.
        scale: multiplies ``q . k`` (usually ``head_size ** -0.5``).
        query_start_loc: None for decode: ``num_tokens == num_seqs``, row ``i`` is the query
            of sequence ``i`` at position ``seq_lens[i] - 1``. Otherwise int32
            ``[num_seqs + 1]``, cumulative: sequence ``i`` owns rows ``[qsl[i], qsl[i+1])``,
            its *last* ``q_len`` positions, with bottom-right aligned causal masking. One
            call serves prefill, chunked prefill, prefill after a prefix hit, recompute,
            speculative verification, and mixes of these with decode rows and empty rows.
        alibi_slopes: fp32 ``[num_heads]``; adds ``slope[h] * (j - p)`` to the score of key
            position ``j`` for the query at position ``p``.
        sliding_window: ``W > 0`` lets the query at ``p`` see keys ``p - W < j <= p``;
            -1 disables it.
        soft_cap: ``c > 0`` maps each score ``s`` to ``c * tanh(s / c)`` (before ALiBi);
            0 disables it.
        sinks: fp32 ``[num_heads]`` attention sinks (GPT-OSS's learned per-head logits): one
            more logit per head in the softmax denominator that contributes no value. With
            the visible scores ``s_j`` of a query of head ``h``,
            ``out = sum_j e^(s_j) v_j / (e^sink[h] + sum_j e^(s_j))`` (computed with the
            max subtracted); ``-inf`` is no sink. This equals transformers' eager GPT-OSS
            attention. None: no sink.
        k_scale, v_scale: fp32 ``[]``, ``[1]`` or ``[num_kv_heads]``, required with fp8
            caches, None otherwise: key (value) ``x`` stored for KV head ``h`` means
            ``float(x) * k_scale[h]`` (``v_scale[h]``). Per-token caches: their scale
            tensors, one per slot (see Layouts), as :func:`write_kv` wrote them.

    Scores, softmax and accumulation are fp32; the result is rounded once to the output
    dtype.

    Returns:
        A new ``[num_tokens, num_heads, head_size_v]`` tensor in the dtype of ``query``;
        zeros for a row that sees no key (never NaN).

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> from paged_attention_ext import reference
        >>> key_cache = torch.randn(4, 2, 16, 64)    # 4 blocks, 2 KV heads, 16 tokens each
        >>> value_cache = torch.randn(4, 2, 16, 64)
        >>> block_tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
        >>> seq_lens = torch.tensor([20, 5], dtype=torch.int32)
        >>> query = torch.randn(2, 8, 64)            # decode: one query per sequence, GQA 4:1
        >>> out = pa.attention(query, key_cache, value_cache, block_tables, seq_lens, 64 ** -0.5)
        >>> out.shape
        torch.Size([2, 8, 64])
        >>> want = reference.attention(query, key_cache, value_cache, block_tables, seq_lens,
        ...                            64 ** -0.5)
        >>> torch.testing.assert_close(out, want)

    With an fp8 cache (written by :func:`write_kv`, which quantizes) and per-layer scales::

        >>> k8 = torch.empty(4, 2, 16, 64, dtype=torch.float8_e4m3fn)
        >>> v8 = torch.empty_like(k8)
        >>> k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.02)
        >>> slots = torch.arange(4 * 16)
        >>> pa.write_kv(key_cache.transpose(1, 2).reshape(64, 2, 64),
        ...             value_cache.transpose(1, 2).reshape(64, 2, 64), k8, v8, slots, k_scale, v_scale)
        >>> out8 = pa.attention(query, k8, v8, block_tables, seq_lens, 64 ** -0.5,
        ...                     k_scale=k_scale, v_scale=v_scale)
        >>> want8 = reference.attention(query, k8, v8, block_tables, seq_lens, 64 ** -0.5,
        ...                             k_scale=k_scale, v_scale=v_scale)
        >>> torch.testing.assert_close(out8, want8)
        >>> (out8 - out).abs().max().item() < 0.1  # 3 mantissa bits: close to the float cache
        True

    With an int4 cache (per-token scales, written by :func:`write_kv`)::

        >>> from paged_attention_ext.token_quantization import scale_shape
        >>> k4 = torch.empty(4, 2, 16, 32, dtype=torch.uint8)     # 64 values in 32 bytes
        >>> v4 = torch.empty_like(k4)
        >>> k_scales = torch.empty(scale_shape(torch.uint8, 4, 2, 16))   # [4, 2, 16, 2]
        >>> v_scales = torch.empty_like(k_scales)
        >>> pa.write_kv(key_cache.transpose(1, 2).reshape(64, 2, 64),
        ...             value_cache.transpose(1, 2).reshape(64, 2, 64), k4, v4, slots, k_scales, v_scales)
        >>> out4 = pa.attention(query, k4, v4, block_tables, seq_lens, 64 ** -0.5,
        ...                     k_scale=k_scales, v_scale=v_scales)
        >>> want4 = reference.attention(query.double(), k4, v4, block_tables, seq_lens, 64 ** -0.5,
        ...                             k_scale=k_scales, v_scale=v_scales)
        >>> torch.testing.assert_close(out4, want4.float())
    """
    try:
        return torch.ops.paged.attention(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                         query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks,
                                         k_scale, v_scale)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


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
    """:func:`attention` plus the log-sum-exp of each row's scores.

    Returns:
        ``(out, lse)``: ``out`` as in :func:`attention`; ``lse`` fp32
        ``[num_tokens, num_heads]``, the natural log of the softmax denominator:
        ``log(sum_j e^(s_j))``, and with sinks ``log(e^sink[h] + sum_j e^(s_j))`` (the sink
        is included). A row that sees no key gets ``sink[h]`` (``-inf`` without sinks).
        Two results over disjoint keys merge exactly:
        ``o = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)`` (cascade attention, split
        prefill); give sinks to only one of the two calls, or the sink counts twice.

    Example (a 40-token sequence attended in two halves, then merged)::

        >>> import torch, paged_attention_ext as pa
        >>> key_cache, value_cache = torch.randn(3, 1, 16, 32), torch.randn(3, 1, 16, 32)
        >>> query = torch.randn(1, 1, 32)
        >>> whole = pa.attention(query, key_cache, value_cache,
        ...                      torch.tensor([[0, 1, 2]], dtype=torch.int32),
        ...                      torch.tensor([40], dtype=torch.int32), 0.2)
        >>> def part(blocks, length):  # a decode query sees every key of its part
        ...     return pa.attention_with_lse(query, key_cache, value_cache,
        ...                                  torch.tensor([blocks], dtype=torch.int32),
        ...                                  torch.tensor([length], dtype=torch.int32), 0.2)
        >>> o1, lse1 = part([0, 1], 32)
        >>> o2, lse2 = part([2], 8)
        >>> w1, w2 = lse1.exp()[..., None], lse2.exp()[..., None]
        >>> torch.testing.assert_close((o1 * w1 + o2 * w2) / (w1 + w2), whole)
    """
    try:
        return torch.ops.paged.attention_with_lse(query, key_cache, value_cache, block_tables, seq_lens,
                                                  scale, query_start_loc, alibi_slopes, sliding_window,
                                                  soft_cap, sinks, k_scale, v_scale)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


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
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`attention` into caller-owned buffers (fixed addresses for CUDA graphs).

    The op itself is ``torch.ops.paged.attention_out(out, lse, query, ...)``: both buffers
    come first and are declared mutated (``Tensor(a!)``, ``Tensor(b!)?``).

    Args:
        out: ``[num_tokens, num_heads, head_size_v]``, dtype of ``query``, last dim
            contiguous; overwritten.
        lse: optional fp32 ``[num_tokens, num_heads]`` that receives the log-sum-exp
            (as in :func:`attention_with_lse`).
        The other arguments as in :func:`attention`.

    Returns:
        ``out``.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> key_cache, value_cache = torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16)
        >>> tables = torch.tensor([[1, 0]], dtype=torch.int32)
        >>> lens = torch.tensor([9], dtype=torch.int32)
        >>> query, out = torch.randn(1, 2, 16), torch.empty(1, 2, 16)
        >>> pa.attention_out(out, query, key_cache, value_cache, tables, lens, 0.25) is out
        True
        >>> want = pa.attention(query, key_cache, value_cache, tables, lens, 0.25)
        >>> torch.testing.assert_close(out, want)
    """
    try:
        torch.ops.paged.attention_out(out, lse, query, key_cache, value_cache, block_tables, seq_lens,
                                      scale, query_start_loc, alibi_slopes, sliding_window, soft_cap,
                                      sinks, k_scale, v_scale)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise
    return out


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
    """Attention of groups of queries over a prefix each group shares: the first level of
    cascade attention.

    Sequences that share their first blocks (samples or beams of one prompt, requests with
    a common system prompt) read those blocks once per group here instead of once per
    sequence: every prefix block serves all the group's query rows and the query heads of
    its KV head. The rest of each sequence (its suffix) goes to :func:`attention_with_lse`
    with its own block table, and :func:`merge_attention_states` combines the two, exactly
    (:mod:`paged_attention_ext.cascade` plans and runs all three).

    Group ``g`` is one shared prefix: its keys are ``seq_lens[g]`` tokens read through row
    ``g`` of ``block_tables`` (any length, a partial last block included), its queries the
    rows ``[query_start_loc[g], query_start_loc[g + 1])`` of ``query`` (any number; decode
    rows, or several rows per sequence). Every query comes after the whole prefix, so it
    sees every prefix key: no causal mask. A group with ``seq_lens[g] == 0`` sees nothing.

    ALiBi and sliding windows depend on each query's position, which this op does not
    know: it has no such arguments, and a model with either runs the plain op
    (:func:`paged_attention_ext.cascade.plan_cascade` is not used for it).

    Args:
        query, key_cache, value_cache, scale, soft_cap, k_scale, v_scale: as in
            :func:`attention`.
        block_tables: int32 ``[num_groups, max_blocks]``, each group's prefix blocks.
        seq_lens: int32 ``[num_groups]``, each prefix's length in tokens.
        query_start_loc: int32 ``[num_groups + 1]``, cumulative: ``0`` first, ``num_tokens``
            last.
        sinks: as in :func:`attention`; counted in this op's ``lse``, so give them to this
            op only, not also to the suffix's :func:`attention_with_lse`.

    Returns:
        ``(out, lse)`` as :func:`attention_with_lse` returns them.

    Example (two samples of one 20-token prompt, each with 3 tokens of its own)::

        >>> import torch, paged_attention_ext as pa
        >>> key_cache, value_cache = torch.randn(6, 2, 16, 32), torch.randn(6, 2, 16, 32)
        >>> tables = torch.tensor([[4, 1, 2], [4, 1, 3]], dtype=torch.int32)  # block 4 shared
        >>> lens = torch.tensor([19, 19], dtype=torch.int32)
        >>> query = torch.randn(2, 4, 32)                    # decode rows, GQA 2:1
        >>> whole = pa.attention(query, key_cache, value_cache, tables, lens, 0.2)
        >>> prefix = pa.shared_prefix_attention(
        ...     query, key_cache, value_cache, tables[:1, :1], torch.tensor([16], dtype=torch.int32),
        ...     torch.tensor([0, 2], dtype=torch.int32), 0.2)
        >>> suffix = pa.attention_with_lse(query, key_cache, value_cache, tables[:, 1:],
        ...                                lens - 16, 0.2)
        >>> out, lse = pa.merge_attention_states([prefix[0], suffix[0]], [prefix[1], suffix[1]])
        >>> torch.testing.assert_close(out, whole)
    """
    try:
        return torch.ops.paged.shared_prefix_attention(query, key_cache, value_cache, block_tables,
                                                       seq_lens, query_start_loc, scale, soft_cap,
                                                       sinks, k_scale, v_scale)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


def merge_attention_states(outputs: Sequence[torch.Tensor],
                           lses: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results over disjoint keys into one, by their log-sum-exps.

    With ``w_k = exp(lses[k] - max_k lses[k])`` per (row, head):
    ``out = sum_k w_k outputs[k] / sum_k w_k`` and ``lse = max + log(sum_k w_k)``, so
    the result equals attention over the union of the parts' keys (and merges again). A
    part with ``lse = -inf`` saw no key and is not read (its output may hold anything); a
    row no part saw gets 0 and ``-inf``; a NaN ``lse`` makes the row NaN.

    Args:
        outputs: 1 to 16 tensors ``[num_tokens, num_heads, head_size]`` of one float dtype
            and shape, last dim contiguous (other strides free).
        lses: fp32 ``[num_tokens, num_heads]`` each, as :func:`attention_with_lse` and
            :func:`shared_prefix_attention` return them.

    Returns:
        ``(out, lse)``: new contiguous tensors, ``out`` in the outputs' dtype (computed in
        fp32), ``lse`` fp32.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> o1, o2 = torch.ones(1, 2, 4), torch.zeros(1, 2, 4)
        >>> lse1, lse2 = torch.zeros(1, 2), torch.tensor([[0.0, float("-inf")]])
        >>> out, lse = pa.merge_attention_states([o1, o2], [lse1, lse2])
        >>> out[0, :, 0].tolist(), lse[0].tolist()   # head 0: equal weights; head 1: only o1
        ([0.5, 1.0], [0.6931471824645996, 0.0])
    """
    if not outputs:  # the dispatcher needs a tensor to pick a backend
        raise ValueError("paged.merge_attention_states: arguments 'outputs' and 'lses' must list "
                         "the same number (>= 1) of partial results, got none")
    try:
        return torch.ops.paged.merge_attention_states(list(outputs), list(lses))
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Store each token's key and value into its cache slot, in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``, dtype of the caches (fp32, fp16 or
            bf16 with fp8 and per-token caches), last dim contiguous (e.g. a view into a fused QKV
            projection).
        value: ``[num_tokens, num_kv_heads, head_size_v]``, dtype of ``key``.
        key_cache, value_cache: the layer's caches (any view of the Layouts), modified in
            place.
        slot_mapping: int64 ``[num_tokens]``; token ``t`` goes to slot ``slot_mapping[t]``
            (``block * block_size + offset``); negative slots are padding and are skipped.
            Slots must be distinct (two tokens writing one slot leave either value).
        k_scale, v_scale: fp32 ``[]``, ``[1]`` or ``[num_kv_heads]``, required with fp8
            caches, None otherwise: the cache stores ``fp8(saturate(key / k_scale[h]))``
            per KV head ``h`` (round to nearest even; beyond the largest finite value,
            infinities included, the largest finite value; NaN stays NaN), the same for
            values. Per-token caches: their scale tensors (see Layouts), written in place:
            each row's scale (int8: ``amax / 127``; int4: ``(scale, low)`` of the rotated
            row) at the row's block, head and offset.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> key_cache, value_cache = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
        >>> key, value = torch.ones(3, 1, 8), torch.full((3, 1, 8), 2.0)
        >>> pa.write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 0]))
        >>> key_cache[1, 0, 1].sum().item(), value_cache[0, 0, 0].sum().item()
        (8.0, 16.0)
        >>> key_cache.sum().item()  # the padding token (slot -1) was not stored
        16.0

    Quantizing into an fp8 cache, one scale per KV head, through an NHD view::

        >>> k8 = torch.zeros(2, 4, 2, 8, dtype=torch.float8_e4m3fn)   # NHD: [blocks, 4, 2 heads, 8]
        >>> v8 = torch.zeros_like(k8)
        >>> scales = torch.tensor([0.5, 2.0])
        >>> key = torch.tensor([1.0, 3.0, 1000.0, float("nan")]).repeat(1, 2, 2)   # [1, 2, 8]
        >>> pa.write_kv(key, key, k8.transpose(1, 2), v8.transpose(1, 2), torch.tensor([6]),
        ...             scales, scales)
        >>> k8[1, 2, 0, :4].float().tolist()   # head 0: x / 0.5, 2000 saturates to 448
        [2.0, 6.0, 448.0, nan]
        >>> k8[1, 2, 1, :4].float().tolist()   # head 1: x / 2.0
        [0.5, 1.5, 448.0, nan]

    Quantizing into an int8 cache, one scale per row, written beside it::

        >>> k_int8, v_int8 = torch.zeros(2, 2, 4, 8, dtype=torch.int8), torch.zeros(2, 2, 4, 8, dtype=torch.int8)
        >>> k_s, v_s = torch.zeros(2, 2, 4), torch.zeros(2, 2, 4)
        >>> key = torch.tensor([1.0, -2.0, 0.5, 254.0, 0.0, 0.0, 0.0, 0.0]).repeat(1, 2, 1)   # [1, 2, 8]
        >>> pa.write_kv(key, key, k_int8, v_int8, torch.tensor([6]), k_s, v_s)
        >>> k_s[1, 0, 2].item(), k_int8[1, 0, 2, :4].tolist()   # scale 254 / 127 = 2
        (2.0, [0, -1, 0, 127])
    """
    try:
        torch.ops.paged.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


def write_latent(
    latent: torch.Tensor,
    rotary_key: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
) -> None:
    """Store each token's MLA latent row ``[latent | rotary_key]`` into its cache slot, in
    place (vLLM's ``concat_and_cache_mla``).

    An MLA latent cache holds one row per token: the KV latent (``kv_lora_rank`` columns)
    then the rotated key (``qk_rope_head_dim``); attention reads the whole row as the key
    and its leading ``kv_lora_rank`` columns (``cache[..., :latent_size]``, a view) as the
    value. This op stores the row whole, so a quantized cache quantizes it once, under one
    scale that serves both views.

    Args:
        latent: ``[num_tokens, num_kv_heads, latent_size]`` (MLA: one KV head), fp32, fp16
            or bf16, last dim contiguous.
        rotary_key: ``[num_tokens, num_kv_heads, rotary_size]``, dtype of ``latent``, last
            dim contiguous.
        cache: ``[num_blocks, num_kv_heads, block_size, latent_size + rotary_size]`` (int4:
            half that many bytes), any view of the Layouts, modified in place.
        slot_mapping: int64 ``[num_tokens]`` as :func:`write_kv`'s (negative: padding).
        scale: a float cache: None (rows are cast to its dtype; the CUDA kernel takes
            rows of the cache's dtype only). fp8: fp32 ``[]``, ``[1]`` or
            ``[num_kv_heads]``, read only: ``fp8(saturate(row / scale[h]))`` as
            :func:`write_kv`. Per-token (int8, int4): the cache's scale tensor (see Layouts),
            written in place: each row's int8 scale (``amax / 127`` of the whole row) or int4
            ``(scale, low)`` of the whole row rotated (``rotation_block(576)`` = 64-channel
            blocks for DeepSeek's rows). Attention over the cache then takes this tensor as
            both ``k_scale`` and ``v_scale``.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> cache, scale = torch.zeros(2, 1, 4, 8, dtype=torch.int8), torch.zeros(2, 1, 4)
        >>> latent, rotary = torch.tensor([[[1.0, -2.0, 0.0, 0.0, 0.0, 254.0]]]), torch.full((1, 1, 2), 4.0)
        >>> pa.write_latent(latent, rotary, cache, torch.tensor([5]), scale)
        >>> scale[1, 0, 1].item(), cache[1, 0, 1].tolist()   # one scale, 254 / 127, for the row
        (2.0, [0, -1, 0, 0, 0, 127, 2, 2])
    """
    try:
        torch.ops.paged.write_latent(latent, rotary_key, cache, slot_mapping, scale)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For every layer ``l`` and row ``(src, dst)``: ``caches[l][dst] = caches[l][src]``.

    One call serves the copy-on-write and fork copies of all layers. Layer ``l``'s
    ``key_caches[l]`` and ``value_caches[l]`` have one dtype (fp8 included: blocks move as
    bytes, their scales are the layer's; a per-token cache's scale tensors, fp32 3-D or
    4-D, are passed as layers of their own beside it) and block layout but may differ in head size and
    strides (any view of the Layouts); every layer has the same ``num_blocks``. ``block_mapping`` is int64
    ``[num_pairs, 2]``; the copies are independent, so a destination appears once and is
    not also a source (checked).

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> keys = [torch.randn(4, 2, 8, 16) for _ in range(3)]       # 3 layers
        >>> values = [torch.randn(4, 2, 8, 16) for _ in range(3)]
        >>> pa.copy_blocks(keys, values, torch.tensor([[0, 3], [1, 2]]))
        >>> all(torch.equal(c[3], c[0]) and torch.equal(c[2], c[1]) for c in keys + values)
        True
    """
    try:
        torch.ops.paged.copy_blocks(list(key_caches), list(value_caches), block_mapping)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[d] = src[s]`` for each row ``(s, d)`` of int64 ``block_mapping`` ``[num_pairs, 2]``.

    ``src`` and ``dst`` are pools of one dtype (fp8 and per-token included: call it for
    a per-token cache's scale tensors too, with the same mapping) and block shape and any
    number of blocks, e.g. a device cache and its (pinned) host swap space; call it once
    per K and V pool. Either may be a strided view (see Layouts; ``dst`` must not overlap
    itself); blocks that are one dense chunk of the same layout in both move as one copy.
    On CUDA, copies to or from pinned host memory run asynchronously on the current
    stream: synchronise it (``torch.cuda.current_stream().synchronize()``) before the CPU
    reads or writes a pinned pool. A captured CUDA graph replays the block pairs of the
    capture and needs pinned host pools.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> device_pool, host_pool = torch.randn(8, 2, 16, 64), torch.zeros(2, 2, 16, 64)
        >>> pa.swap_blocks(device_pool, host_pool, torch.tensor([[5, 0], [2, 1]]))
        >>> torch.equal(host_pool[0], device_pool[5]) and torch.equal(host_pool[1], device_pool[2])
        True
    """
    try:
        torch.ops.paged.swap_blocks(src, dst, block_mapping)
    except RuntimeError as error:  # inference mode skips the entry's translation
        raise_typed(error)
        raise


# The CPU kernels' instruction sets, each a superset of the ones before it.
CPU_ISAS = ("generic", "avx2", "avx512", "avx512_vbmi", "avx512_bf16", "amx")


def cpu_isa() -> str:
    """The instruction set the CPU attention kernel uses, one of :data:`CPU_ISAS`, chosen at
    run time: ``amx`` (``avx512_bf16`` plus AMX tile products for bf16 and fp8 caches with a
    bf16 query), ``avx512_bf16`` (AVX-512 with bf16 dot products), ``avx512_vbmi`` (AVX-512
    with fp8 converted by AVX512_VBMI byte permutes), ``avx512``, ``avx2`` or ``generic``.
    By default the best the CPU runs, except that where a ``vdpbf16ps`` does fewer
    multiply-adds per cycle than fp32 FMAs (measured once, ~0.1 ms; the Xeons with AMX so
    far), ``avx512_vbmi`` runs instead of ``avx512_bf16``, and the ``amx`` kernel hands the
    items its tiles do not take to ``avx512_vbmi`` too. Or ``amx_emulated``, only when asked
    for: the ``amx`` kernel on a software model of its tiles, for testing it on CPUs with
    ``avx512_bf16`` but no AMX (slow; not one of :data:`CPU_ISAS`, which rank the
    instruction sets).

    The choice is made once per process, when the library first runs a kernel: the
    environment variable ``PAGED_ATTENTION_CPU_ISA`` may name any instruction set the CPU
    runs (for testing every path); one it lacks, or an unknown name, makes every call raise
    its ``ValueError``. Changing the variable later changes nothing until
    :func:`select_cpu_isa`.

    Example::

        >>> import paged_attention_ext as pa
        >>> pa.cpu_isa() in pa.CPU_ISAS
        True
    """
    return torch.ops.paged.cpu_isa()


def select_cpu_isa(isa: Optional[str] = None) -> str:
    """Chooses the CPU attention kernel of every later call in this process (for tests and
    benchmarks that compare kernels): ``isa``, one of :data:`CPU_ISAS` that the CPU runs (or
    ``amx_emulated`` where it runs ``avx512_bf16``; see :func:`cpu_isa`), or with None the one ``PAGED_ATTENTION_CPU_ISA`` names now (unset: the default of
    :func:`cpu_isa`). Returns the chosen name. A name that is unknown or beyond this CPU
    raises a ``ValueError`` that names it as it came (``select_cpu_isa('amx')``, or with None
    ``PAGED_ATTENTION_CPU_ISA=amx``) and keeps the current choice.

    Example::

        >>> import paged_attention_ext as pa
        >>> pa.select_cpu_isa("generic")
        'generic'
        >>> pa.cpu_isa()
        'generic'
        >>> pa.select_cpu_isa() in pa.CPU_ISAS  # back to what the environment asks for
        True
    """
    return torch.ops.paged.select_cpu_isa(isa)
