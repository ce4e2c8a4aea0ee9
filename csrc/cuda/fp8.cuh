// fp8 KV-cache elements: float8_e4m3fn and float8_e5m2, as torch defines them.
//
// Quantization (write_kv) is one software routine on every architecture, bit-identical
// to the reference's `(x.float() / s).clamp(-max, max).to(fp8)`: round to nearest even,
// finite values and +-inf saturate to +-max, NaN stays NaN with its sign (torch writes
// 0x7f / 0xff). cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...) also saturates
// +-inf, but returns the canonical NaN 0x7f for any NaN (sign dropped), so -NaN would
// differ from torch; write_kv is memory-bound, so the software routine costs nothing
// that matters, and tests/test_cuda_emulated.py checks it against torch exhaustively.
//
// Dequantization (attention) unpacks 8 bytes into 8 floats in registers. On sm_89 and
// newer: cvt.rn.f16x2.{e4m3,e5m2}x2 (cuda_fp8.h) and half -> float. Below sm_89 (and in
// the CPU emulator) in software: an e5m2 byte is the high byte of the fp16 of the same
// value; an e4m3 byte's 7 low bits, shifted into an fp16's exponent and mantissa, give
// the value / 256 exactly (subnormals included), so that path leaves the factor 256 to
// unpack_scale(), which the kernel folds into the per-head scales; e4m3's NaN bytes
// (0x7f, 0xff) are patched to NaN. The CPU emulator runs the software path, and with
// PAGED_FP8_EMULATE_HARDWARE the sm_89+ code with cuda_fp8.h's host implementation of
// the conversion (our use of it: byte order, widening, scale; not the instruction).
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__) || defined(PAGED_FP8_EMULATE_HARDWARE)
#include <cuda_fp8.h>
#endif

#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890) || defined(PAGED_FP8_EMULATE_HARDWARE)
#define PAGED_FP8_HARDWARE 1
#else
#define PAGED_FP8_HARDWARE 0
#endif

#if defined(__CUDACC__)
#define PAGED_FP8_FN __host__ __device__ __forceinline__
#else
#define PAGED_FP8_FN inline
#endif

namespace paged::cuda {

// Element tags of the two formats (the cache is read as raw bytes).
struct Fp8E4M3 {
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr float kMinNormal = 0.015625f;  // 2^-6
  static constexpr float kInvQuantum = 512.0f;    // 1 / 2^-9, the subnormal step
};
struct Fp8E5M2 {
  static constexpr int kMantissaBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr float kMinNormal = 6.103515625e-05f;  // 2^-14
  static constexpr float kInvQuantum = 65536.0f;         // 1 / 2^-16
};

PAGED_FP8_FN uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

// x / scale as IEEE division, rounded to nearest even, whatever the compiler flags.
PAGED_FP8_FN float divide_rn(float x, float scale) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(x, scale);
#else
  return x / scale;
#endif
}

// One fp32 value to fp8 F: saturate, round to nearest even, NaN keeps its sign.
template <typename F>
PAGED_FP8_FN uint8_t quantize_fp8(float x) {
  const uint32_t sign = (float_bits(x) >> 24) & 0x80u;
  if (x != x) return uint8_t(sign | 0x7fu);
  const float a = fminf(fabsf(x), F::kMax);  // +-inf and finite overflow saturate
  if (a < F::kMinNormal) {
    // Subnormal (or zero) in F: a multiple of the step 2^(1 - bias - M). Scaling by a
    // power of two is exact, rintf rounds to nearest even; 2^M is the smallest normal.
    return uint8_t(sign | uint32_t(rintf(a * F::kInvQuantum)));
  }
  // Normal: round the fp32 mantissa to M bits (nearest even; a carry moves into the
  // exponent), then rebias the exponent. a <= max, so the result is <= max.
  constexpr int kShift = 23 - F::kMantissaBits;
  const uint32_t u = float_bits(a);
  const uint32_t rounded = u + ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u);
  return uint8_t(sign | ((rounded >> kShift) - (uint32_t(127 - F::kBias) << F::kMantissaBits)));
}

// x / scale in fp8 F, as the reference computes it on the CPU, where a NaN keeps its
// sign through the conversion to fp32 and the division (x86 returns the first NaN
// operand). A GPU's arithmetic and fp16 -> fp32 conversion return a NaN without its
// sign, so the caller passes x's sign bit as stored in x's own dtype (0x80 or 0).
template <typename F>
PAGED_FP8_FN uint8_t quantize_scaled(float x, uint32_t x_sign, float scale) {
  const float y = divide_rn(x, scale);
  if (y != y) return uint8_t((x != x ? x_sign : (float_bits(scale) >> 24) & 0x80u) | 0x7fu);
  return quantize_fp8<F>(y);
}

// Four fp8 bytes of `w` (byte i = element i) to floats, in units of unpack_scale<F>().
template <typename F>
PAGED_FP8_FN void unpack_fp8x4(uint32_t w, float* f);

template <typename F>
PAGED_FP8_FN constexpr float unpack_scale() {
  return (PAGED_FP8_HARDWARE || !std::is_same<F, Fp8E4M3>::value) ? 1.0f : 256.0f;
}

// fp16 pairs of bytes (0, 1) and (2, 3): each byte in the high half of its fp16.
PAGED_FP8_FN uint32_t high_bytes_01(uint32_t w) { return ((w & 0xffu) << 8) | ((w & 0xff00u) << 16); }
PAGED_FP8_FN uint32_t high_bytes_23(uint32_t w) { return ((w >> 8) & 0xff00u) | (w & 0xff000000u); }

PAGED_FP8_FN void half2_bits_to_float(uint32_t h, float* f) {
  f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xffffu)));
  f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16)));
}

template <>
PAGED_FP8_FN void unpack_fp8x4<Fp8E5M2>(uint32_t w, float* f) {
#if PAGED_FP8_HARDWARE
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E5M2);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E5M2);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
#else
  half2_bits_to_float(high_bytes_01(w), f);  // exact: e5m2 is fp16 without its low byte
  half2_bits_to_float(high_bytes_23(w), f + 2);
#endif
}

template <>
PAGED_FP8_FN void unpack_fp8x4<Fp8E4M3>(uint32_t w, float* f) {
#if PAGED_FP8_HARDWARE
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
#else
  // Byte s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value / 2^8 (fp16's bias is 8 more;
  // an e4m3 subnormal lands on an fp16 subnormal of the same ratio).
  const uint32_t x01 = high_bytes_01(w), x23 = high_bytes_23(w);
  half2_bits_to_float(((x01 >> 1) & 0x3f803f80u) | (x01 & 0x80008000u), f);
  half2_bits_to_float(((x23 >> 1) & 0x3f803f80u) | (x23 & 0x80008000u), f + 2);
  // e4m3fn has no infinity; s.1111.111 is NaN (the shift made it 1.875 * 2^-8).
  const uint32_t nan_bytes = ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
  if (nan_bytes != 0u) {
    for (int i = 0; i < 4; ++i) {
      if (nan_bytes & (0x80u << (8 * i))) f[i] = NAN;
    }
  }
#endif
}

}  // namespace paged::cuda
