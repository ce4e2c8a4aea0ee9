// Runs the CUDA attention kernels (csrc/cuda/attention_kernels.cuh) on the CPU.
//
// The kernel source is compiled by the host compiler with the CUDA keywords and
// intrinsics it uses defined here: each CTA runs on 128 host threads, __shared__
// variables become function statics (one CTA runs at a time), __syncthreads and
// __syncwarp are barriers, and warp shuffles exchange values through a per-warp
// buffer between two barriers. Slow, but it executes the kernels' own code:
// planner, key schedule, score and value phases, warp merge, sinks, the split
// results and the merge kernel. Built and driven by tests/test_cuda_emulated.py
// (ctypes); needs the CUDA headers (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h), not
// a GPU or the CUDA runtime library.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

// ---- the CUDA language, emulated ------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#undef __align__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct Index3 {
  unsigned x, y, z;
};
thread_local Index3 threadIdx, blockIdx;

namespace emu {
constexpr int kThreads = 128;
struct Warp {
  std::barrier<> bar{32};
  uint64_t buf[32];
};
struct Cta {
  std::barrier<> bar{kThreads};
  Warp warps[kThreads / 32];
};
Cta* cta = nullptr;

template <typename T>
T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= 8);
  Warp& w = cta->warps[threadIdx.x / 32];
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  w.buf[threadIdx.x % 32] = bits;
  w.bar.arrive_and_wait();
  bits = w.buf[src_lane & 31];
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}
}  // namespace emu

template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::exchange(v, int(threadIdx.x % 32) ^ mask);
}
template <typename T>
T __shfl_sync(unsigned, T v, int lane) {
  return emu::exchange(v, lane);
}
inline void __syncwarp() { emu::cta->warps[threadIdx.x / 32].bar.arrive_and_wait(); }
inline void __syncthreads() { emu::cta->bar.arrive_and_wait(); }
template <typename T>
T __ldg(const T* p) {
  return *p;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
using std::max;
using std::min;

#include "attention_kernels.cuh"

// ---- the driver --------------------------------------------------------------------------
namespace paged::cuda {
namespace {

template <typename Kernel>
void run_grid(dim3 grid, Kernel kernel) {
  emu::Cta cta;
  emu::cta = &cta;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < emu::kThreads; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            kernel();
            cta.bar.arrive_and_wait();  // the CTA is done before the next reuses the statics
          }
    });
  }
  for (auto& t : threads) t.join();
  emu::cta = nullptr;
}

template <typename T>
void run_attention(const AttentionParams& p) {
  with_instance(p.head_size, p.head_size_v, p.query_bucket, [&](auto k, auto v, auto q) {
    const dim3 grid(p.num_tiles, p.num_kv_heads * p.head_chunks, p.num_partitions);
    run_grid(grid, [&] { attention_kernel<T, decltype(k)::value, decltype(v)::value, decltype(q)::value>(p); });
    if (p.num_partitions > 1) {
      run_grid(dim3(unsigned(int64_t(p.num_tokens) * p.num_heads)), [&] { merge_partitions_kernel<T>(p); });
    }
    return cudaSuccess;
  });
}

}  // namespace
}  // namespace paged::cuda

// Flat arguments, filled by ctypes (tests/test_cuda_emulated.py mirrors the layout).
struct EmuArgs {
  int64_t kind;  // 0 fp32, 1 fp16, 2 bf16
  void* query;
  int64_t query_token_stride, query_head_stride;
  void* key_cache;
  void* value_cache;
  int32_t* block_tables;
  int64_t block_table_stride;
  int32_t* seq_lens;
  int32_t* query_start_loc;
  float* alibi_slopes;
  float* sinks;
  int64_t num_tokens, num_seqs, num_heads, num_kv_heads, head_size, head_size_v, block_size, num_blocks,
      max_blocks_per_seq, sliding_window;
  double scale, soft_cap;
  void* out;
  int64_t out_token_stride, out_head_stride;
  float* lse;
  int64_t lse_token_stride;
  int64_t multiprocessors, ctas_per_sm;
  int64_t num_partitions;  // out: the plan's split count
};

extern "C" int emu_attention(EmuArgs* a) {
  using namespace paged::cuda;
  AttentionParams p{};
  p.kind = paged::ScalarKind(a->kind);
  p.query = a->query;
  p.query_token_stride = a->query_token_stride;
  p.query_head_stride = a->query_head_stride;
  p.key_cache = a->key_cache;
  p.value_cache = a->value_cache;
  p.block_tables = a->block_tables;
  p.block_table_stride = a->block_table_stride;
  p.seq_lens = a->seq_lens;
  p.query_start_loc = a->query_start_loc;
  p.alibi_slopes = a->alibi_slopes;
  p.sinks = a->sinks;
  p.num_tokens = int(a->num_tokens);
  p.num_seqs = int(a->num_seqs);
  p.num_heads = int(a->num_heads);
  p.num_kv_heads = int(a->num_kv_heads);
  p.head_size = int(a->head_size);
  p.head_size_v = int(a->head_size_v);
  p.block_size = int(a->block_size);
  p.num_blocks = int(a->num_blocks);
  p.max_blocks_per_seq = int(a->max_blocks_per_seq);
  p.scale = float(a->scale);
  p.soft_cap = float(a->soft_cap);
  p.sliding_window = int(a->sliding_window);
  p.out = a->out;
  p.out_token_stride = a->out_token_stride;
  p.out_head_stride = a->out_head_stride;
  p.lse = a->lse;
  p.lse_token_stride = a->lse_token_stride;

  AttentionPlanInput in{};
  in.num_tokens = a->num_tokens;
  in.num_seqs = a->num_seqs;
  in.num_heads = a->num_heads;
  in.num_kv_heads = a->num_kv_heads;
  in.block_size = a->block_size;
  in.max_blocks_per_seq = a->max_blocks_per_seq;
  in.sliding_window = a->sliding_window;
  in.multi_token = a->query_start_loc != nullptr;
  in.multiprocessors = int(a->multiprocessors);
  for (int& c : in.ctas_per_sm) c = int(a->ctas_per_sm);
  const AttentionPlan plan = plan_attention(in);
  set_plan(p, plan);
  a->num_partitions = plan.num_partitions;

  // Split results start as NaN: a merge that used a row no split wrote would show.
  std::vector<float> part_out, part_lse;
  if (p.num_partitions > 1) {
    part_out.assign(size_t(p.num_partitions) * p.num_tokens * p.num_heads * p.head_size_v, NAN);
    part_lse.assign(size_t(p.num_partitions) * p.num_tokens * p.num_heads, NAN);
    p.part_out = part_out.data();
    p.part_lse = part_lse.data();
  }
  switch (p.kind) {
    case paged::ScalarKind::kFloat32: run_attention<float>(p); break;
    case paged::ScalarKind::kFloat16: run_attention<__half>(p); break;
    case paged::ScalarKind::kBFloat16: run_attention<__nv_bfloat16>(p); break;
  }
  return 0;
}
