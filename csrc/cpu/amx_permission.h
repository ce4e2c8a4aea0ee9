// Linux's permission to use the AMX tile data registers, which a process must ask for once
// (ARCH_REQ_XCOMP_PERM for XTILEDATA) before any of its threads touches a tile. Shared by
// the dispatch (cpu_features.cpp) and the microbenchmarks that load a kernel on their own.
#pragma once

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace paged::cpu {

inline bool request_amx_tile_permission() {
#if defined(__x86_64__) && defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace paged::cpu
