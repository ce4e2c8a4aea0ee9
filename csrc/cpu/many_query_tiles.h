// A GEMM-shaped micro-kernel for bf16 rows read by many queries of one KV head (an MLA
// model's latent rows: 16 to 128 query heads on one 576-wide row; GQA items of as many
// queries per KV head), AVX512_BF16 only. Part of the CPU kernel, inside its ISA namespace
// (see vec.h); RowTiles (row_tiles.h) hands it the chunks of such items.
//
// The register tiles of the row driver (bf16_tiles.h) hold 4 queries: every tile reloads
// its keys, sums 16 accumulators across lanes and interleaves its value rows again. Here
// the chunk's rows are rearranged once for all the item's queries, so the work per query
// is vdpbf16ps and little else:
// - scores: the chunk's key rows transposed into pair-major order (kt[i * 32 + t]: the
//   pair of elements 2i, 2i + 1 of key t), then per tile of G queries and the chunk's 32
//   keys (two vectors) acc[g][kb] += kt[i][kb] . (q_g[2i], q_g[2i + 1]) broadcast: 2 G
//   accumulators hold finished scores in key order, with no horizontal sums;
// - values: per 64 channels the chunk's value rows interleaved in key pairs (pair_words,
//   the pair order of bf16_tiles.h, so the accumulators are those of chunk_values_pairs),
//   then per tile of G queries acc[g][c] += vpair[t / 2][c] . (p_g[t], p_g[t + 1])
//   broadcast over the chunk's keys, the accumulators loaded and stored once per chunk.
#pragma once

#include "bf16_tiles.h"
#include "prefetch.h"

#if PAGED_ISA_AVX512_BF16
// Queries per KV head from which an item's bf16 chunks take this kernel. Below, the
// transpose of each chunk's keys is spread over too few queries.
constexpr int kManyQueries = 16;
// Keys a chunk of the kernel holds: bf16 chunks (kMaxChunk<Bf16>), two key vectors.
constexpr int kManyKeys = 32;

// Rows r[0..16) of 16 dwords each into columns: r[i] ends as dword i of every input row.
__attribute__((always_inline)) static inline void transpose_16x16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Each 128-bit lane L of r[j] now holds dword j of rows 4 L .. 4 L + 3 (j < 4, within
  // a group of four r's): gather the lanes across the groups.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// kt[i * kManyKeys + t] = the pair (k[t][2i], k[t][2i + 1]) for i < hs / 2 (hs a multiple
// of 32) and t < kManyKeys; keys from n on repeat row n - 1 (their scores are not used).
// Prefetches the same lines of `ahead` (see prefetch_same_line) for the chunk's n rows.
template <typename R>
__attribute__((always_inline)) static inline void transpose_key_pairs(const R* const* k, int n, int hs,
                                                                      uint32_t* kt, const R* const* ahead) {
  for (int kb = 0; kb < kManyKeys; kb += 16) {
    const R* rows[16];
    for (int t = 0; t < 16; ++t) rows[t] = k[std::min(kb + t, n - 1)];
    for (int d = 0; d < hs; d += 32) {  // 16 pairs of 16 keys
      if (ahead)
        for (int t = kb; t < std::min(kb + 16, n); ++t) prefetch_ahead(ahead, t, d);
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(rows[t] + d);
      transpose_16x16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + (d / 2 + p) * kManyKeys + kb, r[p]);
    }
  }
}

// The scores of G queries (unscaled bf16 rows q, hsp apart) with the chunk's kManyKeys
// transposed keys, times `scale`, into s (rows kKeyChunk apart).
template <int G>
__attribute__((always_inline)) static inline void many_score_tile(const uint16_t* q, int hsp, int pairs,
                                                                  const uint32_t* kt, float scale, float* s) {
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  for (int i = 0; i < pairs; ++i) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + i * kManyKeys);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + i * kManyKeys + 16);
    for (int g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, q + int64_t(g) * hsp + 2 * i, sizeof(pair));
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(int(pair));
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], qp, k0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], qp, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    _mm512_storeu_ps(s + g * kKeyChunk, _mm512_mul_ps(acc[g][0], sc));
    _mm512_storeu_ps(s + g * kKeyChunk + 16, _mm512_mul_ps(acc[g][1], sc));
  }
}

// Tiles of G queries where G may be: the largest first, then 4, 2 and 1 for the rest.
template <int G, typename Tile>
__attribute__((always_inline)) static inline void for_query_tiles(int num_queries, Tile tile) {
  int m = 0;
  for (; m + G <= num_queries; m += G) tile(std::integral_constant<int, G>{}, m);
  if constexpr (G > 4) {
    if (m + 4 <= num_queries) {
      tile(std::integral_constant<int, 4>{}, m);
      m += 4;
    }
  }
  if (m + 2 <= num_queries) {
    tile(std::integral_constant<int, 2>{}, m);
    m += 2;
  }
  if (m < num_queries) tile(std::integral_constant<int, 1>{}, m);
}

