// Predicates on how tensors lay out their elements (sizes and strides): what the checks
// refuse (checks.cpp) and which copy path the cache ops take (cpu/, cuda/). They read no
// tensor data and raise nothing.
#pragma once

#include "torch_api.h"

namespace paged {

// Two indices of `t` address one element (a view that overlaps itself).
bool overlaps_itself(const Tensor& t);

// Two views of one dtype share an element. Halves of a joint tensor interleave (vLLM's
// [num_blocks, 2, ...] pages) without sharing one.
bool share_an_element(const Tensor& a, const Tensor& b);

// Two 4-D caches with the same num_blocks, num_kv_heads and block_size (any head size).
bool same_block_layout(const Tensor& a, const Tensor& b);

// `value_cache` is `key_cache`'s leading columns (key_cache[..., :head_size_v]): MLA latent
// rows, whose values are a view of their keys' memory.
bool values_in_keys(const Tensor& key_cache, const Tensor& value_cache);

// One block of `cache` (dims 1..) is one dense chunk of numel / size(0) elements starting
// at block * stride(0): blocks then move with one memcpy each.
bool block_is_dense(const Tensor& cache);

// Blocks of `a` and `b` lay out their elements alike (the strides of the dimensions
// below the block one, where they matter).
bool same_block_strides(const Tensor& a, const Tensor& b);

}  // namespace paged
