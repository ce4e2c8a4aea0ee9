// The attention kernel instances of one element type (see attention_kernels.cuh);
// one file per type so that nvcc builds them in parallel.
#include "attention_kernels.cuh"

namespace paged::cuda {

cudaError_t launch_attention_f16(const AttentionParams& params, cudaStream_t stream) {
  return launch_attention_typed<__half, __half>(params, stream);
}

cudaError_t occupancy_f16(int head_size, int head_size_v, int query_bucket, int* ctas) {
  return occupancy_typed<__half, __half>(head_size, head_size_v, query_bucket, ctas);
}

}  // namespace paged::cuda
