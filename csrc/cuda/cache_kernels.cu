// Launches of the cache-op kernels (cache_kernels.cuh): the copy unit each launch
// uses, and the format of a quantizing write_kv (fp8, per-token int8 / int4).
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "cache_kernels.cuh"

namespace paged::cuda {
namespace {

// The largest power of two, at most 16, that divides every value.
int common_alignment(std::initializer_list<int64_t> values) {
  uint64_t bits = 16;
  for (const int64_t v : values) bits |= static_cast<uint64_t>(v);
  return static_cast<int>(bits & (~bits + 1));
}

// Calls launch(Unit{}) with the copy unit of `alignment` bytes.
template <typename Launch>
void with_unit(int alignment, Launch&& launch) {
  switch (alignment) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
}

int64_t address(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

}  // namespace

template <typename F>
void launch_write_kv_fp8(const WriteKvParams& p, bool wide, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.num_tokens);
  if (wide) {
    write_kv_fp8_kernel<F, true><<<grid, kCacheThreads, 0, stream>>>(p);
  } else {
    write_kv_fp8_kernel<F, false><<<grid, kCacheThreads, 0, stream>>>(p);
  }
}

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const CacheLayout& k = p.key_layout;
  const CacheLayout& v = p.value_layout;
  // Every cache row's start and length, in bytes (the caches' strides are in bytes here).
  const int cache_alignment = common_alignment({address(p.key_cache), address(p.value_cache), p.key_row_bytes,
                                                p.value_row_bytes, k.block_stride, k.head_stride, k.token_stride,
                                                v.block_stride, v.head_stride, v.token_stride});
  if (p.cache_kind == ScalarKind::kInt8) {
    write_kv_token_kernel<false><<<static_cast<unsigned>(p.num_tokens), kCacheThreads, 0, stream>>>(p);
  } else if (p.cache_kind == ScalarKind::kInt4) {
    write_kv_token_kernel<true><<<static_cast<unsigned>(p.num_tokens), kCacheThreads, 0, stream>>>(p);
  } else if (p.cache_kind == ScalarKind::kFloat8E4M3) {
    launch_write_kv_fp8<Fp8E4M3>(p, cache_alignment >= 8, stream);
  } else if (p.cache_kind == ScalarKind::kFloat8E5M2) {
    launch_write_kv_fp8<Fp8E5M2>(p, cache_alignment >= 8, stream);
  } else {
    const int alignment = common_alignment({cache_alignment, address(p.key), address(p.value), p.key_token_stride,
                                            p.key_head_stride, p.value_token_stride, p.value_head_stride});
    with_unit(alignment, [&](auto unit) {
      write_kv_kernel<decltype(unit)><<<static_cast<unsigned>(p.num_tokens), kCacheThreads, 0, stream>>>(p);
    });
  }
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(const CopyBlocksParams& p, cudaStream_t stream) {
  int alignment = 16;
  for (int l = 0; l < p.num_layers; ++l) {
    for (const CopyCache& c : {p.keys[l], p.values[l]}) {
      alignment = common_alignment({alignment, address(c.base), c.block_stride, c.head_stride, c.token_stride,
                                    c.row_bytes});
    }
  }
  const dim3 grid(static_cast<unsigned>(p.num_pairs), 2 * p.num_layers);
  with_unit(alignment, [&](auto unit) {
    copy_blocks_kernel<decltype(unit)><<<grid, kCacheThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

}  // namespace paged::cuda
