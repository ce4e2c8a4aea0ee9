// The entry point of each instruction set's compile of the attention kernel (isa_*.cpp via
// isa_kernel.h): the work-item function for a cache dtype, or nullptr where the compile is
// not for this architecture.
#pragma once

#include "attention_params.h"

namespace paged::cpu {

AttentionKernelFn amx_attention_kernel(ScalarKind kind);
AttentionKernelFn amx_emulated_attention_kernel(ScalarKind kind);  // amx's, on the tile model
AttentionKernelFn avx512_bf16_attention_kernel(ScalarKind kind);
AttentionKernelFn avx512_vbmi_attention_kernel(ScalarKind kind);
AttentionKernelFn avx512_attention_kernel(ScalarKind kind);
AttentionKernelFn avx2_attention_kernel(ScalarKind kind);
AttentionKernelFn generic_attention_kernel(ScalarKind kind);

// Multiply-adds per unit time of vdpbf16ps over vfmadd231ps on this core (measured, ~0.1 ms;
// bf16_dot_probe.h); 0 where the avx512_bf16 compile is not for this architecture. Call it
// only on a CPU with AVX512_BF16.
double avx512_bf16_dot_gain();

// The vector kernel for the items the amx kernel's tiles do not take: avx512_bf16's where
// its bf16 dot products pay on this CPU, else avx512_vbmi's (cpu_features.cpp).
AttentionKernelFn vector_kernel_beside_amx(ScalarKind kind);

// Query vectors per work item the amx kernel asks for on this call; 0 where its tiles
// take none of the call's items. The same for its compile on the tile model.
int amx_queries_per_item(const AttentionParams& params);
int amx_emulated_queries_per_item(const AttentionParams& params);

}  // namespace paged::cpu
