// CUDA paged-attention kernels: the attention kernel proper and the merge of
// split-KV partitions (flash-decoding).
//
// One CTA owns one query tile (up to kMaxQueriesPerCta query vectors: the rows
// of one sequence times the query heads of one GQA group), one KV head and one
// partition of the keys. Each K/V row is read from memory once per CTA and
// used by every query head of the group.
//
// Inside a CTA each warp walks its own 32-key steps of the partition with its
// own online softmax:
//   * scores: each lane pair takes two keys of the step, reads their rows as
//     16-byte vectors (32 contiguous bytes per row and load) and dots them with
//     every query (queries in shared memory, broadcast reads); one shuffle per
//     query completes a score;
//   * values: lanes split each value row into 16-byte vectors and accumulate
//     p * v for every query in fp32 registers.
// The warps' (max, sum, accumulator) triples are merged through shared memory
// at the end. With several partitions each CTA writes an fp32 result and its
// log-sum-exp, and merge_partitions_kernel combines them exactly.
//
// Device-resident metadata is never validated (that would need a host sync),
// but it is clamped so that no value can make a kernel read or write outside
// its tensors: seq_lens to [0, capacity], block ids to the pool, query_start_loc
// to [0, num_tokens].
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda_utils.cuh"
#include "kernels.h"

namespace paged::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kStep = 32;  // keys per warp step: one per lane in the score phase
constexpr int kMaxQ = kMaxQueriesPerCta;
// 16-byte vectors of each of its two key rows a lane loads before using the first.
constexpr int kKeyVecsInFlight = 2;
// Split-KV (plan_attention): never into partitions shorter than
// kMinPartitionKeys, where the merge costs more than the parallelism gains.
// Partition lengths are multiples of the keys a CTA covers per step.
constexpr int64_t kMinPartitionKeys = 256;
constexpr int64_t kPartitionQuantum = kWarps * kStep;
// Registers are capped so that this many CTAs (12 warps) fit on a multiprocessor.
constexpr int kMinCtasPerSm = 3;
static_assert(kMaxQ % 4 == 0, "probabilities are read as float4");

__device__ __forceinline__ int clamp_int(int x, int lo, int hi) { return min(max(x, lo), hi); }

// The first key a query at `pos` sees: pos - window + 1 with a window, else 0.
__device__ __forceinline__ int window_start(int pos, int window) {
  return window > 0 ? int(max(int64_t(0), int64_t(pos) - window + 1)) : 0;
}

// The query rows [row_begin, row_end) of sequence `seq` that this CTA owns;
// row_begin sits at sequence position first_pos.
struct Tile {
  int seq;
  int row_begin;
  int row_end;
  int first_pos;
};

__device__ bool locate_tile(const AttentionParams& p, Tile& tile) {
  const int index = blockIdx.x;
  int seq, seq_begin, seq_end, row_begin, row_end;
  if (p.query_start_loc == nullptr) {  // decode: one row per sequence
    seq = seq_begin = row_begin = index;
    seq_end = row_end = index + 1;
  } else {
    // Tile i = k + s covers rows [k*R, (k+1)*R) of sequence s, for each k whose
    // R-aligned group of rows meets that sequence's rows. first(s) = qsl[s]/R + s
    // is non-decreasing, so s is the last sequence with first(s) <= i.
    const int32_t* qsl = p.query_start_loc;
    const int r = p.rows_per_tile;
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (clamp_int(qsl[mid], 0, p.num_tokens) / r + mid <= index) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    seq = lo;
    seq_begin = clamp_int(qsl[seq], 0, p.num_tokens);
    seq_end = clamp_int(qsl[seq + 1], seq_begin, p.num_tokens);
    const int64_t k = int64_t(index) - seq;
    row_begin = int(max(int64_t(seq_begin), k * r));
    row_end = int(min(int64_t(seq_end), (k + 1) * r));
    if (row_begin >= row_end) return false;
  }
  const int capacity = p.num_blocks > 0 ? p.max_blocks_per_seq * p.block_size : 0;
  const int kv_len = clamp_int(p.seq_lens[seq], 0, capacity);
  // The sequence's query rows are its last (seq_end - seq_begin) positions.
  tile = {seq, row_begin, row_end, kv_len - (seq_end - seq_begin) + (row_begin - seq_begin)};
  return true;
}

