#include "layout.h"

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

namespace paged {

namespace {

// Dims of size > 1 sorted by stride; each stride must pass the farthest element of
// the smaller ones (a sufficient condition that no two indices share an address).
bool overlaps(Sizes sizes, Sizes strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return false;
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // largest offset the smaller dims address
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += (size - 1) * stride;
  }
  return false;
}

}  // namespace

bool overlaps_itself(const Tensor& t) { return overlaps(t.sizes(), t.strides()); }

// With equal shapes and strides, the pair is one view with an extra dimension whose
// stride is the offset between them, and that view must not overlap itself.
// Offsets are in elements from a's first one; the stable ABI shows no storage, but two
// views whose address ranges meet are views of one allocation.
bool share_an_element(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const int64_t elem = int64_t(a.element_size());
  const int64_t gap = static_cast<const char*>(b.data_ptr()) - static_cast<const char*>(a.data_ptr());
  auto extent = [](const Tensor& t) {  // offset of t's last element from its first
    int64_t offset = 0;
    for (int64_t d = 0; d < t.dim(); ++d) offset += (t.size(d) - 1) * t.stride(d);
    return offset;
  };
  if ((extent(a) + 1) * elem <= gap || (extent(b) + 1) * elem <= -gap) return false;
  if (gap % elem != 0 || !a.sizes().equals(b.sizes()) || !a.strides().equals(b.strides()))
    return true;
  std::vector<int64_t> sizes(a.sizes().begin(), a.sizes().end());
  std::vector<int64_t> strides(a.strides().begin(), a.strides().end());
  sizes.push_back(2);
  strides.push_back(std::abs(gap / elem));
  return overlaps(Sizes(sizes.data(), sizes.size()), Sizes(strides.data(), strides.size()));
}

bool same_block_layout(const Tensor& a, const Tensor& b) {
  return a.sizes().slice(0, 3).equals(b.sizes().slice(0, 3));
}

bool values_in_keys(const Tensor& key_cache, const Tensor& value_cache) {
  if (key_cache.dim() != 4 || value_cache.dim() != 4 ||
      key_cache.data_ptr() != value_cache.data_ptr() ||
      key_cache.scalar_type() != value_cache.scalar_type() ||
      !same_block_layout(key_cache, value_cache) || value_cache.size(3) > key_cache.size(3))
    return false;
  for (int64_t d = 0; d < 3; ++d) {
    if (key_cache.size(d) > 1 && key_cache.stride(d) != value_cache.stride(d)) return false;
  }
  return true;
}

bool block_is_dense(const Tensor& cache) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) within one block
  for (int64_t d = 1; d < cache.dim(); ++d) {
    if (cache.size(d) > 1) dims.emplace_back(cache.stride(d), cache.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

bool same_block_strides(const Tensor& a, const Tensor& b) {
  for (int64_t d = 1; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

}  // namespace paged
