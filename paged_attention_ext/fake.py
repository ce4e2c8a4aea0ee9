"""Fake (meta) implementations: output shapes and dtypes without running a kernel.

They let the ops trace under ``torch.compile`` and ``FakeTensorMode``. Shape
checks live in the real kernels; here only what the output metadata needs, and the
device checks: a meta tensor among CPU ones sends the call here instead of to a
kernel, so mixed devices must raise here as they do there.
"""

from typing import Optional, Sequence

import torch


def _check_devices(op: str, reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """Every given tensor (None: absent) is on the device of ``reference``."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(f"{op}: argument '{name}' must be on the same device as "
                             f"'{reference_name}' ({reference.device}), got {tensor.device}")


def _check_attention_devices(op, query, key_cache, value_cache, block_tables, seq_lens,
                             query_start_loc, alibi_slopes, sinks, out=None, lse=None):
    _check_devices(op, "query", query, key_cache=key_cache, value_cache=value_cache,
                   block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                   alibi_slopes=alibi_slopes, sinks=sinks, out=out, lse=lse)


def _out_shape(query: torch.Tensor, value_cache: torch.Tensor):
    """``[num_tokens, num_heads, head_size_v]``: the value cache's head size."""
    return (query.shape[0], query.shape[1], value_cache.shape[-1])


@torch.library.register_fake("paged::attention")
def _attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                    query_start_loc=None, alibi_slopes=None, sliding_window=-1, soft_cap=0.0,
                    sinks=None):
    _check_attention_devices("paged.attention", query, key_cache, value_cache, block_tables,
                             seq_lens, query_start_loc, alibi_slopes, sinks)
    return query.new_empty(_out_shape(query, value_cache))


@torch.library.register_fake("paged::attention_with_lse")
def _attention_with_lse_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                             query_start_loc=None, alibi_slopes=None, sliding_window=-1,
                             soft_cap=0.0, sinks=None):
    _check_attention_devices("paged.attention_with_lse", query, key_cache, value_cache,
                             block_tables, seq_lens, query_start_loc, alibi_slopes, sinks)
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    return query.new_empty(_out_shape(query, value_cache)), lse


@torch.library.register_fake("paged::attention_out")
def _attention_out_fake(out, lse: Optional[torch.Tensor], query, key_cache, value_cache,
                        block_tables, seq_lens, scale, query_start_loc=None, alibi_slopes=None,
                        sliding_window=-1, soft_cap=0.0, sinks=None):
    _check_attention_devices("paged.attention_out", query, key_cache, value_cache, block_tables,
                             seq_lens, query_start_loc, alibi_slopes, sinks, out, lse)
    return None


@torch.library.register_fake("paged::write_kv")
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping):
    _check_devices("paged.write_kv", "key", key, value=value, key_cache=key_cache,
                   value_cache=value_cache, slot_mapping=slot_mapping)
    return None


@torch.library.register_fake("paged::copy_blocks")
def _copy_blocks_fake(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                      block_mapping):
    if key_caches:
        caches = {f"key_caches[{i}]": t for i, t in enumerate(key_caches)}
        caches.update({f"value_caches[{i}]": t for i, t in enumerate(value_caches)})
        _check_devices("paged.copy_blocks", "key_caches[0]", key_caches[0], **caches)
        # The mapping may also be on the CPU (CUDA caches take it from the host).
        if block_mapping.device.type != "cpu":
            _check_devices("paged.copy_blocks", "key_caches[0]", key_caches[0],
                           block_mapping=block_mapping)
    return None


@torch.library.register_fake("paged::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping):
    # Between a device and the host, or within one device; the mapping on the host.
    if {src.device.type, dst.device.type} != {"cpu", "cuda"}:
        _check_devices("paged.swap_blocks", "src", src, dst=dst)
    if block_mapping.device.type != "cpu":
        raise ValueError("paged.swap_blocks: argument 'block_mapping' must be a CPU tensor, "
                         f"got {block_mapping.device}")
    return None
