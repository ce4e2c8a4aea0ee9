"""The Python mirror of ``csrc/checks.cpp``: the argument checks a trace must make.

Under ``torch.compile`` and ``FakeTensorMode`` the ops run their fakes
(:mod:`paged_attention_ext.fake`), not the kernels, and a meta tensor among CPU ones sends
an eager call there too. So the checks that must refuse at trace time as the kernels do
at run time live here, with the kernels' messages word for word: devices, dtypes, the
fp8 scales and the cache layouts (strides). Each function names the C++ function it
mirrors; change both together (tests/test_op_checks.py runs every check through the
kernel and the fake and compares the errors).

The shape checks that name a cache layout (an NHD cache where HND is expected) are here
too, but only where the sizes they compare are static: the kernels keep the checks that
read tensor data (lengths, block ids, slots, mappings) and the shape checks that would
relate symbolic sizes in a trace (a guard tying two dynamic dimensions together).
"""

from typing import Optional, Sequence

import torch

from .quantization import CACHE_DTYPES, FLOAT_DTYPES, FP8_DTYPES
from .token_quantization import TOKEN_DTYPES


def scalar_type_name(dtype: torch.dtype) -> str:
    """The name C++ prints for a dtype (``Float``, ``BFloat16``, ``Float8_e4m3fn``): the
    legacy tensor type's, ``torch.meta.FloatTensor`` without its prefix and suffix."""
    return torch.empty(0, dtype=dtype, device="meta").type().rsplit(".", 1)[1][:-len("Tensor")]


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64", torch.float8_e4m3fn: "float8_e4m3fn",
                torch.float8_e5m2: "float8_e5m2", torch.int8: "int8", torch.uint8: "uint8"}


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype_name``: Python's name of a dtype (``float16``), as the fixes the messages
    suggest are Python; other dtypes by their C++ name."""
    return _DTYPE_NAMES.get(dtype) or scalar_type_name(dtype)


def static(*sizes) -> bool:
    """Every size a plain int: a check on them adds no guard to a trace."""
    return all(isinstance(size, int) for size in sizes)


def check_input_dtype(op: str, name: str, tensor: torch.Tensor, cache_name: str,
                      cache: torch.Tensor, inputs: str) -> None:
    """``check_input_dtype``: the query (or write_kv's key / value) has its float cache's
    dtype; the message names both sides and both fixes."""
    if tensor.dtype != cache.dtype:
        raise TypeError(f"{op}: {name} is {dtype_name(tensor.dtype)} but {cache_name} is "
                        f"{dtype_name(cache.dtype)}: {inputs} and the caches must have the same "
                        "dtype (or the caches are fp8 or per-token, with k_scale and v_scale); "
                        "cast with "
                        f"{name}.to({cache_name}.dtype) or allocate the caches in "
                        f"{dtype_name(tensor.dtype)}")


def nhd_hint(name: str) -> str:
    """``nhd_hint``: a cache whose num_kv_heads does not fit but whose dim 2 would is likely
    NHD (vLLM's, transformers' layout)."""
    return (f"; {name} looks like NHD [blocks, block_size, kv_heads, head_size]: the ops take "
            "HND [blocks, kv_heads, block_size, head_size] or a strided view of it: pass "
            f"paged_attention_ext.layouts.from_nhd({name}) (the view {name}.transpose(1, 2), no "
            "copy), and the same for value_cache")


def swapped_layout_hint(a: torch.Tensor, b: torch.Tensor) -> str:
    """``swapped_layout_hint``: two caches whose block dims differ by a swap of dims 1 and 2."""
    if a.dim() != 4 or b.dim() != 4 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2] \
            or a.shape[2] != b.shape[1]:
        return ""
    return ("; the two differ by a swap of dims 1 and 2, so one looks like NHD [blocks, "
            "block_size, kv_heads, head_size]: pass both as HND [blocks, kv_heads, block_size, "
            "head_size], an NHD one through paged_attention_ext.layouts.from_nhd(cache) (the view "
            "cache.transpose(1, 2), no copy)")


def check_same_block_layout(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """``same_block_layout`` as the attention and write checks apply it (static sizes only)."""
    sizes = (*key_cache.shape[:3], *value_cache.shape[:3])
    if static(*sizes) and tuple(key_cache.shape[:3]) != tuple(value_cache.shape[:3]):
        raise ValueError(f"{op}: argument 'value_cache' must have the num_blocks, num_kv_heads "
                         f"and block_size of 'key_cache' {list(key_cache.shape)}, got "
                         f"{list(value_cache.shape)}{swapped_layout_hint(key_cache, value_cache)}")


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
    if cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"{op}: argument '{name}' must be float32, float16, bfloat16, "
                        "float8_e4m3fn, float8_e5m2, int8 (int8_per_token_head) or uint8 "
                        f"(int4_per_token_head), got {scalar_type_name(cache.dtype)}")
    if cache.stride(3) != 1 and cache.size(3) > 1:
        raise ValueError(f"{op}: argument '{name}' must be contiguous in its last dimension "
                         f"(head_size), got strides {list(cache.stride())}")
    if overlaps_itself(cache):
        raise ValueError(f"{op}: argument '{name}' is a view that overlaps itself (strides "
                         f"{list(cache.stride())} for shape {list(cache.shape)}); two cache slots "
                         "would share memory")


def is_quantized(dtype: torch.dtype) -> bool:
    """``is_quantized``: a cache quantized on the way in (fp8, per-token), which takes inputs
    of any float dtype."""
    return dtype in FP8_DTYPES + TOKEN_DTYPES


def check_token_scales(op: str, name: str, scale: torch.Tensor, cache: torch.Tensor) -> None:
    """``check_token_scales``: a per-token cache's scales, one (int8) or a (scale, low) pair
    (int4) per slot of the cache, the pair contiguous, not overlapping itself."""
    int4 = cache.dtype == torch.uint8
    want = [*cache.shape[:3], 2] if int4 else list(cache.shape[:3])
    if static(*scale.shape, *want) and list(scale.shape) != want:
        layout = ("[num_blocks, num_kv_heads, block_size, 2] (scale, low)" if int4
                  else "[num_blocks, num_kv_heads, block_size]")
        raise ValueError(f"{op}: argument '{name}' must have shape {layout} = {want}, one per "
                         f"slot of the {dtype_name(cache.dtype)} cache, got {list(scale.shape)}")
    if int4 and scale.dim() == 4 and scale.stride(3) != 1:
        raise ValueError(f"{op}: argument '{name}' must be contiguous in its last dimension "
                         f"(scale, low), got strides {list(scale.stride())}")
    if overlaps_itself(scale):
        raise ValueError(f"{op}: argument '{name}' is a view that overlaps itself (strides "
                         f"{list(scale.stride())} for shape {list(scale.shape)}); two slots would "
                         "share a scale")


def check_cache_scale(op: str, name: str, scale: Optional[torch.Tensor], cache: torch.Tensor,
                      reference: torch.Tensor, reference_name: str) -> None:
    """``check_cache_scale``: one cache's scale is required for fp8 and per-token caches and
    refused for float ones: fp32 on the device of ``reference``; fp8: shape [], [1] or
    [num_kv_heads]; per-token: one per slot of its cache (``check_token_scales``)."""
    cache_dtype, num_kv_heads = cache.dtype, cache.shape[1]
    if not is_quantized(cache_dtype):
        if scale is not None:
            raise ValueError(f"{op}: argument '{name}' is only for fp8 (float8_e4m3fn, "
                             "float8_e5m2) and per-token (int8, uint8) caches, but the caches "
                             f"are {scalar_type_name(cache_dtype)}; pass None")
        return
    per_token = cache_dtype in TOKEN_DTYPES
    if scale is None:
        shape = ("[], [1] or [num_kv_heads]" if not per_token
                 else "[num_blocks, num_kv_heads, block_size, 2]" if cache_dtype == torch.uint8
                 else "[num_blocks, num_kv_heads, block_size]")
        raise ValueError(f"{op}: the caches are {scalar_type_name(cache_dtype)}, which needs "
                         f"argument '{name}' (a float32 tensor of shape {shape}); got None")
    check_dtype(op, name, scale, torch.float32)
    check_same_device(op, reference_name, reference, **{name: scale})
    if per_token:
        check_token_scales(op, name, scale, cache)
        return
    per_layer = scale.numel() == 1 and scale.dim() <= 1
    per_head = scale.dim() == 1 and scale.shape[0] == num_kv_heads
    if not (per_layer or per_head):
        raise ValueError(f"{op}: argument '{name}' must have shape [], [1] or [num_kv_heads] "
                         f"= [{num_kv_heads}], got {list(scale.shape)}")


def check_kv_scales(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                    reference: torch.Tensor, reference_name: str) -> None:
    """``check_kv_scales``: ``check_cache_scale`` of both."""
    check_cache_scale(op, "k_scale", k_scale, key_cache, reference, reference_name)
    check_cache_scale(op, "v_scale", v_scale, value_cache, reference, reference_name)


def check_attention_args(op: str, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: Optional[torch.Tensor],
                         alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
                         out: Optional[torch.Tensor] = None,
                         lse: Optional[torch.Tensor] = None) -> None:
    """``check_attention_args``: its device, dtype, cache and scale checks, and (static sizes)
    the caches' block dims and the query's heads against the caches'."""
    check_same_device(op, "query", query, key_cache=key_cache, value_cache=value_cache,
                      block_tables=block_tables, seq_lens=seq_lens,
                      query_start_loc=query_start_loc, alibi_slopes=alibi_slopes, sinks=sinks,
                      out=out, lse=lse)
    check_rank(op, "query", query, 3, "[num_tokens, num_heads, head_size]")
    check_float(op, "query", query)
    check_cache_tensor(op, "key_cache", key_cache)
    check_cache_tensor(op, "value_cache", value_cache)
    # A float cache has the query's dtype; an fp8 or per-token cache takes a query of any
    # float dtype.
    if not is_quantized(key_cache.dtype):
        check_input_dtype(op, "query", query, "key_cache", key_cache, "the query")
    check_dtype(op, "value_cache", value_cache, key_cache.dtype)
    check_same_block_layout(op, key_cache, value_cache)
    check_kv_scales(op, key_cache, value_cache, k_scale, v_scale, query, "query")
    num_heads, num_kv_heads, block_size = query.shape[1], key_cache.shape[1], key_cache.shape[2]
    if static(num_heads, num_kv_heads, block_size) and not (
            num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        hint = nhd_hint("key_cache") if block_size > 0 and num_heads % block_size == 0 else ""
        raise ValueError(f"{op}: num_heads of 'query' ({num_heads}) must be a multiple of "
                         f"num_kv_heads of 'key_cache' ({num_kv_heads}){hint}")


def check_write_kv_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
    """``check_write_kv_args``: its device, dtype, cache and scale checks, and (static sizes)
    the caches' block dims and the key's shape."""
    op = "paged.write_kv"
    check_same_device(op, "key", key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping)
    check_rank(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    check_rank(op, "value", value, 3, "[num_tokens, num_kv_heads, head_size_v]")
    check_cache_tensor(op, "key_cache", key_cache)
    check_cache_tensor(op, "value_cache", value_cache)
    check_same_block_layout(op, key_cache, value_cache)
    check_dtype(op, "value_cache", value_cache, key_cache.dtype)
    if is_quantized(key_cache.dtype):  # quantized on the way in: any float input
        check_float(op, "key", key)
        check_dtype(op, "value", value, key.dtype)
    else:
        check_input_dtype(op, "key", key, "key_cache", key_cache, "key, value")
        check_input_dtype(op, "value", value, "value_cache", value_cache, "key, value")
    # An int4 cache packs two values a byte: rows of twice its last dimension.
    packing = 2 if key_cache.dtype == torch.uint8 else 1
    if packing == 2 and static(key.shape[2], value.shape[2]) and (key.shape[2] % 2
                                                                   or value.shape[2] % 2):
        raise ValueError(f"{op}: an int4 cache packs two values a byte: head_size "
                         f"{key.shape[2]} (key) and {value.shape[2]} (value) must be even")
    # num_tokens is the key's own (the kernel compares it with itself): left out, so a
    # dynamic token count leaves the check in place.
    want_k = (key_cache.shape[1], key_cache.shape[3] * packing)
    if static(*key.shape[1:], *want_k) and tuple(key.shape[1:]) != want_k:
        hint = (nhd_hint("key_cache") if key_cache.shape[1] != key.shape[1]
                and key_cache.shape[2] == key.shape[1] else "")
        raise ValueError(f"{op}: argument 'key' must be [num_tokens, num_kv_heads="
                         f"{key_cache.shape[1]}, head_size={want_k[1]}], got "
                         f"{list(key.shape)}{hint}")
    check_kv_scales(op, key_cache, value_cache, k_scale, v_scale, key, "key")


def check_write_latent_args(latent: torch.Tensor, rotary_key: torch.Tensor, cache: torch.Tensor,
                            slot_mapping: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
    """``check_write_latent_args``: its device, dtype, cache and scale checks, and (static
    sizes) the rows' widths against the cache's."""
    op = "paged.write_latent"
    check_same_device(op, "latent", latent, rotary_key=rotary_key, cache=cache,
                      slot_mapping=slot_mapping)
    check_rank(op, "latent", latent, 3, "[num_tokens, num_kv_heads, latent_size]")
    check_rank(op, "rotary_key", rotary_key, 3, "[num_tokens, num_kv_heads, rotary_size]")
    check_cache_tensor(op, "cache", cache)
    check_float(op, "latent", latent)
    check_dtype(op, "rotary_key", rotary_key, latent.dtype)
    packing = 2 if cache.dtype == torch.uint8 else 1
    sizes = (*latent.shape[1:], *rotary_key.shape[1:], *cache.shape[1::2])
    if static(*sizes) and not (latent.shape[1] == rotary_key.shape[1] == cache.shape[1]
                               and latent.shape[2] + rotary_key.shape[2] == cache.shape[3] * packing):
        unit = " values, two a byte)" if packing == 2 else " values)"
        raise ValueError(f"{op}: arguments 'latent' {list(latent.shape)} and 'rotary_key' "
                         f"{list(rotary_key.shape)} must be [num_tokens, num_kv_heads="
                         f"{cache.shape[1]}, n] with the two widths adding up to the cache's rows "
                         f"({cache.shape[3] * packing}{unit}")
    check_cache_scale(op, "scale", scale, cache, latent, "latent")


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
