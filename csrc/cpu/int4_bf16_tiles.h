// int4 per-token rows read in place with vdpbf16ps (AVX512_BF16): the attention driver's
// queries-in-rows micro-kernel for Int4Row (attention_kernel.h, row_tiles.h). Part of the
// CPU kernel, inside its ISA namespace (see vec.h).
//
// A nibble n becomes the bf16 value 128 + n exactly by its bits alone, 0x4300 | n
// (exponent 7, n in the low mantissa bits), so a row needs no table: its bytes zero-extended
// to 16-bit words, the low nibbles (even channels) are (w & 15) | 0x4300 and the high ones
// (odd channels) (w >> 4) | 0x4300. A row r = s n + low (scale s, low from the cache's
// (scale, low) pair) is then s (128 + n) + (low - 128 s), so
//   scores: q . r = s (q . (128 + n)) + (low - 128 s) sum(q),
//   values: sum_j p_j r_j = sum_j w_j (128 + n_j) + sum_j (p_j (low_j + 7.5 s_j) - 135.5 w_j)
//           + sum_j (p_j s_j - w_j) (n_j - 7.5),
// with q the rotated query as the dot takes it (its sum from the same values) and w_j the
// weight p_j s_j as the pair dot takes it, the last sum dropped: the correction terms use
// the dot's own operands, so the large 128 parts cancel in the algebra.
//
// Both operands the dots take from fp32 are two bf16 rows each (bf16_split: the rounding
// and the rounding of what that leaves, about 16 bits), dotted with the same converted
// nibbles (the conversion, not the dot, is most of a row's work). One bf16 rounding was
// not enough: of the query, it moved the scores and the lse by about 2e-3 (the tests hold
// the lse to 1e-4); of the weights, it left (p_j s_j - w_j)(n_j - 7.5), of one sign over
// the channels of a row whose mean nibble is off the middle, which the unrotation sums into
// one output channel (one key of Gaussians: 0.012 there; 0.035 taken about 0 instead of
// 7.5), past the fp16 tolerance on GQA rows of head size 512.
//
// Only where the caller's query is 16-bit (AttentionParams::query_from_16bit); an fp32
// query, ragged head sizes (not whole 64-channel steps) and other instruction sets widen
// the rows to fp32 with scale and low folded in (token_row_to_float).
//
// Lane order, per 64-channel step (32 bytes of a row): scores take the query in
// int4_query_channel order (the 32 even channels, then the 32 odd ones), and the value
// accumulators are permuted (int4_value_channel), put back by output_row.
#pragma once

#include "convert.h"
#include "prefetch.h"
#include "register_tiles.h"
#include "vec.h"

#if PAGED_ISA_AVX512_BF16
// The nibbles' common offset: nibble n is read as kNibbleBias + n.
constexpr float kNibbleBias = 128.0f;
// The middle of the nibbles' range, about which the values' weights are corrected (below).
constexpr float kNibbleMid = 7.5f;

// Channel of query slot i of a 64-channel step (scores).
static inline int int4_query_channel(int i) { return i < 32 ? 2 * i : 2 * (i - 32) + 1; }

// Channel of accumulator slot i of a 64-channel step (values): vector v = i / 16, lane
// 4 L + k (128-bit lane L, k < 4) holds byte 8 L + 4 (v / 2) + k, its odd channel for odd v.
static inline int int4_value_channel(int i) {
  const int v = i / 16, lane = i % 16;
  return 2 * (8 * (lane / 4) + 4 * (v / 2) + lane % 4) + v % 2;
}

// The 64 nibbles of 32 bytes as bf16 128 + n: even channels in `even`, odd in `odd`.
__attribute__((always_inline)) static inline void int4_to_bf16(const Int4Row* row, __m512i& even, __m512i& odd) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  const __m512i bits = _mm512_set1_epi16(0x4300);
  even = _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(15), bits, 0xea);  // (a & b) | c
  odd = _mm512_or_si512(_mm512_srli_epi16(w, 4), bits);
}

// x as two bf16 vectors, its rounding and the rounding of what that leaves (about 16 bits
// of x); their sum in fp32.
__attribute__((always_inline)) static inline __m512 bf16_split(__m512 x, __m256bh& high, __m256bh& low) {
  auto widen = [](__m256bh b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16));
  };
  high = _mm512_cvtneps_pbh(x);
  const __m512 h = widen(high);
  low = _mm512_cvtneps_pbh(_mm512_sub_ps(x, h));
  return _mm512_add_ps(h, widen(low));
}