template <typename T, int kHeadCap>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) attention_kernel(const AttentionParams p) {
  using E = Elem<T>;
  constexpr int kPerVec = E::kPerVec;
  constexpr int kRowVecs = kHeadCap / kPerVec;  // 16-byte vectors in a row at the cap
  // Value phase: kLanesPerRow lanes share a row, kRowsPerStep rows per warp instruction.
  constexpr int kLanesPerRow = kRowVecs < 32 ? kRowVecs : 32;
  constexpr int kVecsPerLane = kRowVecs / kLanesPerRow;
  constexpr int kRowsPerStep = 32 / kLanesPerRow;
  constexpr int kAccPerLane = kVecsPerLane * kPerVec;

  // The queries and probabilities are dead once the warps merge, so the merge
  // reuses their space.
  struct LoopSmem {
    float q[kMaxQ][kHeadCap];          // scaled queries
    float prob[kWarps][kStep][kMaxQ];  // each warp's probabilities of its current step
  };
  struct MergeSmem {
    float acc[kWarps][kMaxQ][kHeadCap];
  };
  __shared__ __align__(16) union {
    LoopSmem loop;
    MergeSmem merge;
  } smem;
  __shared__ int pos_s[kMaxQ];        // sequence position of each query
  __shared__ int first_key_s[kMaxQ];  // its first visible key (sliding window)
  __shared__ float slope_s[kMaxQ];
  __shared__ float warp_max_s[kWarps][kMaxQ];
  __shared__ float warp_sum_s[kWarps][kMaxQ];

  Tile tile;
  if (!locate_tile(p, tile)) return;
  const int group = p.num_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int head_chunk = blockIdx.y - kv_head * p.head_chunks;
  const int head_begin = kv_head * group + head_chunk * p.heads_per_cta;
  const int num_cta_heads = min(p.heads_per_cta, group - head_chunk * p.heads_per_cta);
  const int num_rows = tile.row_end - tile.row_begin;
  const int num_q = num_rows * num_cta_heads;  // query m: row m / num_cta_heads, head m % num_cta_heads

  // Keys the tile can see (causal, sliding window), then this partition's share.
  const int last_pos = tile.first_pos + num_rows - 1;
  const int kv_begin = window_start(tile.first_pos, p.sliding_window);
  const int kv_end = max(kv_begin, last_pos + 1);
  const int part_begin = int(min(int64_t(kv_end), kv_begin + int64_t(blockIdx.z) * p.partition_size));
  const int part_end = int(min(int64_t(kv_end), int64_t(part_begin) + p.partition_size));
  const bool split = p.num_partitions > 1;
  if (split && part_begin >= part_end) {
    // An empty partition: its -inf lse alone tells the merge to skip it.
    if (threadIdx.x < num_q) {
      const int token = tile.row_begin + threadIdx.x / num_cta_heads;
      const int head = head_begin + threadIdx.x % num_cta_heads;
      p.part_lse[(int64_t(blockIdx.z) * p.num_tokens + token) * p.num_heads + head] = -INFINITY;
    }
    return;
  }

  const T* query = static_cast<const T*>(p.query);
  for (int i = threadIdx.x; i < num_q * p.head_size; i += kThreads) {
    const int m = i / p.head_size, d = i - m * p.head_size;
    const int64_t row = tile.row_begin + m / num_cta_heads;
    const int64_t head = head_begin + m % num_cta_heads;
    smem.loop.q[m][d] = E::to_float(query[row * p.query_token_stride + head * p.query_head_stride + d]) * p.scale;
  }
  if (threadIdx.x < kMaxQ) {
    const int m = threadIdx.x;
    pos_s[m] = tile.first_pos + m / num_cta_heads;
    first_key_s[m] = window_start(pos_s[m], p.sliding_window);
    slope_s[m] = (p.alibi_slopes != nullptr && m < num_q) ? p.alibi_slopes[head_begin + m % num_cta_heads] : 0.0f;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_vecs = p.head_size / kPerVec;
  const int64_t head_elems = int64_t(p.block_size) * p.head_size;
  const int64_t block_elems = head_elems * p.num_kv_heads;
  const T* key_cache = static_cast<const T*>(p.key_cache) + kv_head * head_elems;
  const T* value_cache = static_cast<const T*>(p.value_cache) + kv_head * head_elems;
  const int32_t* table = p.block_tables + int64_t(tile.seq) * p.block_table_stride;
  const bool soft_cap = p.soft_cap > 0.0f;
  const float inv_soft_cap = soft_cap ? 1.0f / p.soft_cap : 0.0f;
  const int sub_row = lane / kLanesPerRow, sub_lane = lane % kLanesPerRow;

  float run_max[kMaxQ], run_sum[kMaxQ], acc[kMaxQ][kAccPerLane];
#pragma unroll
  for (int m = 0; m < kMaxQ; ++m) {
    run_max[m] = -INFINITY;
    run_sum[m] = 0.0f;  // this lane's share; summed over the warp at the end
#pragma unroll
    for (int e = 0; e < kAccPerLane; ++e) acc[m][e] = 0.0f;
  }

  constexpr int kCtaStep = kWarps * kStep;
  // Block-table entry of this lane's key one CTA step ahead: loaded a step early
  // so its latency hides behind the current step.
  auto load_block = [&](int j) {
    const int block = j < part_end ? table[j / p.block_size] : 0;
    return static_cast<unsigned>(block) < static_cast<unsigned>(p.num_blocks) ? block : 0;
  };
  // Score phase: lanes 2i and 2i+1 share keys i and i + 16 of a step, each taking
  // every other 16-byte vector of the two rows (a load reads 32 contiguous bytes of
  // each row, and a query vector read from shared memory serves both keys). Lane l
  // owns key own = l/2 + 16*(l%2) of the step for the softmax.
  const int parity = lane & 1;
  const int own = (lane >> 1) + 16 * parity;
  const int lo = lane >> 1, hi = lo + 16;
  int next_block = load_block(part_begin + warp * kStep + own);
  for (int t0 = part_begin + warp * kStep; t0 < part_end; t0 += kCtaStep) {
    const int j = t0 + own;
    const bool valid = j < part_end;
    const int64_t row_offset = int64_t(next_block) * block_elems + int64_t(j % p.block_size) * p.head_size;
    next_block = load_block(j < part_end - kCtaStep ? j + kCtaStep : part_end);
    const int64_t partner_offset = __shfl_xor_sync(kFullMask, row_offset, 1);  // key own ^ 16

    // Partial scores of keys lo and hi against every query, then the pair's sums.
    float s_lo[kMaxQ], s_hi[kMaxQ];
#pragma unroll
    for (int m = 0; m < kMaxQ; ++m) s_lo[m] = s_hi[m] = 0.0f;
    const bool lo_valid = t0 + lo < part_end, hi_valid = t0 + hi < part_end;
    if (lo_valid) {
      const uint4* k_lo = reinterpret_cast<const uint4*>(key_cache + (parity ? partner_offset : row_offset));
      const uint4* k_hi = reinterpret_cast<const uint4*>(key_cache + (parity ? row_offset : partner_offset));
      for (int v0 = parity; v0 < num_vecs; v0 += 2 * kKeyVecsInFlight) {
        uint4 a[kKeyVecsInFlight], b[kKeyVecsInFlight];
#pragma unroll
        for (int u = 0; u < kKeyVecsInFlight; ++u) {
          const int v = v0 + 2 * u;
          if (v < num_vecs) {
            a[u] = __ldg(k_lo + v);
            if (hi_valid) b[u] = __ldg(k_hi + v);
          }
        }
#pragma unroll
        for (int u = 0; u < kKeyVecsInFlight; ++u) {
          const int v = v0 + 2 * u;
          if (v >= num_vecs) break;
          float fa[kPerVec], fb[kPerVec];
          E::unpack(a[u], fa);
          E::unpack(hi_valid ? b[u] : make_uint4(0, 0, 0, 0), fb);
#pragma unroll
          for (int m = 0; m < kMaxQ; ++m) {
            if (m >= num_q) break;
            const float4* q4 = reinterpret_cast<const float4*>(&smem.loop.q[m][v * kPerVec]);
#pragma unroll
            for (int e = 0; e < kPerVec / 4; ++e) {
              const float4 q = q4[e];
              s_lo[m] += q.x * fa[4 * e] + q.y * fa[4 * e + 1] + q.z * fa[4 * e + 2] + q.w * fa[4 * e + 3];
              s_hi[m] += q.x * fb[4 * e] + q.y * fb[4 * e + 1] + q.z * fb[4 * e + 2] + q.w * fb[4 * e + 3];
            }
          }
        }
      }
    }

    // The score of this lane's own key, its modifiers and masks, then the online-
    // softmax update of the warp.
#pragma unroll
    for (int m = 0; m < kMaxQ; ++m) {
      if (m >= num_q) break;
      const float lo_sum = s_lo[m] + __shfl_xor_sync(kFullMask, s_lo[m], 1);
      const float hi_sum = s_hi[m] + __shfl_xor_sync(kFullMask, s_hi[m], 1);
      float x = parity ? hi_sum : lo_sum;
      if (soft_cap) x = p.soft_cap * tanhf(x * inv_soft_cap);
      const int pos = pos_s[m];
      x += slope_s[m] * float(j - pos);
      const bool visible = valid && j <= pos && j >= first_key_s[m];
      x = visible ? x : -INFINITY;
      const float step_max = warp_max(x);
      float prob = 0.0f;
      if (step_max != -INFINITY) {
        const float new_max = fmaxf(run_max[m], step_max);
        const float alpha = __expf(run_max[m] - new_max);  // 0 on the first visible key
        prob = __expf(x - new_max);
        run_sum[m] = run_sum[m] * alpha + prob;
#pragma unroll
        for (int e = 0; e < kAccPerLane; ++e) acc[m][e] *= alpha;
        run_max[m] = new_max;
      }
      smem.loop.prob[warp][own][m] = prob;
    }
    __syncwarp();

    // acc += prob * V, value rows split over kLanesPerRow lanes each.
    const int rows = min(kStep, part_end - t0);
#pragma unroll 4
    for (int r = 0; r < rows; r += kRowsPerStep) {
      const int t = r + sub_row;
      const int64_t v_offset = __shfl_sync(kFullMask, row_offset, 2 * (t & 15) + (t >> 4));  // key t's owner
      if (t < rows) {
        float prob[kMaxQ];
#pragma unroll
        for (int m = 0; m < kMaxQ; m += 4) {
          const float4 p4 = *reinterpret_cast<const float4*>(&smem.loop.prob[warp][t][m]);
          prob[m] = p4.x;
          prob[m + 1] = p4.y;
          prob[m + 2] = p4.z;
          prob[m + 3] = p4.w;
        }
        const uint4* v_row = reinterpret_cast<const uint4*>(value_cache + v_offset);
#pragma unroll
        for (int k = 0; k < kVecsPerLane; ++k) {
          const int vec = sub_lane + k * kLanesPerRow;
          if (vec < num_vecs) {
            float vf[kPerVec];
            E::unpack(__ldg(v_row + vec), vf);
#pragma unroll
            for (int m = 0; m < kMaxQ; ++m) {
              if (m >= num_q) break;
#pragma unroll
              for (int e = 0; e < kPerVec; ++e) acc[m][k * kPerVec + e] += prob[m] * vf[e];
            }
          }
        }
      }
    }
    __syncwarp();  // the next step overwrites this warp's probabilities
  }

  // Warp totals: sums over all lanes, accumulators over the row groups.
#pragma unroll
  for (int m = 0; m < kMaxQ; ++m) {
    if (m >= num_q) break;
    run_sum[m] = warp_sum(run_sum[m]);
#pragma unroll
    for (int e = 0; e < kAccPerLane; ++e) {
#pragma unroll
      for (int offset = kLanesPerRow; offset < 32; offset *= 2) {
        acc[m][e] += __shfl_xor_sync(kFullMask, acc[m][e], offset);
      }
    }
  }
  __syncthreads();  // every warp is done with smem.loop before smem.merge overwrites it
#pragma unroll
  for (int m = 0; m < kMaxQ; ++m) {
    if (m >= num_q) break;
    if (lane == 0) {
      warp_max_s[warp][m] = run_max[m];
      warp_sum_s[warp][m] = run_sum[m];
    }
    if (sub_row == 0) {
#pragma unroll
      for (int k = 0; k < kVecsPerLane; ++k) {
        const int vec = sub_lane + k * kLanesPerRow;
        if (vec < num_vecs) {
#pragma unroll
          for (int e = 0; e < kPerVec; ++e) smem.merge.acc[warp][m][vec * kPerVec + e] = acc[m][k * kPerVec + e];
        }
      }
    }
  }
  __syncthreads();

  // Merge the warps and write this CTA's result.
  for (int i = threadIdx.x; i < num_q * p.head_size; i += kThreads) {
    const int m = i / p.head_size, d = i - m * p.head_size;
    float best = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) best = fmaxf(best, warp_max_s[w][m]);
    float total = 0.0f, o = 0.0f;
    if (best != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = __expf(warp_max_s[w][m] - best);
        total += weight * warp_sum_s[w][m];
        o += weight * smem.merge.acc[w][m][d];
      }
    }
    // A query that sees no key (a padded row) yields zeros and lse = -inf.
    const float value = total > 0.0f ? o / total : 0.0f;
    const float lse = total > 0.0f ? best + __logf(total) : -INFINITY;
    const int64_t token = tile.row_begin + m / num_cta_heads;
    const int64_t head = head_begin + m % num_cta_heads;
    if (split) {
      const int64_t slot = (int64_t(blockIdx.z) * p.num_tokens + token) * p.num_heads + head;
      p.part_out[slot * p.head_size + d] = value;
      if (d == 0) p.part_lse[slot] = lse;
    } else {
      static_cast<T*>(p.out)[token * p.out_token_stride + head * p.out_head_stride + d] = E::from_float(value);
      if (d == 0 && p.lse != nullptr) p.lse[token * p.lse_token_stride + head] = lse;
    }
  }
}

