// Software prefetches of cache rows. Part of the CPU kernel, inside its ISA namespace
// (see vec.h).
#pragma once

#include "vec.h"

// Into L2 (prefetcht1): a T0 prefetch holds one of L1's few miss buffers until its line
// arrives from DRAM, which on Zen 4 capped a core at about a third of its read bandwidth
// (decode from DRAM 10.4 GB/s per core with T0 or with no prefetch at all, 19.7 with T1;
// docs/performance.md). GCC's dead-code elimination deletes a loop whose only effect is
// prefetching; the empty volatile asm keeps such loops.
static inline void prefetch(const void* p) {
  __builtin_prefetch(p, 0, 2);
  asm volatile("");
}

static inline void prefetch_row(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int off = 0; off < bytes; off += 64) prefetch(p + off);
}

// Prefetching mirrors the loads: while a phase reads bytes [x, x + 64) of its row t,
// it prefetches the same bytes of row t of the next phase's rows (`ahead`, nullable).
// Misses then stay in flight at the pace of the arithmetic instead of in bursts.
template <typename R>
static inline void prefetch_same_line(const R* const* ahead, int t, int element) {
  if (ahead && (element * int(sizeof(R))) % 64 == 0) prefetch(ahead[t] + element);
}