// The weights of G queries' chunks (scores, kKeyChunk apart) as bf16 pairs of two keys,
// their high and low parts (bf16_split), in the layout int4_accumulate_step reads.
template <int G>
__attribute__((always_inline)) static inline void weight_pairs(const float* scores,
                                                               uint32_t (*pairs)[4 * kKeyChunk / 2]) {
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kMaxChunk<Int4Row>; t += 16) {
      __m256bh high, low;
      bf16_split(_mm512_loadu_ps(scores + g * kKeyChunk + t), high, low);
      std::memcpy(pairs[0] + g * (kKeyChunk / 2) + t / 2, &high, sizeof(high));
      std::memcpy(pairs[1] + g * (kKeyChunk / 2) + t / 2, &low, sizeof(low));
    }
}

// s[g * kKeyChunk + i] = q_g . (128 + n of k[i]) for G queries (4 hsp apart, slot order,
// each its bf16 high part and then its low part, hsp apart) and K keys, by 64-channel steps.
template <int G, int K>
__attribute__((always_inline)) static inline void int4_dot_tile(const uint16_t* q, int hsp,
                                                                const Int4Row* const* k, float* s,
                                                                const Int4Row* const* ahead) {
  __m512 acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < K; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    __m512i even[K], odd[K];
    for (int i = 0; i < K; ++i) {
      prefetch_same_line(ahead, i, d / 2);
      int4_to_bf16(k[i] + d / 2, even[i], odd[i]);
    }
    for (int g = 0; g < G; ++g) {
      const uint16_t* qg = q + int64_t(g) * 4 * hsp + d;
      const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qg), q1 = (__m512bh)_mm512_loadu_si512(qg + 32);
      const __m512bh r0 = (__m512bh)_mm512_loadu_si512(qg + hsp), r1 = (__m512bh)_mm512_loadu_si512(qg + hsp + 32);
      for (int i = 0; i < K; ++i) {
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q0, (__m512bh)even[i]);
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q1, (__m512bh)odd[i]);
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], r0, (__m512bh)even[i]);
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], r1, (__m512bh)odd[i]);
      }
    }
  }
  if constexpr (G * K == VW) {
    vfloat sums[G][K];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < K; ++i) sums[g][i] = (vfloat)acc[g][i];
    hsum_tile<G, K>(sums, s);
  } else {
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < K; ++i) s[g * kKeyChunk + i] = hsum((vfloat)acc[g][i]);
  }
}

// The dots of G queries from query m with the chunk's n keys: 4 keys a tile, then one by one.
template <int G>
__attribute__((always_inline)) static inline void int4_tile_scores(const ItemState& st, int m,
                                                                   const Int4Row* const* k, int n,
                                                                   const Int4Row* const* ahead) {
  const uint16_t* q = st.q_quad + int64_t(m) * 4 * st.hsp;
  float* s = st.scores + int64_t(m) * kKeyChunk;
  const Int4Row* const* tile_ahead = m == 0 ? ahead : nullptr;
  int t = 0;
  for (; t + 4 <= n; t += 4) int4_dot_tile<G, 4>(q, st.hsp, k + t, s + t, tile_ahead ? tile_ahead + t : nullptr);
  for (; t < n; ++t) int4_dot_tile<G, 1>(q, st.hsp, k + t, s + t, tile_ahead ? tile_ahead + t : nullptr);
}

