"""The fakes refuse what the kernels refuse, with the same error: every check of
paged_attention_ext/op_checks.py (the Python mirror of csrc/checks.cpp) runs through the
CPU kernel and, on meta tensors, through the fake, and the two exceptions must match in
type and message."""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext.token_quantization import scale_shape, stored_head_size

FP8, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, BLOCKS = 4, 2, 64, 16, 4


def on_meta(value):
    """A meta tensor of ``value``'s shape, strides (overlapping ones included) and dtype."""
    if isinstance(value, list):
        return [on_meta(v) for v in value]
    if not torch.is_tensor(value):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def raised(call, args):
    with pytest.raises(Exception) as error:
        call(**args)
    return error.value


def assert_same_refusal(call, args):
    kernel = raised(call, args)
    fake = raised(call, {name: on_meta(value) for name, value in args.items()})
    assert (type(fake), str(fake)) == (type(kernel), str(kernel))
    assert isinstance(kernel, (ValueError, TypeError))


def cache(dtype=torch.float32, head_size=HEAD_SIZE):
    return torch.zeros(BLOCKS, KV_HEADS, BLOCK_SIZE, head_size, dtype=dtype)


def float_caches():
    return dict(key_cache=cache(), value_cache=cache())


def fp8_caches():
    return dict(key_cache=cache(FP8), value_cache=cache(FP8), k_scale=torch.tensor(0.5),
                v_scale=torch.ones(KV_HEADS))


CACHE_FAULTS = {
    "cache dtype": dict(key_cache=cache(torch.int16), value_cache=cache(torch.int16)),
    "cache rank": dict(value_cache=cache()[0]),
    "head dim not contiguous": dict(key_cache=cache().transpose(2, 3).contiguous().transpose(2, 3)),
    "overlapping view": dict(value_cache=torch.as_strided(cache(), cache().shape, (64, 64, 64, 1))),
    "value cache dtype": dict(value_cache=cache(torch.bfloat16)),
    "scale with a float cache": dict(k_scale=torch.tensor(1.0)),
    "v_scale with a float cache": dict(v_scale=torch.tensor(1.0)),
}
FP8_FAULTS = {
    "missing k_scale": dict(k_scale=None),
    "missing v_scale": dict(v_scale=None),
    "scale dtype": dict(k_scale=torch.tensor(0.5, dtype=torch.float64)),
    "scale shape": dict(v_scale=torch.ones(3)),
    "scale rank": dict(k_scale=torch.ones(2, 1)),
    "fp8 caches of two dtypes": dict(value_cache=cache(E5M2)),
}


def token_scales(dtype, **sizes):
    shape = dict(zip(("num_blocks", "num_kv_heads", "block_size"), (BLOCKS, KV_HEADS, BLOCK_SIZE)))
    return torch.ones(scale_shape(dtype, **{**shape, **sizes}))


def token_caches(dtype):
    """Per-token caches (int8; uint8: packed int4) and their scales."""
    stored = stored_head_size(dtype, HEAD_SIZE)
    return dict(key_cache=cache(dtype, stored), value_cache=cache(dtype, stored),
                k_scale=token_scales(dtype), v_scale=token_scales(dtype))


def caches(kind: str) -> dict:
    return {"float": float_caches, "fp8": fp8_caches}.get(kind, lambda: token_caches(kind))()


INT8, INT4 = torch.int8, torch.uint8
TOKEN_FAULTS = {
    "missing k_scale": dict(k_scale=None),
    "missing v_scale": dict(v_scale=None),
    "per-head scale": dict(k_scale=torch.ones(KV_HEADS)),
    "scales of another block size": lambda dtype: dict(v_scale=token_scales(dtype, block_size=8)),
    "scales of other blocks": lambda dtype: dict(k_scale=token_scales(dtype, num_blocks=2)),
    "scale dtype": lambda dtype: dict(k_scale=token_scales(dtype).double()),
    "overlapping scales": lambda dtype: dict(
        v_scale=token_scales(dtype).as_strided(scale_shape(dtype, BLOCKS, KV_HEADS, BLOCK_SIZE),
                                               token_scales(dtype).stride()[:2] + (0,)
                                               + token_scales(dtype).stride()[3:])),
    "per-token caches of two dtypes": lambda dtype: dict(
        value_cache=cache(INT4 if dtype == INT8 else INT8)),
}
INT4_FAULTS = {
    "int4 pairs not contiguous": dict(
        k_scale=torch.ones(BLOCKS, KV_HEADS, 2, BLOCK_SIZE).transpose(2, 3)),
    "int8 scales for an int4 cache": dict(v_scale=token_scales(INT8)),
}


