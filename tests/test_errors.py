"""Bad input raises a Python exception that names the argument, and changes nothing."""

import re

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import token_quantization
from paged_case import make_case, query_start_loc, random_query


@pytest.fixture
def case():
    return make_case([5, 20], num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)


@pytest.fixture
def query():
    return random_query(2, 4, 64, torch.float32)


def call(query, case, overrides):
    args = dict(query=query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, scale=0.125)
    args.update(overrides)
    return pa.attention(**args)


@pytest.mark.parametrize("name,make,error,match", [
    ("query rank", lambda q, c: dict(query=q[0]), ValueError, "'query' must be 3-D"),
    ("query dtype", lambda q, c: dict(query=q.double()), TypeError, "'query'"),
    ("cache dtype", lambda q, c: dict(key_cache=c.key_cache.half()), TypeError,
     "query is float32 but key_cache is float16"),
    ("cache rank", lambda q, c: dict(value_cache=c.value_cache[0]), ValueError, "'value_cache'"),
    ("cache shapes", lambda q, c: dict(value_cache=c.value_cache[:-1]), ValueError, "'value_cache'"),
    ("head dim not contiguous", lambda q, c: dict(
        key_cache=c.key_cache.transpose(2, 3).contiguous().transpose(2, 3)),
     ValueError, "'key_cache' must be contiguous in its last dimension"),
    ("overlapping cache view", lambda q, c: dict(
        value_cache=torch.as_strided(c.value_cache, c.value_cache.shape, (64, 64, 64, 1))),
     ValueError, "'value_cache' is a view that overlaps itself"),
    ("head size mismatch", lambda q, c: dict(query=torch.randn(2, 4, 32)), ValueError, "head_size"),
    ("head size unsupported", lambda q, c: dict(
        query=torch.randn(2, 4, 12), key_cache=torch.randn(8, 2, 16, 12),
        value_cache=torch.randn(8, 2, 16, 12)), ValueError, "multiples of 8"),
    ("heads do not divide", lambda q, c: dict(query=torch.randn(2, 3, 64)), ValueError, "num_kv_heads"),
    ("seq_lens dtype", lambda q, c: dict(seq_lens=c.seq_lens.long()), TypeError, "'seq_lens'"),
    ("block_tables dtype", lambda q, c: dict(block_tables=c.block_tables.long()), TypeError,
     "'block_tables'"),
    ("block_tables rows", lambda q, c: dict(block_tables=c.block_tables[:1]), ValueError,
     "'block_tables'"),
    ("decode rows", lambda q, c: dict(query=q[:1]), ValueError, "one row per sequence"),
    ("seq_len beyond table", lambda q, c: dict(seq_lens=torch.tensor([5, 1000], dtype=torch.int32)),
     ValueError, r"seq_lens\[1\]"),
    ("negative seq_len", lambda q, c: dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)),
     ValueError, r"seq_lens\[0\]"),
    ("block id out of range", lambda q, c: dict(
        block_tables=torch.tensor([[0, 1, 2], [99, 1, 2]], dtype=torch.int32)), IndexError,
     r"block_tables\[1, 0\] = 99"),
    ("negative block id", lambda q, c: dict(
        block_tables=torch.tensor([[-1, 1, 2], [0, 1, 2]], dtype=torch.int32)), IndexError,
     r"block_tables\[0, 0\]"),
    ("qsl length", lambda q, c: dict(query_start_loc=query_start_loc([1])), ValueError,
     "'query_start_loc'"),
    ("qsl total", lambda q, c: dict(query_start_loc=query_start_loc([1, 2])), ValueError,
     "num_tokens"),
    ("qsl decreasing", lambda q, c: dict(
        query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32), query=torch.randn(2, 4, 64)),
     ValueError, "non-decreasing"),
    ("qsl longer than sequence", lambda q, c: dict(
        query_start_loc=query_start_loc([6, 1]), query=torch.randn(7, 4, 64)), ValueError,
     r"seq_lens\[0\] = 5"),
    ("alibi shape", lambda q, c: dict(alibi_slopes=torch.ones(3)), ValueError, "'alibi_slopes'"),
    ("alibi dtype", lambda q, c: dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError,
     "'alibi_slopes'"),
    ("soft cap", lambda q, c: dict(soft_cap=-1.0), ValueError, "'soft_cap'"),
    ("scale", lambda q, c: dict(scale=float("nan")), ValueError, "'scale'"),
    ("window", lambda q, c: dict(sliding_window=-5), ValueError, "'sliding_window'"),
    ("sinks dtype", lambda q, c: dict(sinks=torch.zeros(4, dtype=torch.bfloat16)), TypeError,
     "'sinks' must have dtype Float"),
    ("sinks length", lambda q, c: dict(sinks=torch.zeros(2)), ValueError,
     r"'sinks' must have 4 entries \(num_heads\)"),
    ("sinks rank", lambda q, c: dict(sinks=torch.zeros(1, 4)), ValueError, "'sinks' must be 1-D"),
    ("value cache block size", lambda q, c: dict(value_cache=torch.zeros(8, 2, 8, 64)), ValueError,
     "'value_cache' must have the num_blocks, num_kv_heads and block_size"),
    ("value cache kv heads", lambda q, c: dict(value_cache=c.value_cache[:, :1].contiguous()),
     ValueError, "'value_cache' must have the num_blocks"),
    ("value head size unsupported", lambda q, c: dict(value_cache=c.value_cache[..., :12].contiguous()),
     ValueError, "'value_cache' has head_size 12; supported head sizes are multiples of 8 up to 512"),
    ("value head size too large", lambda q, c: dict(value_cache=torch.zeros(c.value_cache.shape[:3] + (520,))),
     ValueError, "'value_cache' has head_size 520; supported head sizes are multiples of 8 up to 512"),
    ("key head size too large", lambda q, c: dict(
        query=torch.randn(2, 4, 584), key_cache=torch.randn(c.key_cache.shape[:3] + (584,))),
     ValueError, "'query' has head_size 584; supported head sizes are multiples of 8 up to 576"),
    ("value cache dtype", lambda q, c: dict(value_cache=c.value_cache.bfloat16()), TypeError,
     "'value_cache'"),
])
def test_attention_rejects(name, make, error, match, query, case):
    with pytest.raises(error, match=match):
        call(query, case, make(query, case))


