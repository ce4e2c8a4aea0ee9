// Element type of the attention tensors, shared by the CPU and CUDA kernels.
// Deliberately free of torch headers (included by the ISA-specific CPU kernels and
// by nvcc-compiled code).
#pragma once

namespace paged {

enum class ScalarKind : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace paged
