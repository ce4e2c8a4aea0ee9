// Runs the CUDA kernels (csrc/cuda/attention_kernels.cuh, cache_kernels.cuh) on the CPU.
//
// The kernel source is compiled by the host compiler with the CUDA keywords and
// intrinsics it uses defined here: each CTA runs on 128 host threads, __shared__
// variables become function statics (one CTA runs at a time), __syncthreads and
// __syncwarp are barriers, and warp shuffles exchange values through a per-warp
// buffer between two barriers. Slow, but it executes the kernels' own code:
// planner, key schedule, score and value phases, warp merge, sinks, the split
// results and the merge kernel, merge_attention_states; write_kv (copying, fp8-quantizing,
// and quantizing into per-token int8 / int4 caches) and copy_blocks; the per-token formats'
// attention (scales, the int4 rotation);
// the fp8 conversions (fp8.cuh's software path, the one sm_80 runs: the hardware
// conversion of sm_89+ is not emulated). Built and driven by tests/test_cuda_emulated.py
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
#define __grid_constant__

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
#include "block_copies.h"
#include "cache_kernels.cuh"
#include "merge_states.cuh"

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

template <typename Q, typename C>
void run_attention(const AttentionParams& p) {
  with_instance(p.head_size, p.head_size_v, p.query_bucket, [&](auto k, auto v, auto q) {
    const dim3 grid(p.num_tiles, p.num_kv_heads * p.head_chunks, p.num_partitions);
    run_grid(grid, [&] { attention_kernel<Q, C, decltype(k)::value, decltype(v)::value, decltype(q)::value>(p); });
    if (p.num_partitions > 1) {
      run_grid(dim3(unsigned(int64_t(p.num_tokens) * p.num_heads)),
               [&] { merge_partitions_kernel<Q, kIsRotated<C>>(p); });
    }
    return cudaSuccess;
  });
}

}  // namespace
}  // namespace paged::cuda

// Cache kinds past the float and fp8 ones: int8_per_token_head, int4_per_token_head.
constexpr int64_t kEmuInt8 = 5, kEmuInt4 = 6;

// Flat arguments, filled by ctypes (tests/test_cuda_emulated.py mirrors the layout).
struct EmuArgs {
  int64_t kind;        // of the query: 0 fp32, 1 fp16, 2 bf16
  int64_t cache_kind;  // the query's, or 3 float8_e4m3fn, 4 float8_e5m2
  void* query;
  int64_t query_token_stride, query_head_stride;
  void* key_cache;
  void* value_cache;
  int64_t key_strides[3], value_strides[3];  // block, head, token (elements)
  float* k_scale;
  float* v_scale;
  int64_t k_scale_stride, v_scale_stride;
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
  int64_t queries_after_keys;  // shared_prefix_attention
  int64_t k_scale_strides[3], v_scale_strides[3];  // per-token caches' scales (block, head, token)
};

extern "C" int emu_attention(EmuArgs* a) {
  using namespace paged::cuda;
  AttentionParams p{};
  p.kind = paged::ScalarKind(a->kind);
  p.cache_kind = paged::ScalarKind(a->cache_kind);
  p.query = a->query;
  p.query_token_stride = a->query_token_stride;
  p.query_head_stride = a->query_head_stride;
  p.key_cache = a->key_cache;
  p.value_cache = a->value_cache;
  p.key_layout = {a->key_strides[0], a->key_strides[1], a->key_strides[2]};
  p.value_layout = {a->value_strides[0], a->value_strides[1], a->value_strides[2]};
  p.k_scale = a->k_scale;
  p.v_scale = a->v_scale;
  p.k_scale_stride = a->k_scale_stride;
  p.v_scale_stride = a->v_scale_stride;
  p.k_scale_layout = {a->k_scale_strides[0], a->k_scale_strides[1], a->k_scale_strides[2]};
  p.v_scale_layout = {a->v_scale_strides[0], a->v_scale_strides[1], a->v_scale_strides[2]};
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
  p.queries_after_keys = int(a->queries_after_keys);
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
  in.head_size_v = a->head_size_v;
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
  switch (a->cache_kind) {
    case 0: run_attention<float, float>(p); break;
    case 1: run_attention<__half, __half>(p); break;
    case 2: run_attention<__nv_bfloat16, __nv_bfloat16>(p); break;
    case 3: run_attention<AnyFloat, Fp8E4M3>(p); break;
    case 4: run_attention<AnyFloat, Fp8E5M2>(p); break;
    case kEmuInt8: run_attention<AnyFloat, Int8>(p); break;
    case kEmuInt4: run_attention<AnyFloat, Int4x2>(p); break;
  }
  return 0;
}

