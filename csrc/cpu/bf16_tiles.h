// The AVX512_BF16 versions of the score and value tiles (register_tiles.h) and of the
// one-query products (single_query.h): vdpbf16ps dot products for bf16 keys and values
// and for fp8 keys and values (fp8_bf16_tables.h). Part of the CPU kernel, inside its ISA
// namespace (see vec.h).
#pragma once

#include "fp8_bf16_tables.h"
#include "prefetch.h"
#include "register_tiles.h"

#if PAGED_ISA_AVX512_BF16
// bf16 keys against bf16 queries with vdpbf16ps: pairs of products summed in fp32,
// 32 elements a step, no widening. The query is the caller's unscaled bf16 (exact);
// the softmax scale is applied to the scores afterwards.
static inline __m512bh load_bf16x32(const void* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// Forced inline, as the fp32 tiles (register_tiles.h): out of line GCC kept the 16
// accumulators on the stack (bf16 decode measured faster inlined).
template <int G, int K>
__attribute__((always_inline)) static inline void dot_tile(const uint16_t* q, int hsp,
                                                           const Bf16* const* k, float* s,
                                                           const Bf16* const* ahead) {
  static_assert(G == 4 && K == 4, "the AVX-512 score tile");
  __m512 acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 32) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const __m512bh k0 = load_bf16x32(k[0] + d), k1 = load_bf16x32(k[1] + d),
                   k2 = load_bf16x32(k[2] + d), k3 = load_bf16x32(k[3] + d);
    for (int g = 0; g < G; ++g) {
      const __m512bh qv = load_bf16x32(q + int64_t(g) * hsp + d);
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], qv, k0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], qv, k1);
      acc[g][2] = _mm512_dpbf16_ps(acc[g][2], qv, k2);
      acc[g][3] = _mm512_dpbf16_ps(acc[g][3], qv, k3);
    }
  }
  vfloat sums[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = (vfloat)acc[g][i];
  hsum_tile<G, K>(sums, s);
}

static inline void dot4(const uint16_t* q, const Bf16* const* k, int hsp, float* out,
                        const Bf16* const* ahead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int d = 0; d < hsp; d += 32) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const __m512bh qv = load_bf16x32(q + d);
    a0 = _mm512_dpbf16_ps(a0, qv, load_bf16x32(k[0] + d));
    a1 = _mm512_dpbf16_ps(a1, qv, load_bf16x32(k[1] + d));
    a2 = _mm512_dpbf16_ps(a2, qv, load_bf16x32(k[2] + d));
    a3 = _mm512_dpbf16_ps(a3, qv, load_bf16x32(k[3] + d));
  }
  hsum4((vfloat)a0, (vfloat)a1, (vfloat)a2, (vfloat)a3, out);
}

static inline float dot1(const uint16_t* q, const Bf16* k, int hsp, const Bf16* const* ahead) {
  __m512 a = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 32) {
    prefetch_same_line(ahead, 0, d);
    a = _mm512_dpbf16_ps(a, load_bf16x32(q + d), load_bf16x32(k + d));
  }
  return hsum((vfloat)a);
}

// fp8 values take accumulate_pairs too (pair_words): four accumulator vectors per query
// and 64-element step, element 16 L + 4 j + k (L, j, k < 4) in slot 16 j + 4 L + k (the
// fp8 pair order), put back here by a 4 x 4 transpose of 128-bit blocks.
static inline void unpermute_fp8_pairs(const float* acc, float* out, int hsp, float factor) {
  const __m512 scale = _mm512_set1_ps(factor);
  for (int d = 0; d < hsp; d += 64) {
    __m512 v[4], t[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_ps(acc + d + 16 * j);
    t[0] = _mm512_shuffle_f32x4(v[0], v[1], 0x44);  // v0 blocks 0 1, v1 blocks 0 1
    t[1] = _mm512_shuffle_f32x4(v[0], v[1], 0xee);  // v0 blocks 2 3, v1 blocks 2 3
    t[2] = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
    t[3] = _mm512_shuffle_f32x4(v[2], v[3], 0xee);
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_shuffle_f32x4(t[0], t[2], 0x88), scale));
    _mm512_storeu_ps(out + d + 16, _mm512_mul_ps(_mm512_shuffle_f32x4(t[0], t[2], 0xdd), scale));
    _mm512_storeu_ps(out + d + 32, _mm512_mul_ps(_mm512_shuffle_f32x4(t[1], t[3], 0x88), scale));
    _mm512_storeu_ps(out + d + 48, _mm512_mul_ps(_mm512_shuffle_f32x4(t[1], t[3], 0xdd), scale));
  }
}

