// The per-token formats on the CPU: the serial loops over a row of the shared maths
// (../token_formats.h): quantizing a row for write_kv, and the int4 rotation, which
// attention applies to the queries and undoes on the outputs. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>

#include "../token_formats.h"

namespace paged::cpu {

// The unnormalised Sylvester-Hadamard transform of each block of n channels, in place:
// butterflies at distance 1, 2, 4, ... (the definition's order, the same sums bit for bit).
inline void hadamard_blocks(float* x, int head_size, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int c = 0; c < head_size / 2; ++c) butterfly(x, c, h);
}

// x (head_size values, fp32) rotated in place: signs, Hadamard blocks, 1 / sqrt(n).
inline void rotate(float* x, int head_size) {
  const int n = rotation_block(head_size);
  for (int i = 0; i < head_size; ++i) x[i] *= rotation_sign(i);
  hadamard_blocks(x, head_size, n);
  const float norm = rotation_norm(n);
  for (int i = 0; i < head_size; ++i) x[i] = mul_rn(x[i], norm);
}

// The inverse of rotate, in place: Hadamard blocks, 1 / sqrt(n), signs.
inline void unrotate(float* x, int head_size) {
  const int n = rotation_block(head_size);
  hadamard_blocks(x, head_size, n);
  const float norm = rotation_norm(n);
  for (int i = 0; i < head_size; ++i) x[i] = x[i] * norm * rotation_sign(i);
}

// int8 row: q[i] from x[i] and the row's amax. Returns the scale.
inline float quantize_int8_row(const float* x, int n, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = nan_max(amax, std::fabs(x[i]));
  const float scale = int8_scale(amax);
  for (int i = 0; i < n; ++i) q[i] = int8_value(x[i], scale);
  return scale;
}

// int4 of an already rotated row r: n / 2 packed bytes and its (scale, low) pair.
inline void quantize_int4_row(const float* r, int n, uint8_t* packed, float* scale_low) {
  float low = r[0], high = r[0];
  for (int i = 1; i < n; ++i) {
    low = nan_min(low, r[i]);
    high = nan_max(high, r[i]);
  }
  const float scale = int4_scale(low, high);
  for (int i = 0; i < n; i += 2) packed[i / 2] = int4_pair(r[i], r[i + 1], low, scale);
  scale_low[0] = scale;
  scale_low[1] = low;
}

// A per-token row, widened to fp32 in `row` (rotated here for int4), quantized into `dst`:
// its scale (int8) or (scale, low) pair (int4) into `scale`.
inline void quantize_token_row(float* row, int n, bool int4, uint8_t* dst, float* scale) {
  if (!int4) {
    *scale = quantize_int8_row(row, n, reinterpret_cast<int8_t*>(dst));
    return;
  }
  rotate(row, n);
  quantize_int4_row(row, n, dst, scale);
}

}  // namespace paged::cpu
