// Host-side helpers shared by the CUDA ops (attention_cuda.cpp, cache_ops_cuda.cpp,
// merge_states_cuda.cpp): CUDA errors, the current stream, and what the kernels need of a
// cache beyond the backend-independent checks (checks.h).
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "../dtypes.h"
#include "../errors.h"
#include "kernels.h"

namespace paged::cuda {

// A failed CUDA runtime call as a RuntimeError. The error is cleared first, as
// C10_CUDA_CHECK does, so that the next call's check does not report it again.
inline void check_cuda(cudaError_t error, const char* file, int line) {
  if (error == cudaSuccess) [[likely]] return;
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(error) + " (" + file +
                           ":" + std::to_string(line) + ")");
}

#define PAGED_CUDA_CHECK(expr) ::paged::cuda::check_cuda((expr), __FILE__, __LINE__)

// torch's current stream on the device: the caller's stream, or the graph's under capture.
inline cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

// The kernels read and write cache rows as vectors of cache_vector_bytes (16; 8 for
// fp8): every row must start at such an address, so the start and the strides of the
// block, head and token dimensions (those of size > 1) must be multiples of it.
inline void check_row_alignment(const char* op, const char* name, const Tensor& cache) {
  const int64_t bytes = cache_vector_bytes(scalar_kind(cache.scalar_type()));
  const int64_t elem = cache.element_size();
  PAGED_CHECK_VALUE(reinterpret_cast<uintptr_t>(cache.data_ptr()) % bytes == 0, op, ": argument '", name,
                    "' must start at a ", bytes, "-byte aligned address on CUDA (it is read in ", bytes,
                    "-byte vectors)");
  for (int d = 0; d < 3; ++d) {
    PAGED_CHECK_VALUE(cache.size(d) <= 1 || cache.stride(d) * elem % bytes == 0, op, ": argument '", name,
                      "' has strides ", cache.strides(), "; on CUDA the strides of its first three "
                      "dimensions must be multiples of ", bytes, " bytes (its rows are read in ", bytes,
                      "-byte vectors)");
  }
}

// The block, head and token strides of a cache, in units of `unit` (1: elements,
// element_size(): bytes).
inline CacheLayout layout_of(const Tensor& cache, int64_t unit) {
  return {cache.stride(0) * unit, cache.stride(1) * unit, cache.stride(2) * unit};
}

// A scale tensor (checked: fp32, one element or [num_kv_heads]) as the kernels read it,
// scale[kv_head * stride]; stride 0 for one element per layer. nullptr when absent. A
// per-token cache's scale tensor (one per slot) is addressed by token_scale_layout.
inline const float* scale_ptr(const std::optional<Tensor>& scale, int64_t* stride) {
  if (!scale.has_value()) {
    *stride = 0;
    return nullptr;
  }
  *stride = scale->numel() == 1 ? 0 : scale->stride(0);
  return scale->mutable_data_ptr<float>();
}

// A per-token cache's scale tensor (checked: fp32 [num_blocks, num_kv_heads, block_size]
// or [..., 2]) as the kernels address a slot's scales: block, head and token strides in
// floats. Zeros for any other scale argument.
inline CacheLayout token_scale_layout(const Tensor& cache, const std::optional<Tensor>& scale) {
  if (!scale.has_value() || !is_per_token(cache.scalar_type())) return {0, 0, 0};
  return layout_of(*scale, 1);
}

}  // namespace paged::cuda
