"""MLA latent caches in every format: ``write_latent`` stores each token's ``[latent |
rotary_key]`` row whole, and attention reads the row as the key and its leading 512
columns (a view) as the value, with one scale tensor as ``k_scale`` and ``v_scale``.

Per-token rows are quantized once, over the whole 576-wide row (int8: its amax; int4: the
row rotated in blocks of ``rotation_block(576)`` = 64 channels, then its ``(scale, low)``),
so attention over int4 latent rows unrotates its 512-wide output with the key rows' blocks
of 64, not with ``rotation_block(512)``. Everything is checked against the float64
reference over the dequantized rows, on adversarial layouts and every CPU instruction set.
"""

import pytest
import torch

import cpu_isas
import paged_attention_ext as pa
from latent_rows import LORA, ROPE, WIDTH, latent_cache, latent_case, rows_of, values_of
from paged_attention_ext import reference as ref
from paged_attention_ext import token_quantization as tq

TOKEN_DTYPES = [torch.int8, torch.uint8]
TOKEN_IDS = ["int8", "int4"]


# ---- write_latent ------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                         torch.float8_e4m3fn, torch.float8_e5m2, *TOKEN_DTYPES],
                         ids=str)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nhd", [False, True], ids=["HND", "NHD"])
def test_write_latent_stores_the_references_rows_and_scales(cache_dtype, input_dtype, nhd):
    gen = torch.Generator().manual_seed(0)
    cache, scale = latent_cache(5, 4, cache_dtype, nhd)
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.tensor([0.03])
    latent, rotary = rows_of(gen, 7, input_dtype)
    latent[2, 0, 3] = float("nan")  # a NaN row: its own scale and values only
    rotary[4, 0] = 0.0
    latent[4, 0] = 0.0  # a zero row: scale 0, stored exactly
    slots = torch.tensor([17, 3, -1, 0, 19, 8, -5])
    want_cache, want_scale = cache.clone(), None if scale is None else scale.clone()
    ref.write_latent(latent, rotary, want_cache, slots, want_scale)
    fp8_scale = None if scale is None else scale.clone()
    pa.write_latent(latent, rotary, cache, slots, scale)
    assert torch.equal(cache.contiguous().view(torch.uint8), want_cache.contiguous().view(torch.uint8))
    if scale is not None:
        assert torch.equal(scale.nan_to_num(7.0), want_scale.nan_to_num(7.0))
        if not tq.is_per_token(cache_dtype):
            assert torch.equal(scale, fp8_scale), "an fp8 scale is read, never written"


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=TOKEN_IDS)
def test_write_latent_quantizes_the_whole_row_under_one_scale(cache_dtype):
    # The rotary key's range sets the scale of the latent's columns too (int8: amax of the
    # whole row), and int4 rotates the 576 columns in blocks of 64.
    cache, scale = latent_cache(1, 2, cache_dtype)
    latent = torch.full((1, 1, LORA), 0.5)
    rotary = torch.full((1, 1, ROPE), -100.0)
    pa.write_latent(latent, rotary, cache, torch.tensor([1]), scale)
    row = torch.cat((latent, rotary), -1)[0]
    stored = tq.dequantize(cache[0, :, 1], scale[0, :, 1])
    if cache_dtype == torch.int8:
        assert scale[0, 0, 1].item() == pytest.approx(100 / 127)
    else:
        assert tq.rotation_block(WIDTH) == 64
        packed, pair = tq.quantize_int4(row)
        assert torch.equal(cache[0, :, 1], packed) and torch.equal(scale[0, :, 1], pair)
    assert (stored - row).abs().max() <= (scale[0, 0, 1, ..., 0] if cache_dtype == torch.uint8
                                          else scale[0, 0, 1]) * 2


