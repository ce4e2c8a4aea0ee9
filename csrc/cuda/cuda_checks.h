// Host-side helpers shared by the CUDA ops (attention_cuda.cpp, cache_ops_cuda.cpp):
// what the kernels need of a cache beyond the backend-independent checks (checks.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

#include "../dtypes.h"
#include "kernels.h"

namespace paged::cuda {

// The kernels read and write cache rows as vectors of cache_vector_bytes (16; 8 for
// fp8): every row must start at such an address, so the start and the strides of the
// block, head and token dimensions (those of size > 1) must be multiples of it.
inline void check_row_alignment(const char* op, const char* name, const at::Tensor& cache) {
  const int64_t bytes = cache_vector_bytes(scalar_kind(cache.scalar_type()));
  const int64_t elem = cache.element_size();
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(cache.data_ptr()) % bytes == 0, op, ": argument '", name,
                    "' must start at a ", bytes, "-byte aligned address on CUDA (it is read in ", bytes,
                    "-byte vectors)");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(cache.size(d) <= 1 || cache.stride(d) * elem % bytes == 0, op, ": argument '", name,
                      "' has strides ", cache.strides(), "; on CUDA the strides of its first three "
                      "dimensions must be multiples of ", bytes, " bytes (its rows are read in ", bytes,
                      "-byte vectors)");
  }
}

// The block, head and token strides of a cache, in units of `unit` (1: elements,
// element_size(): bytes).
inline CacheLayout layout_of(const at::Tensor& cache, int64_t unit) {
  return {cache.stride(0) * unit, cache.stride(1) * unit, cache.stride(2) * unit};
}

// A scale tensor (checked: fp32, one element or [num_kv_heads]) as the kernels read it,
// scale[kv_head * stride]; stride 0 for one element per layer. nullptr when absent.
inline const float* scale_ptr(const std::optional<at::Tensor>& scale, int64_t* stride) {
  if (!scale.has_value()) {
    *stride = 0;
    return nullptr;
  }
  *stride = scale->numel() == 1 ? 0 : scale->stride(0);
  return scale->data_ptr<float>();
}

}  // namespace paged::cuda
