// The attention kernel instances over float8_e4m3 caches (see attention_kernels.cuh),
// for fp32, fp16 and bf16 queries alike (AnyFloat: the query dtype is read at run time).
#include "attention_kernels.cuh"

namespace paged::cuda {

cudaError_t launch_attention_fp8_e4m3(const AttentionParams& params, cudaStream_t stream) {
  return launch_attention_typed<AnyFloat, Fp8E4M3>(params, stream);
}

cudaError_t occupancy_fp8_e4m3(int head_size, int head_size_v, int query_bucket, int* ctas) {
  return occupancy_typed<AnyFloat, Fp8E4M3>(head_size, head_size_v, query_bucket, ctas);
}

}  // namespace paged::cuda
