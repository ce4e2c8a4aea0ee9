// CPU implementation of paged.attention / attention_with_lse / attention_out and
// shared_prefix_attention: validates, splits the call into work items, runs the ISA kernel on them in
// parallel, and merges split-KV partitions into the caller's dtype.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <utility>
#include <vector>

#include "../attention_args.h"
#include "../attention_outputs.h"
#include "../checks.h"
#include "../dtypes.h"
#include "../layout.h"
#include "attention_params.h"
#include "cpu_features.h"
#include "output_rounding.h"
#include "token_quantization.h"

namespace paged::cpu {
namespace {

// Split a query tile's keys only into partitions at least this long.
constexpr int64_t kMinPartitionTokens = 256;
// Aim for this many work items per thread so dynamic scheduling balances.
constexpr int64_t kItemsPerThread = 4;
// Below this many multiply-adds per thread (~0.1 ms) waking more threads costs more
// than it saves, and on a busy machine it can wait for a core that is not free.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 19;

struct Plan {
  int num_threads = 1;  // enough work for each, never more than torch's setting
  std::vector<WorkItem> items;
  std::vector<int32_t> parts_of_token;  // partitions that hold each query row's result
  int32_t max_parts = 1;
  int max_queries_per_item = 1;
};

// Rows [row_begin, row_end) of a sequence, the first at position first_pos, against the keys
// [kv_begin, kv_end). The keys every row sees are not split off from the rest: the kernels
// mask per chunk, and a split only added items and partition merges (causal multi-token
// measured faster whole, docs/performance.md).
struct QueryTile {
  int32_t seq, row_begin, row_end, first_pos, kv_begin, kv_end;
};

Plan make_plan(const AttentionShape& s, const AttentionArgs& args, int max_threads,
               const PlanHints& hints) {
  const int64_t queries_per_item = hints.queries_per_item;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t rows_per_tile = std::max<int64_t>(1, queries_per_item / group);
  const int32_t* lens = args.seq_lens.mutable_data_ptr<int32_t>();
  const int64_t lens_stride = args.seq_lens.stride(0);

  std::vector<QueryTile> tiles;
  int64_t longest = 0;
  int64_t query_key_pairs = 0;  // per query head
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int32_t kv_len = lens[i * lens_stride];
    int32_t q_begin = int32_t(i), q_len = 1;
    if (args.query_start_loc.has_value()) {
      const Tensor& qsl = *args.query_start_loc;
      const int32_t* starts = qsl.mutable_data_ptr<int32_t>();
      q_begin = starts[i * qsl.stride(0)];
      q_len = starts[(i + 1) * qsl.stride(0)] - q_begin;
    }
    for (int32_t r0 = 0; r0 < q_len; r0 += int32_t(rows_per_tile)) {
      const int32_t r1 = int32_t(std::min<int64_t>(q_len, r0 + rows_per_tile));
      if (args.placement == QueryPlacement::kAfterKeys) {
        // Every row at the last key's position or later sees every key (no window then).
        tiles.push_back({int32_t(i), q_begin + r0, q_begin + r1, kv_len - 1, 0, kv_len});
        longest = std::max<int64_t>(longest, kv_len);
        query_key_pairs += int64_t(kv_len) * (r1 - r0);
        continue;
      }
      // Decode rows of padded sequences (kv_len 0) sit at position -1 and see nothing.
      const int32_t first_pos = kv_len - q_len + r0;
      const int32_t last_pos = kv_len - q_len + r1 - 1;
      int32_t kv_begin = 0;
      if (args.sliding_window > 0)
        kv_begin = std::max<int32_t>(0, first_pos - int32_t(args.sliding_window) + 1);
      const int32_t kv_end = std::max<int32_t>(kv_begin, last_pos + 1);
      tiles.push_back({int32_t(i), q_begin + r0, q_begin + r1, first_pos, kv_begin, kv_end});
      longest = std::max<int64_t>(longest, kv_end - kv_begin);
      query_key_pairs += int64_t(kv_end - kv_begin) * (r1 - r0);
    }
  }

  Plan plan;
  // Multiply-adds: a dot product with each key and a weighted sum of each value.
  const int64_t work = query_key_pairs * s.num_heads * (s.head_size + s.head_size_v);
  plan.num_threads = int(std::clamp<int64_t>(work / kMinWorkPerThread, 1, std::max(1, max_threads)));
  const int num_threads = plan.num_threads;

