"""paged_attention_ext.kv_cache: PagedKVCache's arguments, pool shapes and bytes, fp8 scales
(given or calibrated by the first write), growth and KV-group pools.

What the block manager does with the pools (copies, swaps): test_block_manager.py.
"""

import pytest
import torch

from paged_attention_ext import quantization as q
from paged_attention_ext.kv_cache import PagedKVCache, bytes_per_block
from paged_attention_ext.kv_groups import KVGroupLayout
from paged_attention_ext.reference import dequantize, quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_cache(dtype=E4M3, layers=2, kv_heads=2, **kwargs):
    return PagedKVCache(layers, kv_heads, 8, block_size=4, dtype=dtype, num_blocks=6, **kwargs)


# ---- arguments and shapes --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_layers=0), ValueError, "num_layers must be >= 1"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
    (dict(head_size=-1), ValueError, "head_size must be >= 1"),
    (dict(head_size_v=0), ValueError, "head_size_v must be >= 1"),
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(block_size=2.5), TypeError, "block_size must be an int"),
    (dict(num_blocks=0), ValueError, "num_blocks must be >= 1"),
    (dict(num_blocks=None, memory_bytes=-1), ValueError, "memory_bytes must be >= 0"),
    (dict(num_blocks=None, memory_bytes=10), ValueError, "at least one block"),
    (dict(num_host_blocks=-1), ValueError, "num_host_blocks must be >= 0"),
    (dict(dtype=torch.int32), ValueError, "dtype must be one of"),
    (dict(dtype="float32"), TypeError, "dtype must be a torch.dtype"),
    (dict(device=0), TypeError, "device must be a str or torch.device"),
    (dict(memory_bytes=1 << 20), ValueError, "exactly one of num_blocks and memory_bytes"),
])
def test_paged_kv_cache_arguments(kwargs, error, match):
    args = dict(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32,
                num_blocks=4)
    with pytest.raises(error, match=match):
        PagedKVCache(**{**args, **kwargs})


def test_paged_kv_cache_value_head_size():
    cache = PagedKVCache(2, 3, 24, 4, torch.float32, num_blocks=5, num_host_blocks=2, head_size_v=16)
    assert cache.key_caches[1].shape == (5, 3, 4, 24)
    assert cache.value_caches[1].shape == (5, 3, 4, 16)
    assert cache.host_value_caches[0].shape == (2, 3, 4, 16)
    assert cache.block_bytes == 2 * 3 * 4 * (24 + 16) * 4
    assert PagedKVCache(1, 1, 8, 4, torch.float32, num_blocks=1).head_size_v == 8


def test_kv_group_layers_share_pools_one_layer_of_each_group():
    layout = KVGroupLayout.from_windows([None, 8, None, 8])  # groups: layers 0, 2 and 1, 3
    cache = PagedKVCache(4, 2, 8, 4, torch.float32, num_blocks=3, kv_groups=layout)
    assert len(cache.key_caches) == len(cache.value_caches) == layout.layers_per_group == 2
    assert cache.block_bytes == bytes_per_block(2, 2, 8, 4, torch.float32)
    assert [cache.kv_group(layer) for layer in range(4)] == [0, 1, 0, 1]
    key, value = cache.layer(1)
    assert key is cache.key_caches[0] and value is cache.value_caches[0]
    assert cache.layer(3)[0] is cache.key_caches[1] and cache.layer(2)[0] is cache.key_caches[1]
    with pytest.raises(ValueError, match="kv_groups places 4 layers, the cache has 3"):
        PagedKVCache(3, 2, 8, 4, torch.float32, num_blocks=3, kv_groups=layout)


# ---- fp8 caches: scales given or calibrated, growth, bytes ------------------------------------

