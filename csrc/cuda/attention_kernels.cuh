// CUDA paged-attention kernels: the attention kernel proper and the merge of
// split-KV partitions (flash-decoding). Included by attention_{f32,f16,bf16,
// fp8_e4m3,fp8_e5m2}.cu, one cache element type each, so nvcc compiles the instances
// in parallel.
//
// Caches: rows are addressed by the block, head and token strides
// of CacheLayout (HND, NHD, vLLM's joint views; K and V may differ), the head
// dimension contiguous. fp8 caches: rows are read as 8-byte vectors and
// dequantized in registers (fp8.cuh); the per-head scales are folded in once per CTA,
// k_scale into the scaled queries (q . (k * s) = (q * s) . k) and v_scale into the
// final output, so the loop over keys does no extra multiply. Per-token caches
// (token_formats.cuh): int8 and packed int4 rows read as 8- and 4-byte vectors of 8
// values, exact integers in fp32; key j's score is kscale_j * (q . k_j) (int4: plus
// klow_j * sum(q)), and its probability goes to the value phase as p_j * vscale_j
// (int4: sum_j p_j * vlow_j joins every channel at the warps' merge). int4 rows are
// rotated, so the CTA rotates its queries first and the output is rotated back last
// (after the split merge: the merge is linear).
//
// One CTA owns one query tile (up to kQ query vectors: the rows of one sequence
// times the query heads of one GQA group), one KV head and one split of the
// keys. Each K/V row is read from memory once per CTA and used by every query
// head of the group.
//
// Split-KV: the keys a tile sees are cut into chunks of partition_size keys;
// split z of Z takes chunks z, z + Z, z + 2Z, ... (KeySchedule). Z comes from
// shapes only (attention_plan.cpp), and a split with no chunk exits at once, so
// a padded (wide) block table costs little, and whatever the real length, its
// chunks spread evenly over the splits.
//
// Inside a CTA each warp walks its own 32-key steps with its own online softmax:
//   * scores: each lane pair takes two keys of the step, reads their rows as
//     16-byte vectors (8-byte for fp8; 32 or 16 contiguous bytes per row and load
//     of the pair) and dots them with
//     every query (queries in shared memory, broadcast reads), chaining fmaf;
//     one shuffle per query completes a score;
//   * values: lanes split each value row (head_size_v) into vectors and
//     accumulate p * v for every query in fp32 registers.
// The warps' (max, sum, accumulator) triples are merged through shared memory
// at the end, with the sink (one extra logit per head that adds no value) in the
// denominator. With several splits each CTA writes an fp32 result and its
// log-sum-exp (without the sink), and merge_partitions_kernel combines them
// exactly, adding the sink.
//
// Device-resident metadata is never validated (that would need a host sync),
// but it is clamped so that no value can make a kernel read or write outside
// its tensors: seq_lens to [0, capacity], block ids to the pool, query_start_loc
// to [0, num_tokens].
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_utils.cuh"
#include "kernels.h"
#include "token_formats.cuh"

