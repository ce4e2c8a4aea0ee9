"""The paged ops inside transformers' continuous batching.

transformers' continuous batching (``model.generate_batch(...)``, the
``ContinuousBatchingManager``) keeps its own paged KV cache. Its name for this
implementation is :data:`CB_ATTN_IMPLEMENTATION`: ``paged|paged_attention_ext`` up to
transformers 5.18, ``paged_attention_ext`` from 5.19 (which strips the ``paged|`` prefix
and runs one name for ``generate`` and continuous batching; its allowlist is extended in
hooks/cb_attention_allowlist.py). transformers calls the attention in one of two ways:

* with the cache (``cache=``, transformers <= 5.23): ``paged|sdpa`` would write each
  layer's new keys and values with ``index_copy_``, gather every request's whole history
  back with ``index_select`` and run SDPA under a dense mask. This function instead stores
  the new keys and values with ``paged.write_kv`` and attends with the multi-token
  ``paged.attention`` straight over transformers' pages: no gather, no mask.
* after the model's own ``cache.update`` (transformers >= 5.24): the cache is not passed,
  the keys and values arrive gathered, request after request (``cu_seq_lens_k``), and the
  op attends over them as a cache of one-token blocks (a strided view, no copy).

How transformers' cache maps onto the ops (full-attention layers, first form):

* The cache is one flat buffer of pages of ``page_size`` tokens, each page
  ``[page_size, num_kv_heads, head_dim]`` (NHD). The layer's allocator's
  ``get_cache_for_block_table(layer)`` returns the key and value page views
  ``[pages, page_size, kv_heads, head_dim]``; their ``transpose(1, 2)`` is the ops' logical
  ``[blocks, kv_heads, block_size, head_size]`` with block = page (a strided view, no copy).
* A write index ``w`` (a token row of the layer's view) is page ``w // page_size`` at
  offset ``w % page_size``: it *is* the ops' slot. Padding tokens write to
  transformers' trash page, as with ``paged|sdpa``.
* The read index lists, request by request (``cu_seq_lens_k``), the rows of every
  cached and new token in order, so the page of request ``r``'s ``j``-th block is
  ``read_index[cu_seq_lens_k[r] + j * page_size] // page_size``. The block tables are
  derived so once per forward, and checked to reproduce every read and write index;
  a cache whose indices they do not reproduce raises instead of attending elsewhere.

Sliding-window layers: transformers keeps them in a ring buffer of ``sliding_window``
slots per request (its sliding allocator, which frees what leaves the window), which
block tables cannot address; their keys are read back through the cache's own
``update`` (the window's ring slots in position order, then the new tokens) and the op
attends over that gather with the layer's window, as in the second form. Attention sinks
(GPT-OSS's ``s_aux``) are applied. The decode fast path's ``block_table`` (flash-only in
transformers) and any other unknown argument raise ``NotImplementedError``.
Models with linear-attention layers (Qwen3-Next, ...) are refused (transformers' continuous
batching has no allocator for their states). Importing :mod:`paged_attention_ext.hf`
registers the function.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple
import weakref

import torch
import transformers

from .. import ops
from ..attention_metadata import AttentionMetadata
from .self_check import verify_architecture
from .support import refuse_unapplied_kwargs, sink_logits_of
from .transformers_behaviour import STRIPS_PAGED_PREFIX, read_window

CB_ATTN_IMPLEMENTATION = "paged_attention_ext" if STRIPS_PAGED_PREFIX else "paged|paged_attention_ext"


# Arguments continuous batching passes to every attention call that do not change the
# result here (positions are already in the rotary embeddings and the indices).
IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "max_seqlen_q", "max_seqlen_k",
                            "max_length_q", "max_length_k", "logits_indices",
                            "logits_processor_args"})


class BatchLayout(NamedTuple):
    """One forward's metadata for the ops, derived from transformers' indices."""

    attention: AttentionMetadata
    # Rows past this are padding (compiled / CUDA-graph batches pad the query).
    num_query_tokens: int


# Per transformers cache and layer group: the index tensors the last layout was derived
# from (continuous batching passes the same tensor objects to every layer of one forward
# and new views of its rewritten buffers to the next), their versions, and that layout.
# The strong references keep the identity check sound.
_Derived = Tuple[Tuple[torch.Tensor, ...], Tuple[int, ...], BatchLayout]
_LAYOUTS: "weakref.WeakKeyDictionary[object, Dict[int, _Derived]]" = weakref.WeakKeyDictionary()


def derive_layout(read_index: torch.Tensor, write_index: torch.Tensor, cu_seq_lens_q: torch.Tensor,
                  cu_seq_lens_k: torch.Tensor, page_size: int) -> BatchLayout:
    """Block tables, sequence lengths and query starts of a continuous-batching forward.

    Raises ValueError when the indices are not the page-contiguous pattern of
    transformers' full-attention allocator (the derived tables would read other rows).
    """
    device = write_index.device
    cu_q = cu_seq_lens_q.to(device=device, dtype=torch.int64)
    cu_k = cu_seq_lens_k.to(device=device, dtype=torch.int64)
    if read_index.numel() == 0:
        # No request has cached tokens (fresh prefills only): the writes are all the keys.
        if not torch.equal(cu_q, cu_k):
            raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: an empty read index with cached keys "
                             f"(cu_seq_lens_q {cu_q.tolist()} != cu_seq_lens_k {cu_k.tolist()})")
        read_index = write_index
    seq_lens = cu_k[1:] - cu_k[:-1]
    q_lens = cu_q[1:] - cu_q[:-1]
    if bool((q_lens > seq_lens).any()):
        raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: a request has more query tokens than keys "
                         f"(cu_seq_lens_q {cu_q.tolist()}, cu_seq_lens_k {cu_k.tolist()})")
    num_keys = int(cu_k[-1])
    num_query_tokens = int(cu_q[-1])
    if read_index.numel() < num_keys or write_index.numel() < num_query_tokens:
        raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: {read_index.numel()} read and "
                         f"{write_index.numel()} write indices for {num_keys} keys and "
                         f"{num_query_tokens} query tokens")

    max_blocks = max(1, -(-int(seq_lens.max()) // page_size)) if seq_lens.numel() else 1
    first = cu_k[:-1, None] + torch.arange(max_blocks, device=device) * page_size
    used = first < cu_k[1:, None]
    first_rows = read_index[first.clamp(max=max(num_keys - 1, 0))]
    block_tables = torch.where(used, first_rows // page_size, 0)

    # Check that the tables reproduce every read row and, for each request's last
    # q_len positions, the write rows (so write_kv stores where attention reads).
    request = torch.repeat_interleave(torch.arange(seq_lens.numel(), device=device), seq_lens)
    position = torch.arange(num_keys, device=device) - cu_k[:-1][request]
    expected = block_tables[request, position // page_size] * page_size + position % page_size
    query_request = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens)
    query_key = (cu_k[1:] - q_lens)[query_request] + (
        torch.arange(num_query_tokens, device=device) - cu_q[:-1][query_request])
    if not (torch.equal(expected, read_index[:num_keys])
            and torch.equal(expected[query_key], write_index[:num_query_tokens])):
        raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: transformers' read/write indices are not "
                         "page-contiguous per request; block tables cannot address this cache")
    return BatchLayout(AttentionMetadata(block_tables.to(torch.int32), seq_lens.to(torch.int32),
                                         cu_q.to(torch.int32)), num_query_tokens)


def _layout(cache, group: int, read_index: torch.Tensor, write_index: torch.Tensor,
            cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, page_size: int) -> BatchLayout:
    """The forward's layout, derived by its first layer and reused by the others."""
    tensors = (read_index, write_index, cu_seq_lens_q, cu_seq_lens_k)
    versions = tuple(t._version for t in tensors)
    per_cache = _LAYOUTS.setdefault(cache, {})
    last = per_cache.get(group)
    if (last is not None and all(a is b for a, b in zip(last[0], tensors))
            and last[1] == versions):
        return last[2]
    layout = derive_layout(read_index, write_index, cu_seq_lens_q, cu_seq_lens_k, page_size)
    per_cache[group] = (tensors, versions, layout)
    return layout


