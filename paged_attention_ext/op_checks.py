"""The Python mirror of ``csrc/checks.cpp``: the argument checks a trace must make.

Under ``torch.compile`` and ``FakeTensorMode`` the ops run their fakes
(:mod:`paged_attention_ext.fake`), not the kernels, and a meta tensor among CPU ones sends
an eager call there too. So the checks that must refuse at trace time as the kernels do
at run time live here, with the kernels' messages word for word: devices, dtypes, the
fp8 scales and the cache layouts (strides). Each function names the C++ function it
mirrors; change both together (tests/test_op_checks.py runs every check through the
kernel and the fake and compares the errors).

Left to the kernels: checks that read tensor data (lengths, block ids, slots, mappings)
and the shape checks that would relate symbolic sizes in a trace (a guard tying two
dynamic dimensions together).
"""

from typing import Optional, Sequence

import torch

from .quantization import FLOAT_DTYPES, FP8_DTYPES


def scalar_type_name(dtype: torch.dtype) -> str:
    """The name C++ prints for a dtype (``Float``, ``BFloat16``, ``Float8_e4m3fn``): the
    legacy tensor type's, ``torch.meta.FloatTensor`` without its prefix and suffix."""
    return torch.empty(0, dtype=dtype, device="meta").type().rsplit(".", 1)[1][:-len("Tensor")]


def check_same_device(op: str, reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """``check_same_device``: every given tensor (None: absent) is on ``reference``'s device."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(f"{op}: argument '{name}' must be on the same device as "
                             f"'{reference_name}' ({reference.device}), got {tensor.device}")


def check_dtype(op: str, name: str, tensor: torch.Tensor, want: torch.dtype) -> None:
    """``check_dtype``."""
    if tensor.dtype != want:
        raise TypeError(f"{op}: argument '{name}' must have dtype {scalar_type_name(want)}, got "
                        f"{scalar_type_name(tensor.dtype)}")


def check_rank(op: str, name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    """``check_rank``."""
    if tensor.dim() != rank:
        raise ValueError(f"{op}: argument '{name}' must be {rank}-D {layout}, got shape "
                         f"{list(tensor.shape)}")


def check_float(op: str, name: str, tensor: torch.Tensor) -> None:
    """``is_supported_float`` as the attention, write and merge checks apply it."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be float32, float16 or bfloat16, got "
                        f"{scalar_type_name(tensor.dtype)}")


def overlaps_itself(t: torch.Tensor) -> bool:
    """``overlaps_itself``: dims of size > 1 sorted by stride, each stride past the farthest
    element of the smaller ones."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def check_cache_tensor(op: str, name: str, cache: torch.Tensor) -> None:
    """``check_cache_tensor``: a 4-D cache of a cache dtype, head dim contiguous, not
    overlapping itself."""
    check_rank(op, name, cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]")
    if cache.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be float32, float16, bfloat16, "
                        f"float8_e4m3fn or float8_e5m2, got {scalar_type_name(cache.dtype)}")
    if cache.stride(3) != 1 and cache.size(3) > 1:
        raise ValueError(f"{op}: argument '{name}' must be contiguous in its last dimension "
                         f"(head_size), got strides {list(cache.stride())}")
    if overlaps_itself(cache):
        raise ValueError(f"{op}: argument '{name}' is a view that overlaps itself (strides "
                         f"{list(cache.stride())} for shape {list(cache.shape)}); two cache slots "
                         "would share memory")


def check_kv_scales(op: str, cache_dtype: torch.dtype, num_kv_heads: int,
                    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                    reference: torch.Tensor, reference_name: str) -> None:
    """``check_kv_scales``: scales are required for fp8 caches and refused for float ones:
    fp32, shape [], [1] or [num_kv_heads], on the device of ``reference``."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache_dtype not in FP8_DTYPES:
            if scale is not None:
                raise ValueError(f"{op}: argument '{name}' is only for fp8 caches (float8_e4m3fn, "
                                 f"float8_e5m2), but the caches are "
                                 f"{scalar_type_name(cache_dtype)}; pass None")
            continue
        if scale is None:
            raise ValueError(f"{op}: the caches are {scalar_type_name(cache_dtype)}, which needs "
                             f"argument '{name}' (a float32 tensor of shape [], [1] or "
                             "[num_kv_heads]); got None")
        check_dtype(op, name, scale, torch.float32)
        check_same_device(op, reference_name, reference, **{name: scale})
        per_layer = scale.numel() == 1 and scale.dim() <= 1
        per_head = scale.dim() == 1 and scale.shape[0] == num_kv_heads
        if not (per_layer or per_head):
            raise ValueError(f"{op}: argument '{name}' must have shape [], [1] or [num_kv_heads] "
                             f"= [{num_kv_heads}], got {list(scale.shape)}")


