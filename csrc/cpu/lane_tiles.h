// What the queries-in-lanes micro-kernels of the attention driver share (attention_kernel.h;
// lane_float_tiles.h: fp32 FMAs; lane_pair_tiles.h: vdpbf16ps): their chunk length, the
// paced prefetch of the next chunk's rows, their workspace regions and shape, and a query's
// stored row. Part of the CPU kernel, inside its ISA namespace (see vec.h).
//
// Queries sit in vector lanes: a chunk's scores are s[t][query] (rows mp apart), so the
// driver's softmax runs down the lanes (one max, exp and sum per query vector), and the
// driver walks the item KV head by KV head (kHeadsOuter), one head's queries and
// accumulators held in L1. A lane micro-kernel supplies, besides the traits kLayout and
// kHeadsOuter:
//   Tiles(P, LaneWorkspace, LaneShape)   its regions of the workspace
//   load_queries(P, w, st)     the KV head's queries, transposed, scaled, in its order
//   load_chunk(k, v, n, scales)  the chunk's n stored key and value rows, converted from the
//                              cache format into what its tiles read (per-token rows: with
//                              their scales, ChunkTokenScales)
//   scores(st, n, ahead, next_n)
//                              s[t][query] of the chunk's keys, the softmax scale and
//                              k_scale (per-token rows: each key's scale) applied;
//                              fetches the next chunk's next_n key rows ahead[t] and
//                              value rows ahead[kKeyChunk + t] (LaneAhead)
//   probabilities(st, n, v0)   after the softmax of query vector v0 (e.g. rounding to pairs)
//   values(st, n)              acc[query][d] += probabilities x values
//   output_row(am, o, hsv, inv)  a finished accumulator row into output order, times inv
//   value_unit()               the factor of the weighted sums for the rows' unit
//                              (StoredUnit, where the tiles widened e4m3 values)
// Every K and V row is read once per item, and each serves all the item's queries from
// registers.

#pragma once

#include "convert.h"
#include "prefetch.h"
#include "query_rows.h"
#include "vec.h"

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

// A lane item's workspace regions (floats, each a multiple of VW from a cache line): the
// tiles' queries, the scores [kLaneChunk][mp], one KV head's accumulators [mp][hspv], its
// running max and sum [mp], the tiles' keys and values of a chunk and one row of scratch.
// Within kernel_workspace_floats of m + kWorkspacePaddingQueries queries.
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

// Per-token rows with one scale each (int8, the one per-token format the lane tiles take):
// the scales of a chunk's keys and values in row order, as the driver gathers them; nullptr
// for other formats.
struct ChunkTokenScales {
  const float *k_scale, *v_scale;
};

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
