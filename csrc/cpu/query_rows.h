// A work item's query rows in and out, shared by every CPU kernel (the attention driver,
// attention_kernel.h, its micro-kernels, and amx_kernel.h): a KV head's queries and
// online-softmax state (ItemState), a query row to fp32, the online-softmax rescale of
// accumulator rows, a query's epilogue (sink, lse, normalisation) and its output row. Part
// of the CPU kernel, inside its ISA namespace (see vec.h).
#pragma once

#include "convert.h"
#include "vec.h"

// Where a micro-kernel keeps a chunk's scores: queries in rows, s[query][key] (each query's
// softmax runs along its row), or queries in vector lanes, s[key][query] (the softmax runs
// down the lanes, a vector of queries at a time). The driver takes its softmax form from it.
enum class ScoreLayout { kQueriesInRows, kQueriesInLanes };

// One KV head's queries and online-softmax state within a work item, as the attention
// driver (attention_kernel.h) hands them to its micro-kernel. Regions by the micro-kernel's
// score layout: queries in rows (row_tiles.h) or in lanes (lane_tiles.h, whose queries are
// padded to mp, whole vectors).
struct ItemState {
  int kv_head;
  int num_queries;  // query rows x GQA group
  int group;
  int hsp;   // padded key head size
  int hspv;  // padded value head size
  float* q;        // rows: [num_queries, hsp] scaled queries, zero padded; lanes: the tiles'
                   // transposed queries
  uint16_t* q_bits;  // [num_queries, hsp] unscaled bf16 queries (rows' bf16 dot path only)
  uint16_t* q_quad;  // [num_queries, 4 hsp] the same in quad order (fp8 keys, quad_tile;
                           // int4 rows: the query in two bf16 parts and their sum, int4_bf16_tiles.h)
  float scale;     // applied to the scores of the bf16 dot paths (softmax scale x key scale)
  float* acc;      // [num_queries (lanes: mp), hspv] unnormalised outputs
  float* scores;   // rows: [num_queries, kKeyChunk]; lanes: [chunk, mp]; scores, then probabilities
  float* run_max;  // [num_queries (lanes: mp)]
  float* run_sum;  // [num_queries (lanes: mp)]
};

// One query row to fp32: the query has the cache's dtype, or any float dtype for fp8 caches.
static inline void query_row_to_float(ScalarKind kind, const char* row, float* dst, int n) {
  switch (kind) {
    case ScalarKind::kFloat16: row_to_float(reinterpret_cast<const Fp16*>(row), dst, n); break;
    case ScalarKind::kBFloat16: row_to_float(reinterpret_cast<const Bf16*>(row), dst, n); break;
    default: row_to_float(reinterpret_cast<const float*>(row), dst, n); break;
  }
}

// One query's epilogue, shared by every kernel: its head's sink (one more logit without a
// value; partition 0 takes it, and the merge of partitions by their lse counts it once),
// its lse, and the factor its unnormalised accumulator row is multiplied by (1 / sum times
// the value scale; 0 when it sees nothing).
static inline float finish_query(const AttentionParams& P, const WorkItem& w, int token, int head,
                                 float top, float sum, float v_factor) {
  float keep = 1.0f;
  if (P.sinks && w.partition == 0) {
    const float sink = P.sinks[head];
    if (sink > top) {
      keep = std::exp(top - sink);  // 0 when no key is visible (top = -inf)
      sum = sum * keep + 1.0f;
      top = sink;
    } else if (top != -__builtin_inff()) {
      sum += std::exp(sink - top);
    }
  }
  const bool any = sum > 0.0f;
  if (P.lse) {
    P.lse[w.partition * P.lse_part_stride + token * P.lse_token_stride + head] =
        any ? top + std::log(sum) : -__builtin_inff();
  }
  return any ? keep / sum * v_factor : 0.0f;
}

// Online-softmax rescale of `count` consecutive accumulator rows (hspv floats apart) by
// their factors alpha[l]; rows whose factor is 1 are left alone.
static inline void rescale_rows(float* acc, int hspv, const float* alpha, int count) {
  for (int l = 0; l < count; ++l) {
    if (alpha[l] == 1.0f) continue;
    float* am = acc + int64_t(l) * hspv;
    const vfloat a = splat(alpha[l]);
    for (int d = 0; d < hspv; d += VW) store(am + d, load(am + d) * a);
  }
}

// A query's finished output row: `fill(o)` writes its fp32 values into o, which is the
// output's own row when that is fp32, else a row on the stack then rounded into the 16-bit
// output (output_rounding.h).
template <typename Fill>
static inline void write_output(const AttentionParams& P, const WorkItem& w, int token, int head, Fill fill) {
  const int64_t slot = w.partition * P.out_part_stride + token * P.out_token_stride + head * P.out_head_stride;
  if (P.out_kind == ScalarKind::kFloat32) {
    fill(static_cast<float*>(P.out) + slot);
    return;
  }
  alignas(64) float row[kMaxOutputRow];
  fill(row);
  uint16_t* dst = static_cast<uint16_t*>(P.out) + slot;
  if (P.out_kind == ScalarKind::kBFloat16)
    store_bf16_row(row, 1.0f, dst, P.head_size_v);
  else
    store_fp16_row(row, 1.0f, dst, P.head_size_v);
}
