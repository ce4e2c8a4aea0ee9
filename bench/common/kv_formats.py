"""KV-cache formats as round trips (stored -> the values attention reads), for accuracy
measurements: the library's per-token formats (``token_quantization``, their definition),
fp8 per tensor, and other projects' formats as anchors, written from their published
definitions.

Every round trip maps rows ``[..., tokens, head_size]`` to the fp32 values the cache would
hand to attention. All but KIVI's keys round each row on its own, so a cache can round
every token once, when it is written; KIVI's keys are rounded per channel over groups of
tokens.

Anchors:

* llama.cpp ``q8_0`` / ``q4_0`` / ``q4_1`` (``ggml-quants.c``, ``quantize_row_*_ref``):
  blocks of 32 consecutive values of a row, the scale (and q4_1's minimum) stored as fp16.
  q8_0: ``d = amax / 127``, ``q = roundf(x / d)``. q4_0 (symmetric): ``d = max / -8`` with
  ``max`` the value of largest magnitude, ``q = min(15, trunc(x / d + 8.5))``, value
  ``(q - 8) * d``: the levels -8..7 times d. q4_1 (asymmetric): ``d = (max - min) / 15``,
  ``q = min(15, trunc((x - min) / d + 0.5))``, value ``q * d + min``.
* llama.cpp ``q4_0`` rotated: q4_0 of the rows rotated as the int4 format rotates them.
  llama.cpp rotates Q/K/V with a Hadamard transform when its cache is quantized
  (https://github.com/ggml-org/llama.cpp/pull/21038); this stands for it with this
  library's rotation, not a copy of llama.cpp's.
* KIVI 4-bit (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache"): asymmetric (min and scale), keys per channel over groups of 32 tokens, values
  per token over groups of 32 channels; the newest tokens that do not fill a key group yet
  stay in full precision (KIVI's residual); scale and minimum stored as fp16.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from paged_attention_ext import quantization
from paged_attention_ext import reference
from paged_attention_ext import token_quantization as tq

LLAMA_CPP_BLOCK = 32
KIVI_GROUP = 32
Rows = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[-1] % n:
        raise ValueError(f"head_size {x.shape[-1]} is not a multiple of the block size {n}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // n, n)


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


# ---- the library's formats ---------------------------------------------------------------------

def int8_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return tq.dequantize_int8(*tq.quantize_int8(x))


def int4_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return tq.dequantize_int4(*tq.quantize_int4(x))


def int4_unrotated_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return tq.dequantize_int4(*tq.quantize_int4(x, rotated=False), rotated=False)


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """One e4m3 scale for all of ``x`` (``quantization.calibrate``, per tensor)."""
    return quantization.calibrate(x.reshape(-1, 1, x.shape[-1]), torch.float8_e4m3fn)


def fp8_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """e4m3 with one scale per tensor, stored as ``reference.quantize`` stores it."""
    scale = fp8_scale(x) if scale is None else scale
    stored = reference.quantize(x, scale, torch.float8_e4m3fn)
    return stored.float() * scale.float()


# ---- anchors -----------------------------------------------------------------------------------

def q8_0_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    b = _blocks(x, LLAMA_CPP_BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * _reciprocal(d)
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf: ties away from zero
    return (q * _fp16(d)).reshape(x.shape)


def q4_0_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    b = _blocks(x, LLAMA_CPP_BLOCK)
    largest = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # signed: it maps to level -8
    d = largest / -8
    q = torch.trunc(b * _reciprocal(d) + 8.5).clamp(max=15)  # >= 0.5 before the cast
    return ((q - 8) * _fp16(d)).reshape(x.shape)


def q4_0_rotated_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return tq.unrotate(q4_0_rows(tq.rotate(x)))


def q4_1_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    b = _blocks(x, LLAMA_CPP_BLOCK)
    low = b.amin(-1, keepdim=True)
    d = (b.amax(-1, keepdim=True) - low) / 15
    q = torch.trunc((b - low) * _reciprocal(d) + 0.5).clamp(max=15)
    return (q * _fp16(d) + _fp16(low)).reshape(x.shape)


def _asymmetric4(x: torch.Tensor, dim: int) -> torch.Tensor:
    """KIVI's 4-bit min/scale quantization of ``x`` reduced along ``dim``."""
    low = x.amin(dim, keepdim=True)
    scale = (x.amax(dim, keepdim=True) - low) / 15
    q = torch.nan_to_num(torch.round((x - low) / scale), nan=0.0).clamp(0, 15)
    return q * _fp16(scale) + _fp16(low)


def kivi_key_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keys per channel over groups of KIVI_GROUP tokens; the incomplete last group (the
    residual) kept as it is."""
    tokens, head_size = x.shape[-2], x.shape[-1]
    full = tokens // KIVI_GROUP * KIVI_GROUP
    groups = x[..., :full, :].float().reshape(*x.shape[:-2], full // KIVI_GROUP, KIVI_GROUP, head_size)
    grouped = _asymmetric4(groups, dim=-2).reshape(*x.shape[:-2], full, head_size)
    return torch.cat((grouped, x[..., full:, :].float()), dim=-2)


def kivi_value_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _asymmetric4(_blocks(x, KIVI_GROUP), dim=-1).reshape(x.shape)


# ---- the formats compared ----------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    """A cache format: the round trips of its keys and values, and its storage cost."""

    keys: Rows
    values: Rows
    bits: Callable[[int], float]  # bits per stored value, scales included, for a head size
    calibrated: bool = False  # one scale per tensor (per layer in a model), from the first values
    key_token_group: int = 0  # keys rounded per channel over groups of this many tokens


FORMATS: Dict[str, Format] = {
    "int8_per_token_head": Format(int8_rows, int8_rows, lambda d: 8 + 32 / d),
    "int4_per_token_head": Format(int4_rows, int4_rows, lambda d: 4 + 64 / d),
    "int4, K rotated only": Format(int4_rows, int4_unrotated_rows, lambda d: 4 + 64 / d),
    "int4, unrotated": Format(int4_unrotated_rows, int4_unrotated_rows, lambda d: 4 + 64 / d),
    "fp8_e4m3 per tensor": Format(fp8_rows, fp8_rows, lambda d: 8.0, calibrated=True),
    "llama.cpp q8_0": Format(q8_0_rows, q8_0_rows, lambda d: 8.5),
    "llama.cpp q4_0": Format(q4_0_rows, q4_0_rows, lambda d: 4.5),
    "llama.cpp q4_0, rotated": Format(q4_0_rotated_rows, q4_0_rotated_rows, lambda d: 4.5),
    "llama.cpp q4_1": Format(q4_1_rows, q4_1_rows, lambda d: 5.0),
    "KIVI 4-bit": Format(kivi_key_rows, kivi_value_rows, lambda d: 5.0, key_token_group=KIVI_GROUP),
}


def bf16_rows(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return x.bfloat16().float()


# A bf16 cache under an fp32 model: how far any small change of K/V moves a model's tokens.
BF16 = Format(bf16_rows, bf16_rows, lambda d: 16.0)
