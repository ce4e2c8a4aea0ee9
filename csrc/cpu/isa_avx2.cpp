// The attention kernel compiled for AVX2 with FMA and F16C.
#define PAGED_ISA avx2
#define PAGED_ISA_TARGET "avx2,fma,f16c"
#define PAGED_VEC_WIDTH 8
#define PAGED_ISA_AVX512 0
#define PAGED_ISA_F16C 1

#include "isa_kernel.h"
