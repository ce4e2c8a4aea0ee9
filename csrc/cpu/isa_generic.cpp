// The attention kernel compiled for the baseline instruction set (runs everywhere).
#define PAGED_ISA generic
// Vectors of one 16-byte register: GCC keeps wider vectors in memory on SSE2, storing and
// reloading them around every operation (measured far slower than a native 4-lane loop).
#define PAGED_VEC_WIDTH 4
#define PAGED_ISA_AVX512 0
#define PAGED_ISA_F16C 0

#include "isa_kernel.h"