// acc[g] += sum_t w[g][t] (128 + n of v[t]) for G queries over the 64-channel step at d;
// `pairs[part][g * kKeyChunk / 2 + t / 2]` holds part (high, low: bf16_split) of
// (w[g][t], w[g][t+1]) as two bf16. Keys t and t + 1 in each 32-bit lane (an odd last key
// beside zero bytes, whose weight is 0).
template <int G>
__attribute__((always_inline)) static inline void int4_accumulate_step(float* acc, int hsp, int d,
                                                                       const uint32_t (*pairs)[4 * kKeyChunk / 2],
                                                                       const Int4Row* const* v, int n,
                                                                       const Int4Row* const* ahead) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 4; ++k) a[g][k] = _mm512_loadu_ps(acc + int64_t(g) * hsp + d + 16 * k);
  const __m512i low_nibbles = _mm512_set1_epi32(0x000f000f), bits = _mm512_set1_epi32(0x43004300);
  for (int t = 0; t < n; t += 2) {
    const bool odd_key = t + 1 == n;
    prefetch_same_line(ahead, t, d / 2);
    if (!odd_key) prefetch_same_line(ahead, t + 1, d / 2);
    const __m512i wa = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[t] + d / 2)));
    const __m512i wb = odd_key ? _mm512_setzero_si512()
                               : _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(v[t + 1] + d / 2)));
    const __m512i lo = _mm512_unpacklo_epi16(wa, wb), hi = _mm512_unpackhi_epi16(wa, wb);
    __m512i ab[4];
    ab[0] = _mm512_ternarylogic_epi32(lo, low_nibbles, bits, 0xea);
    ab[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 4), low_nibbles, bits, 0xea);
    ab[2] = _mm512_ternarylogic_epi32(hi, low_nibbles, bits, 0xea);
    ab[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(hi, 4), low_nibbles, bits, 0xea);
    for (int g = 0; g < G; ++g) {
      const __m512bh high = (__m512bh)_mm512_set1_epi32(int(pairs[0][g * (kKeyChunk / 2) + t / 2]));
      const __m512bh low = (__m512bh)_mm512_set1_epi32(int(pairs[1][g * (kKeyChunk / 2) + t / 2]));
      for (int k = 0; k < 4; ++k) {
        a[g][k] = _mm512_dpbf16_ps(a[g][k], (__m512bh)ab[k], high);
        a[g][k] = _mm512_dpbf16_ps(a[g][k], (__m512bh)ab[k], low);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc + int64_t(g) * hsp + d + 16 * k, a[g][k]);
}

template <int G>
__attribute__((always_inline)) static inline void int4_accumulate(float* acc, int hsp, const uint32_t (*pairs)[4 * kKeyChunk / 2],
                                                                  const Int4Row* const* v, int n,
                                                                  const Int4Row* const* ahead) {
  for (int d = 0; d < hsp; d += 64) int4_accumulate_step<G>(acc, hsp, d, pairs, v, n, ahead);
}

// The products of int4 rows: in place by the tiles above where the item's query and head
// sizes allow (reads_in_place), else the driver widens the rows to fp32 and this class only
// passes the query and output rows through.
template <>
class RowTiles<Int4Row> {
 public:
  // Whether the driver may read the item's rows in place: a 16-bit caller's query and
  // whole 64-channel steps.
  static bool reads_in_place(const AttentionParams& P, int hs, int hsv) {
    return P.query_from_16bit && hs % 64 == 0 && hsv % 64 == 0;
  }

  static constexpr ScoreLayout kLayout = ScoreLayout::kQueriesInRows;
  static constexpr bool kHeadsOuter = false;

  RowTiles(const AttentionParams&, int, int, bool in_place) : in_place(in_place) {}
  const bool in_place;

  void load_queries(const AttentionParams& P, const WorkItem& w, const ItemState& st) const {
    load_row_queries(*this, P, w, st);
  }

  float key_unit() const { return 1.0f; }
  float value_unit() const { return 1.0f; }

  // In place: the rotated fp32 query row (q_row), unscaled, in slot order into its quad row
  // (4 hs 16-bit words, unused by int4 rows otherwise) as two bf16 rows, its rounding and
  // the rounding of what that leaves (h + l holds the query to about 16 bits), then the
  // sum of h + l in fp32.
  void order_query(const char* q_row, float*, uint16_t*, uint16_t* q_quad, int hs, int) const {
    if (!in_place) return;
    const float* src = reinterpret_cast<const float*>(q_row);
    float sum = 0.0f;
    for (int d = 0; d < hs; d += 64)
      for (int i = 0; i < 64; ++i) {
        const float x = src[d + int4_query_channel(i)];
        const uint16_t high = bf16_bits(x), low = bf16_bits(x - bf16_to_float(high));
        q_quad[d + i] = high;
        q_quad[hs + d + i] = low;
        sum += bf16_to_float(high) + bf16_to_float(low);
      }
    std::memcpy(q_quad + 2 * hs, &sum, sizeof(sum));
  }

  __attribute__((always_inline)) void scores(const ItemState& st, const Int4Row* const* k_rows, int n,
                                             const Int4Row* const* ahead) const {
    int m = 0;
    for (; m + 4 <= st.num_queries; m += 4) int4_tile_scores<4>(st, m, k_rows, n, ahead);
    for (; m < st.num_queries; ++m) int4_tile_scores<1>(st, m, k_rows, n, ahead);
  }

