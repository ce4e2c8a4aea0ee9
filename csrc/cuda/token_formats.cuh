// The per-token KV formats on the device (int8_per_token_head, int4_per_token_head; their
// definition is paged_attention_ext/token_quantization.py): the cache element types the
// attention kernel reads, and the formats' maths (../token_formats.h, shared with the CPU)
// spread over threads: the random Hadamard rotation of int4 rows (and of the queries and
// outputs that meet them) by a warp or the CTA, and the quantization write_kv applies to
// each (token, KV head) row by a warp. Included by attention_kernels.cuh and
// cache_kernels.cuh.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../token_formats.h"
#include "cuda_utils.cuh"
#include "kernels.h"

namespace paged::cuda {

// One byte each, so that a row's strides count bytes as they count elements.
struct Int8 {  // an int8_per_token_head element
  int8_t bits;
};
struct Int4x2 {  // an int4_per_token_head byte: two values, the even channel in the low nibble
  uint8_t bits;
};

// int8 rows: 8-byte vectors of 8 values (like fp8), exact integers in fp32.
template <>
struct Elem<Int8> {
  using Vec = uint2;
  static constexpr int kPerVec = 8;
  __device__ static constexpr float unpack_scale() { return 1.0f; }
  __device__ static void unpack(const uint2& v, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = float(static_cast<int8_t>(v.x >> (8 * i)));
      f[4 + i] = float(static_cast<int8_t>(v.y >> (8 * i)));
    }
  }
};

// int4 rows: 4-byte vectors of 8 values; value i of the word is its nibble i (low first).
template <>
struct Elem<Int4x2> {
  using Vec = uint32_t;
  static constexpr int kPerVec = 8;
  __device__ static constexpr float unpack_scale() { return 1.0f; }
  __device__ static void unpack(const uint32_t& v, float* f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = float((v >> (4 * i)) & 15u);
  }
};

// Cache types with one scale per (token, KV head) row, and those stored rotated (int4).
template <typename C>
constexpr bool kIsPerToken = std::is_same<C, Int8>::value || std::is_same<C, Int4x2>::value;
template <typename C>
constexpr bool kIsRotated = std::is_same<C, Int4x2>::value;

// ---- the rotation, spread over a warp or the CTA -------------------------------------------

// The unnormalised Hadamard transform of each block of n channels of `rows` rows of
// `width` floats (row r at base + r * stride) in shared memory, in place: butterflies at
// distance 1, 2, 4, ... (the definition's order, so the same fp32 sums). `tid` of
// `threads` threads share the work; sync() (a warp's or the CTA's barrier) follows
// each stage. The caller syncs before the first.
template <typename Sync>
__device__ void hadamard_in_place(float* base, int stride, int rows, int width, int n, int tid, int threads,
                                  Sync sync) {
  const int pairs = width / 2;
  for (int h = 1; h < n; h *= 2) {
    for (int k = tid; k < rows * pairs; k += threads) {
      const int r = k / pairs;
      butterfly(base + int64_t(r) * stride, k - r * pairs, h);
    }
    sync();
  }
}

// ---- quantizing one row (write_kv) ---------------------------------------------------------

// The row's max / min over the warp, NaN if any lane holds one (../token_formats.h).
__device__ __forceinline__ float warp_nan_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = nan_max(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}
__device__ __forceinline__ float warp_nan_min(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = nan_min(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// One warp quantizes the row of n values at src (of `kind`) into dst (int8: n bytes;
// int4: n / 2) and writes its scale (int4: scale, low) at scale. buf: the warp's n floats
// of shared memory. Divisions are IEEE (no reciprocal; no fast math), rintf rounds half to
// even, and the rotation's multiply by 1/sqrt(n) is kept apart from the subtraction that
// follows (mul_rn: no fused multiply-add), so the bytes are the definition's.
template <bool kInt4>
__device__ void quantize_token_row(const char* src, ScalarKind kind, int n, char* dst, float* scale, float* buf,
                                   int lane) {
  if constexpr (!kInt4) {
    float amax = 0.0f;
    for (int i = lane; i < n; i += 32) {
      const float x = load_float<AnyFloat>(src, i, kind);
      buf[i] = x;
      amax = nan_max(amax, fabsf(x));
    }
    const float s = int8_scale(warp_nan_max(amax));
    for (int i = lane; i < n; i += 32) dst[i] = static_cast<char>(int8_value(buf[i], s));
    if (lane == 0) scale[0] = s;
  } else {
    for (int i = lane; i < n; i += 32) buf[i] = load_float<AnyFloat>(src, i, kind) * rotation_sign(i);
    __syncwarp();
    const int block = rotation_block(n);
    hadamard_in_place(buf, 0, 1, n, block, lane, 32, [] { __syncwarp(); });
    const float norm = rotation_norm(block);
    float lo = INFINITY, hi = -INFINITY;
    for (int i = lane; i < n; i += 32) {
      const float r = mul_rn(buf[i], norm);
      buf[i] = r;
      lo = nan_min(lo, r);
      hi = nan_max(hi, r);
    }
    lo = warp_nan_min(lo);
    const float s = int4_scale(lo, warp_nan_max(hi));
    __syncwarp();
    for (int j = lane; j < n / 2; j += 32) dst[j] = static_cast<char>(int4_pair(buf[2 * j], buf[2 * j + 1], lo, s));
    if (lane == 0) {
      scale[0] = s;
      scale[1] = lo;
    }
  }
  __syncwarp();  // the warp's next row reuses buf
}

}  // namespace paged::cuda