template <int G, int K, typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
__attribute__((always_inline)) static inline void dot_tile(const uint16_t* q, int hsp,
                                                           const T* const* k, float* s,
                                                           const T* const* ahead) {
  static_assert(G == 4 && K == 4, "the AVX-512 score tile");
  __m512 acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    __m512i first[4], second[4];
    for (int i = 0; i < 4; ++i) fp8_to_bf16_lanes<T>(_mm512_loadu_si512(k[i] + d), first[i], second[i]);
    for (int g = 0; g < G; ++g) {
      const __m512bh q0 = load_bf16x32(q + int64_t(g) * hsp + d);
      const __m512bh q1 = load_bf16x32(q + int64_t(g) * hsp + d + 32);
      for (int i = 0; i < 4; ++i) {
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q0, (__m512bh)first[i]);
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q1, (__m512bh)second[i]);
      }
    }
  }
  vfloat sums[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = (vfloat)acc[g][i];
  hsum_tile<G, K>(sums, s);
}

template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline void dot4(const uint16_t* q, const T* const* k, int hsp, float* out,
                        const T* const* ahead) {
  __m512 even[4], odd[4];
  for (int i = 0; i < 4; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const __m512bh q0 = load_bf16x32(q + d), q1 = load_bf16x32(q + d + 32);
    for (int i = 0; i < 4; ++i) {
      __m512i lo, hi;
      fp8_to_bf16_lanes<T>(_mm512_loadu_si512(k[i] + d), lo, hi);
      even[i] = _mm512_dpbf16_ps(even[i], q0, (__m512bh)lo);
      odd[i] = _mm512_dpbf16_ps(odd[i], q1, (__m512bh)hi);
    }
  }
  hsum4((vfloat)even[0] + (vfloat)odd[0], (vfloat)even[1] + (vfloat)odd[1],
        (vfloat)even[2] + (vfloat)odd[2], (vfloat)even[3] + (vfloat)odd[3], out);
}

template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline float dot1(const uint16_t* q, const T* k, int hsp, const T* const* ahead) {
  __m512 a = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    prefetch_same_line(ahead, 0, d);
    __m512i first, second;
    fp8_to_bf16_lanes<T>(_mm512_loadu_si512(k + d), first, second);
    a = _mm512_dpbf16_ps(a, load_bf16x32(q + d), (__m512bh)first);
    a = _mm512_dpbf16_ps(a, load_bf16x32(q + d + 32), (__m512bh)second);
  }
  return hsum((vfloat)a);
}

// fp8 keys of a GQA group, 16 keys and 4 queries a tile, four keys in each vector: 16
// bytes of key 4 L + j in 128-bit lane L of vector j (masked loads, no shuffle), so the
// 4 x 4 accumulators hold 64 scores in 4-lane groups and sum to them by 12 in-lane folds,
// where four dot_tile<4, 4> take 60, 44 of them across lanes. The queries are in quad order
// (quad_query_order): per 16 elements, elements 0-7 four times, then 8-15 four times.
// Measured faster than e4m3 score tiles by dot_tile.
constexpr int kQuadKeys = 16;

static inline void quad_query_order(const uint16_t* q, int hs, uint16_t* out) {
  for (int d = 0; d < hs; d += 16)
    for (int half = 0; half < 2; ++half)
      for (int lane = 0; lane < 4; ++lane)
        std::memcpy(out + 4 * d + 32 * half + 8 * lane, q + d + 8 * half, 8 * sizeof(uint16_t));
}

