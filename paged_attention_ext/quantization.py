"""fp8 KV-cache formats, their scales, and calibration of the scales.

An fp8 cache stores ``to_fp8(x / scale)`` and the attention reads ``float(stored) * scale``
(the op semantics: :mod:`paged_attention_ext.ops`; in plain PyTorch:
``reference.quantize`` / ``reference.dequantize``). A scale is a float32 tensor per layer
and per K or V: one element (the layer's scale, vLLM's convention) or ``[num_kv_heads]``
(one per KV head). The scale maps the largest value the layer stores onto the format's
largest finite value, ``scale = amax / fmax``: anything larger saturates, anything much
smaller loses relative precision to the format's smallest normal numbers.

Formats (names as vLLM's ``kv_cache_dtype``):

========== ====================== ============= ==================================
name       torch dtype            largest value  precision
========== ====================== ============= ==================================
fp8_e4m3   ``torch.float8_e4m3fn``  448          3 mantissa bits: relative step 2^-3
fp8_e5m2   ``torch.float8_e5m2``    57344        2 mantissa bits: relative step 2^-2
========== ====================== ============= ==================================

``"fp8"`` is ``"fp8_e4m3"`` (as in vLLM); ``"auto"`` or None is the model's dtype.
``"int8_per_token_head"`` (``torch.int8``) and ``"int4_per_token_head"`` (``torch.uint8``,
two values a byte) scale each token's row of each KV head on its own when it is written
(:mod:`paged_attention_ext.token_quantization`): they take no scales and nothing is
calibrated.
"""

from typing import Optional, Sequence, Union

import torch

from .token_quantization import TOKEN_DTYPES, TOKEN_FORMATS

FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = tuple(FP8_FORMATS.values())
_ALIASES = {"fp8": "fp8_e4m3"}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Every format by name, and every cache dtype the pools take.
FORMATS = {**FP8_FORMATS, **TOKEN_FORMATS}
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES + TOKEN_DTYPES
CALIBRATIONS = ("per_layer", "per_head")

# A layer scale as callers may give it: a number, or a float tensor of one or
# num_kv_heads elements; sequences of numbers are one per KV head.
ScaleLike = Union[float, Sequence[float], torch.Tensor]


def kv_cache_dtype(name: "Optional[str | torch.dtype]", model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype a ``kv_cache_dtype`` argument names.

    ``None`` or ``"auto"``: ``model_dtype``; ``"fp8_e4m3"`` / ``"fp8"`` / ``"fp8_e5m2"``:
    the fp8 dtype; ``"int8_per_token_head"`` / ``"int4_per_token_head"``: ``torch.int8`` /
    ``torch.uint8`` (packed int4); a torch dtype of the supported ones is returned as is.
    """
    if name is None or name == "auto":
        return model_dtype
    if isinstance(name, torch.dtype):
        if name not in CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {name} is not a supported cache dtype "
                             f"({', '.join(map(str, CACHE_DTYPES))})")
        return name
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype must be a str, a torch.dtype or None, got "
                        f"{type(name).__name__} {name!r}")
    name = _ALIASES.get(name, name)
    if name not in FORMATS:
        choices = ["auto"] + sorted(FP8_FORMATS) + sorted(_ALIASES) + list(TOKEN_FORMATS)
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose from {choices}")
    return FORMATS[name]


def dtype_label(dtype: torch.dtype) -> str:
    """A cache dtype as reports and errors name it: its torch name (``float8_e4m3fn``), or a
    per-token format's ``kv_cache_dtype`` name (its torch dtype, int8 or uint8, says less)."""
    names = {d: n for n, d in TOKEN_FORMATS.items()}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if not is_fp8(dtype):
        raise ValueError(f"{dtype} is not an fp8 dtype ({', '.join(map(str, FP8_DTYPES))})")
    return float(torch.finfo(dtype).max)


def check_scale(name: str, scale: ScaleLike, num_kv_heads: int,
                device: "str | torch.device") -> torch.Tensor:
    """``scale`` as the ops take it: float32 ``[1]`` or ``[num_kv_heads]`` on ``device``.

    Raises ``ValueError`` naming ``name`` for a wrong element count or a scale that is not
    finite and positive (a zero or negative scale would store only saturated values).
    """
    if isinstance(scale, torch.Tensor):
        if not (scale.dtype.is_floating_point and scale.dtype not in FP8_DTYPES):
            raise TypeError(f"{name} must be a float tensor, got {scale.dtype}")
        tensor = scale.detach().reshape(-1)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        tensor = torch.tensor([float(scale)])
    elif isinstance(scale, Sequence) and all(isinstance(s, (int, float)) and not isinstance(s, bool)
                                             for s in scale):
        tensor = torch.tensor([float(s) for s in scale])
    else:
        raise TypeError(f"{name} must be a number, a sequence of numbers or a float tensor, "
                        f"got {type(scale).__name__}")
    if tensor.numel() not in (1, num_kv_heads):
        raise ValueError(f"{name} must have 1 element (per layer) or {num_kv_heads} (one per KV "
                         f"head), got shape {tuple(scale.shape) if isinstance(scale, torch.Tensor) else tensor.numel()}")
    tensor = tensor.to(device=device, dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(tensor).all() and (tensor > 0).all()):
        raise ValueError(f"{name} must be finite and > 0, got {tensor.tolist()}")
    return tensor


def absmax(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Largest finite ``|x|`` of ``[tokens, num_kv_heads, head_size]``: float32 ``[1]``, or
    ``[num_kv_heads]`` with ``per_head``. NaN and ±inf are left out: they say nothing about
    the range of the values to keep (inf saturates, NaN stays NaN whatever the scale)."""
    if x.dim() != 3:
        raise ValueError(f"expected [tokens, num_kv_heads, head_size], got shape {tuple(x.shape)}")
    magnitude = x.detach().float().abs()
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    if per_head:
        return magnitude.amax(dim=(0, 2)) if x.shape[0] else magnitude.new_zeros(x.shape[1])
    return magnitude.amax().reshape(1) if x.numel() else magnitude.new_zeros(1)


def scale_from_absmax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``amax / fmax``: the scale that stores ``amax`` as the format's largest value.

    An all-zero (or all non-finite) range gets scale 1: any scale stores zeros exactly,
    and 1 keeps the later values' precision no worse than an unscaled cache.
    """
    scale = amax.float() / fp8_max(dtype)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def calibrate(x: torch.Tensor, dtype: torch.dtype, per_head: bool = False) -> torch.Tensor:
    """The scale for storing ``x`` (``[tokens, num_kv_heads, head_size]``) in ``dtype``."""
    return scale_from_absmax(absmax(x, per_head), dtype)