def test_attention_out_rejects_wrong_buffers(query, case):
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    with pytest.raises(ValueError, match="'out'"):
        pa.attention_out(torch.empty(2, 4, 32), *args)
    with pytest.raises(TypeError, match="'out'"):
        pa.attention_out(torch.empty(2, 4, 64, dtype=torch.bfloat16), *args)
    with pytest.raises(ValueError, match="'lse'"):
        pa.attention_out(torch.empty(2, 4, 64), *args, lse=torch.empty(2, 3))
    with pytest.raises(TypeError, match="'lse'"):
        pa.attention_out(torch.empty(2, 4, 64), *args, lse=torch.empty(2, 4, dtype=torch.float64))
    # With a value head size of 32, out is [num_tokens, num_heads, 32].
    narrow = case.value_cache[..., :32].contiguous()
    narrow_args = args[:2] + (narrow,) + args[3:]
    with pytest.raises(ValueError, match=r"'out' must be \[num_tokens, num_heads, head_size_v\] = \[2, 4, 32\]"):
        pa.attention_out(torch.empty(2, 4, 64), *narrow_args)
    pa.attention_out(torch.empty(2, 4, 32), *narrow_args)


def caches():
    return torch.zeros(4, 2, 8, 64), torch.zeros(4, 2, 8, 64)


@pytest.mark.parametrize("make,error,match", [
    (lambda k, v: dict(slot_mapping=torch.tensor([0, 32])), IndexError, r"slot_mapping\[1\] = 32"),
    (lambda k, v: dict(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), TypeError,
     "'slot_mapping'"),
    (lambda k, v: dict(slot_mapping=torch.tensor([0])), ValueError, "'slot_mapping'"),
    (lambda k, v: dict(key=k[:, :1]), ValueError, "'key'"),
    (lambda k, v: dict(value=v.half()), TypeError, "value is float16 but value_cache is float32"),
    (lambda k, v: dict(key=k.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "'key' and 'value'"),
    (lambda k, v: dict(value=torch.ones(2, 2, 32)), ValueError,
     r"'value' must be \[num_tokens=2, num_kv_heads=2, head_size_v=64\]"),
    (lambda k, v: dict(value_cache=torch.zeros(4, 2, 16, 64)), ValueError,
     "'value_cache' must have the num_blocks, num_kv_heads and block_size of 'key_cache'"),
])
def test_write_kv_rejects_and_leaves_cache_unchanged(make, error, match):
    key_cache, value_cache = caches()
    key, value = torch.ones(2, 2, 64), torch.ones(2, 2, 64)
    args = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=torch.tensor([3, 9]))
    args.update(make(key, value))
    with pytest.raises(error, match=match):
        pa.write_kv(**args)
    assert (key_cache == 0).all() and (value_cache == 0).all()


