// The attention kernel compiled for AVX-512 with AVX512_BF16 and AVX512_VBMI: the same
// kernel as isa_avx512.cpp, plus vdpbf16ps dot products for bf16 keys and values and for
// fp8 keys (converted to bf16 by vpermi2b table lookups).
#define PAGED_ISA avx512_bf16
#define PAGED_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c"
#define PAGED_VEC_WIDTH 16
#define PAGED_ISA_AVX512 1
#define PAGED_ISA_AVX512_VBMI 1
#define PAGED_ISA_AVX512_BF16 1
#define PAGED_ISA_F16C 1

#include "isa_kernel.h"
