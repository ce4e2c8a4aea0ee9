// The attention kernel compiled for the baseline instruction set (runs everywhere).
#define PAGED_ISA generic
#define PAGED_VEC_WIDTH 8
#define PAGED_ISA_AVX512 0
#define PAGED_ISA_F16C 0

#include "isa_kernel.h"
