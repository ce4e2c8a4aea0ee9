"""What differs between the supported transformers releases (tests/test_hf_hooks.py checks each)."""

import inspect

import transformers
from transformers.cache_utils import LinearAttentionLayer

from ..versions import release

# 5.19 strips the ``paged|`` prefix from every implementation name but ``paged|eager``
# (continuous batching included), so one name serves generate and continuous batching.
STRIPS_PAGED_PREFIX: bool = release(transformers.__version__) >= (5, 19)

# From 5.25 a recording linear-attention layer keeps the recurrent states of a multi-token
# forward's last positions (``recurrent_states_to_keep``) and ``crop`` restores one of them;
# up to 5.18 its ``crop`` trims the convolution window only (and generate refuses assisted
# decoding for those models).
LINEAR_LAYERS_ROLL_BACK: bool = "recurrent_states_to_keep" in inspect.signature(
    LinearAttentionLayer.activate_past_recording).parameters


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its ``Cache`` by: ``past_key_values`` up to the
    releases that rename it ``cache`` (which then take the old name with a deprecation
    warning). Told apart by the signature."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def read_window(cache, key, value, layer_idx: int, read_index, write_index, cu_seq_lens_k,
                max_length_k):
    """A sliding-window layer's continuous-batching update through the cache's public
    ``update``: store the new K/V ``[1, kv_heads, tokens, head_dim]`` in the ring buffer and
    return the window's keys and values in position order, ``[keys, kv_heads, head_dim]``.

    Up to 5.18 ``update`` takes the indices and returns that shape; from 5.19 it takes the
    attention keyword arguments (selecting the layer type's entries in place) and returns
    ``[1, kv_heads, keys, head_dim]``. Told apart by the signature.
    """
    if "read_index" in inspect.signature(cache.update).parameters:
        return cache.update(key_states=key, value_states=value, layer_idx=layer_idx,
                            read_index=read_index, write_index=write_index)
    # The arguments as continuous batching passed them (per layer type where it does).
    kwargs = {"read_index": read_index, "write_index": write_index,
              "cu_seq_lens_k": cu_seq_lens_k, "max_length_k": max_length_k}
    keys, values = cache.update(key, value, layer_idx, kwargs)
    return keys[0].transpose(0, 1), values[0].transpose(0, 1)