  // KV heads per item: as many as queries_per_item queries allow. A decode row takes
  // every head of a block, and in the HND layout those heads are adjacent, so the item
  // reads long runs of memory instead of one head's rows here and there.
  auto head_groups_of = [&](const QueryTile& t) {
    const int64_t queries_per_head = int64_t(t.row_end - t.row_begin) * group;
    const int64_t heads = std::clamp<int64_t>(queries_per_item / queries_per_head, 1, s.num_kv_heads);
    return (s.num_kv_heads + heads - 1) / heads;
  };
  int64_t base_items = 0;
  for (const QueryTile& t : tiles) base_items += head_groups_of(t);
  // Too few items for the threads: split long key ranges first, then the heads. One thread
  // has nothing to balance: splits would only add items' set-up and partition merges
  // (measured: one thread decodes faster unsplit, most at short contexts).
  const int64_t wanted = num_threads > 1 ? kItemsPerThread * num_threads : 1;
  int64_t parts = 1, head_split = 1;
  if (base_items > 0 && base_items < wanted) {
    parts = (wanted + base_items - 1) / base_items;
    parts = std::min(parts, std::max<int64_t>(1, longest / kMinPartitionTokens));
    head_split = (wanted + base_items * parts - 1) / (base_items * parts);
  }

  plan.parts_of_token.assign(s.num_tokens, 1);
  plan.items.reserve(base_items * parts * head_split);
  std::vector<std::pair<int32_t, int32_t>> ranges;  // one tile's partitions' keys
  for (const QueryTile& t : tiles) {
    // The tile's keys cut into up to `parts` partitions on 16-token multiples (block-aligned
    // chunks).
    ranges.clear();
    const int64_t range = t.kv_end - t.kv_begin;
    const int64_t n = std::max<int64_t>(1, std::min(parts, range / kMinPartitionTokens));
    const int64_t step = ((range + n - 1) / n + 15) / 16 * 16;
    for (int64_t p = 0; p < n; ++p) {
      const int64_t b = t.kv_begin + p * step;
      if (p > 0 && b >= t.kv_end) break;
      ranges.emplace_back(int32_t(b), int32_t(std::min<int64_t>(t.kv_end, b + step)));
    }
    const int64_t head_groups = std::min<int64_t>(s.num_kv_heads, head_groups_of(t) * head_split);
    int32_t used = 0;
    for (const auto& [b, e] : ranges) {
      const int32_t p = used;
      for (int64_t g = 0; g < head_groups; ++g) {
        const int32_t h0 = int32_t(g * s.num_kv_heads / head_groups);
        const int32_t h1 = int32_t((g + 1) * s.num_kv_heads / head_groups);
        plan.items.push_back({t.seq, h0, h1, t.row_begin, t.row_end, t.first_pos, b, e, p});
        plan.max_queries_per_item =
            std::max<int>(plan.max_queries_per_item, int((t.row_end - t.row_begin) * group * (h1 - h0)));
      }
      ++used;
    }
    for (int32_t r = t.row_begin; r < t.row_end; ++r) plan.parts_of_token[r] = used;
    plan.max_parts = std::max(plan.max_parts, used);
  }
  // Longest ranges first so the dynamic schedule ends evenly.
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const WorkItem& a, const WorkItem& b) {
    return int64_t(a.kv_end - a.kv_begin) * (a.row_end - a.row_begin) * (a.kv_head_end - a.kv_head_begin) >
           int64_t(b.kv_end - b.kv_begin) * (b.row_end - b.row_begin) * (b.kv_head_end - b.kv_head_begin);
  });
  return plan;
}

static_assert(kMaxValueHeadSize <= kMaxOutputRow, "a direct 16-bit output row must fit the kernels' stack row");

