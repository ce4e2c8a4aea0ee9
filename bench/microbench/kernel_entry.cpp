// One tree's kernel entry point with C linkage, linked into that tree's kernel library
// for kernel_cycles.cpp (which dlopens one or two such libraries).
#include <cstdint>

#include "attention_params.h"  // from the same tree as the kernel (kernel_cycles.sh sets -I)

#define KERNEL_ENTRY_TOKENS(isa) isa##_attention_kernel
#define KERNEL_ENTRY(isa) KERNEL_ENTRY_TOKENS(isa)

namespace paged::cpu {
AttentionKernelFn KERNEL_ENTRY(KERNEL_ISA)(ScalarKind kind);
}

extern "C" __attribute__((visibility("default"))) paged::cpu::AttentionKernelFn kernel_entry(int kind) {
  return paged::cpu::KERNEL_ENTRY(KERNEL_ISA)(paged::ScalarKind(kind));
}
