"""Fake (meta) implementations: output shapes and dtypes without running a kernel.

They let the ops trace under ``torch.compile`` and ``FakeTensorMode``. Shape
checks live in the real kernels; here only what the output metadata needs, the device
checks (a meta tensor among CPU ones sends the call here instead of to a kernel, so
mixed devices must raise here as they do there), and the checks of the fp8 and layout
arguments (cache dtypes, scales, strides), which a compiled graph must refuse at trace
time exactly as the kernels do.
"""

from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_devices(op: str, reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """Every given tensor (None: absent) is on the device of ``reference``."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(f"{op}: argument '{name}' must be on the same device as "
                             f"'{reference_name}' ({reference.device}), got {tensor.device}")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """The kernels' test (checks.cpp): dims of size > 1 sorted by stride, each stride past
    the farthest element of the smaller ones."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_cache(op: str, name: str, cache: torch.Tensor) -> None:
    """A 4-D cache of a cache dtype, head dim contiguous, not overlapping itself."""
    if cache.dim() != 4:
        raise ValueError(f"{op}: argument '{name}' must be 4-D [num_blocks, num_kv_heads, "
                         f"block_size, head_size], got shape {tuple(cache.shape)}")
    if cache.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be float32, float16, bfloat16, "
                        f"float8_e4m3fn or float8_e5m2, got {cache.dtype}")
    if cache.stride(3) != 1 and cache.size(3) > 1:
        raise ValueError(f"{op}: argument '{name}' must be contiguous in its last dimension "
                         f"(head_size), got strides {cache.stride()}")
    if _overlaps_itself(cache):
        raise ValueError(f"{op}: argument '{name}' is a view that overlaps itself (strides "
                         f"{cache.stride()} for shape {tuple(cache.shape)}); two cache slots "
                         "would share memory")


def check_kv_scales(op: str, cache_dtype: torch.dtype, num_kv_heads: int,
                    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                    reference: torch.Tensor, reference_name: str) -> None:
    """Scales are required for fp8 caches and refused for float ones: fp32, shape [], [1]
    or [num_kv_heads], on the device of ``reference``."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache_dtype not in FP8_DTYPES:
            if scale is not None:
                raise ValueError(f"{op}: argument '{name}' is only for fp8 caches (float8_e4m3fn, "
                                 f"float8_e5m2), but the caches are {cache_dtype}; pass None")
            continue
        if scale is None:
            raise ValueError(f"{op}: the caches are {cache_dtype}, which needs argument '{name}' "
                             "(a float32 tensor of shape [], [1] or [num_kv_heads]); got None")
        if scale.dtype != torch.float32:
            raise TypeError(f"{op}: argument '{name}' must have dtype torch.float32, got "
                            f"{scale.dtype}")
        _check_devices(op, reference_name, reference, **{name: scale})
        per_layer = scale.numel() == 1 and scale.dim() <= 1
        per_head = scale.dim() == 1 and scale.shape[0] == num_kv_heads
        if not (per_layer or per_head):
            raise ValueError(f"{op}: argument '{name}' must have shape [], [1] or [num_kv_heads] "
                             f"= [{num_kv_heads}], got {list(scale.shape)}")


def _check_attention_args(op, query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc, alibi_slopes, sinks, k_scale, v_scale, out=None,
                          lse=None):
    _check_devices(op, "query", query, key_cache=key_cache, value_cache=value_cache,
                   block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                   alibi_slopes=alibi_slopes, sinks=sinks, out=out, lse=lse)
    if query.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: argument 'query' must be float32, float16 or bfloat16, got "
                        f"{query.dtype}")
    check_cache(op, "key_cache", key_cache)
    check_cache(op, "value_cache", value_cache)
    if key_cache.dtype not in FP8_DTYPES and key_cache.dtype != query.dtype:
        raise TypeError(f"{op}: argument 'key_cache' must have dtype {query.dtype}, got "
                        f"{key_cache.dtype}")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"{op}: argument 'value_cache' must have dtype {key_cache.dtype}, got "
                        f"{value_cache.dtype}")
    check_kv_scales(op, key_cache.dtype, key_cache.shape[1], k_scale, v_scale, query, "query")


def _out_shape(query: torch.Tensor, value_cache: torch.Tensor):
    """``[num_tokens, num_heads, head_size_v]``: the value cache's head size."""
    return (query.shape[0], query.shape[1], value_cache.shape[-1])