@pytest.mark.parametrize("mapping,error,match", [
    (torch.tensor([[0, 4]]), IndexError, r"block_mapping\[0, 1\] = 4"),
    (torch.tensor([[-1, 2]]), IndexError, r"block_mapping\[0, 0\]"),
    (torch.tensor([[0, 1], [2, 1]]), ValueError, "more than once"),
    (torch.tensor([[0, 1], [1, 2]]), ValueError, "also writes"),
    (torch.tensor([0, 1]), ValueError, r"\[num_pairs, 2\]"),
    (torch.tensor([[0, 1]], dtype=torch.int32), TypeError, "'block_mapping'"),
])
def test_copy_blocks_rejects_bad_mappings(mapping, error, match):
    key, value = caches()
    key[0] = 1.0
    before = key.clone()
    with pytest.raises(error, match=match):
        pa.copy_blocks([key], [value], mapping)
    assert torch.equal(key, before)


def test_copy_blocks_rejects_mismatched_layers():
    key, value = caches()
    with pytest.raises(ValueError, match="same number of layers"):
        pa.copy_blocks([key, key], [value], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="same dtype and shape"):
        pa.copy_blocks([key], [value[:2]], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"the head size may differ\), got \[4, 2, 8, 64\] and \[4, 2, 4, 64\]"):
        pa.copy_blocks([key], [torch.zeros(4, 2, 4, 64)], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="same dtype and shape"):
        pa.copy_blocks([key], [value.half()], torch.tensor([[0, 1]]))
    pa.copy_blocks([key], [torch.zeros(4, 2, 8, 16)], torch.tensor([[0, 1]]))  # head sizes differ


FP8 = torch.float8_e4m3fn


def fp8_case(case):
    """The case's caches as fp8 e4m3 bytes (values do not matter for the checks)."""
    return case.key_cache.to(FP8), case.value_cache.to(FP8)


@pytest.mark.parametrize("name,make,error,match", [
    ("missing k_scale", lambda s: dict(k_scale=None), ValueError,
     "(?i)float8_e4m3fn, which needs argument 'k_scale'"),
    ("missing v_scale", lambda s: dict(v_scale=None), ValueError, "needs argument 'v_scale'"),
    ("scale dtype", lambda s: dict(k_scale=s.double()), TypeError, "'k_scale' must have dtype Float"),
    ("scale shape", lambda s: dict(v_scale=torch.ones(3)), ValueError,
     r"'v_scale' must have shape \[\], \[1\] or \[num_kv_heads\] = \[2\], got \[3\]"),
    ("scale rank", lambda s: dict(k_scale=torch.ones(2, 1)), ValueError, "'k_scale' must have shape"),
    ("scale device", lambda s: dict(k_scale=s.to("meta")), ValueError,
     "argument 'k_scale' must be on the same device"),
    ("caches of two dtypes", lambda s: dict(value_cache=torch.zeros(8, 2, 16, 64,
                                                                    dtype=torch.float8_e5m2)),
     TypeError, "'value_cache' must have dtype"),
    ("int16 cache", lambda s: dict(key_cache=torch.zeros(8, 2, 16, 64, dtype=torch.int16),
                                   value_cache=torch.zeros(8, 2, 16, 64, dtype=torch.int16)),
     TypeError, r"'key_cache' must be float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, "
     r"int8 \(int8_per_token_head\) or uint8 \(int4_per_token_head\)"),
    ("fp8 query", lambda s: dict(query=torch.zeros(2, 4, 64, dtype=FP8)), TypeError, "'query'"),
])
def test_attention_rejects_fp8_arguments(name, make, error, match, query, case):
    key_cache, value_cache = fp8_case(case)
    overrides = dict(key_cache=key_cache, value_cache=value_cache, k_scale=torch.tensor(0.5),
                     v_scale=torch.ones(2))
    overrides.update(make(torch.tensor(0.5)))
    with pytest.raises(error, match=match):
        call(query, case, overrides)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scale_with_a_float_cache_is_refused(name, query, case):
    with pytest.raises(ValueError, match=f"argument '{name}' is only for fp8 "):
        call(query, case, {name: torch.tensor(1.0)})
    key_cache, value_cache = caches()
    with pytest.raises(ValueError, match=f"paged.write_kv: argument '{name}' is only for fp8"):
        pa.write_kv(torch.ones(2, 2, 64), torch.ones(2, 2, 64), key_cache, value_cache,
                    torch.tensor([3, 9]), **{name: torch.tensor(1.0)})


