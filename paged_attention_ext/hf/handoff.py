"""What a forward hands from one transformers hook to the next, for the paged cache.

transformers passes neither the attention mask to the cache nor the cache to the attention
function, so three hand-offs go through context variables:

* the mask function (:func:`publish_padding_mask`, registered for
  :data:`ATTN_IMPLEMENTATION`) builds no mask: it publishes the forward's 2D padding mask
  for layer 0's ``Cache.update`` (:func:`take_padding_mask`), or, right after a compiled
  cache's eager ``get_mask_sizes`` (:func:`request_preparation`), prepares that cache's
  next forward;
* each ``update`` publishes the layer's :class:`LayerCall` with the key tensor it returns
  (:func:`publish_layer_call`), and the attention function takes the batch only for that
  same tensor (:func:`take_batch`), which clears it;
* a layer whose K/V other layers reuse (Gemma-4's KV-shared layers, which call no
  ``update``: transformers hands them the K/V their source's ``update`` returned) also
  publishes its call as a source (:func:`publish_source_call`); a reader's attention takes
  the batch when it gets that same key tensor, until the next forward's mask function.

Inside a ``torch.compile`` trace dynamo cannot trace ``ContextVar.set``; the layer call and
the source calls then go through attributes of a plain object, which it can (and replays
after the graph). A traced forward starts its source calls anew
(:func:`begin_traced_forward`, from the first layer's update), so the trace never reads
what an earlier run left there (which stays there, with that run's cache, until the next).
"""

from contextvars import ContextVar
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

import torch

from .batch import PagedBatch
from .masks import check_mask_function

if TYPE_CHECKING:
    from .cache import PagedCache
    from .compiled_cache import CompiledPagedCache

ATTN_IMPLEMENTATION = "paged_attention_ext"


class LayerCall(NamedTuple):
    cache: "PagedCache"
    layer_idx: int
    # What update() returned: identifies the attention call the batch is for. None for MLA
    # models, whose attention gets keys expanded from what update() returned.
    key: Optional[torch.Tensor]
    batch: PagedBatch


_padding_mask: ContextVar[Optional[torch.Tensor]] = ContextVar("paged_padding_mask", default=None)
_layer_call: ContextVar[Optional[LayerCall]] = ContextVar("paged_layer_call", default=None)
_source_calls: ContextVar[Tuple[LayerCall, ...]] = ContextVar("paged_source_calls", default=())
# A compiled cache whose get_mask_sizes just ran eagerly: the mask function that
# transformers calls next with the 2D padding mask prepares that cache's next forward.
_preparing: ContextVar[Optional["CompiledPagedCache"]] = ContextVar("paged_mask_sizes", default=None)


class _TracedCall:
    call: Optional[LayerCall] = None
    sources: Tuple[LayerCall, ...] = ()


_traced = _TracedCall()


def publish_padding_mask(attention_mask: Optional[torch.Tensor] = None, mask_function=None,
                         **kwargs) -> None:
    """The mask function of ``paged_attention_ext``: builds no mask, records the padding.

    Attention masks come from block tables and sequence lengths. The 2D mask
    (``[batch, past + new]``, 0 = padding) is kept for the next PagedCache forward. A mask
    function that is not (packed, sliding-window) causal on this forward's positions raises
    ``NotImplementedError`` (masks.py). transformers builds
    the masks before the first layer, so this also drops a batch that a forward stopped by
    an exception left published.
    """
    if torch.compiler.is_compiling():
        # A compiled forward: its PagedCache was prepared eagerly before it (prepare(), or
        # this function's eager call from generate's mask creation).
        return None
    if mask_function is not None:
        check_mask_function(mask_function, attention_mask, kwargs, ATTN_IMPLEMENTATION)
    _layer_call.set(None)
    _source_calls.set(())
    cache = _preparing.get()
    _preparing.set(None)
    if cache is not None:
        cache.prepare_from_mask(attention_mask, kwargs)
        return None
    _padding_mask.set(attention_mask)
    return None


def take_padding_mask() -> Optional[torch.Tensor]:
    """The 2D padding mask the mask function published for this forward (taken once)."""
    mask = _padding_mask.get()
    _padding_mask.set(None)
    return mask


def request_preparation(cache: "CompiledPagedCache") -> None:
    """The mask function called next prepares ``cache``'s forward."""
    _preparing.set(cache)


def cancel_preparation(cache: "CompiledPagedCache") -> None:
    """Drop a request the mask function did not take (a mask function that is not ours)."""
    if _preparing.get() is cache:
        _preparing.set(None)


def publish_layer_call(call: LayerCall) -> None:
    if torch.compiler.is_compiling():
        _traced.call = call
    else:
        _layer_call.set(call)


def publish_source_call(call: LayerCall) -> None:
    """``call``'s layer has readers: they take its batch with its key tensor."""
    if torch.compiler.is_compiling():
        _traced.sources = _traced.sources + (call,)
    else:
        _source_calls.set(_source_calls.get() + (call,))


def begin_traced_forward() -> None:
    """A traced forward's first update: no source call published yet in it."""
    _traced.sources = ()


def pending_call(cache: "PagedCache") -> Optional[LayerCall]:
    """A call ``cache`` published that no attention function took (eager forwards only)."""
    call = _layer_call.get()
    return call if call is not None and call.cache is cache else None


def drop_calls_of(cache: "PagedCache") -> None:
    if pending_call(cache) is not None:
        _layer_call.set(None)
    _source_calls.set(tuple(call for call in _source_calls.get() if call.cache is not cache))


def take_batch(module: torch.nn.Module, key: torch.Tensor) -> Optional[PagedBatch]:
    """The batch a PagedCache published for the attention call of ``module`` with ``key``."""
    compiling = torch.compiler.is_compiling()
    call = _traced.call if compiling else _layer_call.get()
    layer_idx = getattr(module, "layer_idx", None)
    for source in _traced.sources if compiling else _source_calls.get():
        if (source.key is key and layer_idx is not None
                and source.batch.kv_cache.source(layer_idx) == source.layer_idx != layer_idx):
            return source.batch  # a reader of that layer's K/V
    if call is None:
        return None
    if call.key is None:
        if layer_idx != call.layer_idx:
            return None
    elif call.key is not key or (layer_idx is not None and layer_idx != call.layer_idx):
        return None
    if compiling:
        _traced.call = None
    else:
        _layer_call.set(None)  # taken; so the pools are not kept alive after the forward
    return call.batch
