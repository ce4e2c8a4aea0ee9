// The public output forms of paged.attention (a new tensor, the tensor and its lse, the
// caller's buffers) and the shared-prefix op, written once over a backend's
// `attention_into`, which checks the arguments and computes into `out` and, when given,
// `lse`. Each form gathers the op's arguments into AttentionArgs and allocates its results.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "attention_args.h"
#include "dtypes.h"

namespace paged {

using AttentionIntoFn = void (*)(const char* op, const AttentionArgs& args, Tensor& out,
                                 const std::optional<Tensor>& lse);

// [num_tokens, num_heads, head_size_v]: the query's rows and heads, the value cache's head
// size (an int4 cache's: twice its last dimension). A malformed query or cache is rejected by Into before the result is used; until
// then the empty output only needs some valid shape.
inline Tensor empty_out(const Tensor& query, const Tensor& value_cache) {
  std::vector<int64_t> sizes(query.sizes().begin(), query.sizes().end());
  if (sizes.size() == 3 && value_cache.dim() == 4)
    sizes[2] = value_cache.size(3) * values_per_element(value_cache.scalar_type());
  return empty(sizes, query.scalar_type(), query);
}

// fp32 [num_tokens, num_heads]; none for a malformed query, which Into rejects before the
// lse is used.
inline std::optional<Tensor> empty_lse(const Tensor& query) {
  if (query.dim() != 3) return std::nullopt;
  return empty({query.size(0), query.size(1)}, kFloat, query);
}

template <AttentionIntoFn Into>
Tensor attention(const Tensor& query, const Tensor& key_cache,
                 const Tensor& value_cache, const Tensor& block_tables,
                 const Tensor& seq_lens, double scale,
                 const std::optional<Tensor>& query_start_loc,
                 const std::optional<Tensor>& alibi_slopes, int64_t sliding_window,
                 double soft_cap, const std::optional<Tensor>& sinks,
                 const std::optional<Tensor>& k_scale,
                 const std::optional<Tensor>& v_scale) {
  const AttentionArgs args{query, key_cache, value_cache, block_tables, seq_lens, scale,
                           query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks,
                           k_scale, v_scale, QueryPlacement::kLastPositions};
  Tensor out = empty_out(query, value_cache);
  Into("paged.attention", args, out, std::nullopt);
  return out;
}

template <AttentionIntoFn Into>
std::tuple<Tensor, Tensor> attention_with_lse(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, double scale,
    const std::optional<Tensor>& query_start_loc, const std::optional<Tensor>& alibi_slopes,
    int64_t sliding_window, double soft_cap, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  const AttentionArgs args{query, key_cache, value_cache, block_tables, seq_lens, scale,
                           query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks,
                           k_scale, v_scale, QueryPlacement::kLastPositions};
  Tensor out = empty_out(query, value_cache);
  const std::optional<Tensor> lse = empty_lse(query);
  Into("paged.attention_with_lse", args, out, lse);
  return {out, *lse};
}

template <AttentionIntoFn Into>
void attention_out(Tensor& out, const std::optional<Tensor>& lse, const Tensor& query,
                   const Tensor& key_cache, const Tensor& value_cache,
                   const Tensor& block_tables, const Tensor& seq_lens, double scale,
                   const std::optional<Tensor>& query_start_loc,
                   const std::optional<Tensor>& alibi_slopes, int64_t sliding_window,
                   double soft_cap, const std::optional<Tensor>& sinks,
                   const std::optional<Tensor>& k_scale,
                   const std::optional<Tensor>& v_scale) {
  const AttentionArgs args{query, key_cache, value_cache, block_tables, seq_lens, scale,
                           query_start_loc, alibi_slopes, sliding_window, soft_cap, sinks,
                           k_scale, v_scale, QueryPlacement::kLastPositions};
  Into("paged.attention_out", args, out, lse);
}

// Attention of each group's queries over its shared prefix (no ALiBi, no window: both
// depend on the query's position, which the op does not know).
template <AttentionIntoFn Into>
std::tuple<Tensor, Tensor> shared_prefix_attention(
    const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
    const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
    double scale, double soft_cap, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  const std::optional<Tensor> starts = query_start_loc, no_alibi;
  const AttentionArgs args{query, key_cache, value_cache, block_tables, seq_lens, scale,
                           starts, no_alibi, /*sliding_window=*/-1, soft_cap, sinks,
                           k_scale, v_scale, QueryPlacement::kAfterKeys};
  Tensor out = empty_out(query, value_cache);
  const std::optional<Tensor> lse = empty_lse(query);
  Into("paged.shared_prefix_attention", args, out, lse);
  return {out, *lse};
}

// `m`: a backend's STABLE_TORCH_LIBRARY_IMPL library.
template <AttentionIntoFn Into, typename Library>
void register_attention_outputs(Library& m) {
  m.impl("attention", TORCH_BOX(&attention<Into>));
  m.impl("attention_with_lse", TORCH_BOX(&attention_with_lse<Into>));
  m.impl("attention_out", TORCH_BOX(&attention_out<Into>));
  m.impl("shared_prefix_attention", TORCH_BOX(&shared_prefix_attention<Into>));
}

}  // namespace paged
