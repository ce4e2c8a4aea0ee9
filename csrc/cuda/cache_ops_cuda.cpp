// CUDA implementations of the cache ops: write_kv, write_latent, copy_blocks, swap_blocks.
// Everything is enqueued on the current stream; nothing waits for the device.
// Values that live on the device (slot ids, a device block mapping) are not
// validated, since that would need a sync; the kernels skip out-of-range ones.
#include <algorithm>
#include <utility>
#include <vector>

#include "../checks.h"
#include "../dtypes.h"
#include "../layout.h"
#include "block_copies.h"
#include "cuda_checks.h"
#include "kernels.h"

namespace paged::cuda {
namespace {

void enqueue_write_kv(const Tensor& key, const Tensor& value, Tensor& key_cache,
                      Tensor& value_cache, const Tensor& slot_mapping,
                      const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale);

void write_kv_cuda(const Tensor& key, const Tensor& value, Tensor& key_cache,
                   Tensor& value_cache, const Tensor& slot_mapping,
                   const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  const char* op = "paged.write_kv";
  check_write_kv_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  PAGED_CHECK_VALUE(key.is_cuda(), op, ": argument 'key' must be a CUDA tensor, got ", key.device());
  PAGED_CHECK_VALUE(key.size(0) <= INT32_MAX, op, ": too many tokens for one CUDA launch");
  PAGED_CHECK_VALUE(!is_per_token(key_cache.scalar_type()) ||
                        (key.size(2) <= kMaxTokenRow && value.size(2) <= kMaxTokenRow),
                    op, ": arguments 'key' and 'value' have rows of ", key.size(2), " and ", value.size(2),
                    " values; the CUDA kernel quantizes rows of at most ", kMaxTokenRow,
                    " values into a per-token cache");
  enqueue_write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
}

// MLA latent rows through the write_kv kernel. Float and fp8: the latent and the rotary key
// into the two column views of each row (fp8 under one scale for both). Per-token: each
// row [latent | rotary_key] gathered into one tensor first, then quantized whole as keys
// alone (no value rows: their scales are the keys').
void write_latent_cuda(const Tensor& latent, const Tensor& rotary_key, Tensor& cache,
                       const Tensor& slot_mapping, const std::optional<Tensor>& scale) {
  const char* op = "paged.write_latent";
  check_write_latent_args(latent, rotary_key, cache, slot_mapping, scale);
  PAGED_CHECK_VALUE(latent.is_cuda(), op, ": argument 'latent' must be a CUDA tensor, got ",
                    latent.device());
  PAGED_CHECK_TYPE(is_fp8(cache.scalar_type()) || is_per_token(cache.scalar_type()) ||
                       latent.scalar_type() == cache.scalar_type(),
                   op, ": the CUDA kernel stores latent rows into a float cache of their own "
                   "dtype; 'latent' is ", latent.scalar_type(), " and 'cache' ",
                   cache.scalar_type(), ": cast with latent.to(cache.dtype) and "
                   "rotary_key.to(cache.dtype)");
  PAGED_CHECK_VALUE(latent.size(0) <= INT32_MAX, op, ": too many tokens for one CUDA launch");
  const int64_t width = latent.size(2);
  if (!is_per_token(cache.scalar_type())) {
    Tensor head = torch::stable::narrow(cache, 3, 0, width);
    Tensor tail = torch::stable::narrow(cache, 3, width, cache.size(3) - width);
    enqueue_write_kv(latent, rotary_key, head, tail, slot_mapping, scale, scale);
    return;
  }
  const int64_t row_width = width + rotary_key.size(2);
  PAGED_CHECK_VALUE(row_width <= kMaxTokenRow, op, ": latent rows of ", row_width,
                    " values; the CUDA kernel quantizes rows of at most ", kMaxTokenRow,
                    " values into a per-token cache");
  const int32_t device = latent.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  Tensor rows = torch::stable::empty({latent.size(0), latent.size(1), row_width},
                                     latent.scalar_type(), std::nullopt, latent.device());
  Tensor rows_head = torch::stable::narrow(rows, 2, 0, width);
  Tensor rows_tail = torch::stable::narrow(rows, 2, width, row_width - width);
  torch::stable::copy_(rows_head, latent);
  torch::stable::copy_(rows_tail, rotary_key);
  Tensor no_values = torch::stable::narrow(cache, 3, 0, 0);
  enqueue_write_kv(rows, rows, cache, no_values, slot_mapping, scale, scale);
}

// The write_kv kernel over checked arguments, enqueued on the current stream.
void enqueue_write_kv(const Tensor& key, const Tensor& value, Tensor& key_cache,
                      Tensor& value_cache, const Tensor& slot_mapping,
                      const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  if (key.size(0) == 0 || key.size(1) == 0) return;
  const int32_t device = key.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t elem = key.element_size();
  const int64_t cache_elem = key_cache.element_size();
  WriteKvParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_token_stride = key.stride(0) * elem;
  p.key_head_stride = key.stride(1) * elem;
  p.value_token_stride = value.stride(0) * elem;
  p.value_head_stride = value.stride(1) * elem;
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.key_layout = layout_of(key_cache, cache_elem);  // in bytes
  p.value_layout = layout_of(value_cache, cache_elem);
  p.kind = scalar_kind(key.scalar_type());
  p.cache_kind = scalar_kind(key_cache.scalar_type());
  p.k_scale = scale_ptr(k_scale, &p.k_scale_stride);
  p.v_scale = scale_ptr(v_scale, &p.v_scale_stride);
  if (is_per_token(key_cache.scalar_type())) {  // write_kv writes each row's scales
    p.k_token_scale = k_scale->mutable_data_ptr<float>();
    p.v_token_scale = v_scale->mutable_data_ptr<float>();
    p.k_scale_layout = token_scale_layout(key_cache, k_scale);
    p.v_scale_layout = token_scale_layout(value_cache, v_scale);
  }
  p.slot_mapping = slot_mapping.mutable_data_ptr<int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.num_tokens = key.size(0);
  p.num_slots = key_cache.size(0) * key_cache.size(2);
  p.num_kv_heads = int(key_cache.size(1));
  p.block_size = int(key_cache.size(2));
  p.key_row_bytes = key_cache.size(3) * cache_elem;
  p.value_row_bytes = value_cache.size(3) * cache_elem;
  PAGED_CUDA_CHECK(launch_write_kv(p, current_stream(device)));
}

void copy_blocks_cuda(const TensorList& key_caches, const TensorList& value_caches,
                      const Tensor& block_mapping) {
  const char* op = "paged.copy_blocks";
  check_layer_caches(op, key_caches, value_caches);
  check_block_mapping(op, block_mapping);
  if (key_caches.empty()) return;
  const Device device = key_caches[0].device();
  PAGED_CHECK_VALUE(device.is_cuda(), op, ": argument 'key_caches' must hold CUDA tensors");
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;
  PAGED_CHECK_VALUE(num_pairs <= INT32_MAX, op, ": too many pairs for one CUDA launch");
  const torch::stable::accelerator::DeviceGuard guard(device.index());

  // A host mapping is validated, then copied asynchronously from a private pinned
  // copy (the caching host allocator keeps it alive until the copy is done; the
  // caller's tensor, even if pinned, may be rewritten as soon as we return). A
  // device mapping is used as it is: out-of-range pairs are skipped.
  Tensor mapping;
  if (block_mapping.device().is_cpu()) {
    check_block_mapping_values(op, block_mapping, key_caches[0].size(0), key_caches[0].size(0),
                               /*same_pool=*/true);
    Tensor host = torch::stable::empty(block_mapping.sizes(), block_mapping.scalar_type(), std::nullopt,
                                       block_mapping.device(), /*pin_memory=*/true);
    torch::stable::copy_(host, block_mapping);
    mapping = torch::stable::to(host, device, /*non_blocking=*/true);
  } else {
    PAGED_CHECK_VALUE(block_mapping.device() == device, op,
                      ": argument 'block_mapping' must be on the CPU or on ", device, ", got ",
                      block_mapping.device());
    mapping = torch::stable::contiguous(block_mapping);
  }
  // An empty pool: a host mapping was refused above, a device mapping's pairs are all
  // out of range and skipped.
  if (key_caches[0].size(0) == 0) return;

  // A block that is one dense chunk is one row of all its bytes; other views (K and V
  // interleaved per token, say) are copied row by row. A per-token cache's scales move
  // the same way: int4's [..., 2] like a cache, int8's 3-D [num_blocks, num_kv_heads,
  // block_size] as rows of one float.
  auto rows_of = [](const Tensor& t) {
    const int64_t elem = t.element_size();
    if (block_is_dense(t)) {
      // numel / size(0), not stride(0): a one-block pool may have any stride(0).
      return CopyCache{t.data_ptr(), t.stride(0) * elem, 0, 0, t.numel() / t.size(0) * elem, 1, 1};
    }
    const int64_t row = t.dim() == 4 ? t.size(3) : 1;
    return CopyCache{t.data_ptr(), t.stride(0) * elem, t.stride(1) * elem, t.stride(2) * elem,
                     row * elem, int32_t(t.size(1)), int32_t(t.size(2))};
  };
  CopyBlocksParams p{};
  p.block_mapping = mapping.mutable_data_ptr<int64_t>();
  p.num_pairs = num_pairs;
  p.num_blocks = key_caches[0].size(0);
  const cudaStream_t stream = current_stream(device.index());
  // Layers in groups of kMaxCopyLayers: one launch for any usual model.
  for (size_t first = 0; first < key_caches.size(); first += kMaxCopyLayers) {
    p.num_layers = int(std::min<size_t>(kMaxCopyLayers, key_caches.size() - first));
    for (int l = 0; l < p.num_layers; ++l) {
      p.keys[l] = rows_of(key_caches[first + l]);
      p.values[l] = rows_of(value_caches[first + l]);
    }
    PAGED_CUDA_CHECK(launch_copy_blocks(p, stream));
  }
}

// Keeps the host pool's pinned block, if freed while the copies on the current stream are in
// flight, from being handed out again until they are done.
void record_host_use(const Tensor& host, const Device& device) {
  // The stable ABI has no handle on the pinned-memory allocator, but torch's non_blocking copy_
  // records the allocator's event for the block it reads on this stream (a no-op if not its block).
  Tensor first = host;
  for (int64_t d = 0; d < host.dim(); ++d) first = torch::stable::narrow(first, d, 0, 1);
  Tensor scratch = torch::stable::empty(first.sizes(), first.scalar_type(), std::nullopt, device);
  torch::stable::copy_(scratch, first, /*non_blocking=*/true);
}

void swap_blocks_cuda(const Tensor& src, Tensor& dst, const Tensor& block_mapping) {
  const char* op = "paged.swap_blocks";
  check_block_mapping(op, block_mapping);
  PAGED_CHECK_VALUE(block_mapping.device().is_cpu(), op,
                    ": argument 'block_mapping' must be a CPU tensor (the copies are issued from "
                    "the host)");
  check_swap_pools(op, src, dst);
  PAGED_CHECK_VALUE((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()), op,
                    ": 'src' and 'dst' must be CUDA or CPU tensors, got ", src.device(), " and ",
                    dst.device());
  PAGED_CHECK_VALUE(!(src.is_cuda() && dst.is_cuda()) || src.device() == dst.device(), op,
                    ": 'src' and 'dst' on two CUDA devices are not supported, got ", src.device(),
                    " and ", dst.device());
  const bool same_pool = src.data_ptr() == dst.data_ptr();
  check_block_mapping_values(op, block_mapping, src.size(0), dst.size(0), same_pool);
  if (block_mapping.size(0) == 0 || src.numel() == 0) return;

  // Sorted by source, runs of consecutive source and destination blocks become
  // one copy each. The pairs are independent (checked), so order is free.
  const Tensor pairs_tensor = torch::stable::contiguous(block_mapping);
  const int64_t* raw = pairs_tensor.mutable_data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> pairs(block_mapping.size(0));
  for (size_t i = 0; i < pairs.size(); ++i) pairs[i] = {raw[2 * i], raw[2 * i + 1]};
  std::sort(pairs.begin(), pairs.end());

  const Device device = src.is_cuda() ? src.device() : dst.device();
  const torch::stable::accelerator::DeviceGuard guard(device.index());
  const cudaStream_t stream = current_stream(device.index());
  const int64_t elem = src.element_size();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
  // cudaMemcpyDefault: the direction follows from the (unified) addresses. With
  // pinned host memory the copy is asynchronous; with pageable memory the
  // driver stages it and the call returns once the host side is done (and such a
  // copy cannot be graph-captured: capture needs pinned pools). The mapping is
  // read here, on the host: a CUDA graph that captures this call replays the
  // block pairs of the capture, whatever the mapping later holds.
  if (block_is_dense(src) && block_is_dense(dst) && same_block_strides(src, dst)) {
    // Each block one chunk of the same layout in both pools: one copy per block, or
    // per run of adjacent blocks where both pools store blocks back to back.
    const int64_t block_bytes = src.numel() / src.size(0) * elem;
    const int64_t src_stride = src.stride(0) * elem, dst_stride = dst.stride(0) * elem;
    const bool runs = (src.size(0) <= 1 || src_stride == block_bytes) && (dst.size(0) <= 1 || dst_stride == block_bytes);
    for (size_t i = 0; i < pairs.size();) {
      size_t n = 1;
      while (runs && i + n < pairs.size() && pairs[i + n].first == pairs[i].first + int64_t(n) &&
             pairs[i + n].second == pairs[i].second + int64_t(n)) {
        ++n;
      }
      PAGED_CUDA_CHECK(cudaMemcpyAsync(to + pairs[i].second * dst_stride, from + pairs[i].first * src_stride,
                                       n * block_bytes, cudaMemcpyDefault, stream));
      i += n;
    }
  } else {
    // Other layouts (NHD views, a joint K/V tensor, strided scales, any rank) as 2-D copies
    // of rows, the same for every block (block_copies.h).
    const std::vector<BlockCopy> copies = block_copies(int(src.dim()), src.sizes().data(), src.strides().data(),
                                                       dst.strides().data(), elem);
    for (const auto& [s, d] : pairs) {
      for (const BlockCopy& c : copies) {
        PAGED_CUDA_CHECK(cudaMemcpy2DAsync(to + d * dst.stride(0) * elem + c.dst_offset, c.dst_pitch,
                                           from + s * src.stride(0) * elem + c.src_offset, c.src_pitch, c.width,
                                           c.height, cudaMemcpyDefault, stream));
      }
    }
  }
  if (src.is_cpu()) record_host_use(src, device);
  if (dst.is_cpu()) record_host_use(dst, device);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(paged, CUDA, m) {
  m.impl("write_kv", TORCH_BOX(&write_kv_cuda));
  m.impl("write_latent", TORCH_BOX(&write_latent_cuda));
  m.impl("copy_blocks", TORCH_BOX(&copy_blocks_cuda));
  m.impl("swap_blocks", TORCH_BOX(&swap_blocks_cuda));
}

}  // namespace paged::cuda
