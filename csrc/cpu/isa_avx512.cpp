// The attention kernel compiled for AVX-512 (F/BW/VL/DQ) with FMA and F16C.
#define PAGED_ISA avx512
#define PAGED_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define PAGED_VEC_WIDTH 16
#define PAGED_ISA_AVX512 1
#define PAGED_ISA_F16C 1

#include "isa_kernel.h"
