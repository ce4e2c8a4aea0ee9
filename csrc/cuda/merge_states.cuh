// CUDA kernel of paged.merge_attention_states: one CTA per (token, head); every thread
// computes the parts' weights exp(lse - max) (at most kMaxMergeInputs), then a strip of
// the head dimension. A part with lse -inf has weight 0 and is not read. Included by
// merge_states.cu and by tests/cuda_emulator.cpp, which runs it on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_utils.cuh"
#include "kernels.h"

namespace paged::cuda {
namespace {

constexpr int kMergeThreads = 128;

template <typename Q>
__global__ void __launch_bounds__(kMergeThreads) merge_states_kernel(const MergeStatesParams p) {
  const int64_t th = blockIdx.x;
  const int64_t t = th / p.num_heads, h = th % p.num_heads;
  float weight[kMaxMergeInputs];
  float best = -INFINITY;
  bool nan = false;
  for (int k = 0; k < p.num_inputs; ++k) {
    const float x = p.lses[k][t * p.lse_token_stride[k] + h * p.lse_head_stride[k]];
    nan |= x != x;
    best = x > best ? x : best;
  }
  const int64_t row = th * p.head_size;
  if (nan || best == -INFINITY) {  // NaN stays visible; nothing seen gives 0
    const float fill = nan ? NAN : 0.0f;
    for (int d = threadIdx.x; d < p.head_size; d += kMergeThreads) store_float<Q>(p.out, row + d, fill, p.kind);
    if (threadIdx.x == 0) p.lse[th] = nan ? NAN : -INFINITY;
    return;
  }
  float total = 0.0f;
  for (int k = 0; k < p.num_inputs; ++k) {
    weight[k] = __expf(p.lses[k][t * p.lse_token_stride[k] + h * p.lse_head_stride[k]] - best);
    total += weight[k];
  }
  const float inv = 1.0f / total;
  for (int d = threadIdx.x; d < p.head_size; d += kMergeThreads) {
    float acc = 0.0f;
    for (int k = 0; k < p.num_inputs; ++k) {
      if (weight[k] == 0.0f) continue;
      acc = fmaf(weight[k], load_float<Q>(p.outputs[k], t * p.out_token_stride[k] + h * p.out_head_stride[k] + d, p.kind), acc);
    }
    store_float<Q>(p.out, row + d, acc * inv, p.kind);
  }
  if (threadIdx.x == 0) p.lse[th] = best + __logf(total);
}

}  // namespace
}  // namespace paged::cuda
