// Dispatch of the attention kernels by cache element type, and their occupancy (the
// instances themselves are in attention_{f32,f16,bf16,fp8_e4m3,fp8_e5m2,int8,int4}.cu, the
// kernels in attention_kernels.cuh).
#include <cuda_runtime.h>

#include <atomic>

#include "kernels.h"

namespace paged::cuda {
namespace {

// attention_kernels.cuh's head-size buckets (64, 128, 256, 512, 576) as indices.
int bucket_index(int head_size) {
  return head_size <= 64 ? 0 : head_size <= 128 ? 1 : head_size <= 256 ? 2 : head_size <= 512 ? 3 : 4;
}

constexpr int kCachedDevices = 64;
// Resident CTAs per multiprocessor by device, cache kind (the instance family: a float
// cache's query has its dtype, an fp8 or per-token cache's any), key and value head-size
// bucket and query bucket; 0 until first asked.
constexpr int kCacheKinds = int(ScalarKind::kInt4) + 1;  // every ScalarKind (kInt4 the last)
std::atomic<int> occupancy_cache[kCachedDevices][kCacheKinds][5][5][4];

}  // namespace

cudaError_t attention_ctas_per_sm(ScalarKind cache_kind, int head_size, int head_size_v,
                                  int query_bucket, int* ctas) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  std::atomic<int>* cached = nullptr;
  if (device >= 0 && device < kCachedDevices) {
    cached = &occupancy_cache[device][int(cache_kind)][bucket_index(head_size)][bucket_index(head_size_v)][query_bucket];
    *ctas = cached->load(std::memory_order_relaxed);
    if (*ctas > 0) return cudaSuccess;
  }
  switch (cache_kind) {
    case ScalarKind::kFloat32: status = occupancy_f32(head_size, head_size_v, query_bucket, ctas); break;
    case ScalarKind::kFloat16: status = occupancy_f16(head_size, head_size_v, query_bucket, ctas); break;
    case ScalarKind::kBFloat16: status = occupancy_bf16(head_size, head_size_v, query_bucket, ctas); break;
    case ScalarKind::kFloat8E4M3: status = occupancy_fp8_e4m3(head_size, head_size_v, query_bucket, ctas); break;
    case ScalarKind::kFloat8E5M2: status = occupancy_fp8_e5m2(head_size, head_size_v, query_bucket, ctas); break;
    case ScalarKind::kInt8: status = occupancy_int8(head_size, head_size_v, query_bucket, ctas); break;
    case ScalarKind::kInt4: status = occupancy_int4(head_size, head_size_v, query_bucket, ctas); break;
  }
  if (status == cudaSuccess && cached != nullptr && *ctas > 0) cached->store(*ctas, std::memory_order_relaxed);
  return status;
}

cudaError_t launch_attention(const AttentionParams& params, cudaStream_t stream) {
  switch (params.cache_kind) {
    case ScalarKind::kFloat32: return launch_attention_f32(params, stream);
    case ScalarKind::kFloat16: return launch_attention_f16(params, stream);
    case ScalarKind::kBFloat16: return launch_attention_bf16(params, stream);
    case ScalarKind::kFloat8E4M3: return launch_attention_fp8_e4m3(params, stream);
    case ScalarKind::kFloat8E5M2: return launch_attention_fp8_e5m2(params, stream);
    case ScalarKind::kInt8: return launch_attention_int8(params, stream);
    case ScalarKind::kInt4: return launch_attention_int4(params, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace paged::cuda
