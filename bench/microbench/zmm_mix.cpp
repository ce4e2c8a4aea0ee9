// What one more zmm operation costs beside a stream of vdpbf16ps (docs/performance.md,
// sessions 22-23): TSC ticks per iteration of 16 independent vdpbf16ps plus 4 or 8
// independent operations of one kind. Written in inline assembly with fixed registers:
// a first version in C++ kept its accumulators in memory at -O2 (a store and a load per
// vdpbf16ps), which is what it then timed.
//   g++ -O2 -mavx512f -mavx512bw -mavx512bf16 -mavx512vbmi bench/microbench/zmm_mix.cpp -o /tmp/zmm_mix && /tmp/zmm_mix
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>

alignas(64) static uint32_t buf[16];

// Accumulators zmm0-15, side operations on zmm16-23 (one register each: throughput only),
// operands zmm29-31 (zeroed every iteration: no NaN or denormal), scratch zmm28.
#define DPBF16(r) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" #r "\n\t"
#define STREAM                                                                                   \
  DPBF16(0) DPBF16(1) DPBF16(2) DPBF16(3) DPBF16(4) DPBF16(5) DPBF16(6) DPBF16(7) DPBF16(8) \
  DPBF16(9) DPBF16(10) DPBF16(11) DPBF16(12) DPBF16(13) DPBF16(14) DPBF16(15)
#define SIDE4(op) op(16) op(17) op(18) op(19)
#define SIDE8(op) SIDE4(op) op(20) op(21) op(22) op(23)
#define SIDE16(op) SIDE8(op) op(24) op(25) op(26) op(27) SIDE4(op)
#define CLOBBERS                                                                                 \
  "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10",      \
      "zmm11", "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19", "zmm20", \
      "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27", "zmm28", "zmm29", "zmm30", "zmm31", "k1"
#define TIMER(name, side)                                                              \
  __attribute__((noinline)) double name(long iters) {                                  \
    const void* p = buf;                                                               \
    const uint64_t c0 = __rdtsc();                                                     \
    for (long it = 0; it < iters; ++it)                                                \
      asm volatile("vpxord %%zmm29, %%zmm29, %%zmm29\n\tvpxord %%zmm30, %%zmm30, %%zmm30\n\t" \
                   "vpxord %%zmm31, %%zmm31, %%zmm31\n\tkxnorw %%k1, %%k1, %%k1\n\t" STREAM side \
                   :                                                                   \
                   : "r"(p)                                                            \
                   : CLOBBERS);                                                        \
    return double(__rdtsc() - c0) / iters;                                             \
  }

#define UNPACK(r) "vpunpcklwd %%zmm31, %%zmm" #r ", %%zmm" #r "\n\t"
#define PADDD(r) "vpaddd %%zmm31, %%zmm" #r ", %%zmm" #r "\n\t"
#define ADDPS(r) "vaddps %%zmm31, %%zmm" #r ", %%zmm" #r "\n\t"
#define MULPS(r) "vmulps %%zmm31, %%zmm" #r ", %%zmm" #r "\n\t"
#define FMA(r) "vfmadd231ps %%zmm31, %%zmm30, %%zmm" #r "\n\t"
#define SHUFPS(r) "vshufps $0x4e, %%zmm31, %%zmm" #r ", %%zmm" #r "\n\t"
#define SHUFF(r) "vshuff32x4 $0x4e, %%zmm31, %%zmm" #r ", %%zmm" #r "\n\t"
#define BLEND(r) "vblendmps %%zmm31, %%zmm" #r ", %%zmm" #r "%{%%k1%}\n\t"
#define PERMT2PS(r) "vpermt2ps %%zmm31, %%zmm29, %%zmm" #r "\n\t"
#define PERMI2B(r) "vpermi2b %%zmm31, %%zmm30, %%zmm" #r "\n\t"
#define TERNLOG(r) "vpternlogd $0xf8, %%zmm31, %%zmm30, %%zmm" #r "\n\t"
#define BCAST_D(r) "vpbroadcastd (%0), %%zmm28\n\tvpaddd %%zmm28, %%zmm" #r ", %%zmm" #r "\n\t"
#define BCAST_128(r) "vbroadcasti32x4 (%0), %%zmm28\n\tvpaddd %%zmm28, %%zmm" #r ", %%zmm" #r "\n\t"
#define BCAST_256(r) "vbroadcasti64x4 (%0), %%zmm28\n\tvpaddd %%zmm28, %%zmm" #r ", %%zmm" #r "\n\t"
#define INSERT_256(r) "vinserti64x4 $1, (%0), %%zmm31, %%zmm28\n\tvpaddd %%zmm28, %%zmm" #r ", %%zmm" #r "\n\t"
#define LOAD(r) "vmovdqu64 (%0), %%zmm28\n\tvpaddd %%zmm28, %%zmm" #r ", %%zmm" #r "\n\t"

TIMER(alone, "")
#define KIND(op) TIMER(op##_4, SIDE4(op)) TIMER(op##_8, SIDE8(op)) TIMER(op##_16, SIDE16(op))
KIND(UNPACK) KIND(PADDD) KIND(ADDPS) KIND(MULPS) KIND(FMA) KIND(SHUFPS) KIND(SHUFF) KIND(BLEND)
KIND(PERMT2PS) KIND(PERMI2B) KIND(TERNLOG) KIND(BCAST_D) KIND(BCAST_128) KIND(BCAST_256)
KIND(INSERT_256) KIND(LOAD)

int main() {
  const long n = 20000000;
  const double base = alone(n);
  printf("16 vdpbf16ps alone: %.2f TSC ticks/iter\n", base);
  printf("%-32s %7s %7s %7s   (ticks/iter; extra per operation, in vdpbf16ps slots)\n", "with", "x4", "x8", "x16");
#define REPORT(op, name)                                                                    \
  {                                                                                         \
    const double t4 = op##_4(n), t8 = op##_8(n), t16 = op##_16(n);                          \
    const double slot = base / 16;                                                          \
    printf("%-32s %7.2f %7.2f %7.2f   %5.2f / %5.2f / %5.2f\n", name, t4, t8, t16,            \
           (t4 - base) / 4 / slot, (t8 - base) / 8 / slot, (t16 - base) / 16 / slot);      \
  }
  REPORT(UNPACK, "vpunpcklwd")
  REPORT(PADDD, "vpaddd")
  REPORT(ADDPS, "vaddps")
  REPORT(MULPS, "vmulps")
  REPORT(FMA, "vfmadd231ps")
  REPORT(SHUFPS, "vshufps")
  REPORT(SHUFF, "vshuff32x4")
  REPORT(BLEND, "vblendmps")
  REPORT(PERMT2PS, "vpermt2ps")
  REPORT(PERMI2B, "vpermi2b")
  REPORT(TERNLOG, "vpternlogd")
  REPORT(BCAST_D, "vpaddd of vpbroadcastd m32")
  REPORT(BCAST_128, "vpaddd of vbroadcasti32x4 m128")
  REPORT(BCAST_256, "vpaddd of vbroadcasti64x4 m256")
  REPORT(INSERT_256, "vpaddd of vinserti64x4 m256")
  REPORT(LOAD, "vpaddd of a zmm load")
}
