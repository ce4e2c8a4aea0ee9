"""paged_attention_ext.quantization: fp8 format names and limits, quantization round trips,
calibration and scale checks.

The ops' fp8 semantics are tested with the op tests; the cache's scales in test_kv_cache.py.
"""

import pytest
import torch

from paged_attention_ext import quantization as q
from paged_attention_ext.reference import quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- formats -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", E4M3), ("fp8", E4M3), ("fp8_e5m2", E5M2),
                                         ("auto", torch.bfloat16), (None, torch.bfloat16),
                                         (torch.float16, torch.float16), (E5M2, E5M2)])
def test_format_names(name, dtype):
    assert q.kv_cache_dtype(name, torch.bfloat16) is dtype


@pytest.mark.parametrize("name, error, match", [
    ("int8", ValueError, "unknown kv_cache_dtype 'int8'.*fp8_e4m3"),
    ("fp8_e4m3fn", ValueError, "unknown kv_cache_dtype"),
    (torch.int32, ValueError, "not a supported cache dtype"),  # int8: the per-token format
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
