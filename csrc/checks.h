// Argument validation shared by every backend. Errors name the op and the
// argument and map to Python exceptions: ValueError for shapes and values,
// TypeError for dtypes, IndexError for ids out of range.
#pragma once

#include <cstdint>
#include <optional>

#include "attention_args.h"

namespace paged {

// Head sizes: up to 512 (Gemma-4's global layers); keys up to 576 (MLA's latent rows,
// whose values are their leading 512 columns).
constexpr int64_t kMaxValueHeadSize = 512;
constexpr int64_t kMaxKeyHeadSize = 576;

// Shapes, dtypes, devices and layouts of paged.attention's arguments (and of
// the caller's `out` / `lse` buffers when given). Reads no tensor data.
AttentionShape check_attention_args(const char* op, const AttentionArgs& args,
                                    const Tensor* out, const Tensor* lse);

// Data-dependent checks on host-resident int32 metadata: seq_lens within what
// the block table covers, the ids of the blocks attention reads within the pool
// (with a sliding window, not those wholly before it), query_start_loc consistent
// with num_tokens and, unless the queries sit after the keys (the shared-prefix op), no
// sequence with more queries than tokens.
void check_attention_metadata(const char* op, const AttentionShape& shape,
                              const AttentionArgs& args);

// paged.merge_attention_states' partial results: as many outputs as lses (at least one),
// outputs [num_tokens, num_heads, head_size] of one float dtype with the last dim
// contiguous, lses fp32 [num_tokens, num_heads], all on one device.
void check_merge_args(const char* op, const TensorList& outputs, const TensorList& lses);

// key [num_tokens, num_kv_heads, head_size] and value [num_tokens, num_kv_heads,
// head_size_v] against their caches, which differ at most in head size.
// With an fp8 or per-token cache, key and value may be any float dtype (one for both) and
// the scales are required; an int4 cache's rows hold head_size // 2 bytes.
void check_write_kv_args(const Tensor& key, const Tensor& value,
                         const Tensor& key_cache, const Tensor& value_cache,
                         const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                         const std::optional<Tensor>& v_scale);

// paged.write_latent: latent [num_tokens, num_kv_heads, latent_size] and rotary_key
// [num_tokens, num_kv_heads, rotary_size] of one float dtype (any, whatever the cache's),
// whose widths add up to the cache's rows; the cache's scale as check_cache_scale says.
void check_write_latent_args(const Tensor& latent, const Tensor& rotary_key, const Tensor& cache,
                             const Tensor& slot_mapping, const std::optional<Tensor>& scale);

// Every slot is padding (< 0) or inside the pool.
void check_slots_in_range(const Tensor& slot_mapping, int64_t num_slots,
                          const char* op = "paged.write_kv");

// An int64 [num_pairs, 2] mapping on the CPU (shape and dtype only).
void check_block_mapping(const char* op, const Tensor& block_mapping);

// Every pair in range, no destination written twice, no block both read and
// written (the result would depend on the copy order).
void check_block_mapping_values(const char* op, const Tensor& block_mapping,
                                int64_t num_src_blocks, int64_t num_dst_blocks,
                                bool same_pool);

// A 4-D cache [num_blocks, num_kv_heads, block_size, head_size] of a cache dtype, with any
// strides but stride(3) == 1 and no two elements at one address (NHD views and views into
// a joint K/V tensor pass; write_kv into an overlapping view would corrupt it).
void check_cache_tensor(const char* op, const char* name, const Tensor& cache);

// k_scale / v_scale: required for fp8 and per-token caches, refused for float ones; fp32
// on the device of `reference`: fp8, shape [], [1] or [num_kv_heads]; per-token, one scale
// (int8) or (scale, low) pair (int4) per slot of its cache, [num_blocks, num_kv_heads,
// block_size(, 2)], any strides but the pair's, not overlapping itself.
void check_kv_scales(const char* op, const Tensor& key_cache, const Tensor& value_cache,
                     const std::optional<Tensor>& k_scale,
                     const std::optional<Tensor>& v_scale, const Tensor& reference,
                     const char* reference_name);

// One cache's scale (`name`): check_kv_scales' rules for one of its two.
void check_cache_scale(const char* op, const char* name, const std::optional<Tensor>& scale,
                       const Tensor& cache, const Tensor& reference, const char* reference_name);

// copy_blocks' per-layer caches: as many value as key caches, each pair of one dtype
// and one shape but for the head size, every layer with the same num_blocks, all on
// one device. A per-token cache's scale tensors (fp32, 3-D or 4-D) are layers too.
void check_layer_caches(const char* op, const TensorList& key_caches,
                        const TensorList& value_caches);

// swap_blocks' pools: one dtype, one block shape (any num_blocks), any strides; 'dst'
// does not overlap itself.
void check_swap_pools(const char* op, const Tensor& src, const Tensor& dst);

}  // namespace paged
