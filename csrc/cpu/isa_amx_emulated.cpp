// The amx kernel (isa_amx.cpp's) with its tile instructions run by a software model
// (amx_tile_model.h), compiled for isa_avx512_bf16.cpp's instruction set: a testing aid that
// runs the amx kernel, its planning and its hand-offs to a vector kernel on any CPU with
// AVX512_BF16 and AVX512_VBMI, and checks every tile use against the configuration. Slow;
// never chosen by default (select_cpu_isa("amx_emulated")).
#define PAGED_ISA amx_emulated
#define PAGED_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma,f16c"
#define PAGED_VEC_WIDTH 16
#define PAGED_ISA_AVX512 1
#define PAGED_ISA_AVX512_VBMI 1
#define PAGED_ISA_AVX512_BF16 1
#define PAGED_ISA_AMX 1
#define PAGED_AMX_EMULATED 1
#define PAGED_ISA_F16C 1

#include "isa_kernel.h"