def _layer_allocator(cache, module: torch.nn.Module, sliding_window: Optional[int]):
    """The layer's allocator: full attention (pages the ops address) or a sliding window
    of the layer's own length (read back through the cache); anything else raises."""
    allocator = cache.layer_to_allocator[module.layer_idx]
    window = getattr(allocator, "sliding_window", None)
    if getattr(allocator, "supports_block_table", False) and window is None:
        if sliding_window is not None:
            raise NotImplementedError(
                f"{CB_ATTN_IMPLEMENTATION}: layer {module.layer_idx} attends with sliding_window="
                f"{sliding_window} but is cached by the full-attention {type(allocator).__name__}")
        return allocator
    if window is None or window != sliding_window:
        raise NotImplementedError(
            f"{CB_ATTN_IMPLEMENTATION}: layer {module.layer_idx} (sliding_window={sliding_window}) is "
            f"cached by {type(allocator).__name__} (window {window}), which the paged ops cannot "
            "read; use sdpa for this model")
    return allocator


def _refuse_unsupported(module: torch.nn.Module, attention_mask, dropout: float, block_table,
                        kwargs: Dict) -> None:
    layer = f"layer {module.layer_idx} ({type(module).__name__})"
    if "linear_attention" in (getattr(getattr(module, "config", None), "layer_types", None) or ()):
        # transformers' continuous batching keeps no linear-attention states (5.25 refuses
        # such models itself); should a release start to, it is untested here: refused.
        raise NotImplementedError(
            f"{CB_ATTN_IMPLEMENTATION}: {layer} belongs to a model with linear-attention layers, "
            "whose states transformers' continuous batching does not hold for this "
            "implementation; use generate() with a PagedCache")
    if attention_mask is not None:
        raise NotImplementedError(f"{CB_ATTN_IMPLEMENTATION}: {layer} got an attention mask; "
                                  "attention follows the cache's indices (causal) and cannot apply it")
    if dropout:
        raise NotImplementedError(f"{CB_ATTN_IMPLEMENTATION}: {layer} asked for attention "
                                  f"dropout {dropout} (training); the paged ops are for inference")
    if block_table is not None:
        raise NotImplementedError(
            f"{CB_ATTN_IMPLEMENTATION}: {layer} got a decode block_table (transformers' flash "
            "decode fast path); set ContinuousBatchingConfig(max_blocks_per_request=0)")
    # None and False (output_attentions=False, ...) ask for nothing.
    refuse_unapplied_kwargs(kwargs, IGNORED_KWARGS, f"{CB_ATTN_IMPLEMENTATION}: {layer}",
                            unset=(None, False))