void run_items(const AttentionParams& params, const Plan& plan) {
  const AttentionKernelFn kernel = attention_kernel_for(params.kind);
  const int64_t padded_head = (std::max(params.head_size, params.head_size_v) + 15) / 16 * 16;
  const int64_t workspace_floats =
      kernel_workspace_floats(int(padded_head), plan.max_queries_per_item + kWorkspacePaddingQueries);
  const int64_t n = int64_t(plan.items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(plan.num_threads) if (plan.num_threads > 1)
  for (int64_t i = 0; i < n; ++i) {
    // Grows once per thread; later calls reuse it (no allocation in the hot path).
    thread_local std::vector<float> workspace;
    if (int64_t(workspace.size()) < workspace_floats) workspace.resize(workspace_floats);
    kernel(params, plan.items[i], workspace.data());
  }
}

// dst[d] = v[d] * factor in scalar_t, 16-bit rows rounded as the kernels round them.
template <typename scalar_t>
void store_row(const float* v, float factor, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, BFloat16>) {
    store_bf16_row(v, factor, reinterpret_cast<uint16_t*>(dst), n);
  } else if constexpr (std::is_same_v<scalar_t, Half>) {
    store_fp16_row(v, factor, reinterpret_cast<uint16_t*>(dst), n);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = scalar_t(v[d] * factor);
  }
}

// Merge the fp32 partition results of each (token, head) into out / lse.
template <typename scalar_t>
void merge_partitions(const Tensor& part_out, const Tensor& part_lse, const Plan& plan,
                      Tensor& out, float* lse, int64_t lse_token_stride) {
  const int64_t num_tokens = out.size(0), num_heads = out.size(1), hs = out.size(2);
  const float* po = part_out.mutable_data_ptr<float>();
  const float* pl = part_lse.mutable_data_ptr<float>();
  const int64_t part_stride_o = num_tokens * num_heads * hs, part_stride_l = num_tokens * num_heads;
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t ots = out.stride(0), ohs = out.stride(1);
  torch::stable::parallel_for(0, num_tokens * num_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(plan.max_parts), row(hs);
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / num_heads, h = th % num_heads;
      const int parts = plan.parts_of_token[t];
      float best = -std::numeric_limits<float>::infinity();
      for (int p = 0; p < parts; ++p) best = std::max(best, pl[p * part_stride_l + th]);
      scalar_t* dst = o + t * ots + h * ohs;
      if (best == -std::numeric_limits<float>::infinity()) {
        for (int64_t d = 0; d < hs; ++d) dst[d] = scalar_t(0.0f);
        if (lse) lse[t * lse_token_stride + h] = best;
        continue;
      }
      if (parts == 1) {  // a dtype conversion only
        store_row(po + th * hs, 1.0f, dst, hs);
        if (lse) lse[t * lse_token_stride + h] = best;
        continue;
      }
      float total = 0.0f;
      for (int p = 0; p < parts; ++p) {
        weights[p] = std::exp(pl[p * part_stride_l + th] - best);
        total += weights[p];
      }
      std::fill(row.begin(), row.end(), 0.0f);
      for (int p = 0; p < parts; ++p) {
        if (weights[p] == 0.0f) continue;
        const float* src = po + p * part_stride_o + th * hs;
        for (int64_t d = 0; d < hs; ++d) row[d] += weights[p] * src[d];
      }
      store_row(row.data(), 1.0f / total, dst, hs);
      if (lse) lse[t * lse_token_stride + h] = best + std::log(total);
    }
  });
}

