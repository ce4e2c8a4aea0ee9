// A probe of this core: multiply-adds per unit time of vdpbf16ps (two a lane) against
// vfmadd231ps (one), each as 12 independent chains in registers, the best of a few short
// runs (~0.1 ms in all). cpu_features.cpp asks it once, to choose between the avx512_bf16
// kernel's pair dot products and avx512_vbmi's fp32 multiply-adds. Included by
// isa_kernel.h inside the avx512_bf16 namespace.
#pragma once

constexpr int kProbeIterations = 512;

#define PAGED_TIME_CHAINS(op)                                               \
  __m512 a[12];                                                             \
  for (int c = 0; c < 12; ++c) a[c] = _mm512_set1_ps(float(c));             \
  const uint64_t start = __rdtsc();                                         \
  for (int i = 0; i < kProbeIterations; ++i) {                              \
    a[0] = op(a[0]), a[1] = op(a[1]), a[2] = op(a[2]), a[3] = op(a[3]);     \
    a[4] = op(a[4]), a[5] = op(a[5]), a[6] = op(a[6]), a[7] = op(a[7]);     \
    a[8] = op(a[8]), a[9] = op(a[9]), a[10] = op(a[10]), a[11] = op(a[11]); \
  }                                                                         \
  const uint64_t ticks = __rdtsc() - start;                                 \
  volatile float sink = 0.0f;                                               \
  for (int c = 0; c < 12; ++c) sink = sink + _mm512_cvtss_f32(a[c]);        \
  return double(ticks) / (kProbeIterations * 12)

__attribute__((noinline)) static double fma_ticks() {
  const __m512 x = _mm512_set1_ps(0.999f);
#define PAGED_FMA(v) _mm512_fmadd_ps(v, x, x)
  PAGED_TIME_CHAINS(PAGED_FMA);
#undef PAGED_FMA
}

__attribute__((noinline)) static double bf16_dot_ticks() {
  const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
#define PAGED_DOT(v) _mm512_dpbf16_ps(v, one, one)
  PAGED_TIME_CHAINS(PAGED_DOT);
#undef PAGED_DOT
}
#undef PAGED_TIME_CHAINS

inline double bf16_dot_gain() {
  double fma = 1e30, dot = 1e30;
  for (int round = 0; round < 5; ++round) {
    fma = std::min(fma, fma_ticks());
    dot = std::min(dot, bf16_dot_ticks());
  }
  return 2.0 * fma / dot;
}
