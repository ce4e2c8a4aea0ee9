// Run-time choice of the attention kernel's instruction set.
#pragma once

#include <string>

#include "attention_params.h"

namespace paged::cpu {

// The best instruction set this CPU runs: "amx" (avx512_bf16 plus AMX tiles for bf16 and
// fp8 caches), "avx512_bf16" (AVX-512 with bf16 dot products), "avx512", "avx2" or "generic".
// PAGED_ATTENTION_CPU_ISA may lower it (tests use this to cover every path);
// asking for one the CPU lacks raises.
std::string selected_isa();

AttentionKernelFn attention_kernel_for(ScalarKind kind);

// Query vectors a work item of this call aims for: kMaxQueriesPerItem, or more where the
// selected kernel asks for it.
int queries_per_item(const AttentionParams& params);

}  // namespace paged::cpu
