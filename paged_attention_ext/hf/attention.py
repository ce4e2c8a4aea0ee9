"""The ``paged_attention_ext`` attention implementation for transformers models.

transformers calls an attention function per layer with the layer's new queries,
keys and values (``[batch, heads, tokens, head_size]``). This one attends with
``paged.attention`` over the block tables of the forward's :class:`PagedBatch`, which
comes from one of two places:

* the ``paged_batch`` keyword argument (the engine's packed forward): the function
  also stores the keys and values with ``paged.write_kv`` (for an MLA model kept as latent
  rows, the forward's :class:`~paged_attention_ext.hf.packed_latents.PackedLatentCache`
  has stored them in ``update``, and this function reads them with ``kv_b_proj`` absorbed);
* the :class:`~paged_attention_ext.hf.PagedCache` passed as ``past_key_values``: its
  ``update`` has already stored them and published the batch for this layer call
  (for MLA models, whose ``update`` gets compressed latents, this function reads the
  latent rows with ``kv_b_proj`` absorbed, :mod:`.latent_attention`, or, with
  ``mla_storage="expanded"``, stores the keys and values transformers expanded from them).

Every keyword argument transformers passes either is applied (``scaling``,
``sliding_window``, ``softcap``, attention sinks as ``s_aux``/``sinks``; a chunked layer's
chunks come with its KV group's metadata) or known not to
change the result (``position_ids``: positions are already in the rotary embeddings and
in the block tables); anything else raises instead of being ignored.
"""

from typing import Optional, Tuple

import torch

from .batch import PagedBatch, flat_tokens
from .continuous_batching import continuous_batching_attention_forward
from .handoff import take_batch
from .latent_prefill import latent_attention
from .support import refuse_unapplied_kwargs, sink_logits_of

# Keyword arguments that reach attention functions and do not change what they compute.
IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "output_hidden_states",
                            "output_router_logits", "return_dict", "cache_position"})


def _refuse_unsupported(module, attention_mask, dropout, is_causal, output_attentions,
                        kwargs) -> None:
    layer = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
    if attention_mask is not None:
        raise NotImplementedError(
            f"paged_attention_ext: {layer} got an attention_mask tensor (a custom 4D mask, or one "
            "built outside the paged_attention_ext mask function); attention follows the block "
            "tables (causal, with the layer's sliding window) and cannot apply it")
    if dropout:
        raise NotImplementedError(f"paged_attention_ext: {layer} asked for attention dropout "
                                  f"{dropout} (training); the paged ops are for inference")
    if is_causal is False:
        raise NotImplementedError(f"paged_attention_ext: {layer} asked for non-causal attention "
                                  "(is_causal=False); the paged ops are causal")
    if output_attentions:
        raise NotImplementedError(f"paged_attention_ext: {layer}: output_attentions=True is not "
                                  "supported (the paged ops return no attention weights)")
    refuse_unapplied_kwargs(kwargs, IGNORED_KWARGS, f"paged_attention_ext: {layer}")


