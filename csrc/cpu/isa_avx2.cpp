// The attention kernel compiled for AVX2 with FMA and F16C.
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

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PAGED_VEC_WIDTH 8
#define PAGED_ISA_AVX512 0
#define PAGED_ISA_F16C 1

namespace paged::cpu::avx2 {
#include "attention_kernel.h"
}  // namespace paged::cpu::avx2

#undef PAGED_VEC_WIDTH
#undef PAGED_ISA_AVX512
#undef PAGED_ISA_F16C
#pragma GCC pop_options
#endif  // __x86_64__

namespace paged::cpu {
AttentionKernelFn avx2_attention_kernel(ScalarKind kind) {
#if defined(__x86_64__)
  return avx2::kernel_for(kind);
#else
  (void)kind;
  return nullptr;
#endif
}
}  // namespace paged::cpu
