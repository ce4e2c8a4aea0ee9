// fp32 results rounded to 16-bit output rows: one rounding for the merge of partitions
// (attention_cpu.cpp) and the kernels that write a 16-bit output directly. Included outside
// the ISA namespaces (isa_kernel.h, before them), so every translation unit compiles it alike.
#pragma once

#include <cstdint>
#include <cstring>

namespace paged::cpu {

inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// dst[d] = bf16(v[d] * factor), rounded to nearest even from the bit pattern (NaN to the
// quiet 0x7fc0, as c10::BFloat16's constructor does), in a loop the compiler vectorises:
// the per-element constructor made the merge a visible share of a causal multi-token call.
inline void store_bf16_row(const float* v, float factor, uint16_t* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) {
    const float x = v[d] * factor;
    const uint32_t bits = float_bits(x);
    const uint16_t rounded = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    dst[d] = x != x ? uint16_t(0x7fc0) : rounded;
  }
}

// fp16 bits of x rounded to nearest even, as c10::Half's constructor gives them (its
// portable path: the float arithmetic below does the rounding, subnormal halves included;
// NaN to 0x7e00 with the sign, overflow to inf). Needs the default rounding mode and no
// flush-to-zero, as c10's does.
inline uint16_t fp16_bits(float x) {
  const uint32_t w = float_bits(x);
  const uint32_t doubled = w + w;  // without the sign
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = doubled & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  // |x| scaled up past fp16's range and back: overflow becomes inf; then adding 2^(e + 13)
  // (e: x's exponent, at least fp16's smallest normal one) rounds away the bits fp16 drops.
  float base = (__builtin_fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
  return uint16_t((sign >> 16) | (doubled > 0xff000000u ? 0x7e00u : nonsign));
}

// dst[d] = fp16(v[d] * factor) (fp16_bits).
inline void store_fp16_row(const float* v, float factor, uint16_t* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = fp16_bits(v[d] * factor);
}

}  // namespace paged::cpu
