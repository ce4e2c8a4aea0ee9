// Work planning of the CUDA attention kernel: how query rows and heads are
// tiled into CTAs, and how the keys are split over CTAs (split-KV).
//
// Free of torch and of the CUDA runtime: attention_plan.cpp compiles with any
// C++17 compiler, so the planner is tested on machines without a GPU
// (tests/test_cuda_plan.py builds it with a small driver). The key schedule
// below is shared with the kernel (host and device).
#pragma once

#include <cstdint>

#include "../host_device.h"

namespace paged::cuda {

// Query vectors (query rows x query heads of one GQA group) one CTA holds at most;
// with value rows longer than kLargeValueHead, at most 4 (max_queries_per_cta): the kernel
// instances of those value heads hold no more (attention_kernels.cuh).
constexpr int kMaxQueriesPerCta = 8;
constexpr int kMaxQueriesPerCtaLargeHeads = 4;
constexpr int kLargeValueHead = 256;
constexpr PAGED_HOST_DEVICE int max_queries_per_cta(int64_t head_size_v) {
  return head_size_v > kLargeValueHead ? kMaxQueriesPerCtaLargeHeads : kMaxQueriesPerCta;
}
// Upper bound on split-KV partitions (splits) of one query tile.
constexpr int kMaxPartitions = 512;
// Keys a CTA covers per loop step (4 warps of 32 keys).
constexpr int kCtaStepKeys = 128;
// Split-KV chunk: the keys are cut into chunks of this many keys (a multiple of
// kCtaStepKeys), and split z of Z processes chunks z, z + Z, z + 2Z, ...
constexpr int kChunkKeys = 512;
// The kernels use int32 key positions; the host refuses block tables that
// address more keys than this (leaves room for a step past the last key).
constexpr int64_t kMaxKeyPositions = int64_t(INT32_MAX) - 2 * kChunkKeys;
// Instantiations of the kernel on the number of query vectors per CTA.
constexpr int kQueryBuckets[4] = {1, 2, 4, 8};

struct AttentionPlanInput {
  int64_t num_tokens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t max_blocks_per_seq;  // width of block_tables
  int64_t sliding_window;      // <= 0: disabled
  int64_t head_size_v;         // bounds the queries per CTA (max_queries_per_cta)
  bool multi_token;            // query_start_loc given
  int multiprocessors;
  // Resident CTAs per multiprocessor of the kernel instance for each entry of
  // kQueryBuckets (cudaOccupancyMaxActiveBlocksPerMultiprocessor on a GPU).
  int ctas_per_sm[4];
};

struct AttentionPlan {
  // A CTA owns rows_per_tile query rows of one sequence times heads_per_cta
  // query heads of one KV head.
  int rows_per_tile;
  int heads_per_cta;
  int head_chunks;      // ceil(group / heads_per_cta)
  int query_bucket;     // index into kQueryBuckets: the kernel instance
  int64_t num_tiles;    // grid.x: an upper bound on the query tiles
  int num_partitions;   // grid.z: splits of the keys
  int partition_size;   // keys per chunk (kChunkKeys)
  int64_t max_keys;     // the longest key range one tile can see (shape bound)
};

// Depends on shapes only, never on metadata values: a captured CUDA graph stays
// valid for any lengths and block tables.
AttentionPlan plan_attention(const AttentionPlanInput& in);

// The CTA steps of one split. Warp w of split z starts at key
// begin + z * chunk + 32 w and advances 128 keys a step; at the end of a chunk
// it jumps over the chunks of the other splits. Positions stay below `end`
// (the returned position equals `end` once the split is done).
struct KeySchedule {
  int end;         // one past the last key the tile sees
  int chunk;       // keys per chunk, a multiple of kCtaStepKeys
  int64_t jump;    // (num_splits - 1) * chunk

  // The step after the one at position t, whose offset in its chunk is *offset
  // (updated).
  PAGED_HOST_DEVICE int next(int t, int* offset) const {
    int64_t n = int64_t(t) + kCtaStepKeys;
    *offset += kCtaStepKeys;
    if (*offset >= chunk) {
      *offset -= chunk;
      n += jump;
    }
    return n < end ? int(n) : end;
  }
};

}  // namespace paged::cuda
