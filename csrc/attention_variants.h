// The public forms of paged.attention (and of the shared-prefix op, the same computation
// with every query after its keys), written once over a backend's `attention_into`
// (validate, then compute into `out` and optionally `lse`).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "scalar_kind.h"

namespace paged {

// The kernels' element type of an (already validated) attention dtype.
inline ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kFloat8_e4m3fn: return ScalarKind::kFloat8E4M3;
    case at::kFloat8_e5m2: return ScalarKind::kFloat8E5M2;
    default: return ScalarKind::kFloat32;
  }
}

// [num_tokens, num_heads, head_size_v] of a result: the query's rows and heads, the value
// cache's head size. A malformed query or cache is rejected by Into before the result is
// used; until then the empty output only needs some valid shape.
inline std::vector<int64_t> out_sizes(const at::Tensor& query, const at::Tensor& value_cache) {
  std::vector<int64_t> sizes(query.sizes().begin(), query.sizes().end());
  if (sizes.size() == 3 && value_cache.dim() == 4) sizes[2] = value_cache.size(3);
  return sizes;
}

// Where a sequence's query rows sit among its keys.
enum class QueryPlacement {
  kLastPositions,  // paged.attention: the last q_len positions, causal within them
  kAfterKeys,      // paged.shared_prefix_attention: after every key (each sees them all)
};

using AttentionIntoFn = void (*)(const char* op, QueryPlacement placement, at::Tensor& out,
                                 const std::optional<at::Tensor>& lse, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 double scale, const std::optional<at::Tensor>& query_start_loc,
                                 const std::optional<at::Tensor>& alibi_slopes,
                                 int64_t sliding_window, double soft_cap,
                                 const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale);

template <AttentionIntoFn Into>
at::Tensor attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale,
                     const std::optional<at::Tensor>& query_start_loc,
                     const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                     double soft_cap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  at::Tensor out = at::empty(out_sizes(query, value_cache), query.options());
  Into("paged.attention", QueryPlacement::kLastPositions, out, std::nullopt, query, key_cache, value_cache, block_tables,
       seq_lens, scale, query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks, k_scale, v_scale);
  return out;
}

template <AttentionIntoFn Into>
std::tuple<at::Tensor, at::Tensor> attention_with_lse(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
    const std::optional<at::Tensor>& query_start_loc, const std::optional<at::Tensor>& alibi_slopes,
    int64_t sliding_window, double soft_cap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  at::Tensor out = at::empty(out_sizes(query, value_cache), query.options());
  // A malformed query is rejected by Into before the lse is used.
  std::optional<at::Tensor> lse;
  if (query.dim() == 3) {
    lse = at::empty({query.size(0), query.size(1)}, query.options().dtype(at::kFloat));
  }
  Into("paged.attention_with_lse", QueryPlacement::kLastPositions, out, lse, query, key_cache, value_cache, block_tables,
       seq_lens, scale, query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks, k_scale, v_scale);
  return {out, *lse};
}

template <AttentionIntoFn Into>
void attention_out(at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   const std::optional<at::Tensor>& query_start_loc,
                   const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                   double soft_cap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  Into("paged.attention_out", QueryPlacement::kLastPositions, out, lse, query, key_cache, value_cache, block_tables, seq_lens,
       scale, query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks, k_scale, v_scale);
}

// Attention of each group's queries over its shared prefix (no ALiBi, no window: both
// depend on the query's position, which the op does not know).
template <AttentionIntoFn Into>
std::tuple<at::Tensor, at::Tensor> shared_prefix_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    double scale, double soft_cap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  at::Tensor out = at::empty(out_sizes(query, value_cache), query.options());
  std::optional<at::Tensor> lse;
  if (query.dim() == 3) {
    lse = at::empty({query.size(0), query.size(1)}, query.options().dtype(at::kFloat));
  }
  Into("paged.shared_prefix_attention", QueryPlacement::kAfterKeys, out, lse, query, key_cache,
       value_cache, block_tables, seq_lens, scale, query_start_loc, std::nullopt, -1, soft_cap,
       sinks, k_scale, v_scale);
  return {out, *lse};
}

template <AttentionIntoFn Into>
void register_attention_variants(torch::Library& m) {
  m.impl("attention", &attention<Into>);
  m.impl("attention_with_lse", &attention_with_lse<Into>);
  m.impl("attention_out", &attention_out<Into>);
  m.impl("shared_prefix_attention", &shared_prefix_attention<Into>);
}

}  // namespace paged