namespace paged::cuda {
namespace {

// The rotation an int4 cache's output rows are turned back with: the value rows' own, or,
// for MLA latent rows (the values the key rows' leading columns, one memory, which is how
// the host's checks let a per-token cache share it), the key rows' blocks.
__device__ __forceinline__ int output_rotation_block(const AttentionParams& p) {
  return rotation_block(p.value_cache == p.key_cache ? p.head_size : p.head_size_v);
}

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kStep = 32;  // keys per warp step: one per lane in the score phase
static_assert(kWarps * kStep == kCtaStepKeys, "the key schedule's step is the CTA's");
// Bytes of each of its two key rows a lane loads before using the first: two
// 16-byte vectors (32/16-bit caches), four 8-byte ones (fp8, int8); at most four
// vectors, so int4's 4-byte ones stop at 16 bytes (eight in flight spilled registers in
// the 8-query instances: docs/cuda.md).
constexpr int kKeyBytesInFlight = 32;
constexpr int kMaxKeyVecsInFlight = 4;

// Registers are capped so that this many CTAs fit on a multiprocessor: 168
// registers for 8 queries per CTA, 128 for fewer (their accumulators are smaller);
// value rows past kLargeValueHead (4 queries at most) hold twice the accumulators: 256.
template <int kQ, int kVCap>
constexpr int min_ctas_per_sm() {
  return kVCap > kLargeValueHead ? 2 : kQ >= 8 ? 3 : 4;
}

template <int N>
using Int = std::integral_constant<int, N>;

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
      const int mid = lo + (hi - lo + 1) / 2;
      if (int64_t(clamp_int(qsl[mid], 0, p.num_tokens) / r) + mid <= index) {
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
  // The host bounds the capacity by kMaxKeyPositions; int64 all the same.
  const int64_t capacity = p.num_blocks > 0 ? int64_t(p.max_blocks_per_seq) * p.block_size : 0;
  const int kv_len = int(min(max(int64_t(p.seq_lens[seq]), int64_t(0)), capacity));
  // The sequence's query rows are its last (seq_end - seq_begin) positions, or (shared
  // prefix) all sit at its last key's position.
  const int first_pos = p.queries_after_keys ? kv_len - 1
                                             : kv_len - (seq_end - seq_begin) + (row_begin - seq_begin);
  tile = {seq, row_begin, row_end, first_pos};
  return true;
}

// kQ probabilities of one key from shared memory, in the widest loads kQ allows.
template <int kQ>
__device__ __forceinline__ void load_probs(const float* src, float* prob) {
  if constexpr (kQ % 4 == 0) {
#pragma unroll
    for (int m = 0; m < kQ; m += 4) {
      const float4 p4 = *reinterpret_cast<const float4*>(src + m);
      prob[m] = p4.x;
      prob[m + 1] = p4.y;
      prob[m + 2] = p4.z;
      prob[m + 3] = p4.w;
    }
  } else if constexpr (kQ == 2) {
    const float2 p2 = *reinterpret_cast<const float2*>(src);
    prob[0] = p2.x;
    prob[1] = p2.y;
  } else {
    prob[0] = src[0];
  }
}

// Q: the query/out type (AnyFloat: p.kind); C: the cache element type. kKCap / kVCap:
// the key and value head-size buckets the shared memory and the accumulators are
// sized for; kQ: query vectors per CTA (1, 2, 4 or 8).
template <typename Q, typename C, int kKCap, int kVCap, int kQ>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm<kQ, kVCap>()) attention_kernel(const AttentionParams p) {
  using E = Elem<C>;
  using Vec = typename E::Vec;
  constexpr int kPerVec = E::kPerVec;
  constexpr int kKeyVecsInFlight = kKeyBytesInFlight / int(sizeof(Vec)) < kMaxKeyVecsInFlight
                                        ? kKeyBytesInFlight / int(sizeof(Vec))
                                        : kMaxKeyVecsInFlight;
  constexpr int kRowVecs = kVCap / kPerVec;  // vectors (Vec) in a value row at the cap
  // Value phase: kLanesPerRow lanes share a row, kRowsPerStep rows per warp instruction.
  constexpr int kLanesPerRow = kRowVecs < 32 ? kRowVecs : 32;
  constexpr int kVecsPerLane = kRowVecs / kLanesPerRow;
  constexpr int kRowsPerStep = 32 / kLanesPerRow;
  constexpr int kAccPerLane = kVecsPerLane * kPerVec;

  // The queries and probabilities are dead once the warps merge, so the merge
  // reuses their space.
  struct LoopSmem {
    float q[kQ][kKCap];              // scaled queries
    float prob[kWarps][kStep][kQ];  // each warp's probabilities of its current step
  };
  struct MergeSmem {
    float acc[kWarps][kQ][kVCap];
  };
  __shared__ __align__(16) union {
    LoopSmem loop;
    MergeSmem merge;
  } smem;
  __shared__ int pos_s[kQ];        // sequence position of each query
  __shared__ int first_key_s[kQ];  // its first visible key (sliding window)
  __shared__ float slope_s[kQ];
  __shared__ float warp_max_s[kWarps][kQ];
  __shared__ float warp_sum_s[kWarps][kQ];
  __shared__ float q_sum_s[kQ];  // int4: each rotated query's sum, for the keys' low term
  constexpr bool kPerToken = kIsPerToken<C>;
  constexpr bool kRotated = kIsRotated<C>;

  Tile tile;
  if (!locate_tile(p, tile)) return;
  const int group = p.num_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int head_chunk = blockIdx.y - kv_head * p.head_chunks;
  const int head_begin = kv_head * group + head_chunk * p.heads_per_cta;
  const int num_cta_heads = min(p.heads_per_cta, group - head_chunk * p.heads_per_cta);
  const int num_rows = tile.row_end - tile.row_begin;
  const int num_q = num_rows * num_cta_heads;  // <= kQ; query m: row m / num_cta_heads, head m % num_cta_heads

  // Keys the tile can see (causal, sliding window), then this split's chunks.
  const int row_step = p.queries_after_keys ? 0 : 1;  // position step between query rows
  const int last_pos = tile.first_pos + row_step * (num_rows - 1);
  const int kv_begin = window_start(tile.first_pos, p.sliding_window);
  const int kv_end = max(kv_begin, last_pos + 1);
  const bool split = p.num_partitions > 1;
  const int64_t split_begin = kv_begin + int64_t(blockIdx.z) * p.partition_size;
  if (split && split_begin >= kv_end) {
    // A split without keys: its -inf lse alone tells the merge to skip it.
    if (threadIdx.x < num_q) {
      const int token = tile.row_begin + threadIdx.x / num_cta_heads;
      const int head = head_begin + threadIdx.x % num_cta_heads;
      p.part_lse[(int64_t(blockIdx.z) * p.num_tokens + token) * p.num_heads + head] = -INFINITY;
    }
    return;
  }

  // fp8: the KV head's scales, and the unpacking's own factor (fp8.cuh).
  float k_factor = 1.0f, v_factor = 1.0f;
  if constexpr (kIsFp8<C>) {
    k_factor = p.k_scale[kv_head * p.k_scale_stride] * E::unpack_scale();
    v_factor = p.v_scale[kv_head * p.v_scale_stride] * E::unpack_scale();
  }
  for (int i = threadIdx.x; i < num_q * p.head_size; i += kThreads) {
    const int m = i / p.head_size, d = i - m * p.head_size;
    const int64_t row = tile.row_begin + m / num_cta_heads;
    const int64_t head = head_begin + m % num_cta_heads;
    const float q = load_float<Q>(p.query, row * p.query_token_stride + head * p.query_head_stride + d, p.kind);
    smem.loop.q[m][d] = q * p.scale * k_factor * (kRotated ? rotation_sign(d) : 1.0f);
  }
  if (threadIdx.x < kQ) {
    const int m = threadIdx.x;
    pos_s[m] = tile.first_pos + row_step * (m / num_cta_heads);
    first_key_s[m] = window_start(pos_s[m], p.sliding_window);
    slope_s[m] = (p.alibi_slopes != nullptr && m < num_q) ? p.alibi_slopes[head_begin + m % num_cta_heads] : 0.0f;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (kRotated) {
    // The queries rotated like the keys (q . k = rotate(q) . rotate(k)), and their sums.
    const int n = rotation_block(p.head_size);
    hadamard_in_place(&smem.loop.q[0][0], kKCap, num_q, p.head_size, n, threadIdx.x, kThreads,
                      [] { __syncthreads(); });
    const float norm = rotation_norm(n);
    for (int m = warp; m < num_q; m += kWarps) {
      float sum = 0.0f;
      for (int d = lane; d < p.head_size; d += 32) {
        const float q = smem.loop.q[m][d] * norm;
        smem.loop.q[m][d] = q;
        sum += q;
      }
      sum = warp_sum(sum);
      if (lane == 0) q_sum_s[m] = sum;
    }
    __syncthreads();
  }
  const int num_vecs = p.head_size / kPerVec;
  const int num_vecs_v = p.head_size_v / kPerVec;
  const CacheLayout kl = p.key_layout, vl = p.value_layout;
  const CacheLayout ksl = p.k_scale_layout, vsl = p.v_scale_layout;
  const C* key_cache = static_cast<const C*>(p.key_cache) + kv_head * kl.head_stride;
  const C* value_cache = static_cast<const C*>(p.value_cache) + kv_head * vl.head_stride;
  const int32_t* table = p.block_tables + int64_t(tile.seq) * p.block_table_stride;
  const bool soft_cap = p.soft_cap > 0.0f;
  const float inv_soft_cap = soft_cap ? 1.0f / p.soft_cap : 0.0f;
  const int sub_row = lane / kLanesPerRow, sub_lane = lane % kLanesPerRow;

  // run_low (int4): sum_j p_j * vlow_j, this lane's share, rescaled like run_sum.
  float run_max[kQ], run_sum[kQ], run_low[kQ], acc[kQ][kAccPerLane];
#pragma unroll
  for (int m = 0; m < kQ; ++m) {
    run_max[m] = -INFINITY;
    run_sum[m] = 0.0f;  // this lane's share; summed over the warp at the end
    run_low[m] = 0.0f;
#pragma unroll
    for (int e = 0; e < kAccPerLane; ++e) acc[m][e] = 0.0f;
  }

  // Block-table entry of this lane's key one CTA step ahead: loaded a step early
  // so its latency hides behind the current step.
  auto load_block = [&](int j) {
    const int block = j < kv_end ? table[j / p.block_size] : 0;
    return static_cast<unsigned>(block) < static_cast<unsigned>(p.num_blocks) ? block : 0;
  };
  const KeySchedule schedule{kv_end, p.partition_size, int64_t(p.num_partitions - 1) * p.partition_size};
  // Score phase: lanes 2i and 2i+1 share keys i and i + 16 of a step, each taking
  // every other vector of the two rows (a load of the pair reads 32 contiguous bytes
  // of each row, 16 for fp8, and a query vector read from shared memory serves both
  // keys). Lane l
  // owns key own = l/2 + 16*(l%2) of the step for the softmax.
  const int parity = lane & 1;
  const int own = (lane >> 1) + 16 * parity;
  const int lo = lane >> 1, hi = lo + 16;
  // split_begin < kv_end <= kMaxKeyPositions: the int positions below cannot overflow.
  int t0 = int(split_begin) + warp * kStep;
  int chunk_offset = warp * kStep;  // of t0 in its chunk
  int next_block = load_block(t0 + own);
  while (t0 < kv_end) {
    const int j = t0 + own;
    const bool valid = j < kv_end;
    const int in_block = j % p.block_size;
    const int64_t row_offset = int64_t(next_block) * kl.block_stride + int64_t(in_block) * kl.token_stride;
    const int64_t v_row_offset = int64_t(next_block) * vl.block_stride + int64_t(in_block) * vl.token_stride;
    // Per-token caches: this lane's key's scales (int4: and lows), used after the dot
    // products, so their latency hides behind them. A key past the end reads none.
    float k_mul = 0.0f, k_low = 0.0f, v_mul = 0.0f, v_low = 0.0f;
    if constexpr (kPerToken) {
      if (valid) {
        const float* ks = p.k_scale + kv_head * ksl.head_stride + int64_t(next_block) * ksl.block_stride +
                          int64_t(in_block) * ksl.token_stride;
        const float* vs = p.v_scale + kv_head * vsl.head_stride + int64_t(next_block) * vsl.block_stride +
                          int64_t(in_block) * vsl.token_stride;
        k_mul = __ldg(ks);
        v_mul = __ldg(vs);
        if constexpr (kRotated) {
          k_low = __ldg(ks + 1);
          v_low = __ldg(vs + 1);
        }
      }
    }
    const int next_t0 = schedule.next(t0, &chunk_offset);
    next_block = load_block(next_t0 + own);
    const int64_t partner_offset = __shfl_xor_sync(kFullMask, row_offset, 1);  // key own ^ 16

    // Partial scores of keys lo and hi against every query, then the pair's sums.
    float s_lo[kQ], s_hi[kQ];
#pragma unroll
    for (int m = 0; m < kQ; ++m) s_lo[m] = s_hi[m] = 0.0f;
    const bool lo_valid = t0 + lo < kv_end, hi_valid = t0 + hi < kv_end;
    if (lo_valid) {
      const Vec* k_lo = reinterpret_cast<const Vec*>(key_cache + (parity ? partner_offset : row_offset));
      const Vec* k_hi = reinterpret_cast<const Vec*>(key_cache + (parity ? row_offset : partner_offset));
      for (int v0 = parity; v0 < num_vecs; v0 += 2 * kKeyVecsInFlight) {
        Vec a[kKeyVecsInFlight], b[kKeyVecsInFlight];
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
          E::unpack(hi_valid ? b[u] : Vec{}, fb);
#pragma unroll
          for (int m = 0; m < kQ; ++m) {
            if (m >= num_q) break;
            const float4* q4 = reinterpret_cast<const float4*>(&smem.loop.q[m][v * kPerVec]);
#pragma unroll
            for (int e = 0; e < kPerVec / 4; ++e) {
              const float4 q = q4[e];
              // One fmaf per product, chained into the running score.
              s_lo[m] = fmaf(q.x, fa[4 * e], s_lo[m]);
              s_lo[m] = fmaf(q.y, fa[4 * e + 1], s_lo[m]);
              s_lo[m] = fmaf(q.z, fa[4 * e + 2], s_lo[m]);
              s_lo[m] = fmaf(q.w, fa[4 * e + 3], s_lo[m]);
              s_hi[m] = fmaf(q.x, fb[4 * e], s_hi[m]);
              s_hi[m] = fmaf(q.y, fb[4 * e + 1], s_hi[m]);
              s_hi[m] = fmaf(q.z, fb[4 * e + 2], s_hi[m]);
              s_hi[m] = fmaf(q.w, fb[4 * e + 3], s_hi[m]);
            }
          }
        }
      }
    }

    // The score of this lane's own key, its modifiers and masks, then the online-
    // softmax update of the warp.
#pragma unroll
    for (int m = 0; m < kQ; ++m) {
      if (m >= num_q) break;
      const float lo_sum = s_lo[m] + __shfl_xor_sync(kFullMask, s_lo[m], 1);
      const float hi_sum = s_hi[m] + __shfl_xor_sync(kFullMask, s_hi[m], 1);
      float x = parity ? hi_sum : lo_sum;
      if constexpr (kRotated) {
        x = fmaf(k_mul, x, k_low * q_sum_s[m]);
      } else if constexpr (kPerToken) {
        x *= k_mul;
      }
      if (soft_cap) x = p.soft_cap * tanhf(x * inv_soft_cap);
      const int pos = pos_s[m];
      x = fmaf(slope_s[m], float(j - pos), x);
      const bool visible = valid && j <= pos && j >= first_key_s[m];
      x = visible ? x : -INFINITY;
      const float step_max = warp_max(x);
      float prob = 0.0f, alpha = 1.0f;
      if (step_max != -INFINITY) {
        const float new_max = fmaxf(run_max[m], step_max);
        alpha = __expf(run_max[m] - new_max);  // 0 on the first visible key
        prob = __expf(x - new_max);
        run_sum[m] = fmaf(run_sum[m], alpha, prob);
#pragma unroll
        for (int e = 0; e < kAccPerLane; ++e) acc[m][e] *= alpha;
        run_max[m] = new_max;
      }
      // A key's scales are part of its value row (q * scale + low), and meet its weight as
      // a float row does: a key read but masked for this query (weight 0) passes a NaN
      // scale on as 0 * NaN, as the reference's probs @ values and the CPU kernel do; keys
      // past the end are not read (scales 0).
      if constexpr (kRotated) run_low[m] = fmaf(run_low[m], alpha, prob * v_low);
      if constexpr (kPerToken) prob *= v_mul;  // the value phase's weight
      smem.loop.prob[warp][own][m] = prob;
    }
    __syncwarp();

    // acc += prob * V, value rows split over kLanesPerRow lanes each.
    const int rows = min(kStep, kv_end - t0);
#pragma unroll 4
    for (int r = 0; r < rows; r += kRowsPerStep) {
      const int t = r + sub_row;
      const int64_t v_offset = __shfl_sync(kFullMask, v_row_offset, 2 * (t & 15) + (t >> 4));  // key t's owner
      if (t < rows) {
        float prob[kQ];
        load_probs<kQ>(&smem.loop.prob[warp][t][0], prob);
        const Vec* v_row = reinterpret_cast<const Vec*>(value_cache + v_offset);
#pragma unroll
        for (int k = 0; k < kVecsPerLane; ++k) {
          const int vec = sub_lane + k * kLanesPerRow;
          if (vec < num_vecs_v) {
            float vf[kPerVec];
            E::unpack(__ldg(v_row + vec), vf);
#pragma unroll
            for (int m = 0; m < kQ; ++m) {
              if (m >= num_q) break;
#pragma unroll
              for (int e = 0; e < kPerVec; ++e) acc[m][k * kPerVec + e] = fmaf(prob[m], vf[e], acc[m][k * kPerVec + e]);
            }
          }
        }
      }
    }
    __syncwarp();  // the next step overwrites this warp's probabilities
    t0 = next_t0;
  }

  // Warp totals: sums over all lanes, accumulators over the row groups.
#pragma unroll
  for (int m = 0; m < kQ; ++m) {
    if (m >= num_q) break;
    run_sum[m] = warp_sum(run_sum[m]);
    if constexpr (kRotated) run_low[m] = warp_sum(run_low[m]);
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
  for (int m = 0; m < kQ; ++m) {
    if (m >= num_q) break;
    if (lane == 0) {
      warp_max_s[warp][m] = run_max[m];
      warp_sum_s[warp][m] = run_sum[m];
    }
    if (sub_row == 0) {
#pragma unroll
      for (int k = 0; k < kVecsPerLane; ++k) {
        const int vec = sub_lane + k * kLanesPerRow;
        if (vec < num_vecs_v) {
#pragma unroll
          for (int e = 0; e < kPerVec; ++e) {
            smem.merge.acc[warp][m][vec * kPerVec + e] = acc[m][k * kPerVec + e] + (kRotated ? run_low[m] : 0.0f);
          }
        }
      }
    }
  }
  __syncthreads();

  // Merge the warps and write this CTA's result. Without a split the sink joins
  // the denominator here; a split's result leaves it to the merge kernel.
  const float* sinks = split ? nullptr : p.sinks;
  for (int i = threadIdx.x; i < num_q * p.head_size_v; i += kThreads) {
    const int m = i / p.head_size_v, d = i - m * p.head_size_v;
    const int64_t token = tile.row_begin + m / num_cta_heads;
    const int64_t head = head_begin + m % num_cta_heads;
    const float sink = sinks != nullptr ? sinks[head] : -INFINITY;
    float top = sink;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, warp_max_s[w][m]);
    float total = 0.0f, o = 0.0f;
    if (top != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = __expf(warp_max_s[w][m] - top);
        total = fmaf(weight, warp_sum_s[w][m], total);
        o = fmaf(weight, smem.merge.acc[w][m][d], o);
      }
      total += __expf(sink - top);  // 0 without a sink
    }
    // A query that sees no key (a padded row) yields zeros and lse = sink (-inf
    // without sinks).
    // total is 0 exactly when the row sees no key (else >= 1); != 0, not > 0, so that a
    // NaN score (a NaN stored in a visible key) gives NaN, as in the reference, not 0.
    const float value = total != 0.0f ? o / total * v_factor : 0.0f;
    const float lse = total != 0.0f ? top + __logf(total) : -INFINITY;
    if (split) {
      const int64_t slot = (int64_t(blockIdx.z) * p.num_tokens + token) * p.num_heads + head;
      p.part_out[slot * p.head_size_v + d] = value;
      if (d == 0) p.part_lse[slot] = lse;
    } else {
      if constexpr (kRotated) {
        smem.merge.acc[0][m][d] = value;  // only this thread reads (m, d): rotated back below
      } else {
        store_float<Q>(p.out, token * p.out_token_stride + head * p.out_head_stride + d, value, p.kind);
      }
      if (d == 0 && p.lse != nullptr) p.lse[token * p.lse_token_stride + head] = lse;
    }
  }
  if constexpr (kRotated) {
    if (!split) {
      // The output rotated back (the split results stay rotated: the merge kernel does it).
      __syncthreads();
      const int n = output_rotation_block(p);
      hadamard_in_place(&smem.merge.acc[0][0][0], kVCap, num_q, p.head_size_v, n, threadIdx.x, kThreads,
                        [] { __syncthreads(); });
      const float norm = rotation_norm(n);
      for (int i = threadIdx.x; i < num_q * p.head_size_v; i += kThreads) {
        const int m = i / p.head_size_v, d = i - m * p.head_size_v;
        const int64_t token = tile.row_begin + m / num_cta_heads;
        const int64_t head = head_begin + m % num_cta_heads;
        store_float<Q>(p.out, token * p.out_token_stride + head * p.out_head_stride + d,
                       smem.merge.acc[0][m][d] * norm * rotation_sign(d), p.kind);
      }
    }
  }
}

