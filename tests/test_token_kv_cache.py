"""Per-token KV caches (int8, packed int4) in PagedKVCache: the format names, pools and
scales as views of one page per block, what write() stores, and that copies, swaps and
growth move each block's scales with its rows.

The formats' maths: test_token_quantization.py; in models: test_token_models.py.
"""

import pytest
import torch

from paged_attention_ext import ops, reference
from paged_attention_ext import quantization as q
from paged_attention_ext import token_quantization as tq
from paged_attention_ext.kv_cache import PagedKVCache, bytes_per_block
from paged_attention_ext.kv_groups import KVGroupLayout

FORMATS = {"int8_per_token_head": torch.int8, "int4_per_token_head": torch.uint8}
LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, BLOCKS = 3, 2, 32, 4, 6


def token_cache(dtype, **kwargs):
    return PagedKVCache(LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, dtype,
                        **{"num_blocks": BLOCKS, "num_host_blocks": 3, **kwargs})


def slot_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``pool`` ([blocks, heads, block_size, ...]) at ``slots``: [tokens, heads, ...]."""
    blocks, offsets = slots // pool.shape[2], slots % pool.shape[2]
    return pool[blocks, :, offsets]


# ---- names --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", sorted(FORMATS.items()))
def test_kv_cache_dtype_names_the_per_token_formats(name, dtype):
    assert q.kv_cache_dtype(name, torch.bfloat16) == dtype
    assert q.kv_cache_dtype(dtype, torch.bfloat16) == dtype  # the torch dtype as it is
    assert q.dtype_label(dtype) == name
    assert q.dtype_label(torch.float8_e4m3fn) == "float8_e4m3fn" and q.dtype_label(torch.bfloat16) == "bfloat16"


def test_unknown_names_list_every_choice():
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'int4'; choose from \['auto', "
                                         r"'fp8_e4m3', 'fp8_e5m2', 'fp8', 'int8_per_token_head', "
                                         r"'int4_per_token_head'\]"):
        q.kv_cache_dtype("int4", torch.float16)
    with pytest.raises(ValueError, match="torch.int32 is not a supported cache dtype.*torch.uint8"):
        q.kv_cache_dtype(torch.int32, torch.float16)


# ---- pools, scales and bytes ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FORMATS.values())
def test_rows_and_scales_are_views_of_each_blocks_page(dtype):
    cache = token_cache(dtype)
    stored = tq.stored_head_size(dtype, HEAD_SIZE)
    per_token = tq.bytes_per_token_head(dtype, HEAD_SIZE)
    assert cache.block_bytes == LAYERS * HEADS * BLOCK_SIZE * 2 * per_token
    assert cache.block_bytes == bytes_per_block(LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, dtype)
    assert cache.is_quantized and not cache.is_fp8 and cache.calibrated and cache.calibration is None
    page = cache.key_caches[0]
    assert page.shape == (BLOCKS, 1, 1, cache.block_bytes // 2) and page.dtype == dtype
    assert cache.host_key_caches[0].shape == (3,) + page.shape[1:]
    for layer in range(LAYERS):
        key, value = cache.layer(layer)
        scales = cache.scales(layer)
        assert key.shape == value.shape == (BLOCKS, HEADS, BLOCK_SIZE, stored) and key.dtype == dtype
        for name in ("k_scale", "v_scale"):
            assert scales[name].shape == tq.scale_shape(dtype, BLOCKS, HEADS, BLOCK_SIZE)
            assert scales[name].dtype == torch.float32
        # Every view of block 2 lies inside block 2 of its page buffer.
        for view, pages in ((key, cache.key_caches[0]), (value, cache.value_caches[0]),
                            (scales["k_scale"], cache.key_caches[0]),
                            (scales["v_scale"], cache.value_caches[0])):
            start = pages[2].data_ptr()
            assert start <= view[2].data_ptr() < start + pages[2].numel()
            assert view.stride(0) * view.element_size() == pages.stride(0)


@pytest.mark.parametrize("dtype", FORMATS.values())
def test_memory_budget_counts_the_scales(dtype):
    budget = 1 << 20
    shape = dict(num_layers=4, num_kv_heads=2, head_size=128, block_size=16)
    bf16 = PagedKVCache(**shape, dtype=torch.bfloat16, memory_bytes=budget)
    cache = PagedKVCache(**shape, dtype=dtype, memory_bytes=budget)
    assert cache.num_blocks == budget // cache.block_bytes
    # 256 bytes per token and head in bf16 against 132 (int8) or 72 (int4).
    ratio = {torch.int8: 256 / 132, torch.uint8: 256 / 72}[dtype]
    assert cache.num_blocks == int(bf16.num_blocks * ratio)
    usage = cache.usage(used_blocks=1)
    assert usage["dtype"] == q.dtype_label(dtype) and usage["device_bytes_used"] == cache.block_bytes


@pytest.mark.parametrize("dtype", FORMATS.values())
def test_as_query_keeps_the_models_dtype(dtype):
    query = torch.randn(2, 4, HEAD_SIZE, dtype=torch.bfloat16)
    assert token_cache(dtype).as_query(query) is query


def test_bad_per_token_options_raise_at_construction():
    with pytest.raises(ValueError, match=r"k_scale and v_scale apply to fp8 caches only; this cache is "
                                         r"int8_per_token_head \(its scales are computed per token"):
        token_cache(torch.int8, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="v_scale applies to fp8 caches only"):
        token_cache(torch.uint8, v_scale=1.0)
    with pytest.raises(ValueError, match="head_size 7 must be even"):
        PagedKVCache(1, 1, 7, 4, torch.uint8, num_blocks=2)
    with pytest.raises(ValueError, match="head_size 7 must be even"):
        PagedKVCache(1, 1, 8, 4, torch.uint8, num_blocks=2, head_size_v=7)
    with pytest.raises(ValueError, match=r"latent rows of 24 values are rotated in blocks of 8, "
                                         r"so their values \(the leading 12 columns\) must be whole"):
        PagedKVCache(1, 1, 24, 4, torch.uint8, num_blocks=2, head_size_v=12, values_in_keys=True)


# ---- write: rows and their scales ----------------------------------------------------------------

@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", FORMATS.values())
def test_write_stores_each_rows_quantization_and_scales(dtype, model_dtype):
    cache = token_cache(dtype)
    key = (torch.randn(6, HEADS, HEAD_SIZE) * torch.logspace(-2, 2, 6).view(-1, 1, 1)).to(model_dtype)
    value = torch.randn(6, HEADS, HEAD_SIZE).to(model_dtype)
    key[2, 1] = 0.0  # a zero row: scale 0, stored exactly
    slots = torch.tensor([0, 5, -1, 6, 23, 9])
    cache.write(1, key, value, slots)
    stored = slots >= 0
    for pool, name, x in ((cache.layer(1)[0], "k_scale", key), (cache.layer(1)[1], "v_scale", value)):
        rows, scales = tq.quantize(x[stored], dtype)
        scale_tensor = cache.scales(1)[name]
        if dtype == torch.int8:
            assert torch.equal(slot_rows(pool, slots[stored]), rows)
            assert torch.equal(slot_rows(scale_tensor, slots[stored]), scales)
        else:  # the kernel's nibbles may differ at exact rounding ties: compare the values
            back = tq.dequantize(slot_rows(pool, slots[stored]), slot_rows(scale_tensor, slots[stored]))
            step = scales[..., 0, None]
            assert ((back - tq.dequantize(rows, scales)).abs() <= step * 1.001 + 1e-6).all()
            torch.testing.assert_close(slot_rows(scale_tensor, slots[stored]), scales)
    # Other layers and the unused slots are untouched.
    assert not cache.layer(0)[0].any() and not cache.scales(2)["v_scale"].any()
    untouched = torch.tensor([s for s in range(BLOCKS * BLOCK_SIZE) if s not in slots.tolist()])
    assert not slot_rows(cache.layer(1)[0], untouched).any()
    assert not slot_rows(cache.scales(1)["k_scale"], untouched).any()


@pytest.mark.parametrize("dtype", FORMATS.values())
def test_attention_over_the_pools_equals_the_reference(dtype):
    cache = token_cache(dtype)
    cache.write(0, torch.randn(11, HEADS, HEAD_SIZE), torch.randn(11, HEADS, HEAD_SIZE),
                torch.tensor([20, 21, 22, 23, 4, 5, 6, 7, 12, 13, 14]))
    query = torch.randn(2, 4, HEAD_SIZE)
    tables = torch.tensor([[5, 1, 3], [1, 3, 0]], dtype=torch.int32)
    args = (cache.as_query(query), *cache.layer(0), tables, torch.tensor([11, 7], dtype=torch.int32), 0.3)
    torch.testing.assert_close(ops.attention(*args, **cache.scales(0)),
                               reference.attention(*args, **cache.scales(0)), rtol=1e-4, atol=1e-5)


# ---- copies, swaps and growth move the scales ------------------------------------------------------

def filled(dtype, **kwargs):
    cache = token_cache(dtype, **kwargs)
    for layer in range(LAYERS):
        slots = torch.arange(BLOCKS * BLOCK_SIZE)
        cache.write(layer, torch.randn(len(slots), HEADS, HEAD_SIZE),
                    torch.randn(len(slots), HEADS, HEAD_SIZE), slots)
    return cache


def contents(cache, layer):
    """Every view of ``layer``: rows and scales, keys and values."""
    scales = cache.scales(layer)
    return [t.clone() for t in (*cache.layer(layer), scales["k_scale"], scales["v_scale"])]


@pytest.mark.parametrize("dtype", FORMATS.values())
def test_copies_swaps_and_growth_move_rows_with_their_scales(dtype):
    cache = filled(dtype)
    before = [contents(cache, layer) for layer in range(LAYERS)]
    cache.apply_copies([(1, 4), (2, 0)])
    cache.swap_out([(3, 2)])
    for pages in cache.key_caches + cache.value_caches:
        pages[3].zero_()
    cache.swap_in([(2, 5)])
    bigger = cache.with_blocks(9)
    for layer in range(LAYERS):
        for was, now, grown in zip(before[layer], contents(cache, layer), contents(bigger, layer)):
            assert torch.equal(now[4], was[1]) and torch.equal(now[0], was[2])
            assert torch.equal(now[5], was[3]) and not now[3].any()
            assert torch.equal(now[1], was[1]) and torch.equal(grown[:BLOCKS], now)
    assert bigger.dtype == dtype and bigger.scales(1)["k_scale"].shape[0] == 9


@pytest.mark.parametrize("dtype", FORMATS.values())
def test_kv_groups_and_shapes_keep_each_layers_scales_apart(dtype):
    """Sliding-window groups (one page slot per group's layer) and groups of several shapes
    (Gemma-4: pages sized by bytes to the largest group, a reader using its source's)."""
    windows = [4, 4, None, 4, 4, None]
    shapes = [(2, 8, 8), (2, 8, 8), (1, 32, 32), (2, 8, 8), (2, 8, 8), (1, 32, 32)]
    for layout in (KVGroupLayout.from_windows(windows),
                   KVGroupLayout.from_windows(windows, shapes, {5: 2})):
        cache = PagedKVCache(6, 2, 8, BLOCK_SIZE, dtype, num_blocks=4, kv_groups=layout)
        written = {}
        for block, group in enumerate(layout.groups):  # a block holds one group's layers
            slots = torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
            for layer in group.layers:
                heads, size, _ = cache.layer_shape(layer)
                written[layer] = (torch.randn(len(slots), heads, size),
                                  torch.randn(len(slots), heads, size), slots)
                cache.write(layer, *written[layer])
        for layer, (key, value, slots) in written.items():
            scales = cache.scales(layer)
            for pool, scale, x in ((cache.layer(layer)[0], scales["k_scale"], key),
                                   (cache.layer(layer)[1], scales["v_scale"], value)):
                rows, want = tq.quantize(x, dtype)
                torch.testing.assert_close(slot_rows(scale, slots), want)
                if dtype == torch.int8:
                    assert torch.equal(slot_rows(pool, slots), rows)
        if layout.is_shaped:
            assert cache.scales(5)["k_scale"].data_ptr() == cache.scales(2)["k_scale"].data_ptr()
            per_token = max(len(g.layers) * g.shape[0] * (tq.bytes_per_token_head(dtype, g.shape[1])
                                                          + tq.bytes_per_token_head(dtype, g.shape[2]))
                            for g in layout.groups)
            assert cache.block_bytes == BLOCK_SIZE * per_token


# ---- latent rows (values_in_keys): one row per token and layer, one scale -------------------------

@pytest.mark.parametrize("dtype", FORMATS.values())
def test_latent_rows_are_quantized_whole_and_move_with_their_scales(dtype):
    """write_columns stores [latent | rope] as one row under one scale (write_latent); the
    value view is the rows' leading columns and both views take the one scale tensor; copies,
    swaps and growth move rows and scales (inside each block's page) together."""
    cache = PagedKVCache(2, 1, 40, 4, dtype, num_blocks=3, num_host_blocks=2, head_size_v=32,
                         values_in_keys=True)
    assert cache.block_bytes == 2 * 4 * tq.bytes_per_token_head(dtype, 40)
    gen = torch.Generator().manual_seed(0)
    latent, rope = torch.randn(5, 1, 32, generator=gen), torch.randn(5, 1, 8, generator=gen) * 9
    slots = torch.tensor([0, 5, -1, 7, 2])
    cache.write_columns(1, latent, rope, slots)
    rows, values = cache.layer(1)
    scales = cache.scales(1)
    assert scales["k_scale"] is scales["v_scale"]
    assert values.data_ptr() == rows.data_ptr() and values.shape[-1] == tq.stored_head_size(dtype, 32)
    want_rows, want_scales = tq.quantize(torch.cat((latent, rope), -1), dtype)
    flat_rows = rows.reshape(-1, rows.shape[-1])
    flat_scales = scales["k_scale"].reshape(-1, *scales["k_scale"].shape[3:])
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_rows[slot], want_rows[token, 0])
            assert torch.equal(flat_scales[slot], want_scales[token, 0])
    before = rows.clone(), scales["k_scale"].clone()
    cache.apply_copies([(1, 2)])
    assert torch.equal(rows[2], before[0][1]) and torch.equal(scales["k_scale"][2], before[1][1])
    cache.swap_out([(0, 1)])
    rows[0].zero_()
    scales["k_scale"][0].zero_()
    cache.swap_in([(1, 0)])
    assert torch.equal(rows[0], before[0][0]) and torch.equal(scales["k_scale"][0], before[1][0])
    bigger = cache.with_blocks(5)
    assert torch.equal(bigger.layer(1)[0][:2], rows[:2])
    assert torch.equal(bigger.scales(1)["v_scale"][:2], scales["k_scale"][:2])
