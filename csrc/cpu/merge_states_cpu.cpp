// CPU implementation of paged.merge_attention_states: per (token, head), the partial
// outputs weighted by exp(lse - max) (a part with lse -inf has weight 0 and is not read).

#include <cmath>
#include <limits>
#include <vector>

#include "../merge_states.h"

namespace paged::cpu {
namespace {

template <typename scalar_t>
void merge_typed(const TensorList& outputs, const TensorList& lses, Tensor& out, Tensor& lse) {
  const int64_t parts = int64_t(outputs.size());
  const int64_t num_heads = out.size(1), head_size = out.size(2);
  std::vector<const scalar_t*> o(parts);
  std::vector<const float*> l(parts);
  std::vector<int64_t> o_token(parts), o_head(parts), l_token(parts), l_head(parts);
  for (int64_t k = 0; k < parts; ++k) {
    o[k] = outputs[k].mutable_data_ptr<scalar_t>();
    l[k] = lses[k].mutable_data_ptr<float>();
    o_token[k] = outputs[k].stride(0);
    o_head[k] = outputs[k].stride(1);
    l_token[k] = lses[k].stride(0);
    l_head[k] = lses[k].stride(1);
  }
  scalar_t* dst = out.mutable_data_ptr<scalar_t>();
  float* dst_lse = lse.mutable_data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  torch::stable::parallel_for(0, out.size(0) * num_heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> weight(parts), acc(head_size);
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / num_heads, h = th % num_heads;
      float best = kNegInf;
      bool nan = false;
      for (int64_t k = 0; k < parts; ++k) {
        const float x = l[k][t * l_token[k] + h * l_head[k]];
        nan |= std::isnan(x);
        best = x > best ? x : best;
      }
      scalar_t* row = dst + th * head_size;
      if (nan || best == kNegInf) {  // NaN stays visible; nothing seen gives 0
        const float fill = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        for (int64_t d = 0; d < head_size; ++d) row[d] = scalar_t(fill);
        dst_lse[th] = nan ? fill : kNegInf;
        continue;
      }
      float total = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < parts; ++k) {
        weight[k] = std::exp(l[k][t * l_token[k] + h * l_head[k]] - best);
        total += weight[k];
        if (weight[k] == 0.0f) continue;
        const scalar_t* src = o[k] + t * o_token[k] + h * o_head[k];
        for (int64_t d = 0; d < head_size; ++d) acc[d] += weight[k] * float(src[d]);
      }
      const float inv = 1.0f / total;
      for (int64_t d = 0; d < head_size; ++d) row[d] = scalar_t(acc[d] * inv);
      dst_lse[th] = best + std::log(total);
    }
  });
}

void merge_into(const TensorList& outputs, const TensorList& lses, Tensor& out, Tensor& lse) {
  PAGED_CHECK_VALUE(out.device().is_cpu(), "paged.merge_attention_states: expected CPU tensors");
  dispatch_float(out.scalar_type(),
                 [&]<typename scalar_t>() { merge_typed<scalar_t>(outputs, lses, out, lse); });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("merge_attention_states", TORCH_BOX(&merge_attention_states<merge_into>));
}

}  // namespace paged::cpu
