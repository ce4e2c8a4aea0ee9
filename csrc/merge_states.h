// paged.merge_attention_states, written once over a backend's `merge_into`: the shared
// argument checks and the result allocation.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "checks.h"
#include "merge_limits.h"

namespace paged {

using MergeIntoFn = void (*)(at::TensorList outputs, at::TensorList lses, at::Tensor& out,
                             at::Tensor& lse);

template <MergeIntoFn Into>
std::tuple<at::Tensor, at::Tensor> merge_attention_states(at::TensorList outputs,
                                                          at::TensorList lses) {
  const char* op = "paged.merge_attention_states";
  check_merge_args(op, outputs, lses);
  TORCH_CHECK_VALUE(int64_t(outputs.size()) <= kMaxMergeInputs, op, ": at most ",
                    kMaxMergeInputs, " partial results per call, got ", outputs.size(),
                    "; merge them in rounds (a merged result and its lse merge again)");
  at::Tensor out = at::empty(outputs[0].sizes(), outputs[0].options());
  at::Tensor lse = at::empty({out.size(0), out.size(1)}, out.options().dtype(at::kFloat));
  if (out.numel() > 0 || lse.numel() > 0) Into(outputs, lses, out, lse);
  return {out, lse};
}

}  // namespace paged