  // The chunk's dots into scores: s (softmax scale) (scale_t dot + (low_t - 128 scale_t) sum(q)).
  void finish_scores(const ItemState& st, const float* scale, const float* low) const {
    for (int m = 0; m < st.num_queries; ++m) {
      float* s = st.scores + int64_t(m) * kKeyChunk;
      const vfloat qsum = splat(query_sum(st, m));
      const vfloat softmax_scale = splat(st.scale);
      for (int t = 0; t < kMaxChunk<Int4Row>; t += VW) {
        const vfloat sc = load(scale + t);
        const vfloat offset = load(low + t) - splat(kNibbleBias) * sc;
        store(s + t, (load(s + t) * sc + offset * qsum) * softmax_scale);
      }
    }
  }

  // The chunk's probabilities p into p scale_t, whose two bf16 parts (bf16_split) sum to
  // the weight w the pair dots take, and sum_t (p (low_t + 7.5 scale_t) - 135.5 w) added
  // to every accumulator of the query. Keys from n on get
  // weight 0 (their lanes hold no probabilities).
  void weigh_values(const ItemState& st, const float* scale, const float* low, int n) const {
    for (int m = 0; m < st.num_queries; ++m) {
      float* s = st.scores + int64_t(m) * kKeyChunk;
      __m512 offset = _mm512_setzero_ps();
      for (int t = 0; t < kMaxChunk<Int4Row>; t += 16) {
        const __mmask16 keys = n - t >= 16 ? __mmask16(0xffff) : n > t ? __mmask16((1u << (n - t)) - 1) : 0;
        const __m512 p = _mm512_maskz_loadu_ps(keys, s + t);
        const __m512 sc = _mm512_maskz_loadu_ps(keys, scale + t);
        const __m512 ps = _mm512_mul_ps(p, sc);
        _mm512_storeu_ps(s + t, ps);
        __m256bh high, low_part;
        const __m512 w = bf16_split(ps, high, low_part);
        const __m512 mid = _mm512_fmadd_ps(_mm512_set1_ps(kNibbleMid), sc, _mm512_maskz_loadu_ps(keys, low + t));
        offset = _mm512_fmadd_ps(p, mid, offset);
        offset = _mm512_fnmadd_ps(_mm512_set1_ps(kNibbleBias + kNibbleMid), w, offset);
      }
      const vfloat add = splat(hsum((vfloat)offset));
      float* am = st.acc + int64_t(m) * st.hspv;
      for (int d = 0; d < st.hspv; d += VW) store(am + d, load(am + d) + add);
    }
  }

  __attribute__((always_inline)) void values(const ItemState& st, const Int4Row* const* v_rows, int n,
                                             const Int4Row* const* ahead) const {
    uint32_t pairs[2][4 * kKeyChunk / 2];
    int m = 0;
    for (; m + 4 <= st.num_queries; m += 4) {
      weight_pairs<4>(st.scores + int64_t(m) * kKeyChunk, pairs);
      int4_accumulate<4>(st.acc + int64_t(m) * st.hspv, st.hspv, pairs, v_rows, n, m == 0 ? ahead : nullptr);
    }
    for (; m < st.num_queries; ++m) {
      weight_pairs<1>(st.scores + int64_t(m) * kKeyChunk, pairs);
      int4_accumulate<1>(st.acc + int64_t(m) * st.hspv, st.hspv, pairs, v_rows, n, m == 0 ? ahead : nullptr);
    }
  }

  void output_row(const float* am, float* o, int hsv, float inv) const {
    if (!in_place) {
      for (int d = 0; d < hsv; ++d) o[d] = am[d] * inv;
      return;
    }
    for (int d = 0; d < hsv; d += 64)
      for (int i = 0; i < 64; ++i) o[d + int4_value_channel(i)] = am[d + i] * inv;
  }

 private:
  static float query_sum(const ItemState& st, int m) {
    float sum;
    std::memcpy(&sum, st.q_quad + int64_t(m) * 4 * st.hsp + 2 * st.hsp, sizeof(sum));
    return sum;
  }
  // Round to nearest even, as vcvtneps2bf16 (a NaN stays a NaN).
  static uint16_t bf16_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
  }
  static float bf16_to_float(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
  }
};
#endif  // PAGED_ISA_AVX512_BF16