def token_case(case, dtype):
    """The case's caches in a per-token format (int8; uint8: int4) and their scales."""
    (key, k_scale), (value, v_scale) = (token_quantization.quantize(case.key_cache, dtype),
                                        token_quantization.quantize(case.value_cache, dtype))
    return dict(key_cache=key, value_cache=value, k_scale=k_scale, v_scale=v_scale)


TOKEN_SHAPE = r"\[num_blocks, num_kv_heads, block_size\]"
INT4_SHAPE = r"\[num_blocks, num_kv_heads, block_size, 2\] \(scale, low\)"


@pytest.mark.parametrize("dtype,make,error,match", [
    (torch.int8, lambda a: dict(k_scale=None), ValueError,
     r"the caches are Char, which needs argument 'k_scale' \(a float32 tensor of shape "
     + TOKEN_SHAPE),
    (torch.uint8, lambda a: dict(v_scale=None), ValueError,
     r"the caches are Byte, which needs argument 'v_scale' \(a float32 tensor of shape "
     r"\[num_blocks, num_kv_heads, block_size, 2\]\)"),
    (torch.int8, lambda a: dict(k_scale=a["k_scale"].half()), TypeError,
     "'k_scale' must have dtype Float, got Half"),
    (torch.int8, lambda a: dict(k_scale=torch.ones(2)), ValueError,
     "'k_scale' must have shape " + TOKEN_SHAPE + r" = \[{nb}, 2, 16\], one per slot of the int8 "
     r"cache, got \[2\]"),
    (torch.uint8, lambda a: dict(v_scale=a["v_scale"][:, :, :8]), ValueError,
     "'v_scale' must have shape " + INT4_SHAPE + r" = \[{nb}, 2, 16, 2\], one per slot of the uint8 "
     r"cache, got \[{nb}, 2, 8, 2\]"),
    (torch.uint8, lambda a: dict(k_scale=a["k_scale"][..., 0]), ValueError,
     "'k_scale' must have shape " + INT4_SHAPE),
    (torch.int8, lambda a: dict(v_scale=a["v_scale"][:2]), ValueError,
     r"'v_scale' must have shape .* = \[{nb}, 2, 16\]"),  # paged over other blocks
    (torch.int8, lambda a: dict(k_scale=a["k_scale"][:, :1].expand(a["k_scale"].shape)), ValueError,
     "'k_scale' is a view that overlaps itself"),
    (torch.uint8, lambda a: dict(k_scale=a["k_scale"].transpose(2, 3).contiguous().transpose(2, 3)),
     ValueError, r"'k_scale' must be contiguous in its last dimension \(scale, low\)"),
    (torch.uint8, lambda a: dict(query=torch.zeros(2, 4, 32)), ValueError,
     r"'key_cache' holds int4 rows of head_size 64 \(32 bytes, two values a byte\) but 'query' "
     r"has head_size 32; an int4 cache's last dimension is head_size // 2"),
    (torch.uint8, lambda a: dict(value_cache=a["value_cache"].view(torch.int8)), TypeError,
     "'value_cache' must have dtype Byte, got Char"),
    (torch.int8, lambda a: dict(k_scale=a["k_scale"].to("meta")), ValueError,
     "argument 'k_scale' must be on the same device"),
])
def test_attention_rejects_bad_per_token_scales(dtype, make, error, match, query, case):
    args = token_case(case, dtype)
    args.update(make(args))
    with pytest.raises(error, match=match.replace("{nb}", str(case.key_cache.shape[0]))):
        call(query, case, args)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=["int8", "int4"])
