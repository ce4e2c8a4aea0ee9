// Software prefetches of cache rows. Part of the CPU kernel, inside its ISA namespace
// (see vec.h).
#pragma once

#include "vec.h"

// Into L2 (prefetcht1). A T0 prefetch of a line in DRAM holds one of L1's few miss
// buffers until the line arrives, which on Zen 4 capped a core's decode far below its read
// bandwidth (T1 measured far faster than T0 or no software prefetch at all; see
// docs/performance.md). GCC's dead-code elimination deletes a loop whose only
// effect is prefetching; the empty volatile asm keeps such loops.
static inline void prefetch(const void* p) {
  __builtin_prefetch(p, 0, 2);
  asm volatile("");
}
// Into L1 (prefetcht0), for a line a T1 prefetch has already brought towards L2.
static inline void prefetch_l1(const void* p) {
  __builtin_prefetch(p, 0, 3);
  asm volatile("");
}

static inline void prefetch_row(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int off = 0; off < bytes; off += 64) prefetch(p + off);
}

// Row t's bytes at `element` into L1 from ahead[t] and into L2 from ahead[kKeyChunk + t]
// (the next phase's and the one after's rows), `ahead` not null.
template <typename R>
static inline void prefetch_ahead(const R* const* ahead, int t, int element) {
  prefetch_l1(ahead[t] + element);
  prefetch(ahead[kKeyChunk + t] + element);
}

// Prefetching mirrors the loads: while a phase reads bytes [x, x + 64) of its row t, it
// prefetches the same bytes of row t of the next phase's rows into L1 (ahead[t]) and of
// the phase after it into L2 (ahead[kKeyChunk + t]); `ahead` is nullable. Misses then stay
// in flight at the pace of the arithmetic instead of in bursts, and every line has two
// phases to come from DRAM. Against the L2 prefetch one phase ahead alone it measured
// faster from DRAM and L3, slower with every line already in L2 (twice the prefetch
// instructions).
template <typename R>
static inline void prefetch_same_line(const R* const* ahead, int t, int element) {
  if (ahead && (element * int(sizeof(R))) % 64 == 0) prefetch_ahead(ahead, t, element);
}

// prefetch_same_line for every line of row t (`ahead` not null).
template <typename R>
static inline void prefetch_same_line_row(const R* const* ahead, int t, int elements) {
  for (int element = 0; element < elements; element += 64 / int(sizeof(R))) prefetch_ahead(ahead, t, element);
}
