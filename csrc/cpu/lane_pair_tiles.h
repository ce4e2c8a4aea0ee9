// The pair queries-in-lanes micro-kernel of the attention driver (attention_kernel.h;
// lane_tiles.h) on AVX512_BF16, for
// bf16 and fp8 caches under a bf16 query: the fp32 tiles' layout (lane_float_tiles.h), with
// vdpbf16ps (two products per lane, twice the fp32 FMA's) instead of fp32 FMAs. Part of
// the CPU kernel, inside its ISA namespace (see vec.h). Elsewhere LanePairTiles says it is
// not available.
//
// Scores: the queries are transposed once into dim pairs, qp[i][m] = (q[m][2i], q[m][2i+1])
// as two bf16 (exact: the query is bf16), and each key's pair (k[2i], k[2i+1]) is
// broadcast from a bf16 copy of the chunk's keys (fp8 converted exactly, fp8_bf16_tables.h).
// The softmax scale (and k_scale) multiplies the scores. Values: the chunk's rows are
// interleaved once into key pairs (keys t and t + 1, as accumulate_pairs does; the
// accumulators stay in the pair order (unpermute_pairs) until the epilogue) and each query's probabilities
// of the pair are broadcast as two bf16, rounded as the bf16 cache's general kernel does.
#pragma once

#include "bf16_tiles.h"
#include "fp8_bf16_tables.h"
#include "lane_tiles.h"

#if PAGED_ISA_AVX512_BF16
// Register tiles: scores KT keys x MT query vectors, values MR queries x DV vectors of 16
// dims; 16 accumulators, so items of 64 queries per KV head (kMaxQueriesPerItem) and head
// sizes of whole 64s leave no remainder tiles (the fp32 kernel's 8 x 3 tiles left one of a
// single vector, whose 8 chains ran a third of the value dims at half the rate: 8 x 2
// measured faster; 4 x 4 tiles the same as 8 x 2).
// The tile functions below are forced inline, through scores and values into the driver's
// chunk step (as lane_float_tiles.h's on AVX-512).
constexpr int kPairScoreKeys = 8;
constexpr int kPairScoreVecs = 2;
constexpr int kPairValueRows = 8;
constexpr int kPairValueVecs = 2;

// 64 elements of a row as bf16 in their order (fp8 converted exactly).
template <typename T>
static inline void row_to_bf16x64(const T* p, uint16_t* out) {
  if constexpr (sizeof(T) == 1) {
    __m512i first, second;
    fp8_to_bf16_lanes<T>(_mm512_loadu_si512(p), first, second);
    // Words 0-31 of the result: 128-bit lanes 0 of first and second, then lanes 1; 32-63
    // lanes 2 and 3.
    const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i high = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    _mm512_storeu_si512(out, _mm512_permutex2var_epi64(first, low, second));
    _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi64(first, high, second));
  } else {
    std::memcpy(out, p, 128);
  }
}

// s[i][m0 + 16 j ..] = scale * sum_p qp[p][..] . k[i] pair p, for KT keys and MT vectors.
// `ahead` (nullable) steps once per pair.
template <int KT, int MT, typename Ahead>
__attribute__((always_inline)) static inline void lane_pair_score_tile(const uint32_t* qp, int mp,
                                                                       const uint16_t* const* k, int hs,
                                                                       float scale, float* s, int m0,
                                                                       Ahead* ahead) {
  __m512 acc[KT][MT];
  for (int i = 0; i < KT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int p = 0; p < hs / 2; ++p) {
    if (ahead) ahead->step();
    __m512bh q[MT];
    for (int j = 0; j < MT; ++j) q[j] = (__m512bh)_mm512_loadu_si512(qp + int64_t(p) * mp + m0 + 16 * j);
    for (int i = 0; i < KT; ++i) {
      int32_t pair;
      std::memcpy(&pair, k[i] + 2 * p, sizeof(pair));
      const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], q[j], kp);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < KT; ++i)
    for (int j = 0; j < MT; ++j) _mm512_storeu_ps(s + int64_t(i) * mp + m0 + 16 * j, _mm512_mul_ps(acc[i][j], sv));
}

