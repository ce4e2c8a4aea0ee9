// The attention kernel instances of one element type (see attention_kernels.cuh);
// one file per type so that nvcc builds them in parallel.
#include "attention_kernels.cuh"

namespace paged::cuda {

cudaError_t launch_attention_bf16(const AttentionParams& params, cudaStream_t stream) {
  return launch_attention_typed<__nv_bfloat16, __nv_bfloat16>(params, stream);
}

cudaError_t occupancy_bf16(int head_size, int head_size_v, int query_bucket, int* ctas) {
  return occupancy_typed<__nv_bfloat16, __nv_bfloat16>(head_size, head_size_v, query_bucket, ctas);
}

}  // namespace paged::cuda
