// Device helpers shared by the CUDA kernels: element types and warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../scalar_kind.h"
#include "fp8.cuh"

namespace paged::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

// A cache element type: the vector its rows are read in (Vec, kPerVec elements),
// its unpacking into floats, and for the query/out types scalar conversions.
// unpack() yields value / unpack_scale() (not 1 only for fp8 in software).
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using Vec = uint4;
  static constexpr int kPerVec = 4;
  __device__ static constexpr float unpack_scale() { return 1.0f; }
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
  __device__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
};

template <>
struct Elem<__half> {
  using Vec = uint4;
  static constexpr int kPerVec = 8;
  __device__ static constexpr float unpack_scale() { return 1.0f; }
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static void unpack(const uint4& v, float* f) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
    }
  }
};

template <>
struct Elem<__nv_bfloat16> {
  using Vec = uint4;
  static constexpr int kPerVec = 8;
  __device__ static constexpr float unpack_scale() { return 1.0f; }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  // bf16 is the top half of an fp32: widening is a shift or a mask.
  __device__ static void unpack(const uint4& v, float* f) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(words[i] << 16);
      f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
};

// fp8 caches: 8-byte vectors of 8 elements (fp8.cuh).
template <typename F>
struct Fp8Elem {
  using Vec = uint2;
  static constexpr int kPerVec = 8;
  __device__ static constexpr float unpack_scale() { return paged::cuda::unpack_scale<F>(); }
  __device__ static void unpack(const uint2& v, float* f) {
    unpack_fp8x4<F>(v.x, f);
    unpack_fp8x4<F>(v.y, f + 4);
  }
};
template <>
struct Elem<Fp8E4M3> : Fp8Elem<Fp8E4M3> {};
template <>
struct Elem<Fp8E5M2> : Fp8Elem<Fp8E5M2> {};

template <typename C>
constexpr bool kIsFp8 = std::is_same<C, Fp8E4M3>::value || std::is_same<C, Fp8E5M2>::value;

// The query / out element type of a kernel: a fixed one (float caches, whose query has
// the cache's dtype), or AnyFloat, chosen at run time by a ScalarKind (fp8 caches take
// fp32, fp16 and bf16 queries; the switch runs once per query and output element, not
// in the loop over keys).
struct AnyFloat {};

template <typename Q>
__device__ __forceinline__ float load_float(const void* base, int64_t i, ScalarKind) {
  return Elem<Q>::to_float(static_cast<const Q*>(base)[i]);
}
template <>
__device__ __forceinline__ float load_float<AnyFloat>(const void* base, int64_t i, ScalarKind kind) {
  switch (kind) {
    case ScalarKind::kFloat16: return load_float<__half>(base, i, kind);
    case ScalarKind::kBFloat16: return load_float<__nv_bfloat16>(base, i, kind);
    default: return load_float<float>(base, i, kind);
  }
}

template <typename Q>
__device__ __forceinline__ void store_float(void* base, int64_t i, float x, ScalarKind) {
  static_cast<Q*>(base)[i] = Elem<Q>::from_float(x);
}
template <>
__device__ __forceinline__ void store_float<AnyFloat>(void* base, int64_t i, float x, ScalarKind kind) {
  switch (kind) {
    case ScalarKind::kFloat16: store_float<__half>(base, i, x, kind); break;
    case ScalarKind::kBFloat16: store_float<__nv_bfloat16>(base, i, x, kind); break;
    default: store_float<float>(base, i, x, kind); break;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

}  // namespace paged::cuda
