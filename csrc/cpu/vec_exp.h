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

// Coefficients of 2^f on [0, 1), highest degree first.
struct Exp2Poly {
  float c4, c3, c2, c1, c0;
};
// Minimax in relative error (< 2.7e-6).
constexpr Exp2Poly kExp2Minimax{1.3534167781e-2f, 5.2011463791e-2f, 2.4144275486e-1f,
                                6.9300383329e-1f, 1.0000026226e+0f};
// The same fitted with the constant term 1, so 2^0 is exactly 1 (< 3.0e-6 in fp32).
constexpr Exp2Poly kExp2ExactAtZero{1.3426606543e-2f, 5.2242599428e-2f, 2.4128015339e-1f,
                                    6.9304484129e-1f, 1.0f};

// 2^y in six operations: the fraction f = y - floor(y) by vreduceps, 2^f by the degree-4
// polynomial c, times 2^floor(y) by vscalefps. -inf gives f = 0 and 2^-inf = 0, a y below
// -149 rounds to 0, NaN stays NaN: no clamp.
static inline __m512 exp2_poly(__m512 y, const Exp2Poly& c) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF);  // no fraction bits kept
  __m512 p = _mm512_set1_ps(c.c4);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c.c3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c.c2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c.c1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c.c0));
  return _mm512_scalef_ps(p, y);
}

// 2^(x * factor - shift) in seven operations (vexp takes fifteen), for the amx kernel's
// lane softmax: below the bf16 rounding its probabilities get (the lse moves by as much).
static inline __m512 exp2_shifted(__m512 x, __m512 factor, __m512 shift) {
  return exp2_poly(_mm512_fmsub_ps(x, factor, shift), kExp2Minimax);
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

// tanh of a vector, for the soft cap (cap tanh(score / cap)): 1 - 2 / (e^(2|x|) + 1) with
// x's sign, and below |x| = 1/8, where that difference loses digits, the odd series to x^7
// (relative error at most about 1e-6, at the switch; absolute under 2e-7). NaN stays NaN;
// |x| from 9 on gives +-1.
static inline vfloat vtanh(vfloat x) {
  const vfloat a = x < vfloat{} ? -x : x;
  const vfloat clamped = a > splat(9.0f) ? splat(9.0f) : a;
  const vfloat far = splat(1.0f) - splat(2.0f) / (vexp(clamped + clamped) + splat(1.0f));
  const vfloat x2 = x * x;
  const vfloat near =
      x + x * x2 * (splat(-1.0f / 3.0f) + x2 * (splat(2.0f / 15.0f) + x2 * splat(-17.0f / 315.0f)));
  return a < splat(0.125f) ? near : (x < vfloat{} ? -far : far);
}

// The soft cap, cap tanh(s / cap), of n scores in place (n a multiple of VW). Out of line:
// inlined into the row softmax, it changed the code of the uncapped path around it. Unused
// in the amx compile, whose lanes cap a row at a time.
[[maybe_unused]] __attribute__((noinline)) static void soft_cap_scores(float* s, int64_t n, float cap) {
  const vfloat inv = splat(1.0f / cap), scale = splat(cap);
  for (int64_t i = 0; i < n; i += VW) store(s + i, scale * vtanh(load(s + i) * inv));
}

// The same over `rows` rows of n scores, `stride` floats apart: a chunk's rows in one call
// (its own loop: a soft_cap_scores call per row measured slower capped decode).
[[maybe_unused]] __attribute__((noinline)) static void soft_cap_rows(float* s, int rows, int n, int64_t stride,
                                                                    float cap) {
  const vfloat inv = splat(1.0f / cap), scale = splat(cap);
  for (int r = 0; r < rows; ++r, s += stride)
    for (int i = 0; i < n; i += VW) store(s + i, scale * vtanh(load(s + i) * inv));
}

// e^(x - shift) for the online softmaxes (a shift per lane, or one for all). kShort: the
// caller's outputs are 16-bit or fp8-fed (probabilities rounded to bf16 on some paths), so
// on AVX-512 exp2_poly's eight operations do (fp32 caches keep vexp's fp32 accuracy). The difference is taken first and 2^0 is
// exactly 1, so a score equal to the max weighs exactly 1 (one visible key: its value as is).
template <bool kShort>
static inline vfloat exp_minus(vfloat x, vfloat shift) {
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
  if constexpr (kShort)
    return (vfloat)exp2_poly((__m512)((x - shift) * splat(1.44269504088896341f)), kExp2ExactAtZero);
#endif
  return vexp(x - shift);
}
template <bool kShort>
static inline vfloat exp_minus(vfloat x, float shift) {
  return exp_minus<kShort>(x, splat(shift));
}

// Whether a kernel's outputs allow the short exp: 16-bit caches, fp8 caches under a 16-bit
// query (an fp32 query's output keeps fp32 accuracy).
template <typename T>
constexpr bool short_exp_output(ScalarKind query_kind) {
  return sizeof(T) == 2 || (sizeof(T) == 1 && query_kind != ScalarKind::kFloat32);
}
