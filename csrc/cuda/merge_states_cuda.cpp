// CUDA implementation of paged.merge_attention_states (the kernel: merge_states.cuh).
#include <cstdint>

#include "../dtypes.h"
#include "../merge_states.h"
#include "cuda_checks.h"
#include "kernels.h"

namespace paged::cuda {
namespace {

void merge_into(const TensorList& outputs, const TensorList& lses, Tensor& out, Tensor& lse) {
  const char* op = "paged.merge_attention_states";
  PAGED_CHECK_VALUE(out.is_cuda(), op, ": expected CUDA tensors, got ", out.device());
  PAGED_CHECK_VALUE(out.size(0) * out.size(1) <= INT32_MAX, op,
                    ": too many rows times heads for one CUDA launch");
  const int32_t device = out.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  MergeStatesParams p{};
  p.kind = scalar_kind(out.scalar_type());
  p.num_inputs = int(outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    p.outputs[k] = outputs[k].data_ptr();
    p.out_token_stride[k] = outputs[k].stride(0);
    p.out_head_stride[k] = outputs[k].stride(1);
    p.lses[k] = lses[k].mutable_data_ptr<float>();
    p.lse_token_stride[k] = lses[k].stride(0);
    p.lse_head_stride[k] = lses[k].stride(1);
  }
  p.num_tokens = int(out.size(0));
  p.num_heads = int(out.size(1));
  p.head_size = int(out.size(2));
  p.out = out.data_ptr();
  p.lse = lse.mutable_data_ptr<float>();
  PAGED_CUDA_CHECK(launch_merge_states(p, current_stream(device)));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(paged, CUDA, m) {
  m.impl("merge_attention_states", TORCH_BOX(&merge_attention_states<merge_into>));
}

}  // namespace paged::cuda