@pytest.mark.parametrize("make,error,match", [
    (lambda a: dict(k_scale=None), ValueError, "needs argument 'k_scale'"),
    (lambda a: dict(v_scale=a["v_scale"].double()), TypeError, "'v_scale' must have dtype Float"),
    (lambda a: dict(k_scale=a["k_scale"][:, :, :4]), ValueError, "'k_scale' must have shape"),
    (lambda a: dict(key=torch.ones(2, 2, 63), value=torch.ones(2, 2, 63)), ValueError, None),
])
def test_write_kv_rejects_bad_per_token_arguments_before_writing(dtype, make, error, match):
    stored = token_quantization.stored_head_size(dtype, 64)
    args = dict(key=torch.ones(2, 2, 64), value=torch.ones(2, 2, 64),
                key_cache=torch.zeros(4, 2, 8, stored, dtype=dtype),
                value_cache=torch.zeros(4, 2, 8, stored, dtype=dtype),
                slot_mapping=torch.tensor([3, 9]),
                k_scale=torch.zeros(token_quantization.scale_shape(dtype, 4, 2, 8)),
                v_scale=torch.zeros(token_quantization.scale_shape(dtype, 4, 2, 8)))
    args.update(make(args))
    if match is None:  # an odd head size: int4 needs it even; int8 rows of 64 are not 63
        match = ("an int4 cache packs two values a byte: head_size 63 (key) and 63 (value) must "
                 "be even" if dtype == torch.uint8 else "'key' must be .*head_size=64")
        match = re.escape(match) if dtype == torch.uint8 else match
    with pytest.raises(error, match=match):
        pa.write_kv(**args)
    for name in ("key_cache", "value_cache", "k_scale", "v_scale"):
        if args[name] is not None:
            assert (args[name] == 0).all(), f"{name} changed before the refusal"


@pytest.mark.parametrize("make,error,match", [
    (lambda: dict(k_scale=None), ValueError, "needs argument 'k_scale'"),
    (lambda: dict(v_scale=torch.ones(3)), ValueError, "'v_scale' must have shape"),
    (lambda: dict(k_scale=torch.ones(2).to("meta")), ValueError,
     "argument 'k_scale' must be on the same device as 'key'"),
    (lambda: dict(key=torch.ones(2, 2, 64, dtype=torch.float64)), TypeError, "'key'"),
    (lambda: dict(value=torch.ones(2, 2, 64, dtype=torch.bfloat16)), TypeError, "'value'"),
    (lambda: dict(value_cache=torch.zeros(4, 2, 8, 64, dtype=torch.float8_e5m2)), TypeError,
     "'value_cache'"),
    (lambda: dict(key_cache=torch.zeros(4, 2, 1, 64, dtype=FP8).expand(4, 2, 8, 64)), ValueError,
     "'key_cache' is a view that overlaps itself"),
])
def test_write_kv_rejects_fp8_arguments_and_leaves_cache_unchanged(make, error, match):
    key_cache, value_cache = torch.zeros(4, 2, 8, 64, dtype=FP8), torch.zeros(4, 2, 8, 64, dtype=FP8)
    args = dict(key=torch.ones(2, 2, 64), value=torch.ones(2, 2, 64), key_cache=key_cache,
                value_cache=value_cache, slot_mapping=torch.tensor([3, 9]),
                k_scale=torch.tensor(0.5), v_scale=torch.ones(2))
    args.update(make())
    with pytest.raises(error, match=match):
        pa.write_kv(**args)
    assert (key_cache.view(torch.uint8) == 0).all() and (value_cache.view(torch.uint8) == 0).all()


def test_swap_blocks_refuses_different_views_of_one_storage():
    pool = torch.randn(6, 2, 8, 64)
    before = pool.clone()
    with pytest.raises(ValueError, match="'src' and 'dst' are different views that share memory"):
        pa.swap_blocks(pool[:5], pool[1:], torch.tensor([[0, 1], [1, 2]]))
    assert torch.equal(pool, before)
    pa.swap_blocks(pool, pool, torch.tensor([[0, 5]]))  # one pool as both: a copy within it
    assert torch.equal(pool[5], before[0])


def test_swap_blocks_rejects():
    src, dst = torch.zeros(4, 2, 8, 64), torch.zeros(2, 2, 8, 64)
    with pytest.raises(IndexError, match="destination"):
        pa.swap_blocks(src, dst, torch.tensor([[0, 2]]))
    with pytest.raises(TypeError, match="same dtype"):
        pa.swap_blocks(src, dst.half(), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="same block shape"):
        pa.swap_blocks(src, torch.zeros(2, 2, 8, 32), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="'dst' is a view that overlaps itself"):
        pa.swap_blocks(src, dst[:, :1].expand(2, 2, 8, 64), torch.tensor([[0, 1]]))
    assert (dst == 0).all()