// The first tile (query vectors from 0) steps `ahead`.
template <int KT, typename Ahead>
__attribute__((always_inline)) static inline void lane_pair_scores_for_keys(const uint32_t* qp, int mp,
                                                                            const uint16_t* const* k, int hs,
                                                                            float scale, float* s,
                                                                            Ahead* ahead) {
  int m = 0;
  for (; m + kPairScoreVecs * 16 <= mp; m += kPairScoreVecs * 16, ahead = nullptr)
    lane_pair_score_tile<KT, kPairScoreVecs>(qp, mp, k, hs, scale, s, m, ahead);
  for (; m < mp; m += 16, ahead = nullptr) lane_pair_score_tile<KT, 1>(qp, mp, k, hs, scale, s, m, ahead);
}

// As lane_scores (lane_float_tiles.h).
template <typename T>
__attribute__((always_inline)) static inline void lane_pair_scores(const uint32_t* qp, int mp,
                                                                   const uint16_t* const* k, int n, int hs,
                                                                   float scale, float* s,
                                                                   LaneAhead<T>& ahead) {
  int t = 0;
  if (mp == 16) {
    constexpr int kKeys = 2 * kPairScoreKeys;
    ahead.plan(n / kKeys * (hs / 2));
    for (; t + kKeys <= n; t += kKeys)
      lane_pair_score_tile<kKeys, 1>(qp, mp, k + t, hs, scale, s + int64_t(t) * mp, 0, &ahead);
  } else {
    ahead.plan(n / kPairScoreKeys * (hs / 2));
    for (; t + kPairScoreKeys <= n; t += kPairScoreKeys)
      lane_pair_scores_for_keys<kPairScoreKeys>(qp, mp, k + t, hs, scale, s + int64_t(t) * mp, &ahead);
  }
  ahead.finish();
  LaneAhead<T>* const none = nullptr;
  for (; t + 4 <= n; t += 4) lane_pair_scores_for_keys<4>(qp, mp, k + t, hs, scale, s + int64_t(t) * mp, none);
  for (; t < n; ++t) lane_pair_scores_for_keys<1>(qp, mp, k + t, hs, scale, s + int64_t(t) * mp, none);
}

// acc[m0 + r][d0 + 16 j ..] += key pairs u of vp . probability pairs pp[u][m0 + r].
template <int MR, int DV>
__attribute__((always_inline)) static inline void lane_pair_value_tile(float* acc, int hspv,
                                                                       const uint32_t* pp, int mp,
                                                                       const uint32_t* vp, int pairs, int m0,
                                                                       int d0) {
  __m512 a[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < DV; ++j) a[r][j] = _mm512_loadu_ps(acc + int64_t(m0 + r) * hspv + d0 + 16 * j);
  for (int u = 0; u < pairs; ++u) {
    __m512bh v[DV];
    for (int j = 0; j < DV; ++j) v[j] = (__m512bh)_mm512_loadu_si512(vp + int64_t(u) * hspv + d0 + 16 * j);
    const uint32_t* pu = pp + int64_t(u) * mp + m0;
    for (int r = 0; r < MR; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(int(pu[r]));
      for (int j = 0; j < DV; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], v[j], pr);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc + int64_t(m0 + r) * hspv + d0 + 16 * j, a[r][j]);
}

template <int MR>
__attribute__((always_inline)) static inline void lane_pair_values_for_rows(float* acc, int hspv,
                                                                            const uint32_t* pp, int mp,
                                                                            const uint32_t* vp, int pairs,
                                                                            int m0) {
  int d = 0;
  for (; d + kPairValueVecs * 16 <= hspv; d += kPairValueVecs * 16)
    lane_pair_value_tile<MR, kPairValueVecs>(acc, hspv, pp, mp, vp, pairs, m0, d);
  for (; d < hspv; d += 16) lane_pair_value_tile<MR, 1>(acc, hspv, pp, mp, vp, pairs, m0, d);
}

