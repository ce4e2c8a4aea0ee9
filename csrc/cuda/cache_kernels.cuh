// CUDA kernels of the cache ops: write_kv scatters new key/value rows into their
// slots (copied, or quantized into an fp8 or a per-token int8 / int4 cache); copy_blocks copies blocks of every
// layer in one launch. Copies move data in the widest unit (16, 8, 4 or 2 bytes) that
// every address and stride allows (cache_kernels.cu picks it), and skip (never follow)
// an index outside the cache. Caches are addressed by stride (CacheLayout, CopyCache):
// HND, NHD and views into joint K/V tensors alike. Included by cache_kernels.cu and by
// tests/cuda_emulator.cpp, which runs them on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_utils.cuh"
#include "kernels.h"
#include "token_formats.cuh"

namespace paged::cuda {
namespace {

constexpr int kCacheThreads = 128;
constexpr int kUnitsInFlight = 4;  // loads a thread issues before its first store

// The slot's (block, offset in block), or false for padding and out-of-range slots.
__device__ __forceinline__ bool locate_slot(const WriteKvParams& p, int64_t token, int64_t* block,
                                            int64_t* offset) {
  const int64_t slot = p.slot_mapping[token * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return false;  // padding; or out of range, never written
  *block = slot / p.block_size;
  *offset = slot % p.block_size;
  return true;
}

// Copies the rows of all KV heads of one token: src rows at src + h * src_head_stride,
// destination rows at dst + h * layout.head_stride (bytes), row_units units each.
template <typename Unit>
__device__ __forceinline__ void copy_rows(const char* src, int64_t src_head_stride, char* dst,
                                          int64_t dst_head_stride, int heads, int row_units) {
  for (int i = threadIdx.x; i < heads * row_units; i += kCacheThreads) {
    const int head = i / row_units, u = i - head * row_units;
    reinterpret_cast<Unit*>(dst + head * dst_head_stride)[u] =
        reinterpret_cast<const Unit*>(src + head * src_head_stride)[u];
  }
}

// One CTA per token: all its KV heads, keys and values (whose rows may differ in
// length: head_size != head_size_v).
template <typename Unit>
__global__ void __launch_bounds__(kCacheThreads) write_kv_kernel(const WriteKvParams p) {
  const int64_t token = blockIdx.x;
  int64_t block, offset;
  if (!locate_slot(p, token, &block, &offset)) return;
  const CacheLayout kl = p.key_layout, vl = p.value_layout;
  copy_rows<Unit>(static_cast<const char*>(p.key) + token * p.key_token_stride, p.key_head_stride,
                  static_cast<char*>(p.key_cache) + block * kl.block_stride + offset * kl.token_stride,
                  kl.head_stride, p.num_kv_heads, int(p.key_row_bytes / int64_t(sizeof(Unit))));
  copy_rows<Unit>(static_cast<const char*>(p.value) + token * p.value_token_stride, p.value_head_stride,
                  static_cast<char*>(p.value_cache) + block * vl.block_stride + offset * vl.token_stride,
                  vl.head_stride, p.num_kv_heads, int(p.value_row_bytes / int64_t(sizeof(Unit))));
}

// Quantizes the rows of all KV heads of one token into an fp8 cache: each thread takes
// 8 elements, x / scale[head] rounded as fp8.cuh says, and stores them as one 8-byte
// word when kWide (rows 8-byte aligned, a multiple of 8 long), else byte by byte.
template <typename F, bool kWide>
__device__ __forceinline__ void quantize_rows(const char* src, int64_t src_head_stride, ScalarKind kind,
                                              char* dst, int64_t dst_head_stride, int heads, int row_elems,
                                              const float* scale, int64_t scale_stride) {
  const int groups = (row_elems + 7) / 8;
  const int elem = kind == ScalarKind::kFloat32 ? 4 : 2;
  for (int i = threadIdx.x; i < heads * groups; i += kCacheThreads) {
    const int head = i / groups, g = i - head * groups;
    const float s = scale[head * scale_stride];
    const char* row = src + head * src_head_stride;
    char* out = dst + head * dst_head_stride;
    uint64_t word = 0;  // the 8 bytes, element e in byte e (a scalar: no local-memory array)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = 8 * g + e;
      if (!kWide && idx >= row_elems) break;
      const float x = load_float<AnyFloat>(row, idx, kind);
      // The sign bit is the top bit of the element's last byte (little-endian).
      const uint32_t sign = static_cast<uint8_t>(row[(idx + 1) * elem - 1]) & 0x80u;
      const uint8_t q = quantize_scaled<F>(x, sign, s);
      if (kWide) {
        word |= uint64_t(q) << (8 * e);
      } else {
        out[idx] = static_cast<char>(q);
      }
    }
    if (kWide) reinterpret_cast<uint2*>(out)[g] = make_uint2(uint32_t(word), uint32_t(word >> 32));
  }
}

template <typename F, bool kWide>
__global__ void __launch_bounds__(kCacheThreads) write_kv_fp8_kernel(const WriteKvParams p) {
  const int64_t token = blockIdx.x;
  int64_t block, offset;
  if (!locate_slot(p, token, &block, &offset)) return;
  const CacheLayout kl = p.key_layout, vl = p.value_layout;
  quantize_rows<F, kWide>(static_cast<const char*>(p.key) + token * p.key_token_stride, p.key_head_stride, p.kind,
                   static_cast<char*>(p.key_cache) + block * kl.block_stride + offset * kl.token_stride,
                   kl.head_stride, p.num_kv_heads, int(p.key_row_bytes), p.k_scale, p.k_scale_stride);
  quantize_rows<F, kWide>(static_cast<const char*>(p.value) + token * p.value_token_stride, p.value_head_stride,
                   p.kind, static_cast<char*>(p.value_cache) + block * vl.block_stride + offset * vl.token_stride,
                   vl.head_stride, p.num_kv_heads, int(p.value_row_bytes), p.v_scale, p.v_scale_stride);
}

// Quantizes the rows of all KV heads of one token into a per-token cache (int8, or packed
// int4 when kInt4; token_formats.cuh): one warp per row, keys then values, each row's
// scale written beside it. Rows are short (at most kMaxTokenRow values) and written once,
// so bytes are stored one by one (consecutive lanes, consecutive bytes). value_row_bytes 0:
// keys only (write_latent's whole rows, whose values are a view of them).
template <bool kInt4>
__global__ void __launch_bounds__(kCacheThreads) write_kv_token_kernel(const WriteKvParams p) {
  constexpr int kCacheWarps = kCacheThreads / 32;
  __shared__ float row_s[kCacheWarps][kMaxTokenRow];
  const int64_t token = blockIdx.x;
  int64_t block, offset;
  if (!locate_slot(p, token, &block, &offset)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int values_per_byte = kInt4 ? 2 : 1;
  const int rows = (p.value_row_bytes > 0 ? 2 : 1) * p.num_kv_heads;
  for (int r = warp; r < rows; r += kCacheWarps) {
    const bool is_value = r >= p.num_kv_heads;
    const int64_t head = is_value ? r - p.num_kv_heads : r;
    const CacheLayout& cl = is_value ? p.value_layout : p.key_layout;
    const CacheLayout& sl = is_value ? p.v_scale_layout : p.k_scale_layout;
    const char* src = static_cast<const char*>(is_value ? p.value : p.key) +
                      token * (is_value ? p.value_token_stride : p.key_token_stride) +
                      head * (is_value ? p.value_head_stride : p.key_head_stride);
    char* dst = static_cast<char*>(is_value ? p.value_cache : p.key_cache) + block * cl.block_stride +
                head * cl.head_stride + offset * cl.token_stride;
    float* scale = (is_value ? p.v_token_scale : p.k_token_scale) + block * sl.block_stride +
                   head * sl.head_stride + offset * sl.token_stride;
    const int n = int((is_value ? p.value_row_bytes : p.key_row_bytes) * values_per_byte);
    quantize_token_row<kInt4>(src, p.kind, n, dst, scale, row_s[warp], lane);
  }
}

// grid (pair, 2 * layer + {0: keys, 1: values}): one block copy per CTA, as the rows
// of CopyCache (one row when the block is one dense chunk).
template <typename Unit>
__global__ void __launch_bounds__(kCacheThreads) copy_blocks_kernel(const __grid_constant__ CopyBlocksParams p) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y / 2;
  const int64_t src = p.block_mapping[2 * pair], dst = p.block_mapping[2 * pair + 1];
  if (src < 0 || src >= p.num_blocks || dst < 0 || dst >= p.num_blocks) return;
  const CopyCache& c = blockIdx.y % 2 == 0 ? p.keys[layer] : p.values[layer];
  const int64_t row_units = c.row_bytes / int64_t(sizeof(Unit));
  const int64_t rows = int64_t(c.heads) * c.tokens;
  const int64_t units = rows * row_units;
  const char* from = static_cast<const char*>(c.base) + src * c.block_stride;
  char* to = static_cast<char*>(c.base) + dst * c.block_stride;
  // Byte offset of unit i of the block (rows in (head, token) order).
  auto offset = [&](int64_t i) -> int64_t {
    if (rows == 1) return i * int64_t(sizeof(Unit));
    const int64_t row = i / row_units, u = i - row * row_units;
    const int64_t h = row / c.tokens, t = row - h * c.tokens;
    return h * c.head_stride + t * c.token_stride + u * int64_t(sizeof(Unit));
  };
  for (int64_t i = threadIdx.x; i < units; i += kCacheThreads * kUnitsInFlight) {
    Unit v[kUnitsInFlight];
#pragma unroll
    for (int k = 0; k < kUnitsInFlight; ++k) {
      const int64_t j = i + k * kCacheThreads;
      if (j < units) v[k] = *reinterpret_cast<const Unit*>(from + offset(j));
    }
#pragma unroll
    for (int k = 0; k < kUnitsInFlight; ++k) {
      const int64_t j = i + k * kCacheThreads;
      if (j < units) *reinterpret_cast<Unit*>(to + offset(j)) = v[k];
    }
  }
}

}  // namespace
}  // namespace paged::cuda