def _check_causal(module: torch.nn.Module, is_causal) -> None:
    if is_causal is False:
        raise NotImplementedError(f"{CB_ATTN_IMPLEMENTATION}: layer {module.layer_idx} asked for "
                                  "non-causal attention; the paged ops are causal")


def _keys_of_type(cu_seq_lens_k, module: torch.nn.Module, sliding_window: Optional[int]):
    """``cu_seq_lens_k`` of the layer's type (transformers passes one per type for hybrid models)."""
    if not isinstance(cu_seq_lens_k, dict):
        return cu_seq_lens_k
    kind = "sliding_attention" if sliding_window is not None else "full_attention"
    if kind not in cu_seq_lens_k:
        raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: layer {module.layer_idx} is {kind} but "
                         f"cu_seq_lens_k has {sorted(cu_seq_lens_k)}")
    return cu_seq_lens_k[kind]


def _attend_over_pages(module, query, key, value, scale, softcap, sinks, cache, allocator,
                       read_index, write_index, cu_seq_lens_q, cu_seq_lens_k) -> torch.Tensor:
    """Store the new K/V in transformers' pages and attend over them (the ``cache=`` form)."""
    group = allocator.index
    layout = _layout(cache, group, read_index[group], write_index[group], cu_seq_lens_q,
                     cu_seq_lens_k, allocator.tokens_per_page)
    key_pages, value_pages = allocator.get_cache_for_block_table(module.layer_idx)
    # [pages, page_size, kv_heads, head_dim] -> the ops' [blocks, kv_heads, block_size, head_dim].
    key_cache, value_cache = key_pages.transpose(1, 2), value_pages.transpose(1, 2)
    tokens, head_dim = query.shape[2], query.shape[3]
    if key.shape[1] != key_cache.shape[1] or head_dim != key_cache.shape[-1]:
        if getattr(getattr(module, "config", None), "kv_lora_rank", None) is not None:
            # Before 5.24 transformers' pages are sized for compressed heads, not the
            # expanded K/V an MLA layer attends with: nothing here could address them.
            raise NotImplementedError(
                f"{CB_ATTN_IMPLEMENTATION}: continuous batching of a multi-head latent attention "
                f"model (kv_lora_rank) needs transformers 5.24 or later (this is "
                f"{transformers.__version__}, whose paged cache holds {tuple(key_pages.shape)} "
                f"pages for keys of {tuple(key.shape)}); upgrade transformers, or use generate "
                "with a PagedCache or the reference engine")
        raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: layer {module.layer_idx} has keys "
                         f"{tuple(key.shape)}, its cache pages {tuple(key_pages.shape)}")
    # [1, kv_heads, tokens, head_dim] -> [tokens, kv_heads, head_dim]
    new_keys = key[0].transpose(0, 1).to(key_cache.dtype)
    new_values = value[0].transpose(0, 1).to(value_cache.dtype)
    ops.write_kv(new_keys, new_values, key_cache, value_cache, write_index[group][:tokens])
    q = query[0].transpose(0, 1)[:layout.num_query_tokens].to(key_cache.dtype)
    return layout.attention.run(q, key_cache, value_cache, scale, soft_cap=softcap or 0.0,
                                sinks=sinks)