def test_cache_errors_name_the_argument():
    with pytest.raises(ValueError, match="k_scale and v_scale apply to fp8 caches only"):
        PagedKVCache(1, 2, 8, dtype=torch.float16, num_blocks=2, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale.*got only v_scale"):
        fp8_cache(v_scale=1.0)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        fp8_cache(calibration=None)
    with pytest.raises(ValueError, match="calibration must be one of"):
        fp8_cache(calibration="per_token")
    with pytest.raises(ValueError, match=r"v_scale\[1\] must have 1 element"):
        fp8_cache(k_scale=1.0, v_scale=[1.0, [1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"one per layer \(2\), got 3"):
        fp8_cache(k_scale=[1.0, 1.0, 1.0], v_scale=1.0)
    with pytest.raises(ValueError, match="one row per layer"):
        fp8_cache(k_scale=torch.ones(3, 2), v_scale=1.0)
    with pytest.raises(ValueError, match=r"k_scale\[0\] must be finite"):
        fp8_cache(k_scale=0.0, v_scale=1.0)


def test_given_scales_per_layer_and_per_head():
    cache = fp8_cache(k_scale=[0.5, [0.25, 0.125]], v_scale=torch.tensor([[1.0], [2.0]]))
    assert cache.calibrated and cache.calibration is None
    assert cache.scales(0)["k_scale"].tolist() == [0.5]
    assert cache.scales(1)["k_scale"].tolist() == [0.25, 0.125]
    assert cache.scales(1)["v_scale"].tolist() == [2.0]
    assert all(s.dtype == torch.float32 for s in cache.k_scales + cache.v_scales)


def test_float_cache_passes_no_scales():
    cache = PagedKVCache(2, 2, 8, dtype=torch.bfloat16, num_blocks=2)
    assert not cache.is_quantized and cache.calibrated and cache.scales(1) == {}
    query = torch.randn(1, 4, 8)
    assert cache.as_query(query).dtype == torch.bfloat16


def test_uncalibrated_layer_refuses_to_attend():
    cache = fp8_cache()
    assert not cache.calibrated
    with pytest.raises(RuntimeError, match="layer 1 of the torch.float8_e4m3fn cache has no scales"):
        cache.scales(1)


@pytest.mark.parametrize("calibration", ["per_layer", "per_head"])
def test_first_write_calibrates_from_stored_tokens_only(calibration):
    cache = fp8_cache(calibration=calibration)
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8) * 3
    key[1] = 1e4  # a padding token (slot -1): must not widen the range
    slots = torch.tensor([0, -1, 5, 6, 9])
    cache.write(0, key, value, slots)
    stored = slots >= 0
    per_head = calibration == "per_head"
    torch.testing.assert_close(cache.k_scales[0], q.calibrate(key[stored], E4M3, per_head))
    torch.testing.assert_close(cache.v_scales[0], q.calibrate(value[stored], E4M3, per_head))
    assert cache.k_scales[1] is None and not cache.calibrated
    # A later write keeps the scales (values beyond the range saturate).
    first = cache.k_scales[0].clone()
    cache.write(0, key * 10, value, torch.tensor([1, -1, 2, 3, 4]))
    assert torch.equal(cache.k_scales[0], first)
    # What was stored is the quantized value, read back with the scale.
    back = dequantize(cache.key_caches[0], cache.k_scales[0])
    torch.testing.assert_close(back[1, :, 1], quantize(key[2:3], first, E4M3).float()[0]
                               * first.view(-1, 1))


def test_write_storing_nothing_leaves_the_layer_to_calibrate():
    """An all-padding first write (every slot -1) has nothing to calibrate from: the
    layer waits for the first stored token instead of fixing scale 1 for good."""
    cache = fp8_cache()
    cache.write(0, torch.full((2, 2, 8), 1e4), torch.ones(2, 2, 8), torch.tensor([-1, -1]))
    assert cache.k_scales[0] is None
    assert (cache.key_caches[0].view(torch.uint8) == 0).all()
    key = torch.randn(3, 2, 8) * 3000
    cache.write(0, key, torch.ones(3, 2, 8), torch.tensor([0, 1, 2]))
    torch.testing.assert_close(cache.k_scales[0], q.calibrate(key, E4M3))


def test_with_blocks_keeps_contents_and_scales():
    cache = fp8_cache(k_scale=0.5, v_scale=[0.25, 0.125])
    cache.key_caches[1][3] = 7.0
    bigger = cache.with_blocks(9)
    assert bigger.num_blocks == 9 and bigger.dtype == E4M3
    assert torch.equal(bigger.key_caches[1][:6].float(), cache.key_caches[1].float())
    assert bigger.scales(1)["v_scale"].tolist() == [0.125]
    with pytest.raises(ValueError, match="would drop blocks"):
        cache.with_blocks(5)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_memory_accounting_counts_one_byte_per_value(dtype):
    shape = dict(num_layers=4, num_kv_heads=2, head_size=64, block_size=16)
    assert bytes_per_block(**shape, dtype=dtype) * 2 == bytes_per_block(**shape, dtype=torch.bfloat16)
    budget = 1 << 20
    bf16 = PagedKVCache(**shape, dtype=torch.bfloat16, memory_bytes=budget)
    fp8 = PagedKVCache(**shape, dtype=dtype, memory_bytes=budget, k_scale=1.0, v_scale=1.0)
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.key_caches[0].dtype == dtype and fp8.host_key_caches[0].dtype == dtype
    usage = fp8.usage(used_blocks=1)
    assert usage["dtype"] == str(dtype).replace("torch.", "")
    assert usage["device_tokens"] == 2 * bf16.usage(0)["device_tokens"]
    assert usage["device_bytes"] <= budget and usage["device_bytes_used"] == fp8.block_bytes


def test_recalibrate_sets_new_scales_in_place_on_the_next_write():
    cache = fp8_cache()
    cache.write(0, torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([0, 1]))
    k_scale = cache.k_scales[0]
    cache.recalibrate()
    key = torch.full((2, 2, 8), 8.0)
    cache.write(0, key, torch.ones(2, 2, 8), torch.tensor([2, 3]))
    assert cache.k_scales[0] is k_scale  # a compiled forward holding it reads the new scale
    torch.testing.assert_close(k_scale, q.calibrate(key, E4M3))
    given = fp8_cache(k_scale=0.5, v_scale=0.5)
    given.recalibrate()  # given scales stay
    given.write(0, key, key, torch.tensor([0, 1]))
    assert given.k_scales[0].tolist() == [0.5]


# ---- values in the keys' rows (MLA latent rows) ----------------------------------------------

def latent_cache(**kwargs):
    options = dict(num_blocks=6, num_host_blocks=3, head_size_v=32, values_in_keys=True)
    return PagedKVCache(2, 1, 40, 4, **{"dtype": torch.float32, **options, **kwargs})


def test_values_in_keys_rows_are_written_once_and_moved_whole():
    cache = latent_cache()
    rows, values = cache.layer(1)
    assert values.data_ptr() == rows.data_ptr() and values.shape[-1] == 32
    assert cache.block_bytes == bytes_per_block(2, 1, 40, 4, torch.float32, 0)
    latent, rotary = torch.randn(5, 1, 32), torch.randn(5, 1, 8)
    slots = torch.tensor([0, 5, 6, 9, 15])
    cache.write_columns(1, latent, rotary, slots)
    flat = rows.view(-1, 1, 40)
    assert torch.equal(flat[slots], torch.cat((latent, rotary), -1))
    assert not cache.layer(0)[0].any()  # the other layer untouched
    # Copy-on-write copies, swaps and growth move whole rows.
    cache.apply_copies([(1, 4)])
    assert torch.equal(rows[4], rows[1])
    cache.swap_out([(2, 0)])
    cache.swap_in([(0, 5)])
    assert torch.equal(rows[5], rows[2])
    bigger = cache.with_blocks(8)
    assert bigger.values_in_keys and torch.equal(bigger.layer(1)[0][:6], rows)
    assert bigger.layer(1)[1].data_ptr() == bigger.layer(1)[0].data_ptr()


def test_values_in_keys_fp8_rows_share_one_calibrated_scale():
    cache = latent_cache(dtype=torch.float8_e4m3fn)
    latent, rotary = torch.randn(5, 1, 32), 10 * torch.randn(5, 1, 8)
    cache.write_columns(0, latent, rotary, torch.arange(5))
    scales = cache.scales(0)
    assert torch.equal(scales["k_scale"], scales["v_scale"])
    assert torch.allclose(scales["k_scale"], q.calibrate(rotary, torch.float8_e4m3fn))  # the larger range
    stored = dequantize(cache.layer(0)[0], scales["k_scale"], torch.float32).view(-1, 1, 40)[:5]
    torch.testing.assert_close(stored, torch.cat((latent, rotary), -1), rtol=2 ** -3, atol=1e-2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(head_size_v=40), ValueError, "values_in_keys needs head_size_v < head_size"),
    (dict(head_size_v=None), ValueError, "values_in_keys needs head_size_v < head_size"),
    (dict(values_in_keys=1), TypeError, "values_in_keys must be a bool"),
    (dict(dtype=torch.float8_e4m3fn, k_scale=1.0, v_scale=2.0), ValueError, "equal k_scale and v_scale"),
])
def test_values_in_keys_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        latent_cache(**kwargs)


