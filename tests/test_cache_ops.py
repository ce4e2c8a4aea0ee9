"""write_kv, copy_blocks and swap_blocks against the reference."""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import reference as ref
from paged_attention_ext import token_quantization
from paged_attention_ext.layouts import from_nhd, split_kv
from paged_attention_ext.quantization import FP8_DTYPES
from paged_attention_ext.token_quantization import TOKEN_DTYPES
from paged_case import DTYPES


def random_caches(num_blocks=12, num_kv_heads=2, block_size=16, head_size=64,
                  dtype=torch.float32, seed=0, head_size_v=None):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_kv_heads, block_size)
    return (torch.randn(shape + (head_size,), generator=gen).to(dtype),
            torch.randn(shape + (head_size_v or head_size,), generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_write_kv_scattered_slots_and_padding(dtype, block_size):
    key_cache, value_cache = random_caches(num_blocks=6, block_size=block_size, dtype=dtype)
    num_slots = key_cache.shape[0] * block_size
    num_tokens = min(40, num_slots)
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    key = torch.randn(num_tokens, 2, 64).to(dtype)
    value = torch.randn(num_tokens, 2, 64).to(dtype)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    pa.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_write_kv_from_strided_views():
    key_cache, value_cache = random_caches()
    qkv = torch.randn(10, 8, 64)  # fused projection: q heads 0-3, k 4-5, v 6-7
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.arange(10) * 3
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    pa.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_all_layers(dtype):
    layers = [random_caches(dtype=dtype, seed=s) for s in range(3)]
    keys = [k for k, _ in layers]
    values = [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [0, 6], [3, 1], [11, 2]], dtype=torch.int64)
    want_keys = [k.clone() for k in keys]
    want_values = [v.clone() for v in values]
    ref.copy_blocks(want_keys, want_values, mapping)
    pa.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_keys + want_values):
        assert torch.equal(got, want)


def test_copy_blocks_empty_mapping_is_a_no_op():
    key, value = random_caches()
    before = key.clone(), value.clone()
    pa.copy_blocks([key], [value], torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(key, before[0]) and torch.equal(value, before[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_round_trip_is_bit_identical(dtype):
    device_pool, _ = random_caches(num_blocks=10, dtype=dtype)
    host_pool = torch.zeros((4,) + device_pool.shape[1:], dtype=dtype)
    original = device_pool.clone()
    out_map = torch.tensor([[7, 0], [2, 3], [9, 1]], dtype=torch.int64)
    pa.swap_blocks(device_pool, host_pool, out_map)
    want_host = torch.zeros_like(host_pool)
    ref.swap_blocks(original, want_host, out_map)
    assert torch.equal(host_pool, want_host)
    device_pool.zero_()
    pa.swap_blocks(host_pool, device_pool, out_map.flip(1))
    for src, _ in out_map.tolist():
        assert torch.equal(device_pool[src].view(torch.uint8), original[src].view(torch.uint8))


def test_swap_blocks_accepts_non_cache_shapes():
    # Any pool of equal block shape works, e.g. a flattened [num_blocks, block_bytes] view.
    src = torch.arange(40, dtype=torch.float32).view(5, 8)
    dst = torch.zeros(3, 8)
    pa.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 2]]))
    assert torch.equal(dst[0], src[4]) and torch.equal(dst[2], src[1]) and (dst[1] == 0).all()


@pytest.mark.parametrize("head_size", [8, 24, 64])
def test_write_kv_rows_shorter_than_or_not_a_multiple_of_a_cache_line(head_size):
    # 16- and 48-byte bf16 rows take the plain copy; 128-byte rows the streaming stores.
    key_cache, value_cache = random_caches(head_size=head_size, dtype=torch.bfloat16)
    key = torch.randn(7, 2, head_size).bfloat16()
    value = torch.randn(7, 2, head_size).bfloat16()
    slots = torch.tensor([0, 5, 17, 33, -1, 190, 191])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    pa.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,head_size_v", [(192, 128), (64, 128), (24, 64), (64, 8)])
