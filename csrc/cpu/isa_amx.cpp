// The attention kernel compiled for AMX (AMX-TILE, AMX-BF16) on top of isa_avx512_bf16.cpp's
// instruction set: tile products for bf16 and fp8 caches (amx_kernel.h); every other item
// runs a vector kernel (vector_kernel_beside_amx: avx512_bf16's or avx512_vbmi's).
#define PAGED_ISA amx
#define PAGED_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c,amx-tile,amx-bf16"
#define PAGED_VEC_WIDTH 16
#define PAGED_ISA_AVX512 1
#define PAGED_ISA_AVX512_VBMI 1
#define PAGED_ISA_AVX512_BF16 1
#define PAGED_ISA_AMX 1
#define PAGED_ISA_F16C 1

#include "isa_kernel.h"