def test_values_in_keys_and_separate_pools_refuse_each_others_writes():
    with pytest.raises(ValueError, match="write_columns"):
        latent_cache().write(0, torch.randn(1, 1, 40), torch.randn(1, 1, 32), torch.tensor([0]))
    separate = PagedKVCache(1, 1, 8, 4, torch.float32, num_blocks=2)
    with pytest.raises(ValueError, match="use write"):
        separate.write_columns(0, torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.tensor([0]))


# ---- pools per layer shape (one page buffer, views per layer) ---------------------------------
def shaped_layout():
    """Sliding layers 0, 1, 3, 4: 1 head of 8 (16 values a token); full layer 2: 1 head of 16
    (32 values); layer 5 reads layer 2. Pages of 32 values: groups [2], [0, 1], [3, 4]."""
    windows = [4, 4, None, 4, 4, None]
    shapes = [(1, 8, 8), (1, 8, 8), (1, 16, 16), (1, 8, 8), (1, 8, 8), (1, 16, 16)]
    return KVGroupLayout.from_windows(windows, shapes, {5: 2})


def shaped_cache():
    return PagedKVCache(6, 1, 8, block_size=4, dtype=torch.float32, num_blocks=6,
                        num_host_blocks=3, kv_groups=shaped_layout())


