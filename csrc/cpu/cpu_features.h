// Run-time choice of the attention kernel's instruction set.
#pragma once

#include <optional>
#include <string>

#include "attention_params.h"

namespace paged::cpu {

// The best instruction set this CPU runs: "amx" (avx512_bf16 plus AMX tiles for bf16 and
// fp8 caches), "avx512_bf16" (AVX-512 with bf16 dot products), "avx512_vbmi" (AVX-512 with
// fp8 converted by byte permutes), "avx512", "avx2" or "generic"; or "amx_emulated" (the amx
// kernel on a software model of its tiles: tests on CPUs without AMX), only when asked for.
// The one every call runs is chosen once: at first use, from PAGED_ATTENTION_CPU_ISA, which
// may lower it (tests use this to cover every path); asking for one the CPU lacks raises.
std::string selected_isa();

// Chooses the kernel of every later call: `isa`, or without it the one
// PAGED_ATTENTION_CPU_ISA asks for now (unset: the default). Returns its name; a name that is
// unknown or beyond this CPU raises and keeps the current choice.
std::string select_isa(std::optional<std::string> isa);

AttentionKernelFn attention_kernel_for(ScalarKind kind);

// What the selected kernel asks of a call's work items.
struct PlanHints {
  int queries_per_item;  // query vectors an item aims for: kMaxQueriesPerItem or more
};
PlanHints plan_hints(const AttentionParams& params);

}  // namespace paged::cpu
