// fp32 products over fp8 rows of whole 64-element steps converted by AVX512_VBMI table
// lookups (fp8_bf16_tables.h): score tiles, one-query products and value tiles. Exact
// conversion in 9 instructions per 64 elements, where widening through fp16 (convert.h)
// takes about 18 for e4m3 (sign extension, shift, NaN test, fp16 conversions) and 14
// micro-ops for e5m2. The kernel takes them per item where the head sizes allow: against
// the fp16 widening e4m3 measured faster from L2 and from DRAM, e5m2 from L2 (even from
// DRAM on Zen 4). e5m2 takes them also for 4 shuffle micro-ops per 64 elements against 8
// by uops.info's Ice Lake tables, where one port runs every shuffle. Part of the CPU
// kernel, inside its ISA namespace (see vec.h).
#pragma once

#include "fp8_bf16_tables.h"
#include "prefetch.h"
#include "register_tiles.h"

#if PAGED_ISA_AVX512_VBMI
// fp32 queries in fp8_value_slot order (the lookups' order of a 64-element step): the
// query type that selects the tiles below for fp8 keys.
struct LookupQuery {
  float value;
};

// acc[g][i] += q[g] . k[i] for G queries (rows of q, hsp apart, in fp8_value_slot order)
// and K fp8 rows of whole 64-element steps. Each step keeps the K rows as bf16 words (2 K
// registers) and widens one fp32 vector of each at a time, which every query of the tile
// multiplies (its vector loaded once). Forced inline, as the tiles that call it.
template <int G, int K, typename T>
__attribute__((always_inline)) static inline void fp8_tile_products(const LookupQuery* lq, int hsp,
                                                                    const T* const* k,
                                                                    vfloat (&acc)[G][K],
                                                                    const T* const* ahead) {
  const float* q = &lq->value;
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

// The register tile, dot4 and dot1 of register_tiles.h and single_query.h for such keys.
template <int G, int K, typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
__attribute__((always_inline)) static inline void dot_tile(const LookupQuery* q, int hsp,
                                                           const T* const* k, float* s,
                                                           const T* const* ahead) {
  vfloat acc[G][K] = {};
  fp8_tile_products<G, K>(q, hsp, k, acc, ahead);
  hsum_tile<G, K>(acc, s);
}

template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline void dot4(const LookupQuery* q, const T* const* k, int hsp, float* out,
                        const T* const* ahead) {
  vfloat acc[1][4] = {};
  fp8_tile_products<1, 4>(q, hsp, k, acc, ahead);
  hsum4(acc[0][0], acc[0][1], acc[0][2], acc[0][3], out);
}

template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline float dot1(const LookupQuery* q, const T* k, int hsp, const T* const* ahead) {
  vfloat acc[1][1] = {};
  fp8_tile_products<1, 1>(q, hsp, &k, acc, ahead);
  return hsum(acc[0][0]);
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
#endif  // PAGED_ISA_AVX512_VBMI
