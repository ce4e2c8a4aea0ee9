// The interface between the torch-aware host code (*_cuda.cpp, compiled by the
// host compiler) and the kernels (*.cu, compiled by nvcc). Deliberately free of
// torch headers: nvcc then parses no ATen header once per target architecture,
// which keeps a multi-architecture build short.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../merge_limits.h"
#include "../scalar_kind.h"
#include "attention_plan.h"

namespace paged::cuda {

inline constexpr bool is_fp8_kind(ScalarKind k) { return k == ScalarKind::kFloat8E4M3 || k == ScalarKind::kFloat8E5M2; }

// Bytes of the vectors the kernels read cache rows in: 16 for 32/16-bit caches, 8 for
// fp8 and int8, 4 for packed int4 (8 values each, like bf16, so every head size that is a
// multiple of 8 works). Cache addresses and strides must be multiples of it (checked on
// the host).
inline constexpr int cache_vector_bytes(ScalarKind cache_kind) {
  return cache_kind == ScalarKind::kInt4 ? 4 : is_fp8_kind(cache_kind) || cache_kind == ScalarKind::kInt8 ? 8 : 16;
}

// One cache's layout: the logical shape is [num_blocks, num_kv_heads, block_size,
// head_size] (HND), any strides on the first three dimensions (in elements), the head
// dimension contiguous (so NHD views and vLLM's joint [2, ...] tensor need no copy).
struct CacheLayout {
  int64_t block_stride;
  int64_t head_stride;
  int64_t token_stride;
};

struct AttentionParams {
  ScalarKind kind;        // of query and out
  ScalarKind cache_kind;  // of key_cache and value_cache: kind, or fp8
  // query [num_tokens, num_heads, head_size], last dim contiguous (strides in elements).
  const void* query;
  int64_t query_token_stride;
  int64_t query_head_stride;
  // key_cache [num_blocks, num_kv_heads, block_size, head_size] and value_cache
  // [.., head_size_v], strided (CacheLayout), rows aligned to cache_vector_bytes.
  const void* key_cache;
  const void* value_cache;
  CacheLayout key_layout;
  CacheLayout value_layout;
  // fp8 caches: fp32 scales, k_scale[kv_head * k_scale_stride] (stride 0: one per
  // layer, 1: one per KV head). Per-token caches (int8, int4): one scale per row (int4: a
  // (scale, low) pair, the last dimension), addressed like the cache rows by
  // k_scale_layout / v_scale_layout (in floats). nullptr for the other formats.
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_stride;
  int64_t v_scale_stride;
  CacheLayout k_scale_layout;
  CacheLayout v_scale_layout;
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  int64_t block_table_stride;
  const int32_t* seq_lens;         // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1], or nullptr for decode
  const float* alibi_slopes;       // [num_heads], contiguous, or nullptr
  const float* sinks;              // [num_heads], contiguous, or nullptr
  int num_tokens;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;    // of query and keys: the score phase (values per row: int4 packs two a byte)
  int head_size_v;  // of values and out
  int block_size;
  int num_blocks;
  int max_blocks_per_seq;
  float scale;
  float soft_cap;      // <= 0: disabled
  int sliding_window;  // <= 0: disabled
  // 0: a sequence's query rows are its last positions (causal); 1: every query row sits
  // after all its keys and sees each of them (shared_prefix_attention; no window, ALiBi).
  int queries_after_keys;

  // Work decomposition (attention_plan.h: plan_attention). A CTA owns
  // rows_per_tile query rows of one sequence times heads_per_cta query heads
  // of one KV head, against split blockIdx.z of num_partitions: the chunks of
  // partition_size keys blockIdx.z, blockIdx.z + num_partitions, ...
  int rows_per_tile;
  int heads_per_cta;
  int head_chunks;  // ceil(group / heads_per_cta)
  int query_bucket; // kernel instance: kQueryBuckets[query_bucket] queries per CTA
  int num_tiles;    // grid.x: an upper bound on the query tiles
  int num_partitions;
  int partition_size;

  // Final results: out in the query's dtype (strides in elements), lse fp32 or nullptr.
  void* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;
  int64_t lse_token_stride;
  // fp32 partition results when num_partitions > 1:
  // part_out [num_partitions, num_tokens, num_heads, head_size_v], part_lse [.., num_heads].
  // The partition lse leaves the sinks out; the merge adds them.
  float* part_out;
  float* part_lse;
};

// The plan's work decomposition, as the kernels read it (num_tiles checked to fit int).
inline void set_plan(AttentionParams& p, const AttentionPlan& plan) {
  p.rows_per_tile = plan.rows_per_tile;
  p.heads_per_cta = plan.heads_per_cta;
  p.head_chunks = plan.head_chunks;
  p.query_bucket = plan.query_bucket;
  p.num_tiles = int(plan.num_tiles);
  p.num_partitions = plan.num_partitions;
  p.partition_size = plan.partition_size;
}

// Resident CTAs per multiprocessor of the attention kernel instance for this cache
// dtype (which picks the query type too: the same, or any for fp8), these head sizes
// and kQueryBuckets[query_bucket] queries per CTA, on the current device
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor, cached).
cudaError_t attention_ctas_per_sm(ScalarKind cache_kind, int head_size, int head_size_v, int query_bucket,
                                  int* ctas);