def _check_window(module: torch.nn.Module, sliding_window: Optional[int], batch: PagedBatch) -> None:
    """A layer must not see further back than its KV group keeps blocks for."""
    group = batch.kv_cache.kv_groups.groups[batch.kv_cache.kv_group(module.layer_idx)]
    kept = group.sliding_window
    if group.chunk_size is not None:
        # The group's metadata attends within each chunk; a window on top is not applied.
        if sliding_window is not None:
            raise NotImplementedError(
                f"paged_attention_ext: layer {module.layer_idx} is a chunked-attention layer "
                f"(chunks of {group.chunk_size} tokens) and also asks for sliding_window="
                f"{sliding_window}, which chunked layers do not apply")
        return
    if kept is not None and not (sliding_window is not None and 0 < sliding_window <= kept):
        raise ValueError(
            f"paged_attention_ext: layer {module.layer_idx} attends with sliding_window="
            f"{sliding_window}, but its KV group keeps only the last {kept} tokens' blocks (the "
            "config's sliding_window and layer_types must match what the layer attends over)")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    paged_batch: Optional[PagedBatch] = None,
    s_aux: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    is_causal: Optional[bool] = None,
    output_attentions: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    if "write_index" in kwargs:  # continuous batching, which transformers >= 5.19 runs by this name
        return continuous_batching_attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window=sliding_window,
            softcap=softcap, is_causal=is_causal, paged_batch=paged_batch, s_aux=s_aux, sinks=sinks,
            output_attentions=output_attentions, **kwargs)
    batch = paged_batch if paged_batch is not None else take_batch(module, key)
    if batch is None:
        raise ValueError(
            "attn_implementation='paged_attention_ext' attends over a PagedCache or a PagedBatch, "
            "and this forward has neither: pass past_key_values=PagedCache(model.config) (not a "
            "DynamicCache or another cache, and not use_cache=False) to generate or the forward, "
            "or paged_batch=... to a packed forward")
    _refuse_unsupported(module, attention_mask, dropout, is_causal, output_attentions, kwargs)
    key_cache, value_cache = batch.kv_cache.layer(module.layer_idx)
    slot_mapping = batch.slots_of(module.layer_idx)
    _check_window(module, sliding_window, batch)
    rows, heads, q_len, head_size = query.shape
    head_size_v = value.shape[-1]
    latent = batch.kv_cache.values_in_keys
    sink_logits = sink_logits_of(module, s_aux, sinks, heads, key_cache.device)
    # A KV-shared layer (a reader) gets its source's K/V, which the source stored.
    if batch.write_kv and batch.kv_cache.source(module.layer_idx) == module.layer_idx:
        # The pools' rows as values (a packed int4 row is half as many bytes).
        kv_heads, key_size, value_size = batch.kv_cache.layer_shape(module.layer_idx)
        if (key.shape[1] != kv_heads or key.shape[-1] != key_size
                or value.shape[1] != kv_heads or head_size_v != value_size):
            raise ValueError(
                f"paged_attention_ext: layer {module.layer_idx} stores keys {tuple(key.shape)} and "
                f"values {tuple(value.shape)} in pools of {kv_heads} KV heads, key head size "
                f"{key_size} and value head size {value_size}")
        batch.kv_cache.write(module.layer_idx, flat_tokens(key), flat_tokens(value), slot_mapping)
        if batch.on_stored is not None and not torch.compiler.is_compiling():
            batch.on_stored(module.layer_idx)  # eager bookkeeping; a compiled step has none
    elif head_size_v != batch.kv_cache.layer_shape(module.layer_idx)[2] and not latent:
        raise ValueError(f"paged_attention_ext: layer {module.layer_idx} has value head size "
                         f"{head_size_v}, the value pool "
                         f"{batch.kv_cache.layer_shape(module.layer_idx)[2]}")
    if batch.q_len is not None and q_len != batch.q_len:
        if batch.kv_cache.source(module.layer_idx) == module.layer_idx:
            raise ValueError(f"paged_attention_ext: layer {module.layer_idx} has {q_len} queries per "
                             f"row, the forward {batch.q_len} (only a layer that reuses another's "
                             "K/V may run on the last positions alone)")
        if batch.last_queries is None:
            raise NotImplementedError(
                f"paged_attention_ext: layer {module.layer_idx} reuses another layer's K/V on the "
                f"last {q_len} of the forward's {batch.q_len} positions per row, which a compiled "
                "forward does not serve: run forwards of more than one token per row eagerly "
                "(generate's compile_config path compiles only the decode steps)")
        batch = batch.last_queries(q_len)
    q = flat_tokens(query)
    query_rows = batch.inputs.query_rows
    if query_rows is not None:
        q = q.index_select(0, query_rows)
    scale = scaling if scaling is not None else head_size ** -0.5
    metadata = batch.attention_of(module.layer_idx)
    op_kwargs = dict(sliding_window=sliding_window or -1, soft_cap=softcap or 0.0,
                     sinks=sink_logits, **batch.kv_cache.scales(module.layer_idx))
    if latent:
        # Long query runs attend over expanded K/V, transformers' for their own tokens (float
        # caches; a compiled graph keeps one form).
        new_kv = None, None
        if not batch.kv_cache.is_quantized and not torch.compiler.is_compiling():
            new_kv = flat_tokens(key), flat_tokens(value)
            if query_rows is not None:
                new_kv = tuple(t.index_select(0, query_rows) for t in new_kv)
        out = latent_attention(module, metadata, q, *new_kv, key_cache, value_cache, scale,
                               batch.kv_cache.as_query, batch=batch, **op_kwargs)
    else:
        out = metadata.run(batch.kv_cache.as_query(q), key_cache, value_cache, scale, **op_kwargs)
    if query_rows is not None:
        # Padding positions get zeros; nothing reads them (they are never keys).
        out = out.new_zeros(rows * q_len, heads, head_size_v).index_copy_(0, query_rows, out)
    # transformers expects [batch, tokens, heads, head_size_v].
    return out.view(rows, q_len, heads, head_size_v).to(query.dtype), None