def _attend_over_gathered(module, query, key, value, scale, softcap, sinks, sliding_window,
                          cu_seq_lens_q, cu_seq_lens_k) -> torch.Tensor:
    """Attend over K/V gathered request after request (by the model's ``cache.update``, or
    read back from a sliding window's ring buffer): ``key`` ``[1, kv_heads, keys, head_dim]``."""
    device = key.device
    cu_q = cu_seq_lens_q.to(device=device, dtype=torch.int64)
    cu_k = cu_seq_lens_k.to(device=device, dtype=torch.int64)
    seq_lens = cu_k[1:] - cu_k[:-1]
    num_keys, num_query_tokens = int(cu_k[-1]), int(cu_q[-1])
    if key.shape[2] < num_keys or bool(((cu_q[1:] - cu_q[:-1]) > seq_lens).any()):
        raise ValueError(f"{CB_ATTN_IMPLEMENTATION}: layer {module.layer_idx} got {key.shape[2]} keys "
                         f"for cu_seq_lens_k {cu_k.tolist()} and cu_seq_lens_q {cu_q.tolist()}")
    # [1, kv_heads, keys, head_dim] -> [keys, kv_heads, 1, head_dim]: block b is key b.
    key_cache = key[0].transpose(0, 1).unsqueeze(2)
    value_cache = value[0].transpose(0, 1).unsqueeze(2)
    longest = max(1, int(seq_lens.max())) if seq_lens.numel() else 1
    # Entries past a request's length are never read; clamped to stay valid block ids.
    block_tables = (cu_k[:-1, None] + torch.arange(longest, device=device)).clamp(
        max=max(key.shape[2] - 1, 0)).to(torch.int32)
    q = query[0].transpose(0, 1)[:num_query_tokens].to(key_cache.dtype)
    return ops.attention(q, key_cache, value_cache, block_tables, seq_lens.to(torch.int32), scale,
                         cu_q.to(torch.int32), None, sliding_window or -1, softcap or 0.0, sinks)


