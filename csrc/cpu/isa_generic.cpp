// The attention kernel compiled for the baseline instruction set (runs everywhere).
// Chosen at run time by cpu_features.cpp; never called on a CPU that lacks it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_params.h"

#pragma GCC push_options
// Baseline x86-64 / any architecture: no target pragma.
#define PAGED_VEC_WIDTH 8
#define PAGED_ISA_AVX512 0
#define PAGED_ISA_F16C 0

namespace paged::cpu::generic {
#include "attention_kernel.h"
}  // namespace paged::cpu::generic

#undef PAGED_VEC_WIDTH
#undef PAGED_ISA_AVX512
#undef PAGED_ISA_F16C
#pragma GCC pop_options

namespace paged::cpu {
AttentionKernelFn generic_attention_kernel(ScalarKind kind) { return generic::kernel_for(kind); }
}  // namespace paged::cpu
