"""fp8 KV caches, Python layer: format names, scale checks, calibration and PagedKVCache.

The ops' fp8 semantics are tested with the op tests; here: what the cache passes them.
"""

import pytest
import torch

from paged_attention_ext import quantization as q
from paged_attention_ext.reference import dequantize, quantize
from paged_attention_ext.kv_cache import PagedKVCache, bytes_per_block

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_cache(dtype=E4M3, layers=2, kv_heads=2, **kwargs):
    return PagedKVCache(layers, kv_heads, 8, block_size=4, dtype=dtype, num_blocks=6, **kwargs)


# ---- formats -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", E4M3), ("fp8", E4M3), ("fp8_e5m2", E5M2),
                                         ("auto", torch.bfloat16), (None, torch.bfloat16),
                                         (torch.float16, torch.float16), (E5M2, E5M2)])
def test_format_names(name, dtype):
    assert q.kv_cache_dtype(name, torch.bfloat16) is dtype


@pytest.mark.parametrize("name, error, match", [
    ("int8", ValueError, "unknown kv_cache_dtype 'int8'.*fp8_e4m3"),
    ("fp8_e4m3fn", ValueError, "unknown kv_cache_dtype"),
    (torch.int8, ValueError, "not a supported cache dtype"),
    (8, TypeError, "kv_cache_dtype must be"),
])
def test_unknown_format_raises(name, error, match):
    with pytest.raises(error, match=match):
        q.kv_cache_dtype(name, torch.float32)


def test_format_limits():
    assert q.fp8_max(E4M3) == 448.0 and q.fp8_max(E5M2) == 57344.0
    with pytest.raises(ValueError, match="not an fp8 dtype"):
        q.fp8_max(torch.float16)


# ---- quantization semantics -----------------------------------------------------------------

@pytest.mark.parametrize("dtype, mantissa_bits", [(E4M3, 3), (E5M2, 2)])
def test_quantize_round_trip_error_is_half_a_step(dtype, mantissa_bits):
    x = torch.randn(64, 2, 16) * torch.tensor([1.0, 30.0]).view(1, 2, 1)  # heads of unequal range
    scale = q.calibrate(x, dtype, per_head=True)
    stored = quantize(x, scale, dtype)
    back = stored.float() * scale.view(-1, 1)
    # Normal numbers: relative error <= 2^-(mantissa bits + 1); below the smallest normal,
    # the absolute error is at most half the subnormal step.
    tiny = torch.finfo(dtype).smallest_normal * scale.view(-1, 1)
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), tiny * 2.0 ** -mantissa_bits)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert back.abs().amax(dim=(0, 2)).tolist() == pytest.approx(x.abs().amax(dim=(0, 2)).tolist())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_and_keeps_nan(dtype):
    x = torch.tensor([[[1e30, -1e30, float("inf"), float("-inf"), float("nan"), 2.0]]])
    stored = quantize(x, torch.tensor([1.0]), dtype).float()[0, 0]
    limit = q.fp8_max(dtype)
    assert stored[:4].tolist() == [limit, -limit, limit, -limit]
    assert stored[4].isnan() and stored[5] == 2.0


# ---- calibration ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_calibration_scales_are_absmax_over_fmax(dtype):
    x = torch.zeros(5, 3, 4)
    x[2, 0, 1], x[4, 1, 3], x[0, 2, 0] = -7.0, 3.0, 0.5
    fmax = q.fp8_max(dtype)
    assert q.calibrate(x, dtype).tolist() == pytest.approx([7.0 / fmax])
    assert q.calibrate(x, dtype, per_head=True).tolist() == pytest.approx([7 / fmax, 3 / fmax, 0.5 / fmax])
    # The largest value is stored as the format's largest value, exactly.
    scale = q.calibrate(x, dtype, per_head=True)
    assert quantize(x, scale, dtype).float().abs().amax(dim=(0, 2)).tolist() == [fmax] * 3


def test_calibration_ignores_non_finite_values_and_guards_zero():
    x = torch.zeros(4, 2, 4)
    x[0, 0, 0], x[1, 0, 0], x[2, 0, 1], x[3, 0, 2] = float("nan"), float("inf"), -float("inf"), 4.0
    scale = q.calibrate(x, E4M3, per_head=True)
    assert scale.tolist() == pytest.approx([4.0 / 448, 1.0])  # head 1 is all zeros: scale 1
    assert q.calibrate(torch.zeros(0, 2, 4), E4M3).tolist() == [1.0]  # no tokens
    assert q.calibrate(torch.full((2, 1, 3), float("nan")), E5M2).tolist() == [1.0]


def test_calibration_wants_token_head_layout():
    with pytest.raises(ValueError, match=r"\[tokens, num_kv_heads, head_size\]"):
        q.calibrate(torch.ones(2, 8), E4M3)


# ---- scale checks --------------------------------------------------------------------------

@pytest.mark.parametrize("scale, shape", [(0.5, [1]), ([0.5, 0.25], [2]), (torch.tensor(0.5), [1]),
                                          (torch.tensor([0.5], dtype=torch.float64), [1]),
                                          (torch.tensor([[0.5], [0.25]]), [2])])
def test_scale_forms(scale, shape):
    tensor = q.check_scale("k_scale", scale, 2, "cpu")
    assert tensor.dtype == torch.float32 and list(tensor.shape) == shape


@pytest.mark.parametrize("scale, error, match", [
    ([0.5, 0.5, 0.5], ValueError, r"k_scale must have 1 element \(per layer\) or 2"),
    (torch.ones(4), ValueError, r"got shape \(4,\)"),
    (0.0, ValueError, "finite and > 0"),
    (-1.0, ValueError, "finite and > 0"),
    (float("nan"), ValueError, "finite and > 0"),
    (float("inf"), ValueError, "finite and > 0"),
    (torch.ones(1, dtype=torch.int32), TypeError, "float tensor"),
    ("0.5", TypeError, "k_scale must be a number"),
    (True, TypeError, "k_scale must be a number"),
])
def test_bad_scales_raise_naming_the_argument(scale, error, match):
    with pytest.raises(error, match=match):
        q.check_scale("k_scale", scale, 2, "cpu")


# ---- PagedKVCache ----------------------------------------------------------------------------

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
