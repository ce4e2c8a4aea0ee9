// CPU implementations of the cache ops: write_kv, write_latent, copy_blocks, swap_blocks.
// All validation happens before the first byte is written, so a rejected call
// leaves the caches untouched.

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "../checks.h"
#include "../dtypes.h"
#include "../errors.h"
#include "../layout.h"
#include "token_quantization.h"

namespace paged::cpu {
namespace {

// Copies one cache row. Rows of whole cache lines into line-aligned slots are
// written with non-temporal stores (SSE2, so any x86-64): the scattered slots
// would otherwise be read into the cache before being overwritten.
inline void store_row(char* dst, const char* src, int64_t bytes) {
#if defined(__x86_64__)
  if (bytes % 64 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    for (int64_t i = 0; i < bytes; i += 16) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), x);
    }
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// A key or value row quantized to fp8: x / scale saturated to the format's largest finite
// value (NaN stays NaN: both comparisons are false), then c10's round-to-nearest-even
// conversion, the one torch's .to(float8) uses.
template <typename In, typename Fp8>
void quantize_row(Fp8* dst, const In* src, int64_t n, float scale) {
  const float max = float(std::numeric_limits<Fp8>::max());
  for (int64_t d = 0; d < n; ++d) {
    float x = float(src[d]) / scale;
    x = x > max ? max : (x < -max ? -max : x);
    dst[d] = Fp8(x);
  }
}

// Element offset of (block, head, offset) in a cache of any strides.
inline int64_t row_offset(const Tensor& cache, int64_t block, int64_t head, int64_t offset) {
  return block * cache.stride(0) + head * cache.stride(1) + offset * cache.stride(2);
}

// [] / [1] / [num_kv_heads] scales as a contiguous row and the stride of a head in it.
std::pair<Tensor, int64_t> scale_row(const std::optional<Tensor>& scale) {
  Tensor row = torch::stable::contiguous(torch::stable::reshape(*scale, {-1}));
  const int64_t stride = row.numel() > 1 ? 1 : 0;
  return {row, stride};
}

template <typename In, typename Fp8>
void write_kv_fp8(const Tensor& key, const Tensor& value, Tensor& key_cache,
                  Tensor& value_cache, const Tensor& slot_mapping,
                  const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t hs = key_cache.size(3), hsv = value_cache.size(3);
  const auto [k_scales, k_stride] = scale_row(k_scale);
  const auto [v_scales, v_stride] = scale_row(v_scale);
  const float* ks = k_scales.mutable_data_ptr<float>();
  const float* vs = v_scales.mutable_data_ptr<float>();
  const int64_t* slots = slot_mapping.mutable_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const In* k_src = key.mutable_data_ptr<In>();
  const In* v_src = value.mutable_data_ptr<In>();
  Fp8* k_dst = key_cache.mutable_data_ptr<Fp8>();
  Fp8* v_dst = value_cache.mutable_data_ptr<Fp8>();
  torch::stable::parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        quantize_row(k_dst + row_offset(key_cache, block, h, offset),
                     k_src + t * key.stride(0) + h * key.stride(1), hs, ks[h * k_stride]);
        quantize_row(v_dst + row_offset(value_cache, block, h, offset),
                     v_src + t * value.stride(0) + h * value.stride(1), hsv, vs[h * v_stride]);
      }
    }
  });
}

// Each (token, KV head) row quantized from its own values into an int8 / packed int4 cache
// (token_quantization.h), its scale (int8) or (scale, low) pair (int4) written into the scale
// tensor at the row's (block, head, offset).
template <typename In>
void write_kv_per_token(const Tensor& key, const Tensor& value, Tensor& key_cache,
                        Tensor& value_cache, const Tensor& slot_mapping, Tensor& k_scale,
                        Tensor& v_scale) {
  const bool int4 = key_cache.scalar_type() == kByte;
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t hs = key.size(2), hsv = value.size(2);
  const int64_t* slots = slot_mapping.mutable_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const In* k_src = key.mutable_data_ptr<In>();
  const In* v_src = value.mutable_data_ptr<In>();
  uint8_t* k_dst = static_cast<uint8_t*>(key_cache.data_ptr());
  uint8_t* v_dst = static_cast<uint8_t*>(value_cache.data_ptr());
  float* ks = k_scale.mutable_data_ptr<float>();
  float* vs = v_scale.mutable_data_ptr<float>();
  torch::stable::parallel_for(0, key.size(0), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(std::max(hs, hsv));
    // One row: widened to fp32, quantized into the cache and its scales.
    const auto quantize = [&](const In* src, int64_t n, uint8_t* dst, float* scale) {
      for (int64_t d = 0; d < n; ++d) row[d] = float(src[d]);
      quantize_token_row(row.data(), int(n), int4, dst, scale);
    };
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        quantize(k_src + t * key.stride(0) + h * key.stride(1), hs,
                 k_dst + row_offset(key_cache, block, h, offset),
                 ks + row_offset(k_scale, block, h, offset));
        quantize(v_src + t * value.stride(0) + h * value.stride(1), hsv,
                 v_dst + row_offset(value_cache, block, h, offset),
                 vs + row_offset(v_scale, block, h, offset));
      }
    }
  });
}

