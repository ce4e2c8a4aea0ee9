// The queries-in-lanes online-softmax driver: the CPU kernel for work items whose queries all
// see every key of the item and are many per KV head (shared_prefix_attention: the queries of
// a group over its shared prefix). Part of the CPU kernel, inside its ISA namespace (see
// vec.h).
//
// Queries sit in vector lanes. KV head by KV head, the driver walks the item's keys in chunks
// of kLaneChunk and owns everything but the products: the row lookup through the block table,
// the next chunk's prefetch (LaneAhead), the soft cap, the online softmax down the lanes (one
// max, exp and sum per query vector, query_vector_softmax), the accumulators' rescale and the
// epilogue (sink, lse, value scale, output row). Its micro-kernel, `Tiles` (lane_float_tiles.h:
// fp32 FMAs; lane_pair_tiles.h: vdpbf16ps), supplies what differs by format and instruction set:
//   Tiles(P, LaneWorkspace, LaneShape)       its regions of the workspace
//   load_queries(w, kv, m)     the KV head's m queries, transposed, scaled, in its order
//   load_chunk(k, v, n)        the chunk's n stored key and value rows, converted from the
//                              cache format into what its tiles read
//   scores(s, n, ahead)        s[t][query] of the chunk's keys, the softmax scale and
//                              k_scale applied; steps `ahead` through the next chunk's rows
//   probabilities(s, n, v0)    after the softmax of query vector v0 (e.g. rounding to pairs)
//   values(acc, s, n, m)       acc[query][d] += probabilities x values, the first m queries
//   output_row(am, o, inv)     a finished accumulator row into output order, times inv
//   kValueUnit                 the factor of the weighted sums for the rows' unit
//                              (StoredUnit, where the tiles widened e4m3 values)
// Every K and V row is read once per item, and each serves all the item's queries from
// registers.

#pragma once

#include "convert.h"
#include "prefetch.h"
#include "query_rows.h"
#include "vec.h"
#include "vec_exp.h"

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

// The lane driver's workspace regions (floats, each a multiple of VW from a cache line): the
// tiles' queries, the scores [kLaneChunk][mp], the accumulators [mp][hspv], the running max
// and sum [mp], the tiles' keys and values of a chunk and one row of scratch. Within
// kernel_workspace_floats of m + kWorkspacePaddingQueries queries.
struct LaneWorkspace {
  float *queries, *scores, *acc, *run_max, *run_sum, *keys, *values, *row;
};

// The shape of a lane item: head sizes (padded to whole vectors) and queries per KV head
// (padded to whole query vectors).
struct LaneShape {
  int hs, hsv, hsp, hspv, m, mp;
};

static inline LaneWorkspace lane_workspace(float* ws, const LaneShape& d) {
  LaneWorkspace r;
  r.queries = aligned_workspace(ws);                   // [hsp][mp]
  r.scores = r.queries + int64_t(d.mp) * d.hsp;        // [chunk][mp]
  r.acc = r.scores + int64_t(d.mp) * kLaneChunk;       // [mp][hspv]
  r.run_max = r.acc + int64_t(d.mp) * d.hspv;          // [mp]
  r.run_sum = r.run_max + d.mp;                        // [mp]
  r.keys = r.run_sum + d.mp;                           // [chunk][hsp]
  r.values = r.keys + int64_t(kLaneChunk) * d.hsp;     // [chunk][hspv]
  r.row = r.values + int64_t(kLaneChunk) * d.hspv;     // [hsp]
  return r;
}

// Query i of KV head kv in a lane item (rows x GQA group): its token and head.
struct LaneQuery {
  int token, head;
};
static inline LaneQuery lane_query(const AttentionParams& P, const WorkItem& w, int kv, int i) {
  const int group = P.num_heads / P.num_kv_heads;
  return {w.row_begin + i / group, kv * group + i % group};
}

// The stored row of a query (the query's dtype).
static inline const char* query_row(const AttentionParams& P, LaneQuery q) {
  const int64_t elem = P.query_kind == ScalarKind::kFloat32 ? 4 : 2;
  return static_cast<const char*>(P.query) + (q.token * P.query_token_stride + q.head * P.query_head_stride) * elem;
}

// One work item of shared_prefix_attention (every query sees keys [kv_begin, kv_end)),
// KV head by KV head, on the micro-kernel Tiles.
template <typename T, typename Tiles>
void lane_driver(const AttentionParams& P, const WorkItem& w, float* ws) {
  LaneShape shape;
  shape.hs = P.head_size;
  shape.hsv = P.head_size_v;
  shape.hsp = (shape.hs + VW - 1) / VW * VW;
  shape.hspv = (shape.hsv + VW - 1) / VW * VW;
  shape.m = (w.row_end - w.row_begin) * (P.num_heads / P.num_kv_heads);  // queries of one KV head
  shape.mp = (shape.m + VW - 1) / VW * VW;
  const int m = shape.m, mp = shape.mp, hspv = shape.hspv;
  const LaneWorkspace r = lane_workspace(ws, shape);
  Tiles tiles(P, r, shape);
  float* s = r.scores;
  float* acc = r.acc;
  float* run_max = r.run_max;
  float* run_sum = r.run_sum;
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
    tiles.load_queries(w, kv, m);
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
    int current = 0;
    locate(w.kv_begin, std::min(kLaneChunk, w.kv_end - w.kv_begin), k_src[0], v_src[0]);
    for (int j0 = w.kv_begin; j0 < w.kv_end; j0 += kLaneChunk) {
      const int n = std::min(kLaneChunk, w.kv_end - j0);
      // The next chunk's rows are fetched while this one computes (LaneAhead).
      const int next_n = std::max(0, std::min(kLaneChunk, w.kv_end - j0 - kLaneChunk));
      if (next_n > 0) locate(j0 + kLaneChunk, next_n, k_src[1 - current], v_src[1 - current]);
      LaneAhead<T> ahead(k_src[1 - current], v_src[1 - current], next_n, int(shape.hs * sizeof(T)),
                         int(shape.hsv * sizeof(T)));
      tiles.load_chunk(k_src[current], v_src[current], n);
      current = 1 - current;
      tiles.scores(s, n, ahead);
      if (soft_cap)
        for (int64_t i = 0; i < int64_t(n) * mp; ++i) s[i] = P.soft_cap * std::tanh(s[i] * inv_cap);
      for (int v0 = 0; v0 < mp; v0 += VW) {
        softmax(v0, n);
        tiles.probabilities(s, n, v0);
      }
      tiles.values(acc, s, n, m);
    }
    // As the row kernel's epilogue: the sink (partition 0), the value scale, lse.
    const float v_factor = P.v_scale ? P.v_scale[kv * P.v_scale_stride] * Tiles::kValueUnit : 1.0f;
    for (int i = 0; i < m; ++i) {
      const LaneQuery q = lane_query(P, w, kv, i);
      const float inv = finish_query(P, w, q.token, q.head, run_max[i], run_sum[i], v_factor);
      write_output(P, w, q.token, q.head, [&](float* o) { tiles.output_row(acc + int64_t(i) * hspv, o, inv); });
    }
  }
}
