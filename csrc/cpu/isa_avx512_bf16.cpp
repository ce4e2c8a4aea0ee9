// The attention kernel compiled for AVX-512 with AVX512_BF16: the same kernel as
// isa_avx512.cpp, plus vdpbf16ps dot products for bf16 keys. Chosen at run time by
// cpu_features.cpp; never called on a CPU that lacks it.
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
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which trips this warning.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#define PAGED_VEC_WIDTH 16
#define PAGED_ISA_AVX512 1
#define PAGED_ISA_AVX512_BF16 1
#define PAGED_ISA_F16C 1

namespace paged::cpu::avx512_bf16 {
#include "attention_kernel.h"
}  // namespace paged::cpu::avx512_bf16

#undef PAGED_VEC_WIDTH
#undef PAGED_ISA_AVX512
#undef PAGED_ISA_AVX512_BF16
#undef PAGED_ISA_F16C
#pragma GCC pop_options
#endif  // __x86_64__

namespace paged::cpu {
AttentionKernelFn avx512_bf16_attention_kernel(ScalarKind kind) {
#if defined(__x86_64__)
  return avx512_bf16::kernel_for(kind);
#else
  (void)kind;
  return nullptr;
#endif
}
}  // namespace paged::cpu