def token_faults(dtype) -> list:
    faults = {**TOKEN_FAULTS, **(INT4_FAULTS if dtype == INT4 else {})}
    return [(f"{name} ({dtype})", dtype, change(dtype) if callable(change) else change)
            for name, change in faults.items()]


def nhd_cache(dtype=torch.float32):
    """vLLM's layout [num_blocks, block_size, num_kv_heads, head_size], passed as it is."""
    return torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=dtype)


# Faults of the caches' layouts, for attention and write_kv alike.
LAYOUT_FAULTS = {
    "NHD caches": dict(key_cache=nhd_cache(), value_cache=nhd_cache()),
    "caches of two layouts": dict(value_cache=nhd_cache()),
}
QUERY_FAULTS = {
    "query dtype": dict(query=torch.zeros(2, HEADS, HEAD_SIZE, dtype=torch.float64)),
    "fp8 query": dict(query=torch.zeros(2, HEADS, HEAD_SIZE, dtype=FP8)),
    "query rank": dict(query=torch.zeros(2, HEADS * HEAD_SIZE)),
    "float cache of another dtype": dict(key_cache=cache(torch.float16),
                                         value_cache=cache(torch.float16)),
    "query of another dtype": dict(query=torch.zeros(2, HEADS, HEAD_SIZE, dtype=torch.bfloat16)),
    "heads do not divide": dict(query=torch.zeros(2, 3, HEAD_SIZE)),
    **LAYOUT_FAULTS,
}


def attention_call(op):
    """``op`` with the attention arguments (shared_prefix_attention orders them its own way)."""
    if op is pa.shared_prefix_attention:
        return lambda query_start_loc, scale, **args: op(
            query_start_loc=query_start_loc, scale=scale, **args)
    if op is pa.attention_out:
        return lambda query, **args: op(query.new_empty(query.shape), query, **args)
    return op


def attention_args(kind, change: dict) -> dict:
    args = dict(query=torch.zeros(2, HEADS, HEAD_SIZE),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 20], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), scale=0.125,
                **caches(kind))
    args.update(change)
    return args


ATTENTION_CASES = ([(name, "float", change) for name, change in {**CACHE_FAULTS, **QUERY_FAULTS}.items()]
                   + [(name, "fp8", change) for name, change in FP8_FAULTS.items()]
                   + token_faults(INT8) + token_faults(INT4))


@pytest.mark.parametrize("op", [pa.attention, pa.attention_with_lse, pa.attention_out,
                                pa.shared_prefix_attention], ids=lambda op: op.__name__)
