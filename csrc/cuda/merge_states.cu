// Launch of the merge_attention_states kernel (merge_states.cuh).
#include <cuda_runtime.h>

#include "merge_states.cuh"

namespace paged::cuda {

cudaError_t launch_merge_states(const MergeStatesParams& p, cudaStream_t stream) {
  const unsigned ctas = unsigned(int64_t(p.num_tokens) * p.num_heads);
  if (ctas == 0) return cudaSuccess;
  merge_states_kernel<AnyFloat><<<ctas, kMergeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace paged::cuda