# ---- mixed devices: a meta tensor among CPU ones reaches the fake implementation --------

ATTENTION_TENSORS = ["query", "key_cache", "value_cache", "block_tables", "seq_lens",
                     "query_start_loc", "alibi_slopes", "sinks"]


def attention_kwargs(query, case):
    return dict(query=query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, scale=0.125,
                query_start_loc=query_start_loc([1, 1]), alibi_slopes=torch.ones(4),
                sinks=torch.zeros(4))


@pytest.mark.parametrize("name", ATTENTION_TENSORS)
@pytest.mark.parametrize("op", [pa.attention, pa.attention_with_lse])
def test_attention_rejects_mixed_devices(op, name, query, case):
    kwargs = attention_kwargs(query, case)
    kwargs[name] = kwargs[name].to("meta")
    # The error names the argument on the other device (the query when it is the odd one).
    wanted = "key_cache" if name == "query" else name
    with pytest.raises(ValueError, match=f"argument '{wanted}' must be on the same device"):
        op(**kwargs)


@pytest.mark.parametrize("name", ["out", "lse"])
def test_attention_out_rejects_buffers_on_another_device(name, query, case):
    buffers = dict(out=torch.empty(2, 4, 64), lse=torch.empty(2, 4))
    buffers[name] = buffers[name].to("meta")
    with pytest.raises(ValueError, match=f"argument '{name}' must be on the same device"):
        pa.attention_out(buffers["out"], **attention_kwargs(query, case), lse=buffers["lse"])


@pytest.mark.parametrize("name", ["value", "key_cache", "value_cache", "slot_mapping"])
def test_write_kv_rejects_mixed_devices(name):
    key_cache, value_cache = caches()
    args = dict(key=torch.ones(2, 2, 64), value=torch.ones(2, 2, 64), key_cache=key_cache,
                value_cache=value_cache, slot_mapping=torch.tensor([3, 9]))
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"argument '{name}' must be on the same device as 'key'"):
        pa.write_kv(**args)
    assert (key_cache == 0).all() and (value_cache == 0).all()


def test_cache_copies_reject_mixed_devices():
    key, value = caches()
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match=r"argument 'value_caches\[1\]' must be on the same device"):
        pa.copy_blocks([key, key.clone()], [value, value.to("meta")], mapping)
    with pytest.raises(ValueError, match="argument 'block_mapping' must be on the same device"):
        pa.copy_blocks([key], [value], mapping.to("meta"))
    with pytest.raises(ValueError, match="argument 'dst' must be on the same device as 'src'"):
        pa.swap_blocks(key.to("meta"), value, mapping)
    with pytest.raises(ValueError, match="'block_mapping' must be a CPU tensor"):
        pa.swap_blocks(key, value, mapping.to("meta"))


# ---- no backward: arguments that require grad are refused in grad mode -------------------

