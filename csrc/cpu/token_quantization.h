// The per-token formats' maths on the CPU (paged_attention_ext/token_quantization.py
// defines them): quantizing a row for write_kv, and the int4 rotation, which attention
// applies to the queries and undoes on the outputs. Scalar fp32 in the definition's order,
// so a row quantizes to the reference's bytes. Torch-free.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace paged::cpu {

constexpr int kMaxRotationBlock = 512;

// Channels per Hadamard block: the largest power of two dividing head_size, at most 512.
inline int rotation_block(int head_size) { return std::min(head_size & -head_size, kMaxRotationBlock); }

// Channel i is negated when bit 31 of i * 2654435761 (mod 2^32) is set (a Fibonacci hash).
inline float rotation_sign(int i) { return (uint32_t(i) * 2654435761u) >> 31 ? -1.0f : 1.0f; }

// The unnormalised Sylvester-Hadamard transform of each block of n channels, in place:
// butterflies at distance 1, 2, 4, ... (the definition's order, the same sums bit for bit).
inline void hadamard_blocks(float* x, int head_size, int n) {
  for (int base = 0; base < head_size; base += n)
    for (int h = 1; h < n; h *= 2)
      for (int i = base; i < base + n; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
}

// The fp32 factor that makes a Hadamard block of order n orthonormal.
inline float rotation_norm(int n) { return float(1.0 / std::sqrt(double(n))); }

// x (head_size values, fp32) rotated in place: signs, Hadamard blocks, 1 / sqrt(n).
inline void rotate(float* x, int head_size) {
  const int n = rotation_block(head_size);
  for (int i = 0; i < head_size; ++i) x[i] *= rotation_sign(i);
  hadamard_blocks(x, head_size, n);
  const float norm = rotation_norm(n);
  for (int i = 0; i < head_size; ++i) x[i] *= norm;
}

// The inverse of rotate, in place: Hadamard blocks, 1 / sqrt(n), signs.
inline void unrotate(float* x, int head_size) {
  const int n = rotation_block(head_size);
  hadamard_blocks(x, head_size, n);
  const float norm = rotation_norm(n);
  for (int i = 0; i < head_size; ++i) x[i] = x[i] * norm * rotation_sign(i);
}

// round_half_even(ratio) clamped to [low, high]; 0 for NaN (torch.nan_to_num, then clamp).
inline int quantized(float ratio, int low, int high) {
  if (std::isnan(ratio)) return 0;
  const float r = std::nearbyint(ratio);  // the default rounding mode: to nearest even
  return int(std::clamp(r, float(low), float(high)));
}

// max of |x| / min / max as torch's amax / amin: NaN if the row holds one.
inline float nan_max(float a, float b) { return std::isnan(a) || a > b ? a : b; }
inline float nan_min(float a, float b) { return std::isnan(a) || a < b ? a : b; }

// int8: scale = amax / 127, q = clamp(round(x / scale), -127, 127) (true division, as the
// definition). Returns the scale.
inline float quantize_int8_row(const float* x, int n, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = nan_max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  for (int i = 0; i < n; ++i) q[i] = int8_t(quantized(x[i] / scale, -127, 127));
  return scale;
}

// int4 of an already rotated row r: low = min r, scale = (max r - low) / 15,
// q = clamp(round((r - low) / scale), 0, 15), two a byte, the even channel in the low nibble.
inline void quantize_int4_row(const float* r, int n, uint8_t* packed, float* scale_low) {
  float low = r[0], high = r[0];
  for (int i = 1; i < n; ++i) {
    low = nan_min(low, r[i]);
    high = nan_max(high, r[i]);
  }
  const float scale = (high - low) / 15.0f;
  for (int i = 0; i < n; i += 2)
    packed[i / 2] = uint8_t(quantized((r[i] - low) / scale, 0, 15) |
                            quantized((r[i + 1] - low) / scale, 0, 15) << 4);
  scale_low[0] = scale;
  scale_low[1] = low;
}

}  // namespace paged::cpu
