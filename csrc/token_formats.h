// The per-token KV formats' maths (int8_per_token_head, int4_per_token_head; their
// definition is paged_attention_ext/token_quantization.py), one copy for the host and the
// device: the int4 rotation's pieces (block, signs, butterflies, norm), rounding, the
// NaN-propagating max / min, and a value's quantization once its row's scale is known.
// The CPU kernels loop over them serially (cpu/token_quantization.h), the CUDA kernels
// spread them over a warp or a CTA (cuda/token_formats.cuh); fp32 in the definition's
// order, so both give the reference's bytes. Torch-free.
#pragma once

#include <math.h>

#include <cstdint>

#include "host_device.h"

namespace paged {

// ---- the int4 rotation: signs, Hadamard blocks, 1 / sqrt(n) ------------------------------

constexpr int kMaxRotationBlock = 512;

// Channels per Hadamard block: the largest power of two dividing head_size, at most 512.
PAGED_HOST_DEVICE int rotation_block(int head_size) {
  const int n = head_size & -head_size;
  return n < kMaxRotationBlock ? n : kMaxRotationBlock;
}

// Channel i is negated when bit 31 of i * 2654435761 (mod 2^32) is set (a Fibonacci hash).
PAGED_HOST_DEVICE float rotation_sign(int i) {
  return (static_cast<uint32_t>(i) * 2654435761u) >> 31 ? -1.0f : 1.0f;
}

// fp32(1 / sqrt(n)) as the definition computes it (in double, then rounded once): the
// factor that makes a Hadamard block of order n orthonormal.
PAGED_HOST_DEVICE float rotation_norm(int n) { return float(1.0 / ::sqrt(double(n))); }

// Butterfly c of the stage at distance h (h = 1, 2, 4, ...; c < width / 2): channels i and
// i + h, i the c-th channel of a row whose bit h is clear. The butterflies of a stage touch
// disjoint channels, so any order (or thread) gives the definition's sums bit for bit.
PAGED_HOST_DEVICE void butterfly(float* row, int c, int h) {
  const int i = (c / h) * 2 * h + c % h;
  const float a = row[i], b = row[i + h];
  row[i] = a + b;
  row[i + h] = a - b;
}

// a * b rounded on its own: the device would fuse it with a following subtraction
// (quantization's r - low) into one fma, which the definition does not.
PAGED_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// ---- quantizing a value ------------------------------------------------------------------

// max and min that return NaN when either side is NaN (fmaxf would drop it), as torch's
// amax / amin do: a row holding a NaN gets a NaN scale.
PAGED_HOST_DEVICE float nan_max(float a, float b) { return a > b || a != a ? a : b; }
PAGED_HOST_DEVICE float nan_min(float a, float b) { return a < b || a != a ? a : b; }

// round_half_even(ratio) clamped to [low, high]; 0 for NaN (torch.nan_to_num, then clamp).
PAGED_HOST_DEVICE int quantized(float ratio, int low, int high) {
  const float r = rintf(ratio);  // the default rounding mode: to nearest even
  return r != r ? 0 : int(fminf(fmaxf(r, float(low)), float(high)));
}

// int8: scale = amax / 127, q = clamp(round(x / scale), -127, 127) (true division, as the
// definition: not a multiplication by a reciprocal).
PAGED_HOST_DEVICE float int8_scale(float amax) { return amax / 127.0f; }
PAGED_HOST_DEVICE int8_t int8_value(float x, float scale) {
  return static_cast<int8_t>(quantized(x / scale, -127, 127));
}

// int4 of rotated values r: scale = (max r - low) / 15, q = clamp(round((r - low) / scale),
// 0, 15), two a byte, the even channel in the low nibble.
PAGED_HOST_DEVICE float int4_scale(float low, float high) { return (high - low) / 15.0f; }
PAGED_HOST_DEVICE uint8_t int4_pair(float even, float odd, float low, float scale) {
  return static_cast<uint8_t>(quantized((even - low) / scale, 0, 15) | quantized((odd - low) / scale, 0, 15) << 4);
}

}  // namespace paged