// The pair tiles, for bf16, fp8 and per-token int8 caches (kAvailable) under a bf16 query with
// head sizes of whole 64s (takes). int8 rows convert exactly to bf16 by the fp8 byte tables;
// each key's scale multiplies its scores, each value's its probabilities before their
// rounding to pairs (after the softmax: its running sums take them without the values'
// scales, as the row tiles' softmax does).
template <typename T>
class LanePairTiles {
 public:
  static constexpr bool kAvailable = std::is_same_v<T, Bf16> || kByteLookup<T>;
  static constexpr ScoreLayout kLayout = ScoreLayout::kQueriesInLanes;
  static constexpr bool kHeadsOuter = true;

  // Whether the tiles take the item's query dtype and head sizes.
  static bool takes(const AttentionParams& P) {
    return P.query_kind == ScalarKind::kBFloat16 && P.head_size % 64 == 0 && P.head_size_v % 64 == 0;
  }

  // The lane workspace's regions hold pairs: [hs/2][mp] query pairs in the queries', [chunk][mp]
  // scores then [chunk/2][mp] probability pairs after them, bf16 keys in the keys' and
  // [chunk/2][hsv] value pairs in the values'. Head sizes are multiples of 64 (takes), so
  // hsp = hs and hspv = hsv.
  LanePairTiles(const AttentionParams& P, const LaneWorkspace& ws, const LaneShape& shape)
      : P_(P),
        qp_(reinterpret_cast<uint32_t*>(ws.queries)),
        pp_(reinterpret_cast<uint32_t*>(ws.scores + int64_t(shape.mp) * (kLaneChunk / 2))),
        kb_(reinterpret_cast<uint16_t*>(ws.keys)),
        vp_(reinterpret_cast<uint32_t*>(ws.values)),
        vb_(reinterpret_cast<uint16_t*>(ws.row)),
        hs_(shape.hs),
        hsv_(shape.hsv),
        mp_(shape.mp) {}

  // The queries as dim pairs (exact: the query is bf16), zero padded; the softmax scale and
  // k_scale (no unit: the fp8 conversion is exact) multiply the scores.
  void load_queries(const AttentionParams&, const WorkItem& w, const ItemState& st) const {
    const int kv = st.kv_head, m = st.num_queries;
    std::memset(qp_, 0, sizeof(uint32_t) * mp_ * (hs_ / 2));
    for (int i = 0; i < m; ++i) {
      const char* q_row = query_row(P_, lane_query(P_, w, kv, i));
      for (int p = 0; p < hs_ / 2; ++p) std::memcpy(qp_ + int64_t(p) * mp_ + i, q_row + 4 * p, 4);
    }
  }

