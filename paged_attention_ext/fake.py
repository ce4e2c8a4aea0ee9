"""Fake (meta) implementations: output shapes and dtypes without running a kernel.

They let the ops trace under ``torch.compile`` and ``FakeTensorMode``. Shape
checks live in the real kernels; here only what the output metadata needs, the device
checks (a meta tensor among CPU ones sends the call here instead of to a kernel, so
mixed devices must raise here as they do there), and the checks of the fp8, per-token
and layout arguments (cache dtypes, scales, strides), which a compiled graph must refuse at trace
time exactly as the kernels do. Those checks are :mod:`paged_attention_ext.op_checks`,
the Python mirror of csrc/checks.cpp.
"""

from typing import Optional, Sequence

import torch

from .token_quantization import head_size_of
from .op_checks import (check_attention_args, check_layer_caches_devices, check_merge_args,
                        check_swap_devices, check_write_kv_args, check_write_latent_args)


def _checked_output(op: str, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float,
                    query_start_loc: Optional[torch.Tensor] = None,
                    alibi_slopes: Optional[torch.Tensor] = None, sliding_window: int = -1,
                    soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None,
                    lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention arguments in the op schema's order, checked; a new output
    ``[num_tokens, num_heads, head_size_v]`` (the value cache's head size: twice its last
    dimension for a packed int4 cache)."""
    check_attention_args(op, query, key_cache, value_cache, block_tables, seq_lens,
                         query_start_loc, alibi_slopes, sinks, k_scale, v_scale, out, lse)
    return query.new_empty((query.shape[0], query.shape[1], head_size_of(value_cache)))


def _lse_of(out: torch.Tensor) -> torch.Tensor:
    """fp32 ``[num_tokens, num_heads]``."""
    return out.new_empty(out.shape[:2], dtype=torch.float32)


# The dispatcher passes the schema's arguments, trailing defaults left out.
@torch.library.register_fake("paged::attention")
def _attention_fake(*args, **kwargs):
    return _checked_output("paged.attention", *args, **kwargs)


@torch.library.register_fake("paged::attention_with_lse")
def _attention_with_lse_fake(*args, **kwargs):
    out = _checked_output("paged.attention_with_lse", *args, **kwargs)
    return out, _lse_of(out)


@torch.library.register_fake("paged::attention_out")
def _attention_out_fake(out: torch.Tensor, lse: Optional[torch.Tensor], *args, **kwargs):
    _checked_output("paged.attention_out", *args, out=out, lse=lse, **kwargs)
    return None


@torch.library.register_fake("paged::shared_prefix_attention")
def _shared_prefix_attention_fake(query, key_cache, value_cache, block_tables, seq_lens,
                                  query_start_loc, scale, soft_cap=0.0, sinks=None, k_scale=None,
                                  v_scale=None):
    out = _checked_output("paged.shared_prefix_attention", query, key_cache, value_cache,
                          block_tables, seq_lens, scale, query_start_loc, soft_cap=soft_cap,
                          sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    return out, _lse_of(out)


@torch.library.register_fake("paged::merge_attention_states")
def _merge_attention_states_fake(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    check_merge_args(outputs, lses)
    return outputs[0].new_empty(outputs[0].shape), _lse_of(outputs[0])


@torch.library.register_fake("paged::write_kv")
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    check_write_kv_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return None


@torch.library.register_fake("paged::write_latent")
def _write_latent_fake(latent, rotary_key, cache, slot_mapping, scale=None):
    check_write_latent_args(latent, rotary_key, cache, slot_mapping, scale)
    return None


@torch.library.register_fake("paged::copy_blocks")
def _copy_blocks_fake(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                      block_mapping):
    check_layer_caches_devices(key_caches, value_caches, block_mapping)
    return None


@torch.library.register_fake("paged::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    check_swap_devices(src, dst, block_mapping)
    return None
