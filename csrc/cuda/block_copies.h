// swap_blocks on CUDA: one block of a pool of any rank and strides as 2-D copies
// (cudaMemcpy2DAsync's shape: `height` rows of `width` bytes, each side with its own row
// pitch), so the CUDA op moves every pool the CPU op moves. Torch-free and free of the
// CUDA runtime: the emulator (tests/cuda_emulator.cpp) runs the same plan with memcpy.
#pragma once

#include <cstdint>
#include <vector>

namespace paged::cuda {

// Bytes from the start of the block on each side.
struct BlockCopy {
  int64_t src_offset, dst_offset, src_pitch, dst_pitch, width, height;
};

// The copies that move one block: dims 1..dim-1 of sizes, with each side's strides (in
// elements). A row is the last dim when both sides store it contiguously (else one
// element); the dim before the row gives the copy's height where both pitches are at least
// a row wide (what cudaMemcpy2D takes); the dims before that are looped over.
inline std::vector<BlockCopy> block_copies(int dim, const int64_t* sizes, const int64_t* src_strides,
                                           const int64_t* dst_strides, int64_t elem) {
  std::vector<BlockCopy> copies;
  int last = dim - 1;  // the outermost dim the rows (and the height) do not cover
  int64_t width = elem;
  if (dim > 1 && (sizes[last] == 1 || (src_strides[last] == 1 && dst_strides[last] == 1))) {
    width = sizes[last] * elem;
    --last;
  }
  int64_t height = 1, src_pitch = width, dst_pitch = width;
  if (last >= 1 && src_strides[last] * elem >= width && dst_strides[last] * elem >= width) {
    height = sizes[last];
    src_pitch = src_strides[last] * elem;
    dst_pitch = dst_strides[last] * elem;
    --last;
  }
  // An odometer over dims 1..last.
  std::vector<int64_t> index(dim, 0);
  for (int d = 1; d <= last; ++d)
    if (sizes[d] == 0) return copies;
  while (true) {
    int64_t src = 0, dst = 0;
    for (int d = 1; d <= last; ++d) {
      src += index[d] * src_strides[d] * elem;
      dst += index[d] * dst_strides[d] * elem;
    }
    copies.push_back({src, dst, src_pitch, dst_pitch, width, height});
    int d = last;
    while (d >= 1 && ++index[d] == sizes[d]) index[d--] = 0;
    if (d < 1) return copies;
  }
}

}  // namespace paged::cuda