def test_write_latent_refuses_bad_arguments_before_writing():
    cache, scale = latent_cache(2, 4, torch.int8)
    before, before_scale = cache.clone(), scale.clone()
    latent, rotary = rows_of(torch.Generator().manual_seed(1), 2)
    slots = torch.tensor([0, 1])
    cases = [
        ((latent, rotary[..., :32], cache, slots, scale), ValueError,
         r"'latent' \[2, 1, 512\] and 'rotary_key' \[2, 1, 32\] .* adding up to the cache's rows \(576"),
        ((latent, rotary, cache, slots, None), ValueError, "which needs argument 'scale'"),
        ((latent, rotary, cache, slots, scale[..., None].expand(-1, -1, -1, 2)), ValueError,
         "argument 'scale' must have shape"),
        ((latent, rotary.half(), cache, slots, scale), TypeError, "argument 'rotary_key' must have dtype"),
        ((latent.int(), rotary.int(), cache, slots, scale), TypeError, "argument 'latent' must be float32"),
        ((latent, rotary, cache, torch.tensor([0, 8]), scale), IndexError,
         r"paged.write_latent: slot_mapping\[1\] = 8 is outside the cache"),
        ((latent, rotary, cache, slots[:1], scale), ValueError, "'slot_mapping' has 1 entries"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            pa.write_latent(*args)
    float_cache, _ = latent_cache(2, 4, torch.float32)
    with pytest.raises(ValueError, match="argument 'scale' is only for fp8"):
        pa.write_latent(latent, rotary, float_cache, slots, torch.tensor(1.0))
    assert torch.equal(cache, before) and torch.equal(scale.nan_to_num(), before_scale.nan_to_num())


def test_write_kv_still_refuses_per_token_latent_views_and_names_write_latent():
    cache, scale = latent_cache(2, 4, torch.int8)
    latent, rotary = rows_of(torch.Generator().manual_seed(1), 1)
    with pytest.raises(ValueError, match="stored whole, under one scale, with paged.write_latent"):
        pa.write_kv(latent, rotary, cache[..., :LORA], cache[..., LORA:], torch.tensor([0]), scale, scale)


# ---- attention over per-token latent rows --------------------------------------------------

def reference_out(query, cache, scale, tables, seq_lens, qsl=None, form="attention"):
    args = (query.double(), cache, values_of(cache), tables, seq_lens)
    if form == "shared_prefix":
        return ref.shared_prefix_attention(*args, qsl, WIDTH ** -0.5, k_scale=scale, v_scale=scale)
    return ref.attention_with_lse(*args, WIDTH ** -0.5, qsl, k_scale=scale, v_scale=scale)


def run_form(form, query, cache, scale, tables, seq_lens, qsl):
    common = dict(k_scale=scale, v_scale=scale)
    value = values_of(cache)
    if form == "attention":
        return pa.attention(query, cache, value, tables, seq_lens, WIDTH ** -0.5, qsl, **common), None
    if form == "with_lse":
        return pa.attention_with_lse(query, cache, value, tables, seq_lens, WIDTH ** -0.5, qsl, **common)
    if form == "out":
        out = torch.full((query.shape[0], query.shape[1], LORA), float("nan"), dtype=query.dtype)
        lse = torch.full(query.shape[:2], float("nan"))
        pa.attention_out(out, query, cache, value, tables, seq_lens, WIDTH ** -0.5, qsl, lse=lse,
                         **common)
        return out, lse
    return pa.shared_prefix_attention(query, cache, value, tables, seq_lens, qsl, WIDTH ** -0.5,
                                      **common)


def assert_close_to_reference(got, want, query_dtype):
    (out, lse), (want_out, want_lse) = got, want
    tol = 2e-2 if query_dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.double(), want_out.double(), atol=tol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", cpu_isas.ISAS)
@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=TOKEN_IDS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_over_per_token_latent_rows_equals_the_reference(isa, cache_dtype, block_size):
    cpu_isas.select_isa(isa)
    lens = sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 5})
    cache, scale, tables, seq_lens = latent_case(lens, block_size, cache_dtype)
    for heads in (16, 128):
        query = torch.randn(len(lens), heads, WIDTH, generator=torch.Generator().manual_seed(heads))
        got = run_form("with_lse", query, cache, scale, tables, seq_lens, None)
        assert_close_to_reference(got, reference_out(query, cache, scale, tables, seq_lens),
                                  query.dtype)


@pytest.mark.parametrize("isa", cpu_isas.ISAS)
@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=TOKEN_IDS)
@pytest.mark.parametrize("form", ["attention", "with_lse", "out", "shared_prefix"])
def test_multi_token_forms_over_per_token_latent_rows_equal_the_reference(isa, cache_dtype, form):
    cpu_isas.select_isa(isa)
    block_size = 16
    lens = [1, 15, 16, 17, 40]
    q_lens = [1, 3, 0, 17, 6] if form != "shared_prefix" else [2, 1, 0, 4, 3]
    cache, scale, tables, seq_lens = latent_case(lens, block_size, cache_dtype, nhd=True)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    for query_dtype in (torch.float32, torch.bfloat16):
        query = torch.randn(sum(q_lens), 16, WIDTH, generator=torch.Generator().manual_seed(5))
        query = query.to(query_dtype)
        got = run_form(form, query, cache, scale, tables, seq_lens, qsl)
        want = reference_out(query, cache, scale, tables, seq_lens, qsl,
                             "shared_prefix" if form == "shared_prefix" else "attention")
        assert_close_to_reference(got, want, query_dtype)