def test_shaped_pools_are_views_of_one_page():
    cache = shaped_cache()
    assert [g.layers for g in cache.kv_groups.groups] == [(2,), (0, 1), (3, 4)]
    assert cache.layer(2)[0].shape == (6, 1, 4, 16) and cache.layer(0)[0].shape == (6, 1, 4, 8)
    assert cache.layer(5)[0].data_ptr() == cache.layer(2)[0].data_ptr()  # a reader: its source's
    assert cache.block_bytes == 4 * 32 * 4 and len(cache.key_caches) == 1
    # The layers of one group are disjoint slices of a page; layer j of each group shares
    # slot j (a page belongs to one group at a time).
    for group in cache.kv_groups.groups:
        for layer in group.layers:
            key, value = cache.layer(layer)
            key.fill_(layer + 1)
            value.fill_(-(layer + 1))
        for layer in group.layers:
            key, value = cache.layer(layer)
            assert bool((key == layer + 1).all()) and bool((value == -(layer + 1)).all())
    assert cache.layer(0)[0].data_ptr() == cache.layer(3)[0].data_ptr()
    with pytest.raises(ValueError, match="layer 5 reads layer 2's K/V and stores nothing"):
        cache.write(5, torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.tensor([0]))


def test_shaped_pools_copy_swap_and_grow_whole_pages():
    cache = shaped_cache()
    for layer in (2, 0, 1):  # the slots of one group of each kind
        for pool in cache.layer(layer):
            pool.copy_(torch.randn_like(pool))
    before = [tuple(p.clone() for p in cache.layer(layer)) for layer in range(6)]
    cache.apply_copies([(1, 4)])
    cache.swap_out([(2, 0)])
    cache.layer(0)[0][2].zero_()
    cache.swap_in([(0, 5)])
    bigger = cache.with_blocks(8)
    for layer in range(6):
        for was, now, grown in zip(before[layer], cache.layer(layer), bigger.layer(layer)):
            assert torch.equal(now[4], was[1]) and torch.equal(now[5], was[2])
            assert torch.equal(grown[:6], now)


def test_shaped_fp8_scales_per_layer_heads():
    """Per-head scales follow each layer's KV heads; a reader uses its source's scales."""
    windows = [4, None, 4]
    layout = KVGroupLayout.from_windows(windows, [(2, 8, 8), (1, 16, 16), (2, 8, 8)], {2: 0})
    k_scale = [torch.ones(2), torch.full((1,), 2.0), torch.ones(2)]
    cache = PagedKVCache(3, 2, 8, block_size=4, dtype=torch.float8_e4m3fn, num_blocks=2,
                         kv_groups=layout, k_scale=k_scale, v_scale=k_scale)
    assert cache.scales(2)["k_scale"] is cache.scales(0)["k_scale"]
    with pytest.raises(ValueError, match=r"k_scale\[1\]"):
        PagedKVCache(3, 2, 8, block_size=4, dtype=torch.float8_e4m3fn, num_blocks=2,
                     kv_groups=layout, k_scale=[torch.ones(2)] * 3, v_scale=[torch.ones(2)] * 3)
