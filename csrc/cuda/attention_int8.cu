// The attention kernel instances over int8_per_token_head caches
// (one scale per token and KV head; see attention_kernels.cuh),
// for fp32, fp16 and bf16 queries alike (AnyFloat: the query dtype is read at run time).
#include "attention_kernels.cuh"

namespace paged::cuda {

cudaError_t launch_attention_int8(const AttentionParams& params, cudaStream_t stream) {
  return launch_attention_typed<AnyFloat, Int8>(params, stream);
}

cudaError_t occupancy_int8(int head_size, int head_size_v, int query_bucket, int* ctas) {
  return occupancy_typed<AnyFloat, Int8>(head_size, head_size_v, query_bucket, ctas);
}

}  // namespace paged::cuda
