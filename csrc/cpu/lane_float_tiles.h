// The fp32 queries-in-lanes micro-kernel of the attention driver (attention_kernel.h; what a
// lane micro-kernel supplies: lane_tiles.h). Part of the CPU kernel, inside its ISA
// namespace (see vec.h).
//
// The tiles hold the KV head's scaled queries transposed, qt[d][m], and compute a chunk's
// scores s[t][m] as register tiles of KT keys by MT query vectors (each key element
// broadcast, each query vector loaded once per KT keys), so no score needs a horizontal sum;
// the weighted values acc[m][d] accumulate in tiles of MR queries by DV value vectors. The
// cache format's conversion: keys widened to fp32 rows of an L1 scratch chunk, values too
// unless they are fp32 rows of whole vectors (read in place).

#pragma once

#include "convert.h"
#include "lane_tiles.h"
#include "vec.h"

// The tile functions below are forced inline on AVX-512, through scores and values into the
// driver's chunk step: left out of line there, they measured slower lane items.

// Register tiles: scores KT keys x MT query vectors, values MR queries x DV vectors
// (accumulators plus the operands fit 32 AVX-512 registers, 16 AVX2 or SSE ones; at least
// ten accumulators cover the FMA latency on two pipes).
constexpr int kLaneScoreKeys = VW == 16 ? 8 : 6;
constexpr int kLaneScoreVecs = VW == 16 ? 3 : 2;
constexpr int kLaneValueRows = VW == 16 ? 8 : 6;
constexpr int kLaneValueVecs = VW == 16 ? 3 : 2;

