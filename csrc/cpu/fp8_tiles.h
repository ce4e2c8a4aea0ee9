// fp32 products over fp8 rows converted by AVX512_VBMI table lookups (kFp8Lookups,
// fp8_bf16_tables.h): the score products of the register tiles and one-query products, and
// the value tiles. Exact conversion in a few byte permutes where widening through fp16 took
// a sign extension, shifts, a NaN test and two fp16 conversions per 32 elements. Part of the
// CPU kernel, inside its ISA namespace (see vec.h).
#pragma once

#include "fp8_bf16_tables.h"
#include "prefetch.h"

#if PAGED_ISA_AVX512_VBMI
// acc[g][i] += q[g] . k[i] for G queries (rows of q, hsp apart, in fp8_value_slot order)
// and K fp8 rows of whole 64-element steps. Each step keeps the K rows as bf16 words (2 K
// registers) and widens one fp32 vector of each at a time, which every query of the tile
// multiplies (its vector loaded once). Forced inline, as the tiles that call it.
template <int G, int K, typename T>
__attribute__((always_inline)) static inline void fp8_tile_products(const float* q, int hsp,
                                                                    const T* const* k,
                                                                    vfloat (&acc)[G][K],
                                                                    const T* const* ahead) {
  for (int d = 0; d < hsp; d += 64) {
    __m512i first[K], second[K];
    for (int i = 0; i < K; ++i) {
      prefetch_same_line(ahead, i, d);
      fp8_to_bf16_lanes<T>(_mm512_loadu_si512(k[i] + d), first[i], second[i]);
    }
    auto vector = [&](auto j) __attribute__((always_inline)) {
      vfloat x[K];
      for (int i = 0; i < K; ++i) x[i] = fp8_words_to_float<j>(first[i], second[i]);
      for (int g = 0; g < G; ++g) {
        const vfloat qv = load(q + int64_t(g) * hsp + d + j * VW);
        for (int i = 0; i < K; ++i) acc[g][i] += qv * x[i];
      }
    };
    vector(std::integral_constant<int, 0>{});
    vector(std::integral_constant<int, 1>{});
    vector(std::integral_constant<int, 2>{});
    vector(std::integral_constant<int, 3>{});
  }
}

// acc[g] += sum_t p[g][t] v[t] for G queries over fp8 rows of whole 64-element steps,
// accumulators in fp8_value_slot order (accumulate_tile / accumulate_values).
template <int G, typename T>
static inline void accumulate_fp8(float* acc, int hsp, const float* p, const T* const* v, int n,
                                  const T* const* ahead) {
  for (int d = 0; d < hsp; d += 64) {
    vfloat a[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = load(acc + int64_t(g) * hsp + d + i * VW);
    for (int t = 0; t < n; ++t) {
      prefetch_same_line(ahead, t, d);
      if (G == 1 && p[t] == 0.0f) continue;
      vfloat x[4];
      fp8_to_float64(v[t] + d, x);
      for (int g = 0; g < G; ++g) {
        const vfloat pg = splat(p[g * kKeyChunk + t]);
        for (int i = 0; i < 4; ++i) a[g][i] += pg * x[i];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) store(acc + int64_t(g) * hsp + d + i * VW, a[g][i]);
  }
}

static inline void unpermute_fp8_values(const float* acc, float* out, int hsp, float factor) {
  for (int d = 0; d < hsp; d += 64)
    for (int i = 0; i < 64; ++i) out[d + i] = acc[d + fp8_value_slot(i)] * factor;
}
#else
// Declared for the other compiles' discarded `if constexpr (kFp8Lookups<R>)` branches.
template <int G, int K, typename T>
void fp8_tile_products(const float* q, int hsp, const T* const* k, vfloat (&acc)[G][K],
                       const T* const* ahead);
#endif  // PAGED_ISA_AVX512_VBMI
