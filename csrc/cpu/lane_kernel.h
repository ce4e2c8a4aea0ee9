// The CPU kernel for work items whose queries all see every key of the item and are many
// per KV head (shared_prefix_attention: the queries of a group over its shared prefix).
// Part of the CPU kernel, inside its ISA namespace (see vec.h).
//
// Queries sit in vector lanes. The item transposes its scaled queries once, qt[d][m], and
// for each chunk of keys computes the scores s[t][m] as register tiles of KT keys by MT
// query vectors (each key element broadcast, each query vector loaded once per KT keys),
// so no score needs a horizontal sum; the online softmax runs down the lanes (one max,
// exp and sum per query vector); the weighted values acc[m][d] accumulate in tiles of MR
// queries by DV value vectors. Every K and V row is read once per item, as in the general
// kernel, but each serves all the item's queries from registers.

#pragma once

#include "convert.h"
#include "prefetch.h"
#include "query_rows.h"
#include "vec.h"
#include "vec_exp.h"

// Register tiles: scores KT keys x MT query vectors, values MR queries x DV vectors
// (accumulators plus the operands fit 32 AVX-512 registers, 16 AVX2 or SSE ones; at least
// ten accumulators cover the FMA latency on two pipes).
constexpr int kLaneScoreKeys = VW == 16 ? 8 : 6;
constexpr int kLaneScoreVecs = VW == 16 ? 3 : 2;
constexpr int kLaneValueRows = VW == 16 ? 8 : 6;
constexpr int kLaneValueVecs = VW == 16 ? 3 : 2;
constexpr int kLaneChunk = 32;  // keys per step

// The next chunk's stored key and value rows, fetched into L2 (into L1 they would evict the
// queries and accumulators) by the score tiles, a few lines per step of their loop over the
// head's elements (plan), so the misses go out at the pace of the arithmetic. Fetched a
// tile's rows at a time, the bursts overflowed the miss buffers and stalled the core
// (profiles showed the samples on the prefetches and on copying keys whose lines had not
// arrived).
template <typename T>
class LaneAhead {
 public:
  LaneAhead(const T* const* k, const T* const* v, int n, int k_bytes, int v_bytes)
      : k_(k), v_(v), n_(n), k_bytes_(k_bytes), v_bytes_(v_bytes) {
    start_row();
  }

  // Spreads the lines over `steps` calls of step().
  void plan(int steps) {
    const int lines = n_ * ((k_bytes_ + 63) / 64 + (v_bytes_ + 63) / 64);
    per_step_ = steps > 0 ? (lines + steps - 1) / steps : lines;
  }

  void step() {
    for (int i = 0; i < per_step_ && line_ != nullptr; ++i) next_line();
  }

  // Every line not yet fetched.
  void finish() {
    while (line_ != nullptr) next_line();
  }

 private:
  // Rows 0 .. n - 1 are the keys', n .. 2n - 1 the values'.
  void start_row() {
    if (row_ >= 2 * n_) {
      line_ = nullptr;
      return;
    }
    const bool key = row_ < n_;
    line_ = reinterpret_cast<const char*>(key ? k_[row_] : v_[row_ - n_]);
    row_end_ = line_ + (key ? k_bytes_ : v_bytes_);
  }
  void next_line() {
    prefetch(line_);
    line_ += 64;
    if (line_ >= row_end_) {
      ++row_;
      start_row();
    }
  }

  const T* const* k_;
  const T* const* v_;
  int n_;
  int k_bytes_, v_bytes_;
  int per_step_ = 0;
  int row_ = 0;
  const char* line_ = nullptr;
  const char* row_end_ = nullptr;
};