def _attend_over_window(module, query, key, value, scale, softcap, sinks, sliding_window, cache,
                        read_index, write_index, cu_seq_lens_q, cu_seq_lens_k,
                        max_length_k) -> torch.Tensor:
    """A sliding-window layer (the ``cache=`` form): the cache stores the new K/V in its ring
    buffer and returns the window's keys in position order, which the op attends over."""
    keys, values = read_window(cache, key, value, module.layer_idx, read_index, write_index,
                               cu_seq_lens_k, max_length_k)
    # [keys, kv_heads, head_dim] -> [1, kv_heads, keys, head_dim]
    return _attend_over_gathered(module, query, keys.transpose(0, 1).unsqueeze(0),
                                 values.transpose(0, 1).unsqueeze(0), scale, softcap, sinks,
                                 sliding_window, cu_seq_lens_q,
                                 _keys_of_type(cu_seq_lens_k, module, sliding_window))


@torch.compiler.disable  # as transformers' own paged functions: the cache is mutated in place
def continuous_batching_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    cache=None,
    read_index: Optional[List[torch.Tensor]] = None,
    write_index: Optional[List[torch.Tensor]] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k=None,
    block_table: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """Attention of one layer of a continuous-batching forward.

    ``query`` is ``[1, heads, tokens, head_dim]``, ``key``/``value``
    ``[1, kv_heads, tokens, head_dim]``: all requests' new tokens packed, delimited by
    ``cu_seq_lens_q`` (with ``cache``), or every request's cached and new keys, delimited by
    ``cu_seq_lens_k`` (without). Returns ``[1, tokens, heads, head_dim]``.
    """
    if write_index is None or cu_seq_lens_q is None or cu_seq_lens_k is None:
        raise ValueError(
            f"{CB_ATTN_IMPLEMENTATION} runs inside transformers' continuous batching "
            "(model.generate_batch, init_continuous_batching), which passes its paged cache's "
            "indices; for generate() use attn_implementation='paged_attention_ext' with a PagedCache")
    _refuse_unsupported(module, attention_mask, dropout, block_table, kwargs)
    if getattr(module, "config", None) is not None:
        verify_architecture(module.config)  # a no-op on tested transformers releases
    allocator = _layer_allocator(cache, module, sliding_window) if cache is not None else None
    _check_causal(module, is_causal)
    _, heads, tokens, head_dim = query.shape
    scale = scaling if scaling is not None else head_dim ** -0.5
    sink_logits = sink_logits_of(module, s_aux, sinks, heads, query.device)
    if allocator is None:  # transformers >= 5.24: the model's cache.update gathered the K/V
        out = _attend_over_gathered(module, query, key, value, scale, softcap, sink_logits,
                                    sliding_window, cu_seq_lens_q,
                                    _keys_of_type(cu_seq_lens_k, module, sliding_window))
    elif sliding_window is None:
        out = _attend_over_pages(module, query, key, value, scale, softcap, sink_logits, cache,
                                 allocator, read_index, write_index, cu_seq_lens_q,
                                 _keys_of_type(cu_seq_lens_k, module, sliding_window))
    else:
        out = _attend_over_window(module, query, key, value, scale, softcap, sink_logits,
                                  sliding_window, cache, read_index, write_index, cu_seq_lens_q,
                                  cu_seq_lens_k, kwargs.get("max_length_k"))
    if out.shape[0] < tokens:
        # Padding rows: zeros, nothing reads them.
        out = torch.cat([out, out.new_zeros(tokens - out.shape[0], heads, out.shape[-1])])
    return out.unsqueeze(0).to(query.dtype), None