// merge_attention_states with MergeStatesParams' layout, as launch_merge_states runs it.
extern "C" int emu_merge_states(const paged::cuda::MergeStatesParams* p) {
  using namespace paged::cuda;
  run_grid(dim3(unsigned(int64_t(p->num_tokens) * p->num_heads)),
           [&] { merge_states_kernel<AnyFloat>(*p); });
  return 0;
}

// ---- cache ops ---------------------------------------------------------------------------

// write_kv with every stride in bytes (WriteKvParams' layout), as launch_write_kv runs it
// (its copy unit fixed to 2 bytes here, the fp8 store width chosen by the caller: the
// emulator checks indexing, not alignment).
struct EmuWriteKv {
  int64_t kind, cache_kind;
  void* key;
  void* value;
  int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
  void* key_cache;
  void* value_cache;
  int64_t key_strides[3], value_strides[3];
  int64_t* slot_mapping;
  int64_t num_tokens, num_slots, num_kv_heads, block_size, key_row_bytes, value_row_bytes;
  float* k_scale;
  float* v_scale;
  int64_t k_scale_stride, v_scale_stride;
  int64_t wide;  // fp8: 8-byte stores (rows aligned) or byte stores
  int64_t k_scale_strides[3], v_scale_strides[3];  // per-token caches' scales (block, head, token)
};

extern "C" int emu_write_kv(EmuWriteKv* a) {
  using namespace paged::cuda;
  WriteKvParams p{};
  p.key = a->key;
  p.value = a->value;
  p.key_token_stride = a->key_token_stride;
  p.key_head_stride = a->key_head_stride;
  p.value_token_stride = a->value_token_stride;
  p.value_head_stride = a->value_head_stride;
  p.key_cache = a->key_cache;
  p.value_cache = a->value_cache;
  p.key_layout = {a->key_strides[0], a->key_strides[1], a->key_strides[2]};
  p.value_layout = {a->value_strides[0], a->value_strides[1], a->value_strides[2]};
  p.slot_mapping = a->slot_mapping;
  p.slot_stride = 1;
  p.num_tokens = a->num_tokens;
  p.num_slots = a->num_slots;
  p.num_kv_heads = int(a->num_kv_heads);
  p.block_size = int(a->block_size);
  p.key_row_bytes = a->key_row_bytes;
  p.value_row_bytes = a->value_row_bytes;
  p.kind = paged::ScalarKind(a->kind);
  p.cache_kind = paged::ScalarKind(a->cache_kind);
  p.k_scale = a->k_scale;
  p.v_scale = a->v_scale;
  p.k_scale_stride = a->k_scale_stride;
  p.v_scale_stride = a->v_scale_stride;
  p.k_token_scale = a->k_scale;
  p.v_token_scale = a->v_scale;
  p.k_scale_layout = {a->k_scale_strides[0], a->k_scale_strides[1], a->k_scale_strides[2]};
  p.v_scale_layout = {a->v_scale_strides[0], a->v_scale_strides[1], a->v_scale_strides[2]};
  const dim3 grid(unsigned(p.num_tokens));
  switch (a->cache_kind) {
    case kEmuInt8: run_grid(grid, [&] { write_kv_token_kernel<false>(p); }); break;
    case kEmuInt4: run_grid(grid, [&] { write_kv_token_kernel<true>(p); }); break;
    case 3:
      if (a->wide) run_grid(grid, [&] { write_kv_fp8_kernel<Fp8E4M3, true>(p); });
      else run_grid(grid, [&] { write_kv_fp8_kernel<Fp8E4M3, false>(p); });
      break;
    case 4:
      if (a->wide) run_grid(grid, [&] { write_kv_fp8_kernel<Fp8E5M2, true>(p); });
      else run_grid(grid, [&] { write_kv_fp8_kernel<Fp8E5M2, false>(p); });
      break;
    default: run_grid(grid, [&] { write_kv_kernel<uint16_t>(p); }); break;
  }
  return 0;
}

