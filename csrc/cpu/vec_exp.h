// exp of a vector, for the online softmax. Part of the CPU kernel, inside its ISA
// namespace (see vec.h).
#pragma once

#include "vec.h"

// exp(x) for a vector: 0 for -inf and below the float range, NaN for NaN. Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2 / 2, then e^r by exp_reduced and a scale by 2^n.

// e^r for |r| <= ln2 / 2: a degree-6 polynomial.
static inline vfloat exp_reduced(vfloat r) {
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  return p * r * r + r + splat(1.0f);
}

#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
// AVX-512: n rounded by vrndscaleps, 2^n applied by vscalefps, which gives inf above the
// float range and denormals, then 0, below it. The one clamp keeps -inf from becoming
// NaN in the reduction; e^-104 is below the smallest denormal, so it still gives 0.
static inline vfloat vexp(vfloat x) {
  const vfloat lo = splat(-104.0f);
  x = x < lo ? lo : x;  // NaN stays NaN
  const __m512 t = (__m512)(x * splat(1.44269504088896341f));
  const vfloat n = (vfloat)_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
  vfloat r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  return (vfloat)_mm512_scalef_ps((__m512)exp_reduced(r), (__m512)n);
}
#else
// Elsewhere: clamps, rounding by adding and subtracting 1.5 * 2^23, and 2^n built in the
// exponent bits (0 below the normal range, the largest finite result above it).
static inline vfloat vexp(vfloat x) {
  const vfloat lo = splat(-87.33654f);
  const vfloat hi = splat(88.3762626647949f);
  const vfloat xc = x < lo ? lo : (x > hi ? hi : x);
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: round to nearest
  const vfloat n = (xc * splat(1.44269504088896341f) + magic) - magic;
  vfloat r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  const vint e = (__builtin_convertvector(n, vint) + 127) << 23;
  const vfloat result = exp_reduced(r) * (vfloat)e;
  return x < lo ? vfloat{} : result;
}
#endif
