// The arguments of one paged-attention call, defined once: gathered from the op's
// arguments by its output form (attention_outputs.h), checked once (checks.h), then read
// by the backend (cpu/attention_cpu.cpp, cuda/attention_cuda.cpp). The op schemas
// (registration.cpp) document each argument.
#pragma once

#include <cstdint>
#include <optional>

#include "torch_api.h"

namespace paged {

// Where a sequence's query rows sit among its keys.
enum class QueryPlacement {
  kLastPositions,  // paged.attention: the last q_len positions, causal within them
  kAfterKeys,      // paged.shared_prefix_attention: after every key (each sees them all)
};

// References to the op's own arguments, which outlive the call.
struct AttentionArgs {
  const Tensor& query;         // [num_tokens, num_heads, head_size]
  const Tensor& key_cache;     // [num_blocks, num_kv_heads, block_size, head_size]
  const Tensor& value_cache;   // [num_blocks, num_kv_heads, block_size, head_size_v]
  const Tensor& block_tables;  // int32 [num_seqs, max_blocks_per_seq]
  const Tensor& seq_lens;      // int32 [num_seqs]
  double scale;
  const std::optional<Tensor>& query_start_loc;  // int32 [num_seqs + 1]; none: decode
  const std::optional<Tensor>& alibi_slopes;     // fp32 [num_heads]
  int64_t sliding_window;                            // -1: disabled
  double soft_cap;                                   // 0: disabled
  const std::optional<Tensor>& sinks;            // fp32 [num_heads]
  // fp8 caches: fp32 [], [1] or [num_kv_heads]; per-token caches: fp32 [num_blocks,
  // num_kv_heads, block_size] (int8) or [..., 2] (int4: scale, low), paged like the cache.
  const std::optional<Tensor>& k_scale;
  const std::optional<Tensor>& v_scale;
  QueryPlacement placement;
};

// The sizes of a checked call (check_attention_args).
struct AttentionShape {
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_size;    // of query and key_cache (values a row holds: int4 packs two a byte)
  int64_t head_size_v;  // of value_cache and out
  int64_t num_blocks;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t num_seqs;
  int64_t max_blocks_per_seq;
};

}  // namespace paged
