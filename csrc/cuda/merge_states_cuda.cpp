// CUDA implementation of paged.merge_attention_states (the kernel: merge_states.cuh).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../dtypes.h"
#include "../merge_states.h"
#include "kernels.h"

namespace paged::cuda {
namespace {

void merge_into(at::TensorList outputs, at::TensorList lses, at::Tensor& out, at::Tensor& lse) {
  const char* op = "paged.merge_attention_states";
  TORCH_CHECK_VALUE(out.is_cuda(), op, ": expected CUDA tensors, got ", out.device());
  TORCH_CHECK_VALUE(out.size(0) * out.size(1) <= INT32_MAX, op,
                    ": too many rows times heads for one CUDA launch");
  const c10::cuda::CUDAGuard guard(out.device());
  MergeStatesParams p{};
  p.kind = scalar_kind(out.scalar_type());
  p.num_inputs = int(outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) {
    p.outputs[k] = outputs[k].data_ptr();
    p.out_token_stride[k] = outputs[k].stride(0);
    p.out_head_stride[k] = outputs[k].stride(1);
    p.lses[k] = lses[k].data_ptr<float>();
    p.lse_token_stride[k] = lses[k].stride(0);
    p.lse_head_stride[k] = lses[k].stride(1);
  }
  p.num_tokens = int(out.size(0));
  p.num_heads = int(out.size(1));
  p.head_size = int(out.size(2));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  C10_CUDA_CHECK(launch_merge_states(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(paged, CUDA, m) {
  m.impl("merge_attention_states", &merge_attention_states<merge_into>);
}

}  // namespace paged::cuda
