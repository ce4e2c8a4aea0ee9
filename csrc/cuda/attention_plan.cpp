// The CUDA attention planner (see attention_plan.h). Plain C++: no torch, no
// CUDA runtime. All arithmetic on user-controlled sizes is int64.
#include "attention_plan.h"

#include <algorithm>
#include <cmath>

namespace paged::cuda {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static_assert(kChunkKeys % kCtaStepKeys == 0, "a CTA step never straddles two chunks");

// FlashAttention-2's split heuristic: a split count's wave efficiency is the
// share of CTA slots its launch keeps busy (ctas * splits / slots over the whole
// waves it needs); take the fewest splits within 85% of the best efficiency.
// The splits take interleaved chunks of the keys, so whatever the real lengths
// (the plan only knows the table width) the work of a tile spreads evenly over
// the splits that have any.
int64_t choose_splits(int64_t ctas, int64_t slots, int64_t max_splits) {
  auto efficiency = [&](int64_t splits) {
    const double waves = double(ctas) * double(splits) / double(slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, efficiency(s));
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (efficiency(s) >= 0.85 * best) return s;
  }
  return 1;
}

}  // namespace

AttentionPlan plan_attention(const AttentionPlanInput& in) {
  AttentionPlan plan{};
  const int64_t group = std::max<int64_t>(1, in.num_heads / std::max<int64_t>(1, in.num_kv_heads));
  const int max_queries = max_queries_per_cta(in.head_size_v);
  int64_t rows_per_tile = 1;
  if (group <= max_queries) {
    plan.heads_per_cta = int(group);
    plan.head_chunks = 1;
    // Several query rows of a sequence share a CTA, and so its K/V reads.
    if (in.multi_token) rows_per_tile = max_queries / group;
  } else {
    plan.heads_per_cta = max_queries;
    plan.head_chunks = int(ceil_div(group, max_queries));
  }
  plan.rows_per_tile = int(rows_per_tile);
  const int64_t queries = rows_per_tile * plan.heads_per_cta;
  plan.query_bucket = 3;
  for (int b = 0; b < 4; ++b) {
    if (queries <= kQueryBuckets[b]) {
      plan.query_bucket = b;
      break;
    }
  }

  // Tiles never straddle sequences: each sequence adds at most one partial tile.
  const int64_t full_tiles = in.multi_token ? ceil_div(in.num_tokens, rows_per_tile) : in.num_seqs;
  plan.num_tiles = in.multi_token ? full_tiles + in.num_seqs : full_tiles;

  // The longest key range one tile sees: the block table's capacity, or the
  // window plus the tile's extra rows (int64: a window may be up to INT32_MAX).
  int64_t max_keys = in.max_blocks_per_seq * in.block_size;
  if (in.sliding_window > 0) max_keys = std::min(max_keys, in.sliding_window + rows_per_tile - 1);
  max_keys = std::max<int64_t>(max_keys, 1);
  plan.max_keys = max_keys;
  plan.partition_size = kChunkKeys;

  const int64_t ctas = std::max<int64_t>(1, full_tiles * in.num_kv_heads * plan.head_chunks);
  const int64_t slots = int64_t(std::max(1, in.ctas_per_sm[plan.query_bucket])) * std::max(1, in.multiprocessors);
  const int64_t max_splits = std::min<int64_t>(kMaxPartitions, ceil_div(max_keys, kChunkKeys));
  plan.num_partitions = int(max_splits > 1 ? choose_splits(ctas, slots, max_splits) : 1);
  return plan;
}

}  // namespace paged::cuda
