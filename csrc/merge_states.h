// paged.merge_attention_states, written once over a backend's `merge_into`: the shared
// argument checks and the result allocation.
#pragma once

#include <tuple>

#include "checks.h"
#include "errors.h"
#include "merge_limits.h"

namespace paged {

using MergeIntoFn = void (*)(const TensorList& outputs, const TensorList& lses, Tensor& out,
                             Tensor& lse);

template <MergeIntoFn Into>
std::tuple<Tensor, Tensor> merge_attention_states(const TensorList& outputs,
                                                  const TensorList& lses) {
  const char* op = "paged.merge_attention_states";
  check_merge_args(op, outputs, lses);
  PAGED_CHECK_VALUE(int64_t(outputs.size()) <= kMaxMergeInputs, op, ": at most ",
                    kMaxMergeInputs, " partial results per call, got ", outputs.size(),
                    "; merge them in rounds (a merged result and its lse merge again)");
  const Tensor& first = outputs[0];
  Tensor out = empty(first.sizes(), first.scalar_type(), first);
  Tensor lse = empty({out.size(0), out.size(1)}, kFloat, first);
  if (out.numel() > 0 || lse.numel() > 0) Into(outputs, lses, out, lse);
  return {out, lse};
}

}  // namespace paged
