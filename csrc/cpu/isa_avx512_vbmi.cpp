// The attention kernel compiled for AVX-512 with AVX512_VBMI but no AVX512_BF16 (Ice Lake,
// Tiger Lake): the avx512 kernel, with fp8 rows converted exactly by vpermi2b table lookups
// (fp8_bf16_tables.h) instead of widened through fp16.
#define PAGED_ISA avx512_vbmi
#define PAGED_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c"
#define PAGED_VEC_WIDTH 16
#define PAGED_ISA_AVX512 1
#define PAGED_ISA_AVX512_VBMI 1
#define PAGED_ISA_F16C 1

#include "isa_kernel.h"
