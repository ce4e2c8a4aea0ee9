// The attention kernel instances over float8_e5m2 caches (see attention_kernels.cuh),
// for fp32, fp16 and bf16 queries alike (AnyFloat: the query dtype is read at run time).
#include "attention_kernels.cuh"

namespace paged::cuda {

cudaError_t launch_attention_fp8_e5m2(const AttentionParams& params, cudaStream_t stream) {
  return launch_attention_typed<AnyFloat, Fp8E5M2>(params, stream);
}

cudaError_t occupancy_fp8_e5m2(int head_size, int head_size_v, int query_bucket, int* ctas) {
  return occupancy_typed<AnyFloat, Fp8E5M2>(head_size, head_size_v, query_bucket, ctas);
}

}  // namespace paged::cuda