// s[i][m0 + j * VW ..] = sum_d k[i][d] * qt[d][m0 + j * VW ..] for KT keys, MT vectors;
// `ahead` (nullable) steps once per element.
template <int KT, int MT, typename Ahead>
PAGED_AVX512_INLINE static inline void lane_score_tile(const float* qt, int mp, const float* const* k,
                                                       int hs, float* s, int m0, Ahead* ahead) {
  vfloat acc[KT][MT];
  for (int i = 0; i < KT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = vfloat{};
  for (int d = 0; d < hs; ++d) {
    if (ahead) ahead->step();
    vfloat q[MT];
    for (int j = 0; j < MT; ++j) q[j] = load(qt + int64_t(d) * mp + m0 + j * VW);
    for (int i = 0; i < KT; ++i) {
      const vfloat kd = splat(k[i][d]);
      for (int j = 0; j < MT; ++j) acc[i][j] += kd * q[j];
    }
  }
  for (int i = 0; i < KT; ++i)
    for (int j = 0; j < MT; ++j) store(s + int64_t(i) * mp + m0 + j * VW, acc[i][j]);
}

// Scores of KT keys with every query vector: tiles of MT vectors, then (MT >= 4) of MT / 2,
// then of one. The first tile steps `ahead`.
template <int KT, int MT, typename Ahead>
PAGED_AVX512_INLINE static inline void lane_scores_for_keys(const float* qt, int mp, const float* const* k,
                                                            int hs, float* s, Ahead* ahead) {
  int m = 0;
  for (; m + MT * VW <= mp; m += MT * VW, ahead = nullptr)
    lane_score_tile<KT, MT>(qt, mp, k, hs, s, m, ahead);
  if constexpr (MT >= 4)
    for (; m + MT / 2 * VW <= mp; m += MT / 2 * VW, ahead = nullptr)
      lane_score_tile<KT, MT / 2>(qt, mp, k, hs, s, m, ahead);
  for (; m < mp; m += VW, ahead = nullptr) lane_score_tile<KT, 1>(qt, mp, k, hs, s, m, ahead);
}

// Query vectors of the tiles of the last n % kLaneScoreKeys keys: fewer keys a tile, more
// vectors, so the tile still has enough accumulators (FMA chains) to cover the latency
// within the registers. On AVX2 a chunk of 32 keys ends in 2 (5 tiles of 6), which took
// tiles of 1 key x 2 vectors: two chains.
template <int KT>
constexpr int kLaneTailVecs = VW == 16 ? 4 : (KT == 1 ? 8 : KT == 2 ? 4 : 3);

// Scores of the chunk's n keys with every query: s[t][m]. With one vector of queries
// (e.g. 8 sequences of an MHA model), tiles of more keys keep enough accumulators busy.
// The next chunk's rows are fetched over the full tiles' steps (LaneAhead).
template <typename T>
PAGED_AVX512_INLINE static inline void lane_scores(const float* qt, int mp, const float* const* k, int n,
                                                   int hs, float* s, LaneAhead<T>& ahead) {
  int t = 0;
  if (mp == VW) {
    constexpr int kKeys = 2 * kLaneScoreKeys;
    ahead.plan(n / kKeys * hs);
    for (; t + kKeys <= n; t += kKeys)
      lane_score_tile<kKeys, 1>(qt, mp, k + t, hs, s + int64_t(t) * mp, 0, &ahead);
  } else {
    ahead.plan(n / kLaneScoreKeys * hs);
    for (; t + kLaneScoreKeys <= n; t += kLaneScoreKeys)
      lane_scores_for_keys<kLaneScoreKeys, kLaneScoreVecs>(qt, mp, k + t, hs, s + int64_t(t) * mp,
                                                           &ahead);
  }
  ahead.finish();
  LaneAhead<T>* const none = nullptr;
  for (; t + 4 <= n; t += 4)
    lane_scores_for_keys<4, kLaneTailVecs<4>>(qt, mp, k + t, hs, s + int64_t(t) * mp, none);
  for (; t + 2 <= n; t += 2)
    lane_scores_for_keys<2, kLaneTailVecs<2>>(qt, mp, k + t, hs, s + int64_t(t) * mp, none);
  for (; t < n; ++t)
    lane_scores_for_keys<1, kLaneTailVecs<1>>(qt, mp, k + t, hs, s + int64_t(t) * mp, none);
}

// acc[m0 + r][d0 + j * VW ..] += sum_t p[t][m0 + r] * v[t][d0 + j * VW ..].
template <int MR, int DV>
PAGED_AVX512_INLINE static inline void lane_value_tile(float* acc, int hspv, const float* p, int mp,
                                                       const float* const* v, int n, int m0, int d0) {
  vfloat a[MR][DV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < DV; ++j) a[r][j] = load(acc + int64_t(m0 + r) * hspv + d0 + j * VW);
  for (int t = 0; t < n; ++t) {
    vfloat vt[DV];
    for (int j = 0; j < DV; ++j) vt[j] = load(v[t] + d0 + j * VW);
    const float* pt = p + int64_t(t) * mp + m0;
    for (int r = 0; r < MR; ++r) {
      const vfloat pr = splat(pt[r]);
      for (int j = 0; j < DV; ++j) a[r][j] += pr * vt[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < DV; ++j) store(acc + int64_t(m0 + r) * hspv + d0 + j * VW, a[r][j]);
}

template <int MR>
PAGED_AVX512_INLINE static inline void lane_values_for_rows(float* acc, int hspv, const float* p, int mp,
                                                            const float* const* v, int n, int m0) {
  int d = 0;
  for (; d + kLaneValueVecs * VW <= hspv; d += kLaneValueVecs * VW)
    lane_value_tile<MR, kLaneValueVecs>(acc, hspv, p, mp, v, n, m0, d);
  for (; d < hspv; d += VW) lane_value_tile<MR, 1>(acc, hspv, p, mp, v, n, m0, d);
}

// The probability-weighted values of the chunk for the first `m` queries.
PAGED_AVX512_INLINE static inline void lane_values(float* acc, int hspv, const float* p, int mp,
                                                   const float* const* v, int n, int m) {
  int r = 0;
  for (; r + kLaneValueRows <= m; r += kLaneValueRows)
    lane_values_for_rows<kLaneValueRows>(acc, hspv, p, mp, v, n, r);
  // Where 64 queries leave 4 rows (AVX2: 10 tiles of 6), 4 rows before 2: 2 x
  // kLaneValueVecs accumulators are too few chains. (Not on AVX-512, whose 8-row tiles
  // leave none: there the extra tile made GCC keep the value tiles out of line, and
  // multi-token measured slower.)
  if constexpr (kLaneValueRows % 4 != 0)
    for (; r + 4 <= m; r += 4) lane_values_for_rows<4>(acc, hspv, p, mp, v, n, r);
  for (; r + 2 <= m; r += 2) lane_values_for_rows<2>(acc, hspv, p, mp, v, n, r);
  for (; r < m; ++r) lane_values_for_rows<1>(acc, hspv, p, mp, v, n, r);
}

// The fp32 tiles, for every cache dtype and head size (lane_tiles.h lists what a lane
// micro-kernel supplies).
template <typename T>
class LaneFloatTiles {
 public:
  static constexpr ScoreLayout kLayout = ScoreLayout::kQueriesInLanes;
  static constexpr bool kHeadsOuter = true;

  LaneFloatTiles(const AttentionParams& P, const LaneWorkspace& ws, const LaneShape& shape)
      : P_(P), qt_(ws.queries), kf_(ws.keys), vf_(ws.values), row_(ws.row), d_(shape) {
    if (!values_in_place()) std::memset(vf_, 0, sizeof(float) * kLaneChunk * d_.hspv);
  }

  // The queries scaled by the softmax scale (and k_scale with the keys' unit), zero padded.
  void load_queries(const AttentionParams&, const WorkItem& w, const ItemState& st) const {
    const int kv = st.kv_head, m = st.num_queries;
    const float q_scale =
        P_.k_scale ? P_.scale * (P_.k_scale[kv * P_.k_scale_stride] * StoredUnit<T>::value) : P_.scale;
    std::memset(qt_, 0, sizeof(float) * d_.mp * d_.hsp);
    for (int i = 0; i < m; ++i) {
      query_row_to_float(P_.query_kind, query_row(P_, lane_query(P_, w, kv, i)), row_, d_.hs);
      for (int d = 0; d < d_.hs; ++d) qt_[int64_t(d) * d_.mp + i] = row_[d] * q_scale;
    }
  }

  // Keys are copied (widened) into an L1 scratch chunk: the score tiles broadcast their
  // elements from several rows at once, which measured slower from the cache's rows in
  // place (fp32). fp32 values are read in place when their rows are whole vectors (one row
  // at a time); other values are widened once per chunk. No per-token rows (their scales):
  // attention_work_item keeps those in rows.
  void load_chunk(const T* const* k, const T* const* v, int n, const ChunkTokenScales&) {
    static_assert(!kPerToken<T>, "per-token rows take the row tiles or the pair tiles");
    for (int t = 0; t < n; ++t) {
      row_to_float(k[t], kf_ + int64_t(t) * d_.hsp, d_.hs);
      k_rows_[t] = kf_ + int64_t(t) * d_.hsp;
      if (values_in_place()) {
        v_rows_[t] = reinterpret_cast<const float*>(v[t]);
      } else {
        row_to_float(v[t], vf_ + int64_t(t) * d_.hspv, d_.hsv);
        v_rows_[t] = vf_ + int64_t(t) * d_.hspv;
      }
    }
  }

  void scores(const ItemState& st, int n, const T* const* ahead, int next_n) {
    LaneAhead<T> fetch(ahead, ahead + kKeyChunk, next_n, int(d_.hs * sizeof(T)), int(d_.hsv * sizeof(T)));
    lane_scores(qt_, d_.mp, k_rows_, n, d_.hs, st.scores, fetch);
  }
  void probabilities(const ItemState&, int, int) {}
  void values(const ItemState& st, int n) {
    lane_values(st.acc, d_.hspv, st.scores, d_.mp, v_rows_, n, st.num_queries);
  }
  void output_row(const float* am, float* o, int hsv, float inv) const {
    for (int d = 0; d < hsv; ++d) o[d] = am[d] * inv;
  }
  float value_unit() const { return StoredUnit<T>::value; }

 private:
  bool values_in_place() const { return std::is_same_v<T, float> && d_.hsv == d_.hspv; }

  const AttentionParams& P_;
  float* qt_;   // [hsp][mp] scaled queries, transposed
  float* kf_;   // [chunk][hsp] widened keys
  float* vf_;   // [chunk][hspv] widened values, zero padded
  float* row_;  // [hsp] one query row in fp32
  LaneShape d_;
  const float* k_rows_[kLaneChunk];
  const float* v_rows_[kLaneChunk];
};
