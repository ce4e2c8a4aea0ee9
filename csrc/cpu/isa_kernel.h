// One instruction set's compile of the attention kernel and its entry point. An
// isa_*.cpp defines these macros and includes this file, so adding an instruction set
// is one new file (plus its choice in cpu_features.cpp):
//   PAGED_ISA         names the namespace paged::cpu::<PAGED_ISA> and the entry point
//                     paged::cpu::<PAGED_ISA>_attention_kernel
//   PAGED_ISA_TARGET  the `#pragma GCC target` string: x86-64 only (elsewhere the entry
//                     point returns nullptr); undefined for the baseline, which runs anywhere
//   PAGED_VEC_WIDTH, PAGED_ISA_AVX512, PAGED_ISA_AVX512_VBMI, PAGED_ISA_AVX512_BF16,
//   PAGED_ISA_AMX, PAGED_ISA_F16C:
//                     see vec.h
//   PAGED_AMX_EMULATED
//                     1: the amx kernel's tiles run the software model of amx_tile_model.h
//                     (amx_tiles.h), on a target without AMX
// One file rather than a begin/end pair: the x86-64 condition must enclose the kernel,
// and a preprocessor conditional cannot span files.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_params.h"
#include "output_rounding.h"
#include "isa_entry_points.h"

#define PAGED_CONCAT_TOKENS(a, b) a##b
#define PAGED_CONCAT(a, b) PAGED_CONCAT_TOKENS(a, b)

#if !defined(PAGED_ISA_TARGET) || defined(__x86_64__)
#if PAGED_ISA_AVX512
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which trips these warnings.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#pragma GCC push_options
#if defined(PAGED_ISA_TARGET)
// `#pragma GCC target` takes a literal string; _Pragma takes the macro's expansion.
#define PAGED_PRAGMA(text) _Pragma(#text)
#define PAGED_TARGET_PRAGMA(isa_target) PAGED_PRAGMA(GCC target(isa_target))
PAGED_TARGET_PRAGMA(PAGED_ISA_TARGET)
#endif

// The kernel headers are included inside the namespace, after every system header they use:
// the amx compile's tile kernel (which hands other items to a vector compile), or the
// vector kernel.
namespace paged::cpu::PAGED_ISA {
#if PAGED_ISA_AMX
#include "amx_kernel.h"
#else
#include "attention_kernel.h"
#endif
#if PAGED_ISA_AVX512_BF16 && !PAGED_ISA_AMX
#include "bf16_dot_probe.h"
#endif
}  // namespace paged::cpu::PAGED_ISA

#pragma GCC pop_options

namespace paged::cpu {
AttentionKernelFn PAGED_CONCAT(PAGED_ISA, _attention_kernel)(ScalarKind kind) {
#if PAGED_ISA_AMX
  return PAGED_ISA::amx_kernel_for(kind);
#else
  return PAGED_ISA::vector_kernel_for(kind);
#endif
}
#if PAGED_ISA_AMX
int PAGED_CONCAT(PAGED_ISA, _queries_per_item)(const AttentionParams& params) {
  return PAGED_ISA::queries_per_item(params);
}
#endif
#if PAGED_ISA_AVX512_BF16 && !PAGED_ISA_AMX
double avx512_bf16_dot_gain() { return avx512_bf16::bf16_dot_gain(); }
#endif
}  // namespace paged::cpu
#else
namespace paged::cpu {
AttentionKernelFn PAGED_CONCAT(PAGED_ISA, _attention_kernel)(ScalarKind) { return nullptr; }
#if PAGED_ISA_AMX
int PAGED_CONCAT(PAGED_ISA, _queries_per_item)(const AttentionParams&) { return 0; }
#endif
#if PAGED_ISA_AVX512_BF16 && !PAGED_ISA_AMX
double avx512_bf16_dot_gain() { return 0.0; }
#endif
}  // namespace paged::cpu
#endif