def test_int4_latent_output_is_unrotated_with_the_key_rows_blocks():
    # The values are the first 512 channels of rows rotated in blocks of 64: a cache whose
    # every row is one latent reads that latent back (to int4's precision), which an
    # unrotation in one block of 512 would scramble.
    cache, scale = latent_case([5], 16, torch.uint8)[:2]
    latent = torch.randn(1, 1, LORA, generator=torch.Generator().manual_seed(9))
    slots = torch.arange(cache.shape[0] * 16)
    pa.write_latent(latent.expand(len(slots), 1, LORA).contiguous(), torch.zeros(len(slots), 1, ROPE),
                    cache, slots, scale)
    tables = torch.arange(cache.shape[0], dtype=torch.int32)[None]
    out = pa.attention(torch.randn(1, 4, WIDTH), cache, values_of(cache), tables,
                       torch.tensor([20], dtype=torch.int32), 0.05, k_scale=scale, v_scale=scale)
    stored = tq.dequantize(cache[0, 0, :1], scale[0, 0, :1])[0, :LORA]
    torch.testing.assert_close(out[0], stored.expand(4, LORA), atol=1e-4, rtol=1e-4)
    assert (stored - latent[0, 0]).abs().max() < 0.5


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=TOKEN_IDS)
def test_attention_refuses_per_token_caches_sharing_memory_otherwise(cache_dtype):
    cache, scale, tables, seq_lens = latent_case([5], 16, cache_dtype)
    query = torch.randn(1, 4, WIDTH)
    value = values_of(cache)
    message = "the one sharing allowed is latent rows"
    with pytest.raises(ValueError, match=message):  # two scale tensors for one row
        pa.attention(query, cache, value, tables, seq_lens, 0.1, k_scale=scale, v_scale=scale.clone())
    with pytest.raises(ValueError, match=message):  # values not the leading columns
        shift = value.shape[3] // 8
        pa.attention(query, cache, cache[..., shift:shift + value.shape[3]], tables, seq_lens, 0.1,
                     k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match=message):  # one scale tensor for two caches
        other = cache.clone()
        pa.attention(query, cache, values_of(other), tables, seq_lens, 0.1, k_scale=scale,
                     v_scale=scale)


# ---- torch.compile ----------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, *TOKEN_DTYPES], ids=str)
def test_opcheck_write_latent(cache_dtype):
    cache, scale = latent_cache(3, 4, cache_dtype, nhd=True)
    cache.view(torch.uint8).zero_()
    if scale is not None:
        scale.zero_()
    else:
        scale = torch.tensor([0.5]) if cache_dtype == torch.float8_e4m3fn else None
    latent, rotary = rows_of(torch.Generator().manual_seed(2), 3, torch.bfloat16)
    # fp8 tensors have no allclose: the schema test (which compares them) is left out for fp8.
    checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    checks += () if cache_dtype == torch.float8_e4m3fn else ("test_schema",)
    torch.library.opcheck(torch.ops.paged.write_latent.default,
                          (latent, rotary, cache, torch.tensor([5, -1, 9]), scale), test_utils=checks)


def latent_decode_step(latent, rotary, query, cache, scale, slots, tables, seq_lens):
    pa.write_latent(latent, rotary, cache, slots, scale)
    return pa.attention(query, cache, cache[..., :cache.shape[-1] * LORA // WIDTH], tables, seq_lens,
                        0.05, k_scale=scale, v_scale=scale) * 2.0


@pytest.mark.parametrize("cache_dtype", TOKEN_DTYPES, ids=TOKEN_IDS)
def test_compile_fullgraph_write_latent_then_attend_matches_eager(cache_dtype):
    cache, scale, tables, seq_lens = latent_case([9, 16, 1], 8, cache_dtype)
    last = seq_lens.long() - 1
    slots = tables[torch.arange(3), last // 8].long() * 8 + last % 8
    latent, rotary = rows_of(torch.Generator().manual_seed(4), 3, torch.float16)
    query = torch.randn(3, 16, WIDTH).half()

    def run(step):
        c, s = cache.clone(), scale.clone()
        return step(latent, rotary, query, c, s, slots, tables, seq_lens), c, s

    want, want_cache, want_scale = run(latent_decode_step)
    torch._dynamo.reset()
    got, got_cache, got_scale = run(torch.compile(latent_decode_step, fullgraph=True))
    torch.testing.assert_close(got, want)
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(got_scale.nan_to_num(), want_scale.nan_to_num())


def test_int4_latent_values_must_be_whole_rotation_blocks_of_the_key_rows():
    # Rows of 48 values rotate in blocks of 16: values of the leading 40 would end inside one.
    cache = torch.zeros(2, 1, 4, 24, dtype=torch.uint8)
    scale = torch.zeros(2, 1, 4, 2)
    with pytest.raises(ValueError, match="int4 latent rows of 48 values are rotated in blocks of 16, "
                                         r"so their values \(the leading 40 columns\) must be whole"):
        pa.attention(torch.randn(1, 4, 48), cache, cache[..., :20], torch.zeros(1, 1, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), 0.1, k_scale=scale, v_scale=scale)


def test_int4_latent_rows_of_no_values_are_refused_by_name():
    # Rows of width 0 have no rotation block: the head-size check names them (no division).
    cache = torch.zeros(2, 1, 4, 0, dtype=torch.uint8)
    scale = torch.zeros(2, 1, 4, 2)
    with pytest.raises(ValueError, match="head_size"):
        pa.attention(torch.zeros(1, 1, 0, dtype=torch.bfloat16), cache, cache[..., :0],
                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0,
                     k_scale=scale, v_scale=scale)