// merge_attention_states: num_inputs partial results (strided, head dim contiguous) into
// the contiguous out [num_tokens, num_heads, head_size] (dtype `kind`) and lse.
struct MergeStatesParams {
  ScalarKind kind;
  int num_inputs;
  const void* outputs[kMaxMergeInputs];
  int64_t out_token_stride[kMaxMergeInputs], out_head_stride[kMaxMergeInputs];
  const float* lses[kMaxMergeInputs];
  int64_t lse_token_stride[kMaxMergeInputs], lse_head_stride[kMaxMergeInputs];
  int num_tokens, num_heads, head_size;
  void* out;
  float* lse;
};

cudaError_t launch_merge_states(const MergeStatesParams& params, cudaStream_t stream);

// Attention, plus the partition merge when num_partitions > 1, on `stream`.
cudaError_t launch_attention(const AttentionParams& params, cudaStream_t stream);

// Per-cache-type halves of the above (attention_{f32,f16,bf16,fp8_e4m3,fp8_e5m2,int8,int4}.cu).
// The fp8, int8 and int4 instances take any query dtype (read and written by params.kind).
cudaError_t launch_attention_f32(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_f16(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_bf16(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_fp8_e4m3(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_fp8_e5m2(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_int8(const AttentionParams& params, cudaStream_t stream);
cudaError_t launch_attention_int4(const AttentionParams& params, cudaStream_t stream);
cudaError_t occupancy_f32(int head_size, int head_size_v, int query_bucket, int* ctas);
cudaError_t occupancy_f16(int head_size, int head_size_v, int query_bucket, int* ctas);
cudaError_t occupancy_bf16(int head_size, int head_size_v, int query_bucket, int* ctas);
cudaError_t occupancy_fp8_e4m3(int head_size, int head_size_v, int query_bucket, int* ctas);
cudaError_t occupancy_fp8_e5m2(int head_size, int head_size_v, int query_bucket, int* ctas);
cudaError_t occupancy_int8(int head_size, int head_size_v, int query_bucket, int* ctas);
cudaError_t occupancy_int4(int head_size, int head_size_v, int query_bucket, int* ctas);

struct WriteKvParams {
  // key [num_tokens, num_kv_heads, head_size], value [.., head_size_v]; strides in bytes.
  const void* key;
  const void* value;
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  void* key_cache;
  void* value_cache;
  CacheLayout key_layout;  // strides in bytes here
  CacheLayout value_layout;
  const int64_t* slot_mapping;  // [num_tokens], on the device
  int64_t slot_stride;
  int64_t num_tokens;
  int64_t num_slots;  // num_blocks * block_size
  int num_kv_heads;
  int block_size;
  int64_t key_row_bytes;    // head_size * element size of the cache
  int64_t value_row_bytes;  // head_size_v * element size of the cache
  // fp8 caches: key/value (of `kind`) are quantized: x / scale[head * stride],
  // saturated to the format's finite range, rounded to nearest even, NaN stays NaN.
  // Float caches (cache_kind == kind): rows are copied.
  ScalarKind kind;  // of key and value
  ScalarKind cache_kind;
  const float* k_scale;
  const float* v_scale;
  int64_t k_scale_stride;
  int64_t v_scale_stride;
  // Per-token caches (int8, int4): each row is quantized from its own values and its scale
  // (int4: scale and low) written at the row's (block, head, offset) of these, strides
  // in floats.
  float* k_token_scale;
  float* v_token_scale;
  CacheLayout k_scale_layout;
  CacheLayout v_scale_layout;
};

// The longest row write_kv quantizes into a per-token cache (MLA's 576-wide latent keys
// included): the kernel keeps one in shared memory per warp.
constexpr int kMaxTokenRow = 576;

cudaError_t launch_write_kv(const WriteKvParams& params, cudaStream_t stream);

// One cache of copy_blocks, as rows of bytes: block b, row (h, t) starts at
// base + b * block_stride + h * head_stride + t * token_stride and is row_bytes long.
// A block that is one dense chunk (HND, NHD, vLLM's joint views) is one row
// (heads = tokens = 1) of the whole block's bytes.
struct CopyCache {
  void* base;
  int64_t block_stride;
  int64_t head_stride;
  int64_t token_stride;
  int64_t row_bytes;
  int32_t heads;
  int32_t tokens;
};

// Layers one copy_blocks launch covers; its kernel parameters stay under the
// 4 KB every driver accepts (32 * 2 * 48 bytes + the rest).
constexpr int kMaxCopyLayers = 32;

struct CopyBlocksParams {
  // A layer's key and value blocks may differ (head_size != head_size_v, strides).
  CopyCache keys[kMaxCopyLayers];
  CopyCache values[kMaxCopyLayers];
  const int64_t* block_mapping;  // [num_pairs, 2] (src, dst), contiguous, on the device
  int64_t num_pairs;
  int64_t num_blocks;
  int num_layers;  // <= kMaxCopyLayers
};
static_assert(sizeof(CopyBlocksParams) <= 4000, "copy_blocks parameters must fit in 4 KB");

cudaError_t launch_copy_blocks(const CopyBlocksParams& params, cudaStream_t stream);

}  // namespace paged::cuda