def test_write_kv_value_head_size_differs(dtype, head_size, head_size_v):
    # Rows of either cache may or may not take the streaming stores (whole cache lines).
    key_cache, value_cache = random_caches(head_size=head_size, head_size_v=head_size_v,
                                           dtype=dtype)
    qkv = torch.randn(9, 8, 192 + 128).to(dtype)  # fused projection: strided views
    key, value = qkv[:, 2:4, :head_size], qkv[:, 5:7, 192:192 + head_size_v]
    slots = torch.tensor([0, 5, 17, 33, -1, 190, 191, 64, 100])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    ref.write_kv(key, value, want_k, want_v, slots)
    pa.write_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_copy_and_swap_blocks_value_head_size_differs():
    # Two layers, each with its own key and value head sizes.
    layers = [random_caches(head_size=192, head_size_v=128, seed=0),
              random_caches(head_size=64, head_size_v=8, dtype=torch.float32, seed=1)]
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [3, 1], [11, 2]])
    want_keys, want_values = [k.clone() for k in keys], [v.clone() for v in values]
    ref.copy_blocks(want_keys, want_values, mapping)
    pa.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_keys + want_values):
        assert torch.equal(got, want)
    # Swapping out: each pool to its own host pool.
    for pool in (keys[0], values[0]):
        host = torch.zeros((4,) + pool.shape[1:])
        pa.swap_blocks(pool, host, torch.tensor([[7, 0], [2, 3]]))
        assert torch.equal(host[0], pool[7]) and torch.equal(host[3], pool[2])


def test_one_block_pools_with_any_leading_stride():
    """A one-block pool counts as contiguous whatever its stride(0): the block size in bytes
    must come from its shape, not from that stride."""
    shape = (1, 2, 4, 8)
    one = torch.randn(64).as_strided(shape, (5, 32, 8, 1))
    assert one.is_contiguous()
    host = torch.zeros(3, 2, 4, 8)
    pa.swap_blocks(one, host, torch.tensor([[0, 2]]))
    assert torch.equal(host[2], one[0]) and host[:2].abs().sum() == 0
    back = torch.zeros(64).as_strided(shape, (7, 32, 8, 1))
    pa.swap_blocks(host, back, torch.tensor([[2, 0]]))
    assert torch.equal(back[0], one[0])


# ---- fp8 caches and strided layouts --------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor: compares NaN payloads and fp8 (whose == torch lacks) exactly."""
    return t.contiguous().view(torch.uint8)