__device__ __forceinline__ float block_max(float x, float* scratch) {
  x = warp_max(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();
  return r;
}

__device__ __forceinline__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

// One CTA per (token, head). The split results are weighted by exp(lse - max);
// the threads form groups of head_size_v / 4 lanes (one float4 each), and the
// groups take the splits in turn, four loads in flight per thread: every load
// is unconditional (an empty split, weight 0, reads split 0's row instead, which
// any row with keys has written, and a select drops it). The sink joins the
// denominator. kUnrotate (int4 caches): the merged row is rotated back before it is stored.
template <typename Q, bool kUnrotate>
__global__ void __launch_bounds__(kThreads) merge_partitions_kernel(const AttentionParams p) {
  __shared__ float scratch[kWarps];
  __shared__ float4 partial[kThreads];
  const int64_t index = blockIdx.x;  // token * num_heads + head
  const int64_t token = index / p.num_heads, head = index % p.num_heads;
  const int64_t part_stride = int64_t(p.num_tokens) * p.num_heads;
  const int parts = p.num_partitions;
  const float* lse_of = p.part_lse + index;  // split q: lse_of[q * part_stride]

  float parts_max = -INFINITY;
  for (int q = threadIdx.x; q < parts; q += kThreads) parts_max = fmaxf(parts_max, lse_of[q * part_stride]);
  parts_max = block_max(parts_max, scratch);
  const float sink = p.sinks != nullptr ? p.sinks[head] : -INFINITY;
  const float top = fmaxf(parts_max, sink);
  float total = 0.0f;
  if (top != -INFINITY) {
    for (int q = threadIdx.x; q < parts; q += kThreads) total += __expf(lse_of[q * part_stride] - top);
  }
  total = block_sum(total, scratch);
  if (top != -INFINITY) total += __expf(sink - top);

  const int vecs = p.head_size_v / 4;  // head_size_v is a multiple of 8
  const int groups = kThreads / vecs;  // >= 1: head_size_v <= kMaxValueHeadSize (512)
  const int g = threadIdx.x / vecs, v = threadIdx.x - g * vecs;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (parts_max != -INFINITY && g < groups) {
    const float4* rows = reinterpret_cast<const float4*>(p.part_out) + index * vecs + v;
    const int64_t split_stride = part_stride * vecs;  // float4s from one split's rows to the next's
    auto add = [&](float w, const float4& x) {
      const bool use = w != 0.0f;
      o.x += use ? w * x.x : 0.0f;
      o.y += use ? w * x.y : 0.0f;
      o.z += use ? w * x.z : 0.0f;
      o.w += use ? w * x.w : 0.0f;
    };
    int q = g;
    for (; q + 3 * groups < parts; q += 4 * groups) {
      float w[4];
      float4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) w[u] = __expf(lse_of[int64_t(q + u * groups) * part_stride] - top);
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = rows[(w[u] != 0.0f ? int64_t(q + u * groups) : 0) * split_stride];
#pragma unroll
      for (int u = 0; u < 4; ++u) add(w[u], x[u]);
    }
    for (; q < parts; q += groups) {
      const float w = __expf(lse_of[int64_t(q) * part_stride] - top);
      add(w, rows[(w != 0.0f ? int64_t(q) : 0) * split_stride]);
    }
  }
  partial[threadIdx.x] = o;
  __syncthreads();

  const float inv_total = total != 0.0f ? 1.0f / total : 0.0f;  // NaN stays NaN
  const int64_t out = token * p.out_token_stride + head * p.out_head_stride;
  // This thread's four output values: the groups' partial sums, normalised.
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (threadIdx.x < vecs) {
    sum = partial[threadIdx.x];
    for (int k = 1; k < groups; ++k) {
      const float4 x = partial[k * vecs + threadIdx.x];
      sum.x += x.x;
      sum.y += x.y;
      sum.z += x.z;
      sum.w += x.w;
    }
  }
  const float values[4] = {sum.x * inv_total, sum.y * inv_total, sum.z * inv_total, sum.w * inv_total};
  if constexpr (kUnrotate) {
    // One output row: head_size_v is at most the largest rotation block (checks.h's
    // kMaxValueHeadSize is 512 too).
    __shared__ float row_s[kMaxRotationBlock];
    if (threadIdx.x < vecs) {
      for (int i = 0; i < 4; ++i) row_s[4 * threadIdx.x + i] = values[i];
    }
    __syncthreads();
    const int n = output_rotation_block(p);
    hadamard_in_place(row_s, 0, 1, p.head_size_v, n, threadIdx.x, kThreads, [] { __syncthreads(); });
    const float norm = rotation_norm(n);
    for (int d = threadIdx.x; d < p.head_size_v; d += kThreads) {
      store_float<Q>(p.out, out + d, row_s[d] * norm * rotation_sign(d), p.kind);
    }
  } else if (threadIdx.x < vecs) {
    for (int i = 0; i < 4; ++i) store_float<Q>(p.out, out + 4 * threadIdx.x + i, values[i], p.kind);
  }
  if (threadIdx.x == 0 && p.lse != nullptr) {
    p.lse[token * p.lse_token_stride + head] = total != 0.0f ? top + __logf(total) : -INFINITY;
  }
}

