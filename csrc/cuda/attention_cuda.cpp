// CUDA implementation of paged.attention / attention_with_lse / attention_out and
// shared_prefix_attention.
//
// Shapes, dtypes and devices are validated on the host. The metadata values
// (block ids, seq_lens, query_start_loc) live on the device and are not read
// here: that would need a host sync and break CUDA graph capture. The kernels
// clamp them instead, so no value can cause an out-of-bounds access (see
// attention_kernels.cu). The work split depends on shapes alone, so a captured
// graph replays correctly with new metadata values.
#include <cstdint>
#include <optional>

#include "../attention_args.h"
#include "../attention_outputs.h"
#include "../checks.h"
#include "../dtypes.h"
#include "cuda_checks.h"
#include "kernels.h"

namespace paged::cuda {
namespace {

constexpr int64_t kMaxGridY = 65535;

int multiprocessor_count(int device) {
  int count = 0;
  PAGED_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// The planner's view of a checked call: shapes only, never metadata values.
AttentionPlanInput plan_input(const AttentionShape& s, const AttentionArgs& args,
                              ScalarKind cache_kind) {
  AttentionPlanInput in{};
  in.num_tokens = s.num_tokens;
  in.num_seqs = s.num_seqs;
  in.num_heads = s.num_heads;
  in.num_kv_heads = s.num_kv_heads;
  in.block_size = s.block_size;
  in.max_blocks_per_seq = s.max_blocks_per_seq;
  in.sliding_window = args.sliding_window;
  in.head_size_v = s.head_size_v;
  in.multi_token = args.query_start_loc.has_value();
  in.multiprocessors = multiprocessor_count(args.query.get_device_index());
  for (int b = 0; b < 4; ++b) {
    // A bucket past the head size's most queries has no instance (the planner skips it).
    if (kQueryBuckets[b] > max_queries_per_cta(s.head_size_v)) continue;
    PAGED_CUDA_CHECK(attention_ctas_per_sm(cache_kind, int(s.head_size), int(s.head_size_v), b,
                                           &in.ctas_per_sm[b]));
  }
  return in;
}

void attention_into(const char* op, const AttentionArgs& args, Tensor& out,
                    const std::optional<Tensor>& lse) {
  const AttentionShape s = check_attention_args(op, args, &out, lse.has_value() ? &*lse : nullptr);
  PAGED_CHECK_VALUE(args.query.is_cuda(), op, ": argument 'query' must be a CUDA tensor, got ",
                    args.query.device());
  check_row_alignment(op, "key_cache", args.key_cache);
  check_row_alignment(op, "value_cache", args.value_cache);
  PAGED_CHECK_VALUE(s.num_seqs > 0 || s.num_tokens == 0, op, ": 'query' has ", s.num_tokens,
                    " rows but there are no sequences");
  PAGED_CHECK_VALUE(s.num_blocks <= INT32_MAX, op, ": more cache blocks than int32 block ids address");
  PAGED_CHECK_VALUE(s.num_tokens + s.num_seqs <= INT32_MAX, op,
                    ": too many query rows and sequences for one CUDA launch");
  PAGED_CHECK_VALUE(s.num_tokens * s.num_heads <= INT32_MAX, op,
                    ": too many query rows times heads for one CUDA launch");
  // The kernels step through key positions in int32, a chunk past the last key.
  PAGED_CHECK_VALUE(s.max_blocks_per_seq * s.block_size <= kMaxKeyPositions, op,
                    ": 'block_tables' addresses ", s.max_blocks_per_seq * s.block_size,
                    " keys per sequence; the CUDA kernel supports at most ", kMaxKeyPositions);
  if (s.num_tokens == 0 || s.num_heads == 0) return;

  const int32_t device = args.query.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  // The kernels index these densely (a no-op for the usual contiguous tensors).
  const auto contiguous = [](const std::optional<Tensor>& t) {
    return t.has_value() ? std::optional<Tensor>(torch::stable::contiguous(*t)) : std::nullopt;
  };
  const Tensor lens = torch::stable::contiguous(args.seq_lens);
  const std::optional<Tensor> starts = contiguous(args.query_start_loc);
  const std::optional<Tensor> slopes = contiguous(args.alibi_slopes);
  const std::optional<Tensor> sink_logits = contiguous(args.sinks);

  AttentionParams p{};
  p.kind = scalar_kind(args.query.scalar_type());
  p.cache_kind = scalar_kind(args.key_cache.scalar_type());
  p.query = args.query.data_ptr();
  p.query_token_stride = args.query.stride(0);
  p.query_head_stride = args.query.stride(1);
  p.key_cache = args.key_cache.data_ptr();
  p.value_cache = args.value_cache.data_ptr();
  p.key_layout = layout_of(args.key_cache, 1);  // in elements
  p.value_layout = layout_of(args.value_cache, 1);
  p.k_scale = scale_ptr(args.k_scale, &p.k_scale_stride);
  p.v_scale = scale_ptr(args.v_scale, &p.v_scale_stride);
  p.k_scale_layout = token_scale_layout(args.key_cache, args.k_scale);
  p.v_scale_layout = token_scale_layout(args.value_cache, args.v_scale);
  p.block_tables = args.block_tables.mutable_data_ptr<int32_t>();
  p.block_table_stride = args.block_tables.stride(0);
  p.seq_lens = lens.mutable_data_ptr<int32_t>();
  p.query_start_loc = starts.has_value() ? starts->mutable_data_ptr<int32_t>() : nullptr;
  p.alibi_slopes = slopes.has_value() ? slopes->mutable_data_ptr<float>() : nullptr;
  p.sinks = sink_logits.has_value() ? sink_logits->mutable_data_ptr<float>() : nullptr;
  p.num_tokens = int(s.num_tokens);
  p.num_seqs = int(s.num_seqs);
  p.num_heads = int(s.num_heads);
  p.num_kv_heads = int(s.num_kv_heads);
  p.head_size = int(s.head_size);
  p.head_size_v = int(s.head_size_v);
  p.block_size = int(s.block_size);
  p.num_blocks = int(s.num_blocks);
  p.max_blocks_per_seq = int(s.max_blocks_per_seq);
  p.scale = float(args.scale);
  p.soft_cap = float(args.soft_cap);
  p.sliding_window = int(args.sliding_window);  // checked <= INT32_MAX
  p.queries_after_keys = args.placement == QueryPlacement::kAfterKeys;
  p.out = out.data_ptr();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.lse = lse.has_value() ? lse->mutable_data_ptr<float>() : nullptr;
  p.lse_token_stride = lse.has_value() ? lse->stride(0) : 0;

  const AttentionPlan plan = plan_attention(plan_input(s, args, p.cache_kind));
  PAGED_CHECK_VALUE(s.num_kv_heads * plan.head_chunks <= kMaxGridY, op,
                    ": too many heads for one CUDA launch (num_kv_heads * ceil(num_heads / num_kv_heads / ",
                    max_queries_per_cta(s.head_size_v), ") must be <= ", kMaxGridY, ")");
  PAGED_CHECK_VALUE(plan.num_tiles <= INT32_MAX, op, ": too many query tiles for one CUDA launch");
  set_plan(p, plan);

  // Partition results: from the caching allocator, which under CUDA graph
  // capture hands out the graph's private pool, fixed across replays.
  std::optional<Tensor> part_out, part_lse;
  if (p.num_partitions > 1) {
    part_out = empty({p.num_partitions, s.num_tokens, s.num_heads, s.head_size_v}, kFloat, args.query);
    part_lse = empty({p.num_partitions, s.num_tokens, s.num_heads}, kFloat, args.query);
    p.part_out = part_out->mutable_data_ptr<float>();
    p.part_lse = part_lse->mutable_data_ptr<float>();
  }
  PAGED_CUDA_CHECK(launch_attention(p, current_stream(device)));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(paged, CUDA, m) { register_attention_outputs<attention_into>(m); }

}  // namespace paged::cuda
