"""write_kv, copy_blocks and swap_blocks against the reference."""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import reference as ref
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