// Query tiles of the scores: 8 queries x 2 key vectors, 16 accumulators; measured
// against other tile sizes in docs/performance.md.
constexpr int kManyScoreQueries = 8;
// Query tiles of the values: 6 queries x 64 channels, 24 accumulators.
constexpr int kManyValueQueries = 6;

// The chunk's scores (n keys, n <= kManyKeys) of num_queries queries: q_bits their unscaled
// bf16 rows (hsp apart, hs of them used), times `scale`, into `scores` (kKeyChunk apart).
template <typename R>
__attribute__((always_inline)) static inline void many_query_scores(const uint16_t* q_bits, int num_queries,
                                                                    int hs, int hsp, float scale, float* scores,
                                                                    const R* const* k_rows, int n,
                                                                    const R* const* ahead) {
  alignas(64) uint32_t kt[kMaxKeyRow / 2 * kManyKeys];
  transpose_key_pairs(k_rows, n, hs, kt, ahead);
  for_query_tiles<kManyScoreQueries>(num_queries, [&](auto g, int m) {
    many_score_tile<decltype(g)::value>(q_bits + int64_t(m) * hsp, hsp, hs / 2, kt, scale,
                                        scores + int64_t(m) * kKeyChunk);
  });
}

// acc[g] += the chunk's 2 STEPS x 16 channels from `channel` of value pairs vp (one entry
// of 2 STEPS vectors per key pair), weighted by the probability pairs of G queries
// (`pairs`, kKeyChunk / 2 apart). acc rows hspv apart, in the pair order.
template <int G, int STEPS>
__attribute__((always_inline)) static inline void many_value_tile(float* acc, int hspv, int channel,
                                                                  const uint32_t* pairs, const __m512i* vp,
                                                                  int key_pairs) {
  constexpr int kVecs = 2 * STEPS;
  __m512 a[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kVecs; ++c) a[g][c] = _mm512_loadu_ps(acc + int64_t(g) * hspv + channel + 16 * c);
  for (int tp = 0; tp < key_pairs; ++tp) {
    __m512bh v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = (__m512bh)_mm512_load_si512(vp + tp * kVecs + c);
    for (int g = 0; g < G; ++g) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pairs[g * (kKeyChunk / 2) + tp]));
      for (int c = 0; c < kVecs; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], v[c], pp);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(acc + int64_t(g) * hspv + channel + 16 * c, a[g][c]);
}

// Queries whose probability pairs a block of the values holds on the stack: the value
// rows are interleaved once per block.
constexpr int kManyValueBlock = 128;

// acc (num_queries rows hspv apart, pair order) += the chunk's probabilities (`scores`,
// kKeyChunk apart, keys from n on not read) times its n value rows (hsv a multiple of 32).
// `ahead` as in transpose_key_pairs.
template <typename R>
__attribute__((always_inline)) static inline void many_query_values(float* acc, int num_queries, int hsv,
                                                                    int hspv, const float* scores,
                                                                    const R* const* v_rows, int n,
                                                                    const R* const* ahead) {
  alignas(64) uint32_t pairs[kManyValueBlock * (kKeyChunk / 2)];
  alignas(64) __m512i vp[kManyKeys / 2 * 4];
  const int key_pairs = (n + 1) / 2;
  for (int m0 = 0; m0 < num_queries; m0 += kManyValueBlock) {
    const int block = std::min(kManyValueBlock, num_queries - m0);
    for (int m = 0; m < block; ++m)
      probability_pairs<1, kManyKeys>(scores + int64_t(m0 + m) * kKeyChunk, pairs + m * (kKeyChunk / 2));
    // An odd last key is paired with a zero row (pair_words), so its partner's probability
    // (past n, not a probability) meets zeros: p x 0 is 0 for finite p, and the driver
    // leaves the probabilities past n finite.
    auto channels = [&](auto steps, int d) {
      constexpr int S = decltype(steps)::value;
      for (int tp = 0; tp < key_pairs; ++tp) {
        const int t = 2 * tp;
        const bool odd = t + 1 == n;
        if (ahead && m0 == 0)
          for (int k = 0; k < S; ++k) {
            prefetch_same_line(ahead, t, d + 32 * k);
            if (!odd) prefetch_same_line(ahead, t + 1, d + 32 * k);
          }
        __m512i ab[2 * S];
        pair_words<S>(v_rows[t] + d, odd ? nullptr : v_rows[t + 1] + d, ab);
        for (int c = 0; c < 2 * S; ++c) _mm512_store_si512(vp + tp * 2 * S + c, ab[c]);
      }
      for_query_tiles<kManyValueQueries>(block, [&](auto g, int m) {
        many_value_tile<decltype(g)::value, S>(acc + int64_t(m0 + m) * hspv, hspv, d,
                                               pairs + m * (kKeyChunk / 2), vp, key_pairs);
      });
    };
    int d = 0;
    for (; d + 64 <= hsv; d += 64) channels(std::integral_constant<int, 2>{}, d);
    if (d < hsv) channels(std::integral_constant<int, 1>{}, d);
  }
}
#endif  // PAGED_ISA_AVX512_BF16