// One warp per (token, head): weights exp(lse_p - max) of the partitions in
// shared memory, then lanes over the head dimension.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_partitions_kernel(const AttentionParams p) {
  using E = Elem<T>;
  __shared__ float weights[kWarps][kMaxPartitions];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t index = int64_t(blockIdx.x) * kWarps + warp;  // token * num_heads + head
  if (index >= int64_t(p.num_tokens) * p.num_heads) return;
  const int64_t token = index / p.num_heads, head = index % p.num_heads;
  const int64_t part_stride = int64_t(p.num_tokens) * p.num_heads;

  float best = -INFINITY;
  for (int q = lane; q < p.num_partitions; q += 32) best = fmaxf(best, p.part_lse[q * part_stride + index]);
  best = warp_max(best);
  float total = 0.0f;
  for (int q = lane; q < p.num_partitions; q += 32) {
    const float w = best == -INFINITY ? 0.0f : __expf(p.part_lse[q * part_stride + index] - best);
    weights[warp][q] = w;
    total += w;
  }
  total = warp_sum(total);
  __syncwarp();

  const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  T* out = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride;
  for (int d = lane; d < p.head_size; d += 32) {
    float o = 0.0f;
    for (int q = 0; q < p.num_partitions; ++q) {
      const float w = weights[warp][q];
      // Empty partitions (weight 0) never wrote their part_out rows.
      if (w != 0.0f) o += w * p.part_out[(q * part_stride + index) * p.head_size + d];
    }
    out[d] = E::from_float(o * inv_total);
  }
  if (lane == 0 && p.lse != nullptr) {
    p.lse[token * p.lse_token_stride + head] = total > 0.0f ? best + __logf(total) : -INFINITY;
  }
}

