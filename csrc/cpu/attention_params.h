// Plain-C++ description of one paged-attention call, shared by the torch-aware
// dispatcher (attention_cpu.cpp) and the ISA-specific kernels (isa_*.cpp).
// Deliberately free of torch headers: the ISA translation units are compiled
// under `#pragma GCC target`, and no torch inline function may be emitted there.
#pragma once

#include <cstdint>

#include "../scalar_kind.h"

namespace paged::cpu {

struct AttentionParams {
  ScalarKind kind;        // of the caches: selects the kernel
  ScalarKind query_kind;  // of query: the cache's, or any float kind for fp8 caches
  // query [num_tokens, num_heads, head_size], last dim contiguous.
  const void* query;
  int64_t query_token_stride;
  int64_t query_head_stride;
  // key cache [num_blocks, num_kv_heads, block_size, head_size] and value cache
  // [num_blocks, num_kv_heads, block_size, head_size_v], last dim contiguous, the others
  // at these strides (elements): HND, NHD views, views into a joint K/V tensor.
  const void* key_cache;
  const void* value_cache;
  int64_t k_block_stride, k_head_stride, k_token_stride;
  int64_t v_block_stride, v_head_stride, v_token_stride;
  // fp8 caches: the value of a stored x is float(x) * scale[kv_head * stride] (stride 0:
  // one scale per layer). nullptr for float caches.
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_stride, v_scale_stride;
  // Per-token caches (kInt8, kInt4): each row's fp32 scale (int8) or (scale, low) pair
  // (int4) at token_scale + block * stride[0] + kv_head * stride[1] + slot * stride[2]
  // (elements), k_scale and v_scale nullptr. int4: the query is rotated (rows of head_size
  // values in head_size / 2 bytes), and so are the outputs.
  // int4: the caller's query was 16-bit before its rotation to fp32, so a kernel may round
  // the rotated query to bf16 (int4_bf16_tiles.h).
  bool query_from_16bit;
  const float* k_token_scale;
  const float* v_token_scale;
  int64_t k_token_scale_strides[3], v_token_scale_strides[3];
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  const int32_t* seq_lens;       // [num_seqs]
  const float* alibi_slopes;     // [num_heads] or nullptr
  const float* sinks;            // [num_heads] or nullptr
  int num_heads;
  int num_kv_heads;
  int head_size;    // of queries and keys
  int head_size_v;  // of values and outputs
  int block_size;
  float scale;
  float soft_cap;      // <= 0: disabled
  int sliding_window;  // <= 0: disabled
  // Every query sits after every key (shared_prefix_attention): items with many queries
  // per KV head take the queries-in-lanes micro-kernels (lane_tiles.h).
  bool queries_after_keys;

  // Results ([head_size_v] rows of out_kind: fp32, or the caller's 16-bit output when one
  // partition writes it directly), one slot per (partition, token, head):
  //   o   at out + part*out_part_stride + token*out_token_stride + head*out_head_stride
  //   lse at lse + part*lse_part_stride + token*lse_token_stride + head (fp32)
  void* out;
  ScalarKind out_kind;
  int64_t out_part_stride;
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;
  int64_t lse_part_stride;
  int64_t lse_token_stride;
};

// One unit of parallel work: the query rows [row_begin, row_end) of one
// sequence times all query heads of the KV heads [kv_head_begin, kv_head_end),
// against the keys [kv_begin, kv_end). The row `row_begin` sits at sequence
// position `first_pos`. Each row's partition 0 also takes its head's sink, if any.
struct WorkItem {
  int32_t seq;
  int32_t kv_head_begin;
  int32_t kv_head_end;
  int32_t row_begin;
  int32_t row_end;
  int32_t first_pos;
  int32_t kv_begin;
  int32_t kv_end;
  int32_t partition;
};

// Longest output row (head_size_v; checks.h's kMaxValueHeadSize): a kernel writing a
// 16-bit output rounds each row from a stack row this long.
constexpr int kMaxOutputRow = 512;

// Most keys per online-softmax step: the decode kernel's chunk capacity (it takes 64 for
// fp8 rows of up to 128 bytes, 32 or 16 for others: attention_kernel.h); the lane and AMX
// kernels have their own.
constexpr int kKeyChunk = 64;
// Query vectors (rows x heads of one GQA group) a work item aims for; a group
// larger than this still stays whole (one row per item). A kernel may take more
// (plan_hints in cpu_features.h).
constexpr int kMaxQueriesPerItem = 64;

// Queries beyond an item's own the workspace is sized for: the lane tiles round a KV
// head's queries up to whole vectors.
constexpr int kWorkspacePaddingQueries = 16;

// Workspace regions start on cache lines: a zmm load or store across two lines costs two
// (std::vector<float>'s storage is only 16-byte aligned).
constexpr int kCacheLineFloats = 16;
constexpr int64_t cache_lines_floats(int64_t n) { return (n + kCacheLineFloats - 1) / kCacheLineFloats * kCacheLineFloats; }
inline float* aligned_workspace(float* ws) {
  constexpr uintptr_t kLineBytes = kCacheLineFloats * sizeof(float);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ws) + kLineBytes - 1) & ~(kLineBytes - 1));
}

// Floats of per-thread scratch a kernel needs; head_size_padded is the larger of the key
// and value head sizes rounded up to whole vectors (an upper bound when they differ).
inline int64_t kernel_workspace_floats(int head_size_padded, int num_queries) {
  return kCacheLineFloats                              // aligning the start (aligned_workspace)
         + int64_t(num_queries) * head_size_padded * 2   // scaled queries, accumulators
         + int64_t(num_queries) * kKeyChunk            // scores
         + 2 * cache_lines_floats(num_queries)         // running max, running sum
         + int64_t(kKeyChunk) * head_size_padded * 2   // fp32 keys and values of a chunk
         + cache_lines_floats((int64_t(num_queries) * head_size_padded + 1) / 2)  // bf16 queries
         + int64_t(num_queries) * head_size_padded * 2;  // the same in quad order (fp8 keys)
}

using AttentionKernelFn = void (*)(const AttentionParams&, const WorkItem&, float* workspace);

}  // namespace paged::cpu