// Bytes [d, d + 16) of rows k[0], k[4], k[8], k[12] in lanes 0-3. The masked loads touch
// only their enabled 16 bytes, whatever lies before the row.
template <typename T>
__attribute__((always_inline)) static inline __m512i load_quad(const T* const* k, int d) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k[0] + d)));
  v = _mm512_mask_loadu_epi64(v, 0x0c, reinterpret_cast<const char*>(k[4] + d) - 16);
  v = _mm512_mask_loadu_epi64(v, 0x30, reinterpret_cast<const char*>(k[8] + d) - 32);
  return _mm512_mask_loadu_epi64(v, 0xc0, reinterpret_cast<const char*>(k[12] + d) - 48);
}

// s[g * kKeyChunk + t] = q_g . k[t] for 4 queries (q: quad order, 4 hsp apart) and 16 keys
// (hsp a multiple of 64). Each 16-byte step prefetches 4 rows' line of `ahead` (see
// prefetch_same_line), so the 16 rows' lines are fetched over the line's 4 steps.
template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
__attribute__((always_inline)) static inline void quad_tile(const uint16_t* q, int hsp,
                                                            const T* const* k, float* s,
                                                            const T* const* ahead) {
  __m512 acc[4][4];  // [query][vector]
  for (int g = 0; g < 4; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 16) {
    if (ahead) {
      const int line = d & ~63, first = d % 64 / 16 * 4;
      for (int t = first; t < first + 4; ++t) prefetch_ahead(ahead, t, line);
    }
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) fp8_to_bf16_lanes<T>(load_quad(k + j, d), lo[j], hi[j]);
    for (int g = 0; g < 4; ++g) {
      const __m512bh q0 = load_bf16x32(q + int64_t(g) * 4 * hsp + 4 * d);
      const __m512bh q1 = load_bf16x32(q + int64_t(g) * 4 * hsp + 4 * d + 32);
      for (int j = 0; j < 4; ++j) {
        acc[g][j] = _mm512_dpbf16_ps(acc[g][j], q0, (__m512bh)lo[j]);
        acc[g][j] = _mm512_dpbf16_ps(acc[g][j], q1, (__m512bh)hi[j]);
      }
    }
  }
  // Folding query g's vectors 0 and 2, 1 and 3 at stride 2, then the two results at stride
  // 1, leaves key 4 L + j (vector j, lane L) in lane 4 L + j: query g's 16 scores in order.
  for (int g = 0; g < 4; ++g) {
    const vfloat even = fold_lanes<2>((vfloat)acc[g][0], (vfloat)acc[g][2]);
    const vfloat odd = fold_lanes<2>((vfloat)acc[g][1], (vfloat)acc[g][3]);
    store(s + g * kKeyChunk, fold_lanes<1>(even, odd));
  }
}

// Probability-weighted bf16 values with vdpbf16ps, two keys per instruction: the rows
// of keys t and t+1 are interleaved (vpunpck{l,h}wd) and dotted with the pair
// (p[t], p[t+1]) rounded to bf16, as flash-attention kernels do on GPUs.
//
// The interleave works within 128-bit lanes, so each 32-element step of a row leaves
// its results in a fixed permutation (the pair order: element 8 L + 4 j + k, L, k < 4 and
// j < 2, in slot 16 j + 4 L + k): the accumulators stay permuted for the whole item and
// unpermute_pairs restores the order at the end.
static inline void unpermute_pairs(const float* acc, float* out, int hsp, float factor) {
  const __m512 scale = _mm512_set1_ps(factor);
  // Per 32 elements, 4 at a time: vector 0's block 0, vector 1's block 0, then blocks 1, 2, 3.
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int d = 0; d < hsp; d += 32) {
    const __m512 v0 = _mm512_loadu_ps(acc + d), v1 = _mm512_loadu_ps(acc + d + 16);
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_permutex2var_ps(v0, first, v1), scale));
    _mm512_storeu_ps(out + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(v0, second, v1), scale));
  }
}