// The checked call's attention into out / lse.
// query_from_16bit: int4 rows' rotated fp32 query came from a 16-bit one (AttentionParams).
void run_attention(const AttentionShape& s, const AttentionArgs& args, Tensor& out,
                   const std::optional<Tensor>& lse, bool query_from_16bit = false) {
  const auto contiguous = [](const std::optional<Tensor>& t) {
    return t.has_value() ? std::optional<Tensor>(torch::stable::contiguous(*t)) : std::nullopt;
  };
  const std::optional<Tensor> slopes = contiguous(args.alibi_slopes);
  const std::optional<Tensor> sink_logits = contiguous(args.sinks);
  // [] / [1] / [num_kv_heads] scales as one contiguous row (read at kv_head * stride).
  const auto scale_row = [](const std::optional<Tensor>& t) {
    if (!t.has_value()) return std::optional<Tensor>();
    return std::optional<Tensor>(torch::stable::contiguous(torch::stable::reshape(*t, {-1})));
  };
  // Per-token scales are read in place, paged like their caches.
  const bool per_token = is_per_token(args.key_cache.scalar_type());
  const std::optional<Tensor> k_scales = per_token ? std::nullopt : scale_row(args.k_scale);
  const std::optional<Tensor> v_scales = per_token ? std::nullopt : scale_row(args.v_scale);
  // The kernel's own OpenMP region: one thread when called inside another one.
  const int max_threads = omp_in_parallel() ? 1 : int(torch::stable::get_num_threads());

  AttentionParams p{};
  p.kind = scalar_kind(args.key_cache.scalar_type());
  p.query_kind = scalar_kind(args.query.scalar_type());
  p.query_from_16bit = query_from_16bit;
  p.query = args.query.data_ptr();
  p.query_token_stride = args.query.stride(0);
  p.query_head_stride = args.query.stride(1);
  p.key_cache = args.key_cache.data_ptr();
  p.value_cache = args.value_cache.data_ptr();
  p.k_block_stride = args.key_cache.stride(0);
  p.k_head_stride = args.key_cache.stride(1);
  p.k_token_stride = args.key_cache.stride(2);
  p.v_block_stride = args.value_cache.stride(0);
  p.v_head_stride = args.value_cache.stride(1);
  p.v_token_stride = args.value_cache.stride(2);
  p.k_scale = k_scales.has_value() ? k_scales->mutable_data_ptr<float>() : nullptr;
  p.v_scale = v_scales.has_value() ? v_scales->mutable_data_ptr<float>() : nullptr;
  p.k_scale_stride = k_scales.has_value() && k_scales->numel() > 1 ? 1 : 0;
  p.v_scale_stride = v_scales.has_value() && v_scales->numel() > 1 ? 1 : 0;
  if (per_token) {
    p.k_token_scale = args.k_scale->mutable_data_ptr<float>();
    p.v_token_scale = args.v_scale->mutable_data_ptr<float>();
    for (int d = 0; d < 3; ++d) {
      p.k_token_scale_strides[d] = args.k_scale->stride(d);
      p.v_token_scale_strides[d] = args.v_scale->stride(d);
    }
  }
  p.block_tables = args.block_tables.mutable_data_ptr<int32_t>();
  p.block_table_stride = args.block_tables.stride(0);
  p.seq_lens = args.seq_lens.mutable_data_ptr<int32_t>();
  p.alibi_slopes = slopes.has_value() ? slopes->mutable_data_ptr<float>() : nullptr;
  p.sinks = sink_logits.has_value() ? sink_logits->mutable_data_ptr<float>() : nullptr;
  p.num_heads = int(s.num_heads);
  p.num_kv_heads = int(s.num_kv_heads);
  p.head_size = int(s.head_size);
  p.head_size_v = int(s.head_size_v);
  p.block_size = int(s.block_size);
  p.scale = float(args.scale);
  p.soft_cap = float(args.soft_cap);
  p.sliding_window = int(args.sliding_window);
  p.queries_after_keys = args.placement == QueryPlacement::kAfterKeys;
  const Plan plan = make_plan(s, args, max_threads, plan_hints(p));

  // Results go straight into `out` when there is nothing to merge: fp32, or 16-bit rows
  // rounded as the merge would (no fp32 copy of the output to allocate, fill, read back and
  // convert, which measured a large share of short-context decode).
  const bool direct = plan.max_parts == 1;
  std::optional<Tensor> part_out, part_lse;  // none when direct: nothing allocated
  if (direct) {
    p.out = out.data_ptr();
    p.out_kind = scalar_kind(out.scalar_type());
    p.out_token_stride = out.stride(0);
    p.out_head_stride = out.stride(1);
    p.lse = lse.has_value() ? lse->mutable_data_ptr<float>() : nullptr;
    p.lse_token_stride = lse.has_value() ? lse->stride(0) : 0;
  } else {
    part_out =
        empty({plan.max_parts, s.num_tokens, s.num_heads, s.head_size_v}, kFloat, args.query);
    part_lse = empty({plan.max_parts, s.num_tokens, s.num_heads}, kFloat, args.query);
    p.out = part_out->mutable_data_ptr<float>();
    p.out_part_stride = s.num_tokens * s.num_heads * s.head_size_v;
    p.out_token_stride = s.num_heads * s.head_size_v;
    p.out_head_stride = s.head_size_v;
    p.lse = part_lse->mutable_data_ptr<float>();
    p.lse_part_stride = s.num_tokens * s.num_heads;
    p.lse_token_stride = s.num_heads;
  }
  run_items(p, plan);
  if (direct) return;

  float* lse_ptr = lse.has_value() ? lse->mutable_data_ptr<float>() : nullptr;
  const int64_t lse_stride = lse.has_value() ? lse->stride(0) : 0;
  dispatch_float(out.scalar_type(), [&]<typename scalar_t>() {
    merge_partitions<scalar_t>(*part_out, *part_lse, plan, out, lse_ptr, lse_stride);
  });
}