  // Keys as bf16 rows; values interleaved, keys t and t + 1 per 32-element step (the pair
  // order); an odd last key is paired with zeros.
  void load_chunk(const T* const* k, const T* const* v, int n, const ChunkTokenScales& scales) {
    scales_ = scales;
    pairs_ = (n + 1) / 2;
    for (int t = 0; t < n; ++t) {
      uint16_t* kt = kb_ + int64_t(t) * hs_;
      for (int d = 0; d < hs_; d += 64) row_to_bf16x64(k[t] + d, kt + d);
      k_rows_[t] = kt;
    }
    for (int u = 0; u < pairs_; ++u) {
      const int t = 2 * u;
      for (int d = 0; d < hsv_; d += 64) {
        row_to_bf16x64(v[t] + d, vb_);
        if (t + 1 < n) row_to_bf16x64(v[t + 1] + d, vb_ + 64);
        else std::memset(vb_ + 64, 0, 128);
        for (int h = 0; h < 64; h += 32) {
          const __m512i a = _mm512_loadu_si512(vb_ + h), b = _mm512_loadu_si512(vb_ + 64 + h);
          uint32_t* out = vp_ + int64_t(u) * hsv_ + d + h;
          _mm512_storeu_si512(out, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(out + 16, _mm512_unpackhi_epi16(a, b));
        }
      }
    }
  }

  void scores(const ItemState& st, int n, const T* const* ahead, int next_n) {
    LaneAhead<T> fetch(ahead, ahead + kKeyChunk, next_n, int(hs_ * sizeof(T)), int(hsv_ * sizeof(T)));
    lane_pair_scores(qp_, mp_, k_rows_, n, hs_, st.scale, st.scores, fetch);
    if constexpr (kPerToken<T>)
      for (int t = 0; t < n; ++t) {
        float* row = st.scores + int64_t(t) * mp_;
        const vfloat key_scale = splat(scales_.k_scale[t]);
        for (int m = 0; m < mp_; m += 16) store(row + m, load(row + m) * key_scale);
      }
  }

  // The probabilities of query vector v0 as bf16 pairs of keys (2u, 2u + 1) into row
  // kLaneChunk / 2 + u of the scores, last pair first, so no pair reads a row an earlier one
  // overwrote (pair u' < u reads rows up to 2u - 1, below kLaneChunk / 2 + u).
  void probabilities(const ItemState& st, int n, int v0) {
    const float* s = st.scores;
    auto weight = [&](int t) {  // key t's probabilities, times its value's scale (per-token rows)
      const vfloat p = load(s + int64_t(t) * mp_ + v0);
      if constexpr (kPerToken<T>) return p * splat(scales_.v_scale[t]);
      return p;
    };
    for (int u = pairs_ - 1; u >= 0; --u) {
      const __m256bh lo = _mm512_cvtneps_pbh((__m512)weight(2 * u));
      const __m256bh hi = 2 * u + 1 < n ? _mm512_cvtneps_pbh((__m512)weight(2 * u + 1))
                                        : (__m256bh)_mm256_setzero_si256();
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32((__m256i)lo),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
      _mm512_storeu_si512(pp_ + int64_t(u) * mp_ + v0, pair);
    }
  }

  void values(const ItemState& st, int) {
    float* acc = st.acc;
    const int m = st.num_queries;
    int r = 0;
    for (; r + kPairValueRows <= m; r += kPairValueRows)
      lane_pair_values_for_rows<kPairValueRows>(acc, hsv_, pp_, mp_, vp_, pairs_, r);
    for (; r + 2 <= m; r += 2) lane_pair_values_for_rows<2>(acc, hsv_, pp_, mp_, vp_, pairs_, r);
    for (; r < m; ++r) lane_pair_values_for_rows<1>(acc, hsv_, pp_, mp_, vp_, pairs_, r);
  }

  void output_row(const float* am, float* o, int hsv, float inv) const {
    unpermute_pairs(am, o, hsv, inv);
  }
  // Exact bf16 products (the fp8 conversion is exact): no unit.
  float value_unit() const { return 1.0f; }

 private:
  const AttentionParams& P_;
  uint32_t* qp_;  // [hs/2][mp] query pairs
  uint32_t* pp_;  // [chunk/2][mp] probability pairs
  uint16_t* kb_;  // [chunk][hs] bf16 keys
  uint32_t* vp_;  // [chunk/2][hsv] value pairs
  uint16_t* vb_;  // one value row as bf16 (two for a pair)
  int hs_, hsv_, mp_;
  int pairs_ = 0;
  ChunkTokenScales scales_{};
  const uint16_t* k_rows_[kLaneChunk];
};
#else
template <typename T>
struct LanePairTiles {
  static constexpr bool kAvailable = false;
};
#endif  // PAGED_ISA_AVX512_BF16