def check_attention_args(op: str, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: Optional[torch.Tensor],
                         alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                         out: Optional[torch.Tensor] = None,
                         lse: Optional[torch.Tensor] = None) -> None:
    """``check_attention_args``: its device, dtype, cache and scale checks."""
    check_same_device(op, "query", query, key_cache=key_cache, value_cache=value_cache,
                      block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc, alibi_slopes=alibi_slopes, sinks=sinks,
                      out=out, lse=lse)
    check_float(op, "query", query)
    check_cache_tensor(op, "key_cache", key_cache)
    check_cache_tensor(op, "value_cache", value_cache)
    # A float cache has the query's dtype; an fp8 cache takes a query of any float dtype.
    if key_cache.dtype not in FP8_DTYPES:
        check_dtype(op, "key_cache", key_cache, query.dtype)
    check_dtype(op, "value_cache", value_cache, key_cache.dtype)
    check_kv_scales(op, key_cache.dtype, key_cache.shape[1], k_scale, v_scale, query, "query")


def check_write_kv_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    """``check_write_kv_args``: its device, dtype, cache and scale checks."""
    op = "paged.write_kv"
    check_same_device(op, "key", key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping)
    check_cache_tensor(op, "key_cache", key_cache)
    check_cache_tensor(op, "value_cache", value_cache)
    check_dtype(op, "value_cache", value_cache, key_cache.dtype)
    if key_cache.dtype in FP8_DTYPES:  # quantized on the way in: any float input
        check_float(op, "key", key)
        check_dtype(op, "value", value, key.dtype)
    else:
        check_dtype(op, "key", key, key_cache.dtype)
        check_dtype(op, "value", value, key_cache.dtype)
    check_kv_scales(op, key_cache.dtype, key_cache.shape[1], k_scale, v_scale, key, "key")


def check_merge_args(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> None:
    """``check_merge_args``: all but the outputs' stride check."""
    op = "paged.merge_attention_states"
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"{op}: arguments 'outputs' and 'lses' must list the same number (>= 1) "
                         f"of partial results, got {len(outputs)} and {len(lses)}")
    first = outputs[0]
    tensors = {f"outputs[{i}]": t for i, t in enumerate(outputs)}
    tensors.update({f"lses[{i}]": t for i, t in enumerate(lses)})
    check_same_device(op, "outputs[0]", first, **tensors)
    check_rank(op, "outputs[0]", first, 3, "[num_tokens, num_heads, head_size]")
    check_float(op, "outputs[0]", first)
    for i, (o, l) in enumerate(zip(outputs, lses)):
        if o.shape != first.shape:
            raise ValueError(f"{op}: argument 'outputs[{i}]' must have the shape of 'outputs[0]' "
                             f"{list(first.shape)}, got {list(o.shape)}")
        check_dtype(op, f"outputs[{i}]", o, first.dtype)
        check_rank(op, f"lses[{i}]", l, 2, "[num_tokens, num_heads]")
        if l.shape != first.shape[:2]:
            raise ValueError(f"{op}: argument 'lses[{i}]' must have shape {list(first.shape[:2])} "
                             f"(num_tokens, num_heads of 'outputs[0]'), got {list(l.shape)}")
        check_dtype(op, f"lses[{i}]", l, torch.float32)


def check_layer_caches_devices(key_caches: Sequence[torch.Tensor],
                               value_caches: Sequence[torch.Tensor],
                               block_mapping: torch.Tensor) -> None:
    """``check_layer_caches``' device checks, and the mapping's (on the caches' device or
    the host: CUDA caches take it from there, csrc/cuda/cache_ops_cuda.cpp)."""
    if not key_caches:
        return
    op = "paged.copy_blocks"
    caches = {f"key_caches[{i}]": t for i, t in enumerate(key_caches)}
    caches.update({f"value_caches[{i}]": t for i, t in enumerate(value_caches)})
    check_same_device(op, "key_caches[0]", key_caches[0], **caches)
    if block_mapping.device.type != "cpu":
        check_same_device(op, "key_caches[0]", key_caches[0], block_mapping=block_mapping)


def check_swap_devices(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """The device rules of ``swap_blocks_cpu`` / ``swap_blocks_cuda`` (csrc/*/cache_ops_*.cpp):
    between a device and the host, or within one device; the mapping on the host."""
    if {src.device.type, dst.device.type} != {"cpu", "cuda"}:
        check_same_device("paged.swap_blocks", "src", src, dst=dst)
    if block_mapping.device.type != "cpu":
        raise ValueError("paged.swap_blocks: argument 'block_mapping' must be a CPU tensor, "
                         f"got {block_mapping.device}")