@pytest.mark.parametrize("name,kind,change", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_checks_match_the_kernel(op, name, kind, change):
    assert_same_refusal(attention_call(op), attention_args(kind, change))


WRITE_KV_FAULTS = {
    **CACHE_FAULTS,
    **LAYOUT_FAULTS,
    "key of another dtype": dict(key=torch.ones(2, KV_HEADS, HEAD_SIZE, dtype=torch.float16)),
    "value of another dtype": dict(value=torch.ones(2, KV_HEADS, HEAD_SIZE, dtype=torch.float16)),
    "key of other heads": dict(key=torch.ones(2, 3, HEAD_SIZE)),
    "key rank": dict(key=torch.ones(2, KV_HEADS * HEAD_SIZE)),
    "value rank": dict(value=torch.ones(2, KV_HEADS * HEAD_SIZE)),
}
WRITE_KV_FP8_FAULTS = {
    **FP8_FAULTS,
    "key dtype": dict(key=torch.ones(2, KV_HEADS, HEAD_SIZE, dtype=torch.float64)),
    "value dtype": dict(value=torch.ones(2, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)),
}
WRITE_KV_INT4_FAULTS = {
    "odd int4 head size": dict(key=torch.ones(2, KV_HEADS, HEAD_SIZE - 1)),
    "int4 key of stored width": dict(key=torch.ones(2, KV_HEADS, HEAD_SIZE // 2)),
}
WRITE_KV_CASES = ([(name, "float", change) for name, change in WRITE_KV_FAULTS.items()]
                  + [(name, "fp8", change) for name, change in WRITE_KV_FP8_FAULTS.items()]
                  + token_faults(INT8) + token_faults(INT4)
                  + [(name, INT4, change) for name, change in WRITE_KV_INT4_FAULTS.items()])


@pytest.mark.parametrize("name,kind,change", WRITE_KV_CASES, ids=[c[0] for c in WRITE_KV_CASES])
def test_write_kv_checks_match_the_kernel(name, kind, change):
    args = dict(key=torch.ones(2, KV_HEADS, HEAD_SIZE), value=torch.ones(2, KV_HEADS, HEAD_SIZE),
                slot_mapping=torch.tensor([3, 9]), **caches(kind))
    args.update(change)
    assert_same_refusal(pa.write_kv, args)


def latent_cache(dtype):
    """A latent cache of rows 40 + 24 wide (one KV head) and its scale, as the kind needs."""
    rows = torch.zeros(BLOCKS, 1, BLOCK_SIZE, stored_head_size(dtype, HEAD_SIZE), dtype=dtype)
    if dtype in (torch.int8, torch.uint8):
        return dict(cache=rows, scale=torch.zeros(scale_shape(dtype, BLOCKS, 1, BLOCK_SIZE)))
    return dict(cache=rows, scale=torch.tensor(0.5) if dtype == FP8 else None)


WRITE_LATENT_CASES = [
    ("cache dtype", torch.float32, dict(cache=torch.zeros(BLOCKS, 1, BLOCK_SIZE, HEAD_SIZE, dtype=torch.int16))),
    ("cache rank", torch.float32, dict(cache=torch.zeros(BLOCKS, BLOCK_SIZE, HEAD_SIZE))),
    ("latent rank", torch.float32, dict(latent=torch.ones(2, 40))),
    ("latent dtype", torch.float32, dict(latent=torch.ones(2, 1, 40, dtype=torch.float64))),
    ("rotary dtype", FP8, dict(rotary_key=torch.ones(2, 1, 24, dtype=torch.float16))),
    ("widths", torch.float32, dict(rotary_key=torch.ones(2, 1, 16))),
    ("heads", torch.bfloat16, dict(latent=torch.ones(2, 2, 40), rotary_key=torch.ones(2, 2, 24))),
    ("int4 widths", torch.uint8, dict(rotary_key=torch.ones(2, 1, 12))),
    ("scale with a float cache", torch.float32, dict(scale=torch.tensor(1.0))),
    ("fp8 without a scale", FP8, dict(scale=None)),
    ("fp8 scale shape", FP8, dict(scale=torch.ones(3))),
    ("int8 without a scale", torch.int8, dict(scale=None)),
    ("int8 scale shape", torch.int8, dict(scale=torch.zeros(BLOCKS, 1, BLOCK_SIZE, 2))),
    ("int4 scale dtype", torch.uint8, dict(scale=torch.zeros(BLOCKS, 1, BLOCK_SIZE, 2).double())),
    ("int4 pair not contiguous", torch.uint8,
     dict(scale=torch.zeros(BLOCKS, 1, 2, BLOCK_SIZE).transpose(2, 3))),
]


@pytest.mark.parametrize("name,dtype,change", WRITE_LATENT_CASES, ids=[c[0] for c in WRITE_LATENT_CASES])
def test_write_latent_checks_match_the_kernel(name, dtype, change):
    args = dict(latent=torch.ones(2, 1, 40), rotary_key=torch.ones(2, 1, 24),
                slot_mapping=torch.tensor([3, 9]), **latent_cache(dtype))
    args.update(change)
    assert_same_refusal(pa.write_latent, args)


OUT, LSE = torch.zeros(4, 3, 8), torch.zeros(4, 3)
MERGE_CASES = {
    "count": ([OUT, OUT], [LSE]),
    "rank": ([OUT[0], OUT[0]], [LSE, LSE]),
    "first dtype": ([OUT.double(), OUT.double()], [LSE, LSE]),
    "dtype": ([OUT, OUT.half()], [LSE, LSE]),
    "shape": ([OUT, OUT[:, :2]], [LSE, LSE]),
    "lse rank": ([OUT, OUT], [LSE, LSE[0]]),
    "lse shape": ([OUT, OUT], [LSE, LSE[:2]]),
    "lse dtype": ([OUT, OUT], [LSE, LSE.double()]),
}


@pytest.mark.parametrize("name", MERGE_CASES)
def test_merge_checks_match_the_kernel(name):
    outputs, lses = MERGE_CASES[name]
    assert_same_refusal(pa.merge_attention_states, dict(outputs=outputs, lses=lses))
