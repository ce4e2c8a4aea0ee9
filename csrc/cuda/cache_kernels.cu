// CUDA kernels of the cache ops: write_kv scatters new key/value rows into
// their slots; copy_blocks copies blocks of every layer in one launch. Both
// move data in the widest unit (16, 8, 4 or 2 bytes) that every address and
// stride allows, and skip (never follow) an index outside the cache.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "kernels.h"

namespace paged::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kUnitsInFlight = 4;  // loads a thread issues before its first store

// The largest power of two, at most 16, that divides every value.
int common_alignment(std::initializer_list<int64_t> values) {
  uint64_t bits = 16;
  for (const int64_t v : values) bits |= static_cast<uint64_t>(v);
  return static_cast<int>(bits & (~bits + 1));
}

// Calls launch(Unit{}) with the copy unit of `alignment` bytes.
template <typename Launch>
void with_unit(int alignment, Launch&& launch) {
  switch (alignment) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    default: launch(uint16_t{}); break;
  }
}

// One CTA per token: all its KV heads, keys and values (whose rows may differ in
// length: head_size != head_size_v).
template <typename Unit>
__global__ void __launch_bounds__(kThreads) write_kv_kernel(const WriteKvParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return;  // padding; or out of range, never written
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int64_t row_slot = (block * p.num_kv_heads) * p.block_size + offset;  // of head 0, in rows
  const int key_units = static_cast<int>(p.key_row_bytes / static_cast<int64_t>(sizeof(Unit)));
  const int value_units = static_cast<int>(p.value_row_bytes / static_cast<int64_t>(sizeof(Unit)));
  const char* key = static_cast<const char*>(p.key) + token * p.key_token_stride;
  const char* value = static_cast<const char*>(p.value) + token * p.value_token_stride;
  Unit* key_cache = static_cast<Unit*>(p.key_cache);
  Unit* value_cache = static_cast<Unit*>(p.value_cache);
  for (int i = threadIdx.x; i < p.num_kv_heads * key_units; i += kThreads) {
    const int head = i / key_units, u = i - head * key_units;
    const int64_t dst = (row_slot + int64_t(head) * p.block_size) * key_units + u;
    key_cache[dst] = reinterpret_cast<const Unit*>(key + head * p.key_head_stride)[u];
  }
  for (int i = threadIdx.x; i < p.num_kv_heads * value_units; i += kThreads) {
    const int head = i / value_units, u = i - head * value_units;
    const int64_t dst = (row_slot + int64_t(head) * p.block_size) * value_units + u;
    value_cache[dst] = reinterpret_cast<const Unit*>(value + head * p.value_head_stride)[u];
  }
}

// grid (pair, 2 * layer + {0: keys, 1: values}): one block copy per CTA.
template <typename Unit>
__global__ void __launch_bounds__(kThreads) copy_blocks_kernel(const __grid_constant__ CopyBlocksParams p) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y / 2;
  const int64_t src = p.block_mapping[2 * pair], dst = p.block_mapping[2 * pair + 1];
  if (src < 0 || src >= p.num_blocks || dst < 0 || dst >= p.num_blocks) return;
  Unit* cache = static_cast<Unit*>(blockIdx.y % 2 == 0 ? p.key_caches[layer] : p.value_caches[layer]);
  const int64_t block_bytes = blockIdx.y % 2 == 0 ? p.key_block_bytes[layer] : p.value_block_bytes[layer];
  const int64_t units = block_bytes / static_cast<int64_t>(sizeof(Unit));
  const Unit* from = cache + src * units;
  Unit* to = cache + dst * units;
  for (int64_t i = threadIdx.x; i < units; i += kThreads * kUnitsInFlight) {
    Unit v[kUnitsInFlight];
#pragma unroll
    for (int k = 0; k < kUnitsInFlight; ++k) {
      if (i + k * kThreads < units) v[k] = from[i + k * kThreads];
    }
#pragma unroll
    for (int k = 0; k < kUnitsInFlight; ++k) {
      if (i + k * kThreads < units) to[i + k * kThreads] = v[k];
    }
  }
}

int64_t address(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

}  // namespace

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const int alignment = common_alignment({address(p.key), address(p.value), address(p.key_cache),
                                          address(p.value_cache), p.key_token_stride, p.key_head_stride,
                                          p.value_token_stride, p.value_head_stride, p.key_row_bytes,
                                          p.value_row_bytes});
  with_unit(alignment, [&](auto unit) {
    write_kv_kernel<decltype(unit)><<<static_cast<unsigned>(p.num_tokens), kThreads, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(const CopyBlocksParams& p, cudaStream_t stream) {
  int alignment = 16;
  for (int l = 0; l < p.num_layers; ++l) {
    alignment = common_alignment({alignment, address(p.key_caches[l]), address(p.value_caches[l]),
                                  p.key_block_bytes[l], p.value_block_bytes[l]});
  }
  const dim3 grid(static_cast<unsigned>(p.num_pairs), 2 * p.num_layers);
  with_unit(alignment, [&](auto unit) { copy_blocks_kernel<decltype(unit)><<<grid, kThreads, 0, stream>>>(p); });
  return cudaGetLastError();
}

}  // namespace paged::cuda