def special_values(fp8: torch.dtype) -> torch.Tensor:
    """Values at every edge of the format: ties at each exponent (round to nearest even),
    subnormals, the largest finite value and just beyond it, infinities, NaN, -0."""
    finfo = torch.finfo(fp8)
    every = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = every[every.isfinite()].unique()
    ties = (finite[:-1] + finite[1:]) / 2  # halfway between neighbours
    beyond = torch.tensor([finfo.max * 1.0625, finfo.max * 1.2, 1e30, float("inf"), -float("inf"),
                           float("nan"), -0.0, finfo.tiny / 3, -finfo.tiny / 3])
    return torch.cat([finite, ties, ties + ties.abs() * 1e-3, -ties, beyond, torch.randn(300) * 20])


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_write_kv_fp8_is_bit_exact_against_torch(fp8, in_dtype, per_head):
    """Each stored byte equals torch's own conversion after the clamp: round to nearest
    even, saturation to the largest finite value, NaN preserved."""
    values = special_values(fp8)
    head_size = 64
    num_tokens = -(-values.numel() // (2 * head_size))
    flat = torch.cat([values, torch.zeros(num_tokens * 2 * head_size - values.numel())])
    key = flat.view(num_tokens, 2, head_size).to(in_dtype)
    value = key.flip(0)
    k_scale = torch.tensor([0.5, 3.0]) if per_head else torch.tensor([1.0])
    v_scale = torch.tensor([2.0, 0.25]) if per_head else torch.tensor(0.75)
    block_size = 16
    num_blocks = -(-num_tokens // block_size) + 1
    key_cache = torch.zeros(num_blocks, 2, block_size, head_size, dtype=fp8)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[3] = -1
    pa.write_kv(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        limit = torch.finfo(fp8).max
        want = (x.float() / scale.view(-1, 1)).clamp(-limit, limit).to(fp8)  # torch's conversion
        blocks, offsets = slots.div(block_size, rounding_mode="floor"), slots % block_size
        stored = cache[blocks, :, offsets]  # [num_tokens, heads, head_size]
        keep = slots >= 0
        assert torch.equal(bits(stored)[keep], bits(want)[keep])
    want_k, want_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    ref.write_kv(key, value, want_k, want_v, slots, k_scale, v_scale)
    assert torch.equal(bits(key_cache), bits(want_k)) and torch.equal(bits(value_cache), bits(want_v))


def nhd_view(cache: torch.Tensor) -> torch.Tensor:
    return from_nhd(cache.transpose(1, 2).contiguous())


def padded_view(cache: torch.Tensor) -> torch.Tensor:
    nb, kvh, bs, hs = cache.shape
    buf = torch.zeros(nb + 1, kvh + 1, bs + 3, hs + 1, dtype=cache.dtype)
    view = buf[1:, 1:, 2:bs + 2, :hs]
    view.copy_(cache)
    return view


@pytest.mark.parametrize("dtype", [*DTYPES, *FP8_DTYPES])
@pytest.mark.parametrize("layout", ["NHD", "joint", "padded"])
def test_write_kv_into_strided_views(dtype, layout):
    key_cache, value_cache = random_caches(num_blocks=6, head_size=64, head_size_v=32)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    if layout == "NHD":
        key_view, value_view = nhd_view(key_cache), nhd_view(value_cache)
    elif layout == "joint":
        kv = torch.zeros(2, 6, 16, 2, 64, dtype=dtype)
        key_view, value_view = split_kv(kv)
        value_view = value_view[..., :32]
        key_view.copy_(key_cache), value_view.copy_(value_cache)
    else:
        key_view, value_view = padded_view(key_cache), padded_view(value_cache)
    scales = ({"k_scale": torch.tensor([0.5, 2.0]), "v_scale": torch.tensor(0.1)}
              if dtype in FP8_DTYPES else {})
    in_dtype = torch.bfloat16 if dtype in FP8_DTYPES else dtype
    key, value = torch.randn(9, 2, 64).to(in_dtype), torch.randn(9, 2, 32).to(in_dtype)
    slots = torch.tensor([0, 5, 17, 33, -1, 90, 95, 64, 48])
    ref.write_kv(key, value, key_cache, value_cache, slots, **scales)
    pa.write_kv(key, value, key_view, value_view, slots, **scales)
    assert torch.equal(bits(key_view), bits(key_cache)) and torch.equal(bits(value_view), bits(value_cache))


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8_DTYPES])
@pytest.mark.parametrize("layout", ["HND", "NHD", "joint", "padded"])
def test_copy_and_swap_blocks_fp8_and_strided_views(dtype, layout):
    keys, values = [], []
    for seed in range(2):
        key_cache, value_cache = random_caches(num_blocks=8, seed=seed)
        key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
        if layout == "NHD":
            key_cache, value_cache = nhd_view(key_cache), nhd_view(value_cache)
        elif layout == "joint":
            kv = torch.empty((2,) + key_cache.transpose(1, 2).shape, dtype=dtype)
            kv[0], kv[1] = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
            key_cache, value_cache = split_kv(kv)
        elif layout == "padded":
            key_cache, value_cache = padded_view(key_cache), padded_view(value_cache)
        keys.append(key_cache), values.append(value_cache)
    mapping = torch.tensor([[0, 5], [3, 1], [7, 2]])
    want = [c.contiguous() for c in keys + values]
    for c in want:
        for src, dst in mapping.tolist():
            c[dst] = c[src]
    pa.copy_blocks(keys, values, mapping)
    for got, expected in zip(keys + values, want):
        assert torch.equal(bits(got), bits(expected))
    # Swapping out to a contiguous host pool and back into the view.
    host = torch.zeros((4,) + keys[0].shape[1:], dtype=dtype)
    pa.swap_blocks(keys[0], host, torch.tensor([[7, 0], [2, 3]]))
    assert torch.equal(bits(host[0]), bits(keys[0][7])) and torch.equal(bits(host[3]), bits(keys[0][2]))
    before = bits(keys[0]).clone()
    pa.swap_blocks(host, keys[0], torch.tensor([[0, 4]]))
    after = bits(keys[0])
    assert torch.equal(after[4], bits(host[0])) and torch.equal(after[:4], before[:4])


# ---- per-token int8 / int4 caches ------------------------------------------------------------


def token_rows(num_tokens: int, head_size: int, seed: int = 0) -> torch.Tensor:
    """[num_tokens, 2, head_size] rows of every kind a row quantizes differently: random of
    many magnitudes, exact rounding ties, zero and constant rows, one outlier, NaN, inf,
    huge, subnormal."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_tokens, 2, head_size, generator=gen)
    rows *= torch.logspace(-3, 3, num_tokens)[:, None, None]
    rows[0, 0] = (torch.arange(head_size) - head_size // 2) * 0.5  # ties at every step
    rows[1, 0], rows[1, 1] = 0.0, 3.25  # zero row; constant row (int4: scale 0)
    rows[2, 0, 5] = 1e4  # one outlier channel
    rows[3, 0, 7], rows[3, 1, 2] = float("nan"), float("inf")
    rows[4, 0], rows[4, 1] = 3e38, 1e-42
    return rows


def assert_token_rows_match(cache, scales, want_cache, want_scales):
    """int8: rows and scales bit-exact (NaN scales of NaN rows as NaN). int4: scales to fp32 rounding (the rotation's
    order), and each value within one step of the reference's."""
    if cache.dtype == torch.int8:
        assert torch.equal(cache, want_cache)
        torch.testing.assert_close(scales, want_scales, rtol=0, atol=0, equal_nan=True)
        return
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0, equal_nan=True)
    got = token_quantization.dequantize_int4(cache, scales, rotated=False)
    want = token_quantization.dequantize_int4(want_cache, want_scales, rotated=False)
    step = want_scales[..., 0, None].abs().expand_as(want)  # rows not written: -5, unchanged
    finite = want.isfinite() & step.isfinite()
    assert ((got - want).abs()[finite] <= step[finite] * 1.0001 + 1e-30).all()
    assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=["int8", "int4"])
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("head_size,head_size_v", [(64, 64), (128, 96), (576, 512)])
def test_write_kv_per_token_matches_the_reference(cache_dtype, in_dtype, head_size, head_size_v):
    num_tokens, block_size = 40, 16
    key = token_rows(num_tokens, head_size).to(in_dtype)
    value = token_rows(num_tokens, head_size_v, seed=1).to(in_dtype)
    num_blocks = -(-num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[9] = -1  # padding: nothing written
    caches, scales = [], []
    for _ in range(2):  # the kernel's and the reference's
        caches.append(tuple(torch.full((num_blocks, 2, block_size,
                                        token_quantization.stored_head_size(cache_dtype, hs)),
                                       7, dtype=cache_dtype) for hs in (head_size, head_size_v)))
        scales.append(tuple(torch.full(token_quantization.scale_shape(cache_dtype, num_blocks, 2,
                                                                      block_size), -5.0)
                            for _ in range(2)))
    pa.write_kv(key, value, *caches[0], slots, *scales[0])
    ref.write_kv(key, value, *caches[1], slots, *scales[1])
    for got, got_scale, want, want_scale in zip(caches[0], scales[0], caches[1], scales[1]):
        assert_token_rows_match(got, got_scale, want, want_scale)


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=["int8", "int4"])
@pytest.mark.parametrize("layout", ["NHD", "joint", "padded"])
def test_write_kv_per_token_into_strided_views(cache_dtype, layout):
    """Caches and scales as strided views (NHD; one joint tensor for K and V; spare rows)."""
    nb, bs, hs = 6, 16, 64
    stored = token_quantization.stored_head_size(cache_dtype, hs)
    key_cache = torch.zeros(nb, 2, bs, stored, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    k_scale = torch.zeros(token_quantization.scale_shape(cache_dtype, nb, 2, bs))
    v_scale = torch.zeros_like(k_scale)
    if layout == "NHD":
        views = [nhd_view(t) for t in (key_cache, value_cache)] + [
            s.transpose(1, 2).contiguous().transpose(1, 2) for s in (k_scale, v_scale)]
    elif layout == "joint":
        kv = torch.zeros(2, nb, bs, 2, stored, dtype=cache_dtype)
        scales = torch.zeros((2, nb, bs, 2) + k_scale.shape[3:])
        views = list(split_kv(kv)) + [scales[0].transpose(1, 2), scales[1].transpose(1, 2)]
    else:
        views = [padded_view(t) for t in (key_cache, value_cache)]
        for s in (k_scale, v_scale):
            buf = torch.full((nb, 3, bs + 2) + s.shape[3:], float("nan"))  # NaN around the view
            views.append(buf[:, 1:, 1:bs + 1].zero_())
    key, value = token_rows(9, hs).bfloat16(), token_rows(9, hs, seed=2).bfloat16()
    slots = torch.tensor([0, 5, 17, 33, -1, 90, 95, 64, 48])
    ref.write_kv(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    pa.write_kv(key, value, views[0], views[1], slots, views[2], views[3])
    assert_token_rows_match(views[0], views[2], key_cache, k_scale)
    assert_token_rows_match(views[1], views[3], value_cache, v_scale)


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=["int8", "int4"])
@pytest.mark.parametrize("shared", ["rows", "scales"])
def test_write_kv_per_token_refuses_views_of_one_memory(cache_dtype, shared):
    """MLA latent rows written as two column views (values a view of the keys), or one
    scale tensor for both: each row's scales would overwrite the other's. Nothing is written."""
    nb, bs = 4, 16
    rows = torch.zeros(nb, 1, bs, token_quantization.stored_head_size(cache_dtype, 576), dtype=cache_dtype)
    scales = torch.zeros(token_quantization.scale_shape(cache_dtype, nb, 1, bs))
    split = token_quantization.stored_head_size(cache_dtype, 512)
    if shared == "rows":
        caches = (rows[..., :split], rows[..., split:])
        scale_pair = (scales, torch.zeros_like(scales))
    else:
        caches = (rows[..., :split], torch.zeros_like(rows[..., split:]))
        scale_pair = (scales, scales)
    with pytest.raises(ValueError, match="latent rows .* stored whole, under one scale, with paged.write_latent"):
        pa.write_kv(torch.randn(3, 1, 512), torch.randn(3, 1, 64), *caches, torch.tensor([0, 1, 2]),
                    *scale_pair)
    assert not rows.any() and not scales.any()


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=["int8", "int4"])
def test_copy_and_swap_blocks_move_per_token_caches_and_their_scales(cache_dtype):
    """copy_blocks takes the scale tensors as layers of their own (the same mapping);
    swap_blocks moves each tensor, caches and scales, to the host pool and back."""
    nb, bs, hs = 8, 16, 64
    tensors = []
    for seed in range(2):
        rows = torch.randint(0, 255, (nb, 2, bs, token_quantization.stored_head_size(cache_dtype, hs)),
                             generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        tensors.append(rows.view(cache_dtype) if cache_dtype == torch.int8 else rows)
        tensors.append(torch.randn(token_quantization.scale_shape(cache_dtype, nb, 2, bs)))
    keys, values = [tensors[0], tensors[1]], [tensors[2], tensors[3]]
    mapping = torch.tensor([[0, 5], [3, 1], [7, 2]])
    want = [t.clone() for t in keys + values]
    ref.copy_blocks(want[:2], want[2:], mapping)
    pa.copy_blocks(keys, values, mapping)
    for got, expected in zip(keys + values, want):
        assert torch.equal(bits(got), bits(expected))
    for t in keys + values:
        host = torch.zeros((4,) + t.shape[1:], dtype=t.dtype)
        pa.swap_blocks(t, host, torch.tensor([[7, 0], [2, 3]]))
        assert torch.equal(bits(host[0]), bits(t[7])) and torch.equal(bits(host[3]), bits(t[2]))
        pa.swap_blocks(host, t, torch.tensor([[0, 4]]))
        assert torch.equal(bits(t[4]), bits(t[7]))