// Head-size buckets: (key cap, value cap) instances. Equal buckets cover every
// model with equal key and value head sizes (up to 512: Gemma-4's global layers);
// (128, 64) and (256, 128) cover 96/64 and 192/128 (MLA models as transformers runs
// them), (576, 512) MLA's latent rows (keys the whole row, values its leading 512
// columns). Any other pair runs in the equal-bucket instance of the larger cap.
__host__ __device__ inline int head_bucket(int h) {
  return h <= 64 ? 64 : h <= 128 ? 128 : h <= 256 ? 256 : h <= 512 ? 512 : 576;
}

template <typename F>
cudaError_t with_head_caps(int head_size, int head_size_v, F&& f) {
  const int k = head_bucket(head_size), v = head_bucket(head_size_v);
  if (k == 128 && v == 64) return f(Int<128>{}, Int<64>{});
  if (k == 256 && v == 128) return f(Int<256>{}, Int<128>{});
  if (k == 576) return f(Int<576>{}, Int<512>{});  // the value head is <= 512 (checked)
  const int cap = k > v ? k : v;
  if (cap == 64) return f(Int<64>{}, Int<64>{});
  if (cap == 128) return f(Int<128>{}, Int<128>{});
  if (cap == 256) return f(Int<256>{}, Int<256>{});
  return f(Int<512>{}, Int<512>{});
}