// The query rows in fp32, each head's row rotated as int4 rows are (token_quantization.h).
Tensor rotated_queries(const Tensor& query) {
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), hs = query.size(2);
  Tensor rotated = empty({num_tokens, num_heads, hs}, kFloat, query);
  float* dst = rotated.mutable_data_ptr<float>();
  dispatch_float(query.scalar_type(), [&]<typename scalar_t>() {
    const scalar_t* src = query.mutable_data_ptr<scalar_t>();
    torch::stable::parallel_for(0, num_tokens * num_heads, 16, [&](int64_t begin, int64_t end) {
      for (int64_t th = begin; th < end; ++th) {
        const scalar_t* row = src + (th / num_heads) * query.stride(0) + (th % num_heads) * query.stride(1);
        float* r = dst + th * hs;
        for (int64_t d = 0; d < hs; ++d) r[d] = float(row[d]);
        rotate(r, int(hs));
      }
    });
  });
  return rotated;
}

// out = the rotated fp32 rows turned back (per head), in out's dtype, with the rotation of
// rows `width` wide: the value rows' own (width = head_size_v), or for latent rows, whose
// values are their keys' leading columns, the key rows' (blocks of rotation_block(576) = 64
// channels, not of 512): the row is unrotated zero-padded to that width, its blocks apart.
void unrotate_into(const Tensor& rotated, Tensor& out, int64_t width) {
  const int64_t num_tokens = out.size(0), num_heads = out.size(1), hs = out.size(2);
  const float* src = rotated.mutable_data_ptr<float>();
  dispatch_float(out.scalar_type(), [&]<typename scalar_t>() {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    torch::stable::parallel_for(0, num_tokens * num_heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(width, 0.0f);
      for (int64_t th = begin; th < end; ++th) {
        std::memcpy(row.data(), src + th * hs, sizeof(float) * hs);
        std::fill(row.begin() + hs, row.end(), 0.0f);
        unrotate(row.data(), int(width));
        store_row(row.data(), 1.0f, o + (th / num_heads) * out.stride(0) + (th % num_heads) * out.stride(1), hs);
      }
    });
  });
}

void attention_into(const char* op, const AttentionArgs& args, Tensor& out,
                    const std::optional<Tensor>& lse) {
  const AttentionShape s = check_attention_args(op, args, &out, lse.has_value() ? &*lse : nullptr);
  check_attention_metadata(op, s, args);
  if (s.num_tokens == 0) return;
  if (args.key_cache.scalar_type() != kByte) return run_attention(s, args, out, lse);
  // int4 rows are rotated: attention over them takes rotated queries and gives rotated
  // outputs (in fp32, partitions merged there: the rotation is linear), turned back once;
  // the lse is the rotation's too (q . k is unchanged).
  const Tensor query = rotated_queries(args.query);
  Tensor rotated_out = empty({s.num_tokens, s.num_heads, s.head_size_v}, kFloat, query);
  const AttentionArgs rotated{query, args.key_cache, args.value_cache, args.block_tables,
                              args.seq_lens, args.scale, args.query_start_loc, args.alibi_slopes,
                              args.sliding_window, args.soft_cap, args.sinks, args.k_scale,
                              args.v_scale, args.placement};
  run_attention(s, rotated, rotated_out, lse, args.query.scalar_type() != kFloat);
  const bool latent = values_in_keys(args.key_cache, args.value_cache);
  unrotate_into(rotated_out, out, latent ? s.head_size : s.head_size_v);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(paged, CPU, m) { register_attention_outputs<attention_into>(m); }

}  // namespace paged::cpu