// copy_blocks of one layer (key and value caches as CopyCache rows, strides in bytes).
extern "C" int emu_copy_blocks(const paged::cuda::CopyCache* key, const paged::cuda::CopyCache* value, const int64_t* mapping,
                               int64_t num_pairs, int64_t num_blocks) {
  using namespace paged::cuda;
  CopyBlocksParams p{};
  p.keys[0] = *key;
  p.values[0] = *value;
  p.block_mapping = mapping;
  p.num_pairs = num_pairs;
  p.num_blocks = num_blocks;
  p.num_layers = 1;
  run_grid(dim3(unsigned(num_pairs), 2), [&] { copy_blocks_kernel<uint16_t>(p); });
  return 0;
}

// swap_blocks' strided path (cache_ops_cuda.cpp): each pair's block moved by block_copies'
// 2-D copies, each a memcpy per row as cudaMemcpy2DAsync would do. Sizes and strides in
// elements, mapping (src, dst) pairs.
extern "C" int emu_swap_blocks(int dim, const int64_t* sizes, const char* src, const int64_t* src_strides, char* dst,
                               const int64_t* dst_strides, int64_t elem, const int64_t* mapping, int64_t num_pairs) {
  using namespace paged::cuda;
  const std::vector<BlockCopy> copies = block_copies(dim, sizes, src_strides, dst_strides, elem);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const char* from = src + mapping[2 * i] * src_strides[0] * elem;
    char* to = dst + mapping[2 * i + 1] * dst_strides[0] * elem;
    for (const BlockCopy& c : copies) {
      for (int64_t r = 0; r < c.height; ++r)
        std::memcpy(to + c.dst_offset + r * c.dst_pitch, from + c.src_offset + r * c.src_pitch, c.width);
    }
  }
  return 0;
}

// fp8.cuh's conversions on n values: quantize (format 3 e4m3, 4 e5m2) x / scale, and
// unpack n bytes (a multiple of 4) to their values (unpack_scale applied).
extern "C" void emu_quantize(int64_t format, const float* x, float scale, uint8_t* out, int64_t n) {
  using namespace paged::cuda;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t sign = (float_bits(x[i]) >> 24) & 0x80u;
    out[i] = format == 3 ? quantize_scaled<Fp8E4M3>(x[i], sign, scale) : quantize_scaled<Fp8E5M2>(x[i], sign, scale);
  }
}

extern "C" void emu_unpack(int64_t format, const uint8_t* in, float* out, int64_t n) {
  using namespace paged::cuda;
  for (int64_t i = 0; i + 4 <= n; i += 4) {
    uint32_t w;
    std::memcpy(&w, in + i, 4);
    if (format == 3) {
      unpack_fp8x4<Fp8E4M3>(w, out + i);
      for (int e = 0; e < 4; ++e) out[i + e] *= unpack_scale<Fp8E4M3>();
    } else {
      unpack_fp8x4<Fp8E5M2>(w, out + i);
      for (int e = 0; e < 4; ++e) out[i + e] *= unpack_scale<Fp8E5M2>();
    }
  }
}