template <typename T, int kHeadCap>
void launch_typed(const AttentionParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_tiles, p.num_kv_heads * p.head_chunks, p.num_partitions);
  attention_kernel<T, kHeadCap><<<grid, kThreads, 0, stream>>>(p);
  if (p.num_partitions > 1) {
    const int64_t rows = int64_t(p.num_tokens) * p.num_heads;
    merge_partitions_kernel<T><<<unsigned((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(p);
  }
}

// Head sizes are bucketed so that few kernels cover every supported size.
template <typename T>
void launch_for_head_size(const AttentionParams& p, cudaStream_t stream) {
  if (p.head_size <= 64) {
    launch_typed<T, 64>(p, stream);
  } else if (p.head_size <= 128) {
    launch_typed<T, 128>(p, stream);
  } else {
    launch_typed<T, 256>(p, stream);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// FlashAttention-2's split heuristic: a split's wave efficiency is the share of
// CTA slots its launch keeps busy (ctas * parts / slots over the waves it
// needs); take the fewest partitions within 85% of the best efficiency, among
// counts that change the partition length.
int64_t choose_partitions(int64_t ctas, int64_t slots, int64_t max_keys, int64_t max_parts) {
  auto efficiency = [&](int64_t parts) {
    const double waves = double(ctas * parts) / double(slots);
    return waves / std::ceil(waves);
  };
  auto quanta = [&](int64_t parts) { return ceil_div(ceil_div(max_keys, parts), kPartitionQuantum); };
  auto eligible = [&](int64_t parts) { return parts == 1 || quanta(parts) != quanta(parts - 1); };
  double best = 0.0;
  for (int64_t parts = 1; parts <= max_parts; ++parts) {
    if (eligible(parts)) best = std::max(best, efficiency(parts));
  }
  for (int64_t parts = 1; parts <= max_parts; ++parts) {
    if (eligible(parts) && efficiency(parts) >= 0.85 * best) return parts;
  }
  return 1;
}

}  // namespace

void plan_attention(AttentionParams& p, bool multi_token, int multiprocessors) {
  const int group = p.num_heads / p.num_kv_heads;
  int rows_per_tile = 1;
  if (group <= kMaxQ) {
    p.heads_per_cta = group;
    p.head_chunks = 1;
    // Several query rows of a sequence share a CTA, and so its K/V reads.
    if (multi_token) rows_per_tile = kMaxQ / group;
  } else {
    p.heads_per_cta = kMaxQ;
    p.head_chunks = int(ceil_div(group, kMaxQ));
  }
  p.rows_per_tile = rows_per_tile;
  // Tiles never straddle sequences: each sequence adds at most one partial tile.
  const int64_t full_tiles = multi_token ? ceil_div(p.num_tokens, rows_per_tile) : p.num_seqs;
  p.num_tiles = int(multi_token ? full_tiles + p.num_seqs : full_tiles);

  // The longest key range one tile sees: the block table's capacity, or the window.
  int64_t max_keys = int64_t(p.max_blocks_per_seq) * p.block_size;
  if (p.sliding_window > 0) max_keys = std::min<int64_t>(max_keys, p.sliding_window + rows_per_tile - 1);
  max_keys = std::max<int64_t>(max_keys, 1);
  const int64_t ctas = std::max<int64_t>(1, full_tiles * p.num_kv_heads * p.head_chunks);
  const int64_t max_parts = std::min<int64_t>(kMaxPartitions, max_keys / kMinPartitionKeys);
  const int64_t parts = max_parts > 1 ? choose_partitions(ctas, int64_t(kMinCtasPerSm) * multiprocessors,
                                                          max_keys, max_parts)
                                      : 1;
  p.partition_size = int(parts == 1 ? max_keys : ceil_div(ceil_div(max_keys, parts), kPartitionQuantum) *
                                                     kPartitionQuantum);
  p.num_partitions = int(ceil_div(max_keys, p.partition_size));
}

cudaError_t launch_attention(const AttentionParams& params, cudaStream_t stream) {
  switch (params.kind) {
    case ScalarKind::kFloat32: launch_for_head_size<float>(params, stream); break;
    case ScalarKind::kFloat16: launch_for_head_size<__half>(params, stream); break;
    case ScalarKind::kBFloat16: launch_for_head_size<__nv_bfloat16>(params, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace paged::cuda