// The value pairs of rows a and b (b null: a zero row) over STEPS 32-element steps from
// element 0: 2 STEPS vectors whose 32-bit lanes hold (a[i], b[i]) as bf16. bf16 rows:
// their words interleaved (vpunpck{l,h}wd), lanes in the pair order. fp8 rows (STEPS 2):
// their bytes interleaved first (vpunpck{l,h}bw), then converted by fp8_to_bf16_lanes,
// lanes in the fp8 pair order: 12 operations for two rows' 64 elements, where converting
// each row and interleaving its words took 18.
template <int STEPS, typename R>
__attribute__((always_inline)) static inline void pair_words(const R* a, const R* b,
                                                             __m512i (&ab)[2 * STEPS]) {
  const __m512i zero = _mm512_setzero_si512();
  if constexpr (sizeof(R) == 1) {
    static_assert(STEPS == 2, "an fp8 step is 64 elements");
    const __m512i xa = _mm512_loadu_si512(a), xb = b ? _mm512_loadu_si512(b) : zero;
    fp8_to_bf16_lanes<R>(_mm512_unpacklo_epi8(xa, xb), ab[0], ab[1]);
    fp8_to_bf16_lanes<R>(_mm512_unpackhi_epi8(xa, xb), ab[2], ab[3]);
  } else {
    for (int k = 0; k < STEPS; ++k) {
      const __m512i xa = _mm512_loadu_si512(a + 32 * k), xb = b ? _mm512_loadu_si512(b + 32 * k) : zero;
      ab[2 * k] = _mm512_unpacklo_epi16(xa, xb);
      ab[2 * k + 1] = _mm512_unpackhi_epi16(xa, xb);
    }
  }
}

// acc[g] += sum_t p[g][t] v[t] for G queries; `pairs[g * kKeyChunk / 2 + t / 2]` holds
// (p[g][t], p[g][t+1]) as two bf16. An odd last key is paired with a zero row.
template <int G, int STEPS, typename R>
static inline void accumulate_pairs_block(float* acc, int hsp, int d, const uint32_t* pairs,
                                          const R* const* v, int n, const R* const* ahead) {
  // STEPS 32-element steps of the rows at once: each broadcast pair serves them all.
  constexpr int kVecs = 2 * STEPS;
  __m512 a[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < kVecs; ++k) a[g][k] = _mm512_loadu_ps(acc + int64_t(g) * hsp + d + 16 * k);
  for (int t = 0; t < n; t += 2) {
    const bool odd = t + 1 == n;
    for (int k = 0; k < STEPS; ++k) {
      prefetch_same_line(ahead, t, d + 32 * k);
      if (!odd) prefetch_same_line(ahead, t + 1, d + 32 * k);
    }
    __m512i ab[kVecs];
    pair_words<STEPS>(v[t] + d, odd ? nullptr : v[t + 1] + d, ab);
    for (int g = 0; g < G; ++g) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pairs[g * (kKeyChunk / 2) + t / 2]));
      for (int k = 0; k < kVecs; ++k) a[g][k] = _mm512_dpbf16_ps(a[g][k], (__m512bh)ab[k], pp);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < kVecs; ++k) _mm512_storeu_ps(acc + int64_t(g) * hsp + d + 16 * k, a[g][k]);
}

// bf16 rows of whole 32-element steps, fp8 rows of whole 64-element steps.
template <int G, typename R>
static inline void accumulate_pairs(float* acc, int hsp, const uint32_t* pairs, const R* const* v,
                                    int n, const R* const* ahead) {
  int d = 0;
  for (; d + 64 <= hsp; d += 64) accumulate_pairs_block<G, 2>(acc, hsp, d, pairs, v, n, ahead);
  if constexpr (sizeof(R) == 2)
    if (d < hsp) accumulate_pairs_block<G, 1>(acc, hsp, d, pairs, v, n, ahead);
}

// The chunk's probabilities of G queries as bf16 pairs (see accumulate_pairs), of its
// first K keys (a constant bound; keys from the chunk's n on are not read).
template <int G, int K>
static inline void probability_pairs(const float* scores, uint32_t* pairs) {
  static_assert(K % 16 == 0 && K <= kKeyChunk, "whole fp32 vectors of probabilities per query");
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < K; t += 16) {
      const __m256bh p = _mm512_cvtneps_pbh(_mm512_loadu_ps(scores + g * kKeyChunk + t));
      std::memcpy(pairs + g * (kKeyChunk / 2) + t / 2, &p, sizeof(p));
    }
  }
}
#endif  // PAGED_ISA_AVX512_BF16