void write_kv_cpu(const Tensor& key, const Tensor& value, Tensor& key_cache,
                  Tensor& value_cache, const Tensor& slot_mapping,
                  const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  check_write_kv_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  check_slots_in_range(slot_mapping, key_cache.size(0) * block_size);

  if (is_per_token(key_cache.scalar_type())) {
    Tensor k_scales = *k_scale, v_scales = *v_scale;  // handles to the caller's tensors
    dispatch_float(key.scalar_type(), [&]<typename scalar_t>() {
      write_kv_per_token<scalar_t>(key, value, key_cache, value_cache, slot_mapping, k_scales,
                                   v_scales);
    });
    return;
  }
  if (is_fp8(key_cache.scalar_type())) {
    dispatch_float(key.scalar_type(), [&]<typename scalar_t>() {
      if (key_cache.scalar_type() == kFloat8_e4m3fn) {
        write_kv_fp8<scalar_t, Float8_e4m3fn>(key, value, key_cache, value_cache,
                                                   slot_mapping, k_scale, v_scale);
      } else {
        write_kv_fp8<scalar_t, Float8_e5m2>(key, value, key_cache, value_cache,
                                                 slot_mapping, k_scale, v_scale);
      }
    });
    return;
  }

  const int64_t elem = key.element_size();
  // Key and value rows may differ in length (head_size, head_size_v).
  const int64_t k_row_bytes = key_cache.size(3) * elem, v_row_bytes = value_cache.size(3) * elem;
  const int64_t* slots = slot_mapping.mutable_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  torch::stable::parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        // [block, head, offset, :] at the caches' strides; int64 offsets throughout.
        store_row(k_dst + row_offset(key_cache, block, h, offset) * elem,
                  k_src + (t * key.stride(0) + h * key.stride(1)) * elem, k_row_bytes);
        store_row(v_dst + row_offset(value_cache, block, h, offset) * elem,
                  v_src + (t * value.stride(0) + h * value.stride(1)) * elem, v_row_bytes);
      }
    }
#if defined(__x86_64__)
    _mm_sfence();  // streaming stores are visible before the op returns
#endif
  });
}

// Each (token, KV head) row [latent | rotary_key] gathered into fp32 and stored whole: cast
// into a float cache, divided by the scale into an fp8 one, quantized as one row (its scale
// or (scale, low) pair into `scale`) into a per-token one.
template <typename In, typename Cache>
void write_latent_rows(const Tensor& latent, const Tensor& rotary_key, Tensor& cache,
                       const Tensor& slot_mapping, const std::optional<Tensor>& scale) {
  const int64_t num_kv_heads = cache.size(1), block_size = cache.size(2);
  const int64_t lat = latent.size(2), width = lat + rotary_key.size(2);
  const int64_t* slots = slot_mapping.mutable_data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const In* lat_src = latent.mutable_data_ptr<In>();
  const In* rot_src = rotary_key.mutable_data_ptr<In>();
  Cache* dst = static_cast<Cache*>(cache.data_ptr());
  float* scales = scale.has_value() ? scale->mutable_data_ptr<float>() : nullptr;
  const int64_t fp8_scale_stride = scale.has_value() && scale->numel() > 1 ? 1 : 0;
  torch::stable::parallel_for(0, latent.size(0), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const In* l = lat_src + t * latent.stride(0) + h * latent.stride(1);
        const In* r = rot_src + t * rotary_key.stride(0) + h * rotary_key.stride(1);
        for (int64_t d = 0; d < lat; ++d) row[d] = float(l[d]);
        for (int64_t d = lat; d < width; ++d) row[d] = float(r[d - lat]);
        Cache* out = dst + row_offset(cache, block, h, offset);
        if constexpr (std::is_same_v<Cache, int8_t> || std::is_same_v<Cache, uint8_t>) {
          quantize_token_row(row.data(), int(width), std::is_same_v<Cache, uint8_t>,
                             reinterpret_cast<uint8_t*>(out), scales + row_offset(*scale, block, h, offset));
        } else if constexpr (std::is_same_v<Cache, Float8_e4m3fn> ||
                             std::is_same_v<Cache, Float8_e5m2>) {
          quantize_row(out, row.data(), width, scales[h * fp8_scale_stride]);
        } else {
          for (int64_t d = 0; d < width; ++d) out[d] = Cache(row[d]);
        }
      }
    }
  });
}

