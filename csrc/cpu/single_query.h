// Scores and weighted value sums of one query against rows of R (float, or a cache type
// read in place and widened to fp32 in registers; convert.h): every row holds hsp
// elements. Part of the CPU kernel, inside its ISA namespace (see vec.h).
#pragma once

#include "convert.h"
#include "prefetch.h"

// Dot products of one query with 4 keys.
template <typename R>
static inline void dot4(const float* q, const R* const* k, int hsp, float* out,
                        const R* const* ahead) {
  // Two accumulators per key (even and odd steps): eight independent FMA chains. The
  // loop takes two steps at a time so that both sets stay in registers (indexing them
  // by step parity put them on the stack: a store-forwarding chain per FMA).
  vfloat even[4] = {}, odd[4] = {};
  int d = 0;
  for (; d + 2 * VW <= hsp; d += 2 * VW) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d + VW);
    const vfloat q0 = load(q + d), q1 = load(q + d + VW);
    for (int i = 0; i < 4; ++i) {
      vfloat k0, k1;
      load2_as_float(k[i] + d, k0, k1);
      even[i] += q0 * k0;
      odd[i] += q1 * k1;
    }
  }
  if constexpr (!kSplitRows<R>) {
    if (d < hsp) {
      for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
      const vfloat q0 = load(q + d);
      for (int i = 0; i < 4; ++i) even[i] += q0 * load_as_float(k[i] + d);
    }
  }
  hsum4(even[0] + odd[0], even[1] + odd[1], even[2] + odd[2], even[3] + odd[3], out);
}

template <typename R>
static inline float dot1(const float* q, const R* k, int hsp, const R* const* ahead) {
  vfloat a{};
  if constexpr (kSplitRows<R>) {
    for (int d = 0; d < hsp; d += 2 * VW) {
      prefetch_same_line(ahead, 0, d);
      vfloat k0, k1;
      load2_as_float(k + d, k0, k1);
      a += load(q + d) * k0 + load(q + d + VW) * k1;
    }
  } else {
    for (int d = 0; d < hsp; d += VW) {
      prefetch_same_line(ahead, 0, d);
      a += load(q + d) * load_as_float(k + d);
    }
  }
  return hsum(a);
}

// acc[d:d + W*VW] += sum_t p[t] * v[t][d:d + W*VW]: W independent accumulator vectors.
template <int W, typename R>
static inline void accumulate_block(float* acc, const float* p, const R* const* v, int n, int d,
                                   const R* const* ahead) {
  vfloat a[W];
  for (int i = 0; i < W; ++i) a[i] = load(acc + d + i * VW);
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < W; ++i) prefetch_same_line(ahead, t, d + i * VW);
    if (p[t] == 0.0f) continue;
    const vfloat pt = splat(p[t]);
    int i = 0;
    for (; i + 2 <= W; i += 2) {
      vfloat v0, v1;
      load2_as_float(v[t] + d + i * VW, v0, v1);
      a[i] += pt * v0;
      a[i + 1] += pt * v1;
    }
    if constexpr (W % 2 == 1) a[W - 1] += pt * load_as_float(v[t] + d + (W - 1) * VW);
  }
  for (int i = 0; i < W; ++i) store(acc + d + i * VW, a[i]);
}

// acc[0:hsp] += sum_t p[t] * v[t][0:hsp], eight accumulator vectors at a time.
template <typename R>
static inline void accumulate_values(float* acc, const float* p, const R* const* v, int n, int hsp,
                                     const R* const* ahead) {
  int d = 0;
  for (; d + 8 * VW <= hsp; d += 8 * VW) accumulate_block<8>(acc, p, v, n, d, ahead);
  for (; d + 4 * VW <= hsp; d += 4 * VW) accumulate_block<4>(acc, p, v, n, d, ahead);
  if constexpr (!kSplitRows<R>) for (; d < hsp; d += VW) accumulate_block<1>(acc, p, v, n, d, ahead);
}
