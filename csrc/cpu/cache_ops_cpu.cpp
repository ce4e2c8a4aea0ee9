// CPU implementations of the cache ops: write_kv, copy_blocks, swap_blocks.
// All validation happens before the first byte is written, so a rejected call
// leaves the caches untouched.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "../checks.h"

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

void write_kv_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                  at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_write_kv_args(key, value, key_cache, value_cache, slot_mapping);
  const int64_t num_kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  check_slots_in_range(slot_mapping, key_cache.size(0) * block_size);

  const int64_t elem = key.element_size();
  // Key and value rows may differ in length (head_size, head_size_v).
  const int64_t k_row_bytes = key_cache.size(3) * elem, v_row_bytes = value_cache.size(3) * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, key.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t * slot_stride];
      if (slot < 0) continue;  // padding token
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        // HND: [block, head, offset, :]; int64 offsets throughout.
        const int64_t row = (block * num_kv_heads + h) * block_size + offset;
        store_row(k_dst + row * k_row_bytes,
                  k_src + (t * key.stride(0) + h * key.stride(1)) * elem, k_row_bytes);
        store_row(v_dst + row * v_row_bytes,
                  v_src + (t * value.stride(0) + h * value.stride(1)) * elem, v_row_bytes);
      }
    }
#if defined(__x86_64__)
    _mm_sfence();  // streaming stores are visible before the op returns
#endif
  });
}

void copy_blocks_cpu(at::TensorList key_caches, at::TensorList value_caches,
                     const at::Tensor& block_mapping) {
  const char* op = "paged.copy_blocks";
  check_layer_caches(op, key_caches, value_caches);
  check_block_mapping(op, block_mapping);
  TORCH_CHECK_VALUE(block_mapping.device().is_cpu(), op,
                    ": argument 'block_mapping' must be a CPU tensor for CPU caches");
  TORCH_CHECK_VALUE(key_caches.empty() || key_caches[0].device().is_cpu(), op,
                    ": the CPU implementation needs CPU caches");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  check_block_mapping_values(op, block_mapping, key_caches[0].size(0), key_caches[0].size(0),
                             /*same_pool=*/true);

  const at::Tensor pairs = block_mapping.contiguous();
  const int64_t* p = pairs.data_ptr<int64_t>();
  const int64_t num_pairs = pairs.size(0);
  const int64_t num_layers = int64_t(key_caches.size());
  at::parallel_for(0, num_layers * num_pairs * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t layer = i / (num_pairs * 2), pair = (i / 2) % num_pairs;
      const at::Tensor& cache = (i % 2 == 0) ? key_caches[layer] : value_caches[layer];
      // numel / size(0), not stride(0): a one-block pool may have any stride(0).
      const int64_t block_bytes = cache.numel() / cache.size(0) * cache.element_size();
      char* base = static_cast<char*>(cache.data_ptr());
      std::memcpy(base + p[2 * pair + 1] * block_bytes, base + p[2 * pair] * block_bytes,
                  block_bytes);
    }
  });
}

void swap_blocks_cpu(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const char* op = "paged.swap_blocks";
  check_block_mapping(op, block_mapping);
  TORCH_CHECK_VALUE(src.device().is_cpu() && dst.device().is_cpu() &&
                        block_mapping.device().is_cpu(),
                    op, ": the CPU implementation needs 'src', 'dst' and 'block_mapping' on the CPU");
  check_swap_pools(op, src, dst);
  const bool same_pool = src.data_ptr() == dst.data_ptr();
  check_block_mapping_values(op, block_mapping, src.size(0), dst.size(0), same_pool);
  if (block_mapping.size(0) == 0 || src.numel() == 0) return;

  const at::Tensor pairs = block_mapping.contiguous();
  const int64_t* p = pairs.data_ptr<int64_t>();
  const int64_t block_bytes = src.numel() / src.size(0) * src.element_size();  // not stride(0)
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, pairs.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(d + p[2 * i + 1] * block_bytes, s + p[2 * i] * block_bytes, block_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("write_kv", &write_kv_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
  m.impl("swap_blocks", &swap_blocks_cpu);
}

}  // namespace paged::cpu