void write_latent_cpu(const Tensor& latent, const Tensor& rotary_key, Tensor& cache,
                      const Tensor& slot_mapping, const std::optional<Tensor>& scale) {
  check_write_latent_args(latent, rotary_key, cache, slot_mapping, scale);
  check_slots_in_range(slot_mapping, cache.size(0) * cache.size(2), "paged.write_latent");
  // fp8 scales are read from one contiguous row ([] / [1] / [num_kv_heads]).
  const bool fp8 = is_fp8(cache.scalar_type());
  const std::optional<Tensor> scales =
      fp8 ? std::optional<Tensor>(scale_row(scale).first) : scale;
  dispatch_float(latent.scalar_type(), [&]<typename In>() {
    switch (cache.scalar_type()) {
      case kChar: return write_latent_rows<In, int8_t>(latent, rotary_key, cache, slot_mapping, scales);
      case kByte: return write_latent_rows<In, uint8_t>(latent, rotary_key, cache, slot_mapping, scales);
      case kFloat8_e4m3fn:
        return write_latent_rows<In, Float8_e4m3fn>(latent, rotary_key, cache, slot_mapping, scales);
      case kFloat8_e5m2:
        return write_latent_rows<In, Float8_e5m2>(latent, rotary_key, cache, slot_mapping, scales);
      default:
        dispatch_float(cache.scalar_type(), [&]<typename C>() {
          write_latent_rows<In, C>(latent, rotary_key, cache, slot_mapping, scales);
        });
    }
  });
}

// dst[d] = src[s] for each pair of one pool (copy_blocks) or two (swap_blocks). Blocks that
// are one dense chunk with the same layout in both pools move with one memcpy; others
// (e.g. NHD views into a joint K/V tensor of another block layout) row by row.
void copy_block_pairs(const Tensor& src, Tensor& dst, const int64_t* pairs, int64_t begin,
                      int64_t end) {
  const int64_t elem = src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const bool dense = block_is_dense(src) && block_is_dense(dst) && same_block_strides(src, dst);
  if (dense) {
    // numel / size(0), not stride(0), for the bytes: a one-block pool may have any stride(0).
    const int64_t block_bytes = src.numel() / src.size(0) * elem;
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(d + pairs[2 * i + 1] * dst.stride(0) * elem,
                  s + pairs[2 * i] * src.stride(0) * elem, block_bytes);
    }
    return;
  }
  for (int64_t i = begin; i < end; ++i) {
    Tensor to = torch::stable::select(dst, 0, pairs[2 * i + 1]);
    torch::stable::copy_(to, torch::stable::select(src, 0, pairs[2 * i]));
  }
}

void copy_blocks_cpu(const TensorList& key_caches, const TensorList& value_caches,
                     const Tensor& block_mapping) {
  const char* op = "paged.copy_blocks";
  check_layer_caches(op, key_caches, value_caches);
  check_block_mapping(op, block_mapping);
  PAGED_CHECK_VALUE(block_mapping.device().is_cpu(), op,
                    ": argument 'block_mapping' must be a CPU tensor for CPU caches");
  PAGED_CHECK_VALUE(key_caches.empty() || key_caches[0].device().is_cpu(), op,
                    ": the CPU implementation needs CPU caches");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  check_block_mapping_values(op, block_mapping, key_caches[0].size(0), key_caches[0].size(0),
                             /*same_pool=*/true);

  const Tensor pairs = torch::stable::contiguous(block_mapping);
  const int64_t* p = pairs.mutable_data_ptr<int64_t>();
  const int64_t num_pairs = pairs.size(0);
  const int64_t num_layers = int64_t(key_caches.size());
  torch::stable::parallel_for(0, num_layers * num_pairs * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t layer = i / (num_pairs * 2), pair = (i / 2) % num_pairs;
      Tensor cache = (i % 2 == 0) ? key_caches[layer] : value_caches[layer];
      copy_block_pairs(cache, cache, p, pair, pair + 1);
    }
  });
}

void swap_blocks_cpu(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const char* op = "paged.swap_blocks";
  check_block_mapping(op, block_mapping);
  PAGED_CHECK_VALUE(src.device().is_cpu() && dst.device().is_cpu() &&
                        block_mapping.device().is_cpu(),
                    op, ": the CPU implementation needs 'src', 'dst' and 'block_mapping' on the CPU");
  check_swap_pools(op, src, dst);
  const bool same_pool = src.data_ptr() == dst.data_ptr();
  check_block_mapping_values(op, block_mapping, src.size(0), dst.size(0), same_pool);
  if (block_mapping.size(0) == 0 || src.numel() == 0) return;

  const Tensor pairs = torch::stable::contiguous(block_mapping);
  const int64_t* p = pairs.mutable_data_ptr<int64_t>();
  torch::stable::parallel_for(0, pairs.size(0), 1, [&](int64_t begin, int64_t end) {
    copy_block_pairs(src, dst, p, begin, end);
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("write_kv", TORCH_BOX(&write_kv_cpu));
  m.impl("write_latent", TORCH_BOX(&write_latent_cpu));
  m.impl("copy_blocks", TORCH_BOX(&copy_blocks_cpu));
  m.impl("swap_blocks", TORCH_BOX(&swap_blocks_cpu));
}

}  // namespace paged::cpu