@torch.library.register_fake("paged::attention")
def _attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                    query_start_loc=None, alibi_slopes=None, sliding_window=-1, soft_cap=0.0,
                    sinks=None, k_scale=None, v_scale=None):
    _check_attention_args("paged.attention", query, key_cache, value_cache, block_tables,
                          seq_lens, query_start_loc, alibi_slopes, sinks, k_scale, v_scale)
    return query.new_empty(_out_shape(query, value_cache))


@torch.library.register_fake("paged::attention_with_lse")
def _attention_with_lse_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                             query_start_loc=None, alibi_slopes=None, sliding_window=-1,
                             soft_cap=0.0, sinks=None, k_scale=None, v_scale=None):
    _check_attention_args("paged.attention_with_lse", query, key_cache, value_cache,
                          block_tables, seq_lens, query_start_loc, alibi_slopes, sinks, k_scale,
                          v_scale)
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    return query.new_empty(_out_shape(query, value_cache)), lse


@torch.library.register_fake("paged::attention_out")
def _attention_out_fake(out, lse: Optional[torch.Tensor], query, key_cache, value_cache,
                        block_tables, seq_lens, scale, query_start_loc=None, alibi_slopes=None,
                        sliding_window=-1, soft_cap=0.0, sinks=None, k_scale=None, v_scale=None):
    _check_attention_args("paged.attention_out", query, key_cache, value_cache, block_tables,
                          seq_lens, query_start_loc, alibi_slopes, sinks, k_scale, v_scale, out,
                          lse)
    return None


@torch.library.register_fake("paged::shared_prefix_attention")
def _shared_prefix_attention_fake(query, key_cache, value_cache, block_tables, seq_lens,
                                  query_start_loc, scale, soft_cap=0.0, sinks=None, k_scale=None,
                                  v_scale=None):
    _check_attention_args("paged.shared_prefix_attention", query, key_cache, value_cache,
                          block_tables, seq_lens, query_start_loc, None, sinks, k_scale, v_scale)
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    return query.new_empty(_out_shape(query, value_cache)), lse


@torch.library.register_fake("paged::merge_attention_states")
def _merge_attention_states_fake(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    op = "paged.merge_attention_states"
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"{op}: arguments 'outputs' and 'lses' must list the same number (>= 1) "
                         f"of partial results, got {len(outputs)} and {len(lses)}")
    first = outputs[0]
    tensors = {f"outputs[{i}]": t for i, t in enumerate(outputs)}
    tensors.update({f"lses[{i}]": t for i, t in enumerate(lses)})
    _check_devices(op, "outputs[0]", first, **tensors)
    if first.dim() != 3:
        raise ValueError(f"{op}: argument 'outputs[0]' must be 3-D [num_tokens, num_heads, "
                         f"head_size], got shape {tuple(first.shape)}")
    for i, (o, l) in enumerate(zip(outputs, lses)):
        if o.dtype != first.dtype or first.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: argument 'outputs[{i}]' must have dtype {first.dtype} "
                            f"(float32, float16 or bfloat16), got {o.dtype}")
        if o.shape != first.shape:
            raise ValueError(f"{op}: argument 'outputs[{i}]' must have the shape of 'outputs[0]' "
                             f"{list(first.shape)}, got {list(o.shape)}")
        if l.dtype != torch.float32:
            raise TypeError(f"{op}: argument 'lses[{i}]' must have dtype torch.float32, got {l.dtype}")
        if l.shape != first.shape[:2]:
            raise ValueError(f"{op}: argument 'lses[{i}]' must have shape {list(first.shape[:2])} "
                             f"(num_tokens, num_heads of 'outputs[0]'), got {list(l.shape)}")
    return first.new_empty(first.shape), first.new_empty(first.shape[:2], dtype=torch.float32)


@torch.library.register_fake("paged::write_kv")
def _write_kv_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    op = "paged.write_kv"
    _check_devices(op, "key", key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping)
    check_cache(op, "key_cache", key_cache)
    check_cache(op, "value_cache", value_cache)
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"{op}: argument 'value_cache' must have dtype {key_cache.dtype}, got "
                        f"{value_cache.dtype}")
    if key_cache.dtype in FP8_DTYPES:  # quantized on the way in: any float input
        if key.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: argument 'key' must be float32, float16 or bfloat16, got "
                            f"{key.dtype}")
        if value.dtype != key.dtype:
            raise TypeError(f"{op}: argument 'value' must have dtype {key.dtype}, got {value.dtype}")
    else:
        for name, t in (("key", key), ("value", value)):
            if t.dtype != key_cache.dtype:
                raise TypeError(f"{op}: argument '{name}' must have dtype {key_cache.dtype}, "
                                f"got {t.dtype}")
    check_kv_scales(op, key_cache.dtype, key_cache.shape[1], k_scale, v_scale, key, "key")
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
