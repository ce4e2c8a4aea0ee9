// The entry point of each instruction set's compile of the attention kernel (isa_*.cpp via
// isa_kernel.h): the work-item function for a cache dtype, or nullptr where the compile is
// not for this architecture.
#pragma once

#include "attention_params.h"

namespace paged::cpu {

AttentionKernelFn amx_attention_kernel(ScalarKind kind);
AttentionKernelFn avx512_bf16_attention_kernel(ScalarKind kind);
AttentionKernelFn avx512_vbmi_attention_kernel(ScalarKind kind);
AttentionKernelFn avx512_attention_kernel(ScalarKind kind);
AttentionKernelFn avx2_attention_kernel(ScalarKind kind);
AttentionKernelFn generic_attention_kernel(ScalarKind kind);

// Query vectors per work item the amx kernel asks for on this call; 0 where its tiles
// take none of the call's items.
int amx_queries_per_item(const AttentionParams& params);

}  // namespace paged::cpu
