// One tree's kernel entry point with C linkage, linked into that tree's kernel library
// for kernel_cycles.cpp (which dlopens one or two such libraries).
#include <cstdint>
#if KERNEL_AMX_TILES
#include "amx_permission.h"
#endif

#include "attention_params.h"  // from the same tree as the kernel (kernel_cycles.sh sets -I)

#define KERNEL_ENTRY_TOKENS(isa) isa##_attention_kernel
#define KERNEL_ENTRY(isa) KERNEL_ENTRY_TOKENS(isa)

namespace paged::cpu {
AttentionKernelFn KERNEL_ENTRY(KERNEL_ISA)(ScalarKind kind);
#if KERNEL_AMX
// The amx kernel hands the items its tiles do not take to a vector kernel, which the
// extension picks at run time (cpu_features.cpp); here always avx512_vbmi's, linked beside it.
AttentionKernelFn avx512_vbmi_attention_kernel(ScalarKind kind);
AttentionKernelFn vector_kernel_beside_amx(ScalarKind kind) { return avx512_vbmi_attention_kernel(kind); }
#endif
}

extern "C" __attribute__((visibility("default"))) paged::cpu::AttentionKernelFn kernel_entry(int kind) {
#if KERNEL_AMX_TILES  // the hardware's tiles (not amx_emulated's model)
  static const bool tiles_permitted = paged::cpu::request_amx_tile_permission();
  if (!tiles_permitted) return nullptr;
#endif
  return paged::cpu::KERNEL_ENTRY(KERNEL_ISA)(paged::ScalarKind(kind));
}