// Query vectors per CTA the instances of a value cap hold (attention_plan.h:
// max_queries_per_cta): past kLargeValueHead, the warps' merge buffer (kWarps x kQ x kVCap
// floats) of 8 queries would pass the 48 KB of static shared memory, so those stop at 4.
template <typename F>
cudaError_t with_instance(int head_size, int head_size_v, int query_bucket, F&& f) {
  return with_head_caps(head_size, head_size_v, [&](auto k, auto v) {
    switch (query_bucket) {
      case 0: return f(k, v, Int<1>{});
      case 1: return f(k, v, Int<2>{});
      case 2: return f(k, v, Int<4>{});
      default:
        if constexpr (max_queries_per_cta(decltype(v)::value) == kMaxQueriesPerCta) {
          return f(k, v, Int<kMaxQueriesPerCta>{});
        } else {
          return cudaErrorInvalidConfiguration;  // the planner never picks it
        }
    }
  });
}

// The launches (CUDA syntax): nvcc only. tests/cuda_emulator.cpp compiles the kernels
// above with the host compiler and runs them on emulated threads.
#if defined(__CUDACC__)
// Q: the query/out type, C: the cache's (for float caches Q = C; fp8, int8, int4: Q = AnyFloat).
template <typename Q, typename C>
cudaError_t launch_attention_typed(const AttentionParams& p, cudaStream_t stream) {
  return with_instance(p.head_size, p.head_size_v, p.query_bucket, [&](auto k, auto v, auto q) {
    const dim3 grid(p.num_tiles, p.num_kv_heads * p.head_chunks, p.num_partitions);
    attention_kernel<Q, C, decltype(k)::value, decltype(v)::value, decltype(q)::value>
        <<<grid, kThreads, 0, stream>>>(p);
    if (p.num_partitions > 1) {
      merge_partitions_kernel<Q, kIsRotated<C>><<<unsigned(int64_t(p.num_tokens) * p.num_heads), kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

template <typename Q, typename C>
cudaError_t occupancy_typed(int head_size, int head_size_v, int query_bucket, int* ctas) {
  return with_instance(head_size, head_size_v, query_bucket, [&](auto k, auto v, auto q) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        ctas, attention_kernel<Q, C, decltype(k)::value, decltype(v)::value, decltype(q)::value>, kThreads, 0);
  });
}

#endif  // __CUDACC__

}  // namespace
}  // namespace paged::cuda