// s[i][m0 + j * VW ..] = sum_d k[i][d] * qt[d][m0 + j * VW ..] for KT keys, MT vectors;
// `ahead` (nullable) steps once per element.
template <int KT, int MT, typename Ahead>
static inline void lane_score_tile(const float* qt, int mp, const float* const* k, int hs, float* s,
                                   int m0, Ahead* ahead) {
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
static inline void lane_scores_for_keys(const float* qt, int mp, const float* const* k, int hs,
                                        float* s, Ahead* ahead) {
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
static inline void lane_scores(const float* qt, int mp, const float* const* k, int n, int hs,
                               float* s, LaneAhead<T>& ahead) {
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
static inline void lane_value_tile(float* acc, int hspv, const float* p, int mp,
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
static inline void lane_values_for_rows(float* acc, int hspv, const float* p, int mp,
                                        const float* const* v, int n, int m0) {
  int d = 0;
  for (; d + kLaneValueVecs * VW <= hspv; d += kLaneValueVecs * VW)
    lane_value_tile<MR, kLaneValueVecs>(acc, hspv, p, mp, v, n, m0, d);
  for (; d < hspv; d += VW) lane_value_tile<MR, 1>(acc, hspv, p, mp, v, n, m0, d);
}

// The probability-weighted values of the chunk for the first `m` queries.
static inline void lane_values(float* acc, int hspv, const float* p, int mp, const float* const* v,
                               int n, int m) {
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

// The stored key and value rows of keys [j0, j0 + n) of the KV head at k_head / v_head.
template <typename T>
static inline void lane_locate(const AttentionParams& P, const int32_t* table, int64_t k_head,
                               int64_t v_head, int j0, int n, const T** k_out, const T** v_out) {
  const T* key_cache = static_cast<const T*>(P.key_cache);
  const T* value_cache = static_cast<const T*>(P.value_cache);
  for (int t = 0; t < n; ++t) {
    const int j = j0 + t;
    const int64_t block = table[j / P.block_size], slot = j % P.block_size;
    k_out[t] = key_cache + block * P.k_block_stride + k_head + slot * P.k_token_stride;
    v_out[t] = value_cache + block * P.v_block_stride + v_head + slot * P.v_token_stride;
  }
}

// The online softmax of a chunk's n score rows (s[t][m], rows mp apart) down the lanes of
// the query vector at v0: one max, exp and sum per vector; the accumulator rows of queries
// whose max moved (of the first m) are rescaled. kShortExp: the exp of exp_minus<kShortExp>.
// Out of line: inlined into lane_pairs_work_item, GCC kept the running total on the stack
// (a store and a reload per key; multi-token bf16 and fp8 measured faster out of line).
template <bool kShortExp>
__attribute__((noinline)) static void query_vector_softmax(float* s, int n, int mp, int v0, int m,
                                                   float* run_max, float* run_sum,
                                                   float* acc, int hspv) {
  vfloat top = load(s + v0);
  for (int t = 1; t < n; ++t) top = vmax(top, load(s + int64_t(t) * mp + v0));
  const vfloat old = load(run_max + v0);
  const vfloat now = vmax(old, top);
  vfloat total{};
  for (int t = 0; t < n; ++t) {
    const vfloat p = exp_minus<kShortExp>(load(s + int64_t(t) * mp + v0), now);
    store(s + int64_t(t) * mp + v0, p);
    total += p;
  }
  float alpha[VW];
  for (int l = 0; l < VW; ++l) alpha[l] = old[l] == now[l] ? 1.0f : std::exp(old[l] - now[l]);
  rescale_rows(acc + int64_t(v0) * hspv, hspv, alpha, std::min(VW, m - v0));
  vfloat alphas;
  std::memcpy(&alphas, alpha, sizeof(alphas));
  store(run_sum + v0, load(run_sum + v0) * alphas + total);
  store(run_max + v0, now);
}

// One work item of shared_prefix_attention (every query sees keys [kv_begin, kv_end)),
// KV head by KV head. Scratch: (m rounded up to VW) x (hsp + chunk + hspv + 2) plus a
// chunk of widened keys and values and one query row, within kernel_workspace_floats of
// m + kWorkspacePaddingQueries queries.
template <typename T>
void lane_work_item(const AttentionParams& P, const WorkItem& w, float* ws) {
  const int hs = P.head_size, hsv = P.head_size_v;
  const int hsp = (hs + VW - 1) / VW * VW, hspv = (hsv + VW - 1) / VW * VW;
  const int group = P.num_heads / P.num_kv_heads;
  const int m = (w.row_end - w.row_begin) * group;  // queries of one KV head
  const int mp = (m + VW - 1) / VW * VW;
  float* qt = aligned_workspace(ws);             // [hs][mp] scaled queries, transposed
  float* s = qt + int64_t(mp) * hsp;             // [chunk][mp] scores, then probabilities
  float* acc = s + int64_t(mp) * kLaneChunk;     // [mp][hspv] unnormalised outputs
  float* run_max = acc + int64_t(mp) * hspv;     // [mp]
  float* run_sum = run_max + mp;                 // [mp]
  float* kf = run_sum + mp;                      // [chunk][hsp] widened keys
  float* vf = kf + int64_t(kLaneChunk) * hsp;    // [chunk][hspv] widened values, zero padded
  float* row = vf + int64_t(kLaneChunk) * hspv;  // [hsp] one query row in fp32
  // Keys are copied (widened) into an L1 scratch chunk: the score tiles broadcast their
  // elements from several rows at once, which measured slower from the cache's rows in
  // place (fp32). fp32 values are read in place when their rows are whole
  // vectors (one row at a time); other values are widened once per chunk.
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool values_in_place = kFloat && hsv == hspv;
  if (!values_in_place) std::memset(vf, 0, sizeof(float) * kLaneChunk * hspv);
  constexpr float kUnit = StoredUnit<T>::value;
  const char* query = static_cast<const char*>(P.query);
  const int64_t query_elem = P.query_kind == ScalarKind::kFloat32 ? 4 : 2;
  const int32_t* table = P.block_tables + int64_t(w.seq) * P.block_table_stride;
  const bool soft_cap = P.soft_cap > 0.0f;
  const float inv_cap = soft_cap ? 1.0f / P.soft_cap : 0.0f;
  const bool short_exp = short_exp_output<T>(P.query_kind);  // the shorter exp (exp_minus)
  auto softmax = [&](int v0, int n) {
    if constexpr (sizeof(T) < sizeof(float))
      if (short_exp) return query_vector_softmax<true>(s, n, mp, v0, m, run_max, run_sum, acc, hspv);
    query_vector_softmax<false>(s, n, mp, v0, m, run_max, run_sum, acc, hspv);
  };

  for (int kv = w.kv_head_begin; kv < w.kv_head_end; ++kv) {
    const float q_scale = P.k_scale ? P.scale * (P.k_scale[kv * P.k_scale_stride] * kUnit) : P.scale;
    std::memset(qt, 0, sizeof(float) * mp * hsp);
    for (int i = 0; i < m; ++i) {
      const int token = w.row_begin + i / group, head = kv * group + i % group;
      query_row_to_float(P.query_kind,
                         query + (token * P.query_token_stride + head * P.query_head_stride) * query_elem,
                         row, hs);
      for (int d = 0; d < hs; ++d) qt[int64_t(d) * mp + i] = row[d] * q_scale;
    }
    std::fill(run_max, run_max + mp, -__builtin_inff());
    std::fill(run_sum, run_sum + mp, 0.0f);
    std::memset(acc, 0, sizeof(float) * mp * hspv);
    const int64_t k_head = kv * P.k_head_stride, v_head = kv * P.v_head_stride;
    // The stored rows of keys [j0, j0 + n) of this head.
    const T* k_src[2][kLaneChunk];
    const T* v_src[2][kLaneChunk];
    auto locate = [&](int j0, int n, const T** k_out, const T** v_out) {
      lane_locate(P, table, k_head, v_head, j0, n, k_out, v_out);
    };
    const float* k_rows[kLaneChunk];
    const float* v_rows[kLaneChunk];
    int current = 0;
    locate(w.kv_begin, std::min(kLaneChunk, w.kv_end - w.kv_begin), k_src[0], v_src[0]);
    for (int j0 = w.kv_begin; j0 < w.kv_end; j0 += kLaneChunk) {
      const int n = std::min(kLaneChunk, w.kv_end - j0);
      // The next chunk's rows are fetched while this one computes (LaneAhead).
      const int next_n = std::max(0, std::min(kLaneChunk, w.kv_end - j0 - kLaneChunk));
      if (next_n > 0) locate(j0 + kLaneChunk, next_n, k_src[1 - current], v_src[1 - current]);
      LaneAhead<T> ahead(k_src[1 - current], v_src[1 - current], next_n, int(hs * sizeof(T)),
                         int(hsv * sizeof(T)));
      for (int t = 0; t < n; ++t) {
        row_to_float(k_src[current][t], kf + int64_t(t) * hsp, hs);
        k_rows[t] = kf + int64_t(t) * hsp;
        if (values_in_place) {
          v_rows[t] = reinterpret_cast<const float*>(v_src[current][t]);
        } else {
          row_to_float(v_src[current][t], vf + int64_t(t) * hspv, hsv);
          v_rows[t] = vf + int64_t(t) * hspv;
        }
      }
      current = 1 - current;
      lane_scores(qt, mp, k_rows, n, hs, s, ahead);
      if (soft_cap)
        for (int64_t i = 0; i < int64_t(n) * mp; ++i) s[i] = P.soft_cap * std::tanh(s[i] * inv_cap);
      for (int v0 = 0; v0 < mp; v0 += VW) softmax(v0, n);
      lane_values(acc, hspv, s, mp, v_rows, n, m);
    }
    // As the general kernel's epilogue: the sink (partition 0), the fp8 value scale, lse.
    const float v_factor = P.v_scale ? P.v_scale[kv * P.v_scale_stride] * kUnit : 1.0f;
    for (int i = 0; i < m; ++i) {
      const int token = w.row_begin + i / group, head = kv * group + i % group;
      const float inv = finish_query(P, w, token, head, run_max[i], run_sum[i], v_factor);
      const float* am = acc + int64_t(i) * hspv;
      write_output(P, w, token, head, [&](float* o) {
        for (int d = 0; d < hsv; ++d) o[d] = am[d] * inv;
      });
    }
  }
}