@pytest.mark.parametrize("name", ["query", "key_cache", "value_cache", "alibi_slopes", "sinks"])
def test_attention_refuses_arguments_that_require_grad(name, query, case):
    kwargs = attention_kwargs(query, case)
    kwargs[name] = kwargs[name].clone().requires_grad_(True)
    for op in (pa.attention, pa.attention_with_lse):
        with pytest.raises(NotImplementedError,
                           match=f"argument '{name}' requires grad, but the paged ops have no backward"):
            op(**kwargs)
    out = torch.zeros(2, 4, 64)
    with pytest.raises(NotImplementedError, match=f"argument '{name}' requires grad"):
        pa.attention_out(out, **kwargs)
    assert (out == 0).all()
    # Inference as before: under no_grad and inference_mode, and with detached tensors.
    want = pa.attention(**{k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    with torch.no_grad():
        torch.testing.assert_close(pa.attention(**kwargs), want, atol=0, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(pa.attention(**kwargs), want, atol=0, rtol=0)


def test_cache_ops_refuse_arguments_that_require_grad():
    key_cache, value_cache = caches()
    key, value = torch.ones(2, 2, 64), torch.ones(2, 2, 64, requires_grad=True)
    slots = torch.tensor([3, 9])
    with pytest.raises(NotImplementedError, match="paged.write_kv: argument 'value' requires grad"):
        pa.write_kv(key, value, key_cache, value_cache, slots)
    assert (value_cache == 0).all()
    with torch.no_grad():
        pa.write_kv(key, value, key_cache, value_cache, slots)
    assert (value_cache[0, :, 3] == 1).all()
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(NotImplementedError, match="paged.copy_blocks: argument 'key_caches'"):
        pa.copy_blocks([key_cache.clone().requires_grad_(True)], [value_cache], mapping)
    with pytest.raises(NotImplementedError, match="paged.swap_blocks: argument 'src'"):
        pa.swap_blocks(key_cache.clone().requires_grad_(True), value_cache, mapping)


# ---- messages that say what to do: an input of another dtype than its cache, an NHD cache --
# Each through the kernel and, on meta tensors, through the fake (paged_attention_ext/
# op_checks.py): the same words either way.

QUERY_OPS = [pa.attention, pa.attention_with_lse, pa.attention_out, pa.shared_prefix_attention]


def on_meta(args: dict) -> dict:
    return {k: v.to("meta") if torch.is_tensor(v) else v for k, v in args.items()}


def call_query_op(op, args: dict):
    if op is pa.attention_out:
        return op(args["query"].new_empty(args["query"].shape[:2] + args["value_cache"].shape[-1:]),
                  **args)
    return op(**args)


def query_op_args(query, key_cache, value_cache):
    return dict(query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([5, 20], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), scale=0.125)


def refusal(call, error) -> str:
    with pytest.raises(error) as raised:
        call()
    return str(raised.value)


@pytest.mark.parametrize("path", ["kernel", "fake"])
@pytest.mark.parametrize("op", QUERY_OPS, ids=lambda op: op.__name__)
@pytest.mark.parametrize("query_dtype,cache_dtype", [(torch.float16, torch.float32),
                                                     (torch.float32, torch.bfloat16)])
def test_query_of_another_dtype_names_the_query_the_cache_and_the_fix(
        op, path, query_dtype, cache_dtype):
    args = query_op_args(torch.zeros(2, 4, 64, dtype=query_dtype),
                         torch.zeros(4, 2, 16, 64, dtype=cache_dtype),
                         torch.zeros(4, 2, 16, 64, dtype=cache_dtype))
    if path == "fake":
        args = on_meta(args)
    q, c = str(query_dtype).split(".")[1], str(cache_dtype).split(".")[1]
    message = refusal(lambda: call_query_op(op, args), TypeError)
    assert message == (
        f"paged.{op.__name__}: query is {q} but key_cache is {c}: the query and the caches must "
        "have the same dtype (or the caches are fp8 or per-token, with k_scale and v_scale); "
        f"cast with query.to(key_cache.dtype) or allocate the caches in {q}")


def test_query_of_another_dtype_is_refused_as_such_under_torch_compile():
    args = query_op_args(torch.zeros(2, 4, 64, dtype=torch.float16), torch.zeros(4, 2, 16, 64),
                         torch.zeros(4, 2, 16, 64))
    compiled = torch.compile(lambda a: pa.attention(**a), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=re.escape("query is float16 but key_cache is float32: "
                                                  "the query and the caches must have the same "
                                                  "dtype")):
        compiled(args)


@pytest.mark.parametrize("path", ["kernel", "fake"])
@pytest.mark.parametrize("name", ["key", "value"])
def test_write_kv_input_of_another_dtype_names_both_sides(path, name):
    key_cache, value_cache = caches()
    args = dict(key=torch.ones(2, 2, 64), value=torch.ones(2, 2, 64), key_cache=key_cache,
                value_cache=value_cache, slot_mapping=torch.tensor([3, 9]))
    args[name] = args[name].half()
    if path == "fake":
        args = on_meta(args)
    message = refusal(lambda: pa.write_kv(**args), TypeError)
    assert message == (
        f"paged.write_kv: {name} is float16 but {name}_cache is float32: key, value and the "
        "caches must have the same dtype (or the caches are fp8 or per-token, with k_scale and "
        f"v_scale); cast with {name}.to({name}_cache.dtype) or allocate the caches in float16")
    assert (key_cache == 0).all() and (value_cache == 0).all()


NHD_HINT = ("key_cache looks like NHD [blocks, block_size, kv_heads, head_size]: the ops take HND "
            "[blocks, kv_heads, block_size, head_size] or a strided view of it: pass "
            "paged_attention_ext.layouts.from_nhd(key_cache) (the view key_cache.transpose(1, 2), "
            "no copy), and the same for value_cache")


@pytest.mark.parametrize("path", ["kernel", "fake"])
@pytest.mark.parametrize("op", QUERY_OPS, ids=lambda op: op.__name__)
def test_nhd_cache_is_named_as_such(op, path):
    # vLLM's layout [num_blocks, block_size, num_kv_heads, head_size]: 2 KV heads, blocks of 16.
    nhd = torch.zeros(4, 16, 2, 64)
    args = query_op_args(torch.zeros(2, 4, 64), nhd, nhd.clone())
    if path == "fake":
        args = on_meta(args)
    message = refusal(lambda: call_query_op(op, args), ValueError)
    assert message == (f"paged.{op.__name__}: num_heads of 'query' (4) must be a multiple of "
                       f"num_kv_heads of 'key_cache' (16); {NHD_HINT}")


def test_nhd_cache_works_through_the_helper_the_hint_names():
    from paged_attention_ext.layouts import from_nhd

    nhd_k, nhd_v = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    args = query_op_args(torch.randn(2, 4, 64), from_nhd(nhd_k), from_nhd(nhd_v))
    want = query_op_args(args["query"], nhd_k.transpose(1, 2).contiguous(),
                         nhd_v.transpose(1, 2).contiguous())
    torch.testing.assert_close(pa.attention(**args), pa.attention(**want))


def test_heads_that_do_not_divide_get_no_layout_hint(query, case):
    # 3 query heads over 2 KV heads: neither the cache's dim 1 (2) nor dim 2 (16) divides 3.
    message = refusal(lambda: call(torch.randn(2, 3, 64), case, {}), ValueError)
    assert message.endswith("num_kv_heads of 'key_cache' (2)") and "NHD" not in message


@pytest.mark.parametrize("path", ["kernel", "fake"])
def test_write_kv_into_an_nhd_cache_is_named_as_such(path):
    nhd = torch.zeros(4, 8, 2, 64)  # [blocks, block_size 8, kv_heads 2, head_size]
    args = dict(key=torch.ones(2, 2, 64), value=torch.ones(2, 2, 64), key_cache=nhd,
                value_cache=nhd.clone(), slot_mapping=torch.tensor([3, 9]))
    if path == "fake":
        args = on_meta(args)
    message = refusal(lambda: pa.write_kv(**args), ValueError)
    assert message == ("paged.write_kv: argument 'key' must be [num_tokens, num_kv_heads=8, "
                       f"head_size=64], got [2, 2, 64]; {NHD_HINT}")
    assert path == "fake" or (nhd == 0).all()


@pytest.mark.parametrize("path", ["kernel", "fake"])
@pytest.mark.parametrize("op", [pa.attention, pa.write_kv], ids=lambda op: op.__name__)
def test_caches_of_two_layouts_are_named_as_such(op, path):
    hnd, nhd = torch.zeros(4, 2, 16, 64), torch.zeros(4, 16, 2, 64)
    if op is pa.write_kv:
        args = dict(key=torch.ones(2, 2, 64), value=torch.ones(2, 2, 64), key_cache=hnd,
                    value_cache=nhd, slot_mapping=torch.tensor([3, 9]))
    else:
        args = query_op_args(torch.zeros(2, 4, 64), hnd, nhd)
    if path == "fake":
        args = on_meta(args)
    message = refusal(lambda: op(**args), ValueError)
    assert message == (
        f"paged.{op.__name__}: argument 'value_cache' must have the num_blocks, num_kv_heads and "
        "block_size of 'key_cache' [4, 2, 16, 64], got [4, 16, 2, 64]; the two differ by a swap "
        "of dims 1 and 2, so one looks like NHD [blocks, block_size, kv_heads, head_size]: pass "
        "both as HND [blocks, kv_heads, block_size, head_size], an NHD one through "
        "paged_attention_ext.layouts.from_nhd(cache) (the view cache.transpose(1, 2), no copy)")


def test_nhd_cache_is_named_as_such_under_torch_compile():
    nhd = torch.zeros(4, 16, 2, 64)
    args = query_op_args(torch.zeros(2, 4, 64), nhd, nhd.clone())
    compiled = torch.compile(lambda a: pa.attention(**a), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=re.escape(NHD_HINT)):
        compiled(args)
