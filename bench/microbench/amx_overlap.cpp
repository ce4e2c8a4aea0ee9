// Whether AMX tile products and AVX-512 vector work run side by side on one core (docs/
// performance.md, session 26). Two independent tdpbf16ps per iteration (tiles in
// registers, no memory), alone and beside 24 or 48 independent vector FMAs (12 chains) or
// 48 vpermps; TSC ticks per iteration. Where the two overlap, "with" reads the larger of
// the two "alone" figures; on the Xeon with AMX (session 26) the FMAs beside the tile
// products ran at about half their rate, so the amx kernel's softmax and its tile
// products add up rather than overlap.
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 bench/microbench/amx_overlap.cpp -o /tmp/amx_overlap \
//       && /tmp/amx_overlap
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <initializer_list>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
alignas(64) uint16_t operands[4][512];

#define TWELVE(op)                                                                   \
  a0 = op(a0), a1 = op(a1), a2 = op(a2), a3 = op(a3), a4 = op(a4), a5 = op(a5);     \
  a6 = op(a6), a7 = op(a7), a8 = op(a8), a9 = op(a9), a10 = op(a10), a11 = op(a11);

// kVec rounds of 12 vector operations (FMAs, or permutes) per iteration, with or without
// two tile products.
template <int kVec, bool kTiles, bool kPermutes>
__attribute__((noinline)) double ticks_per_iteration(long n) {
  __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2), a3 = _mm512_set1_ps(3);
  __m512 a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5), a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7);
  __m512 a8 = _mm512_set1_ps(8), a9 = _mm512_set1_ps(9), a10 = _mm512_set1_ps(10), a11 = _mm512_set1_ps(11);
  const __m512 x = _mm512_set1_ps(0.999f);
  const __m512i index = _mm512_set1_epi32(3);
#define FMA(a) _mm512_fmadd_ps(a, x, x)
#define PERMUTE(a) _mm512_permutexvar_ps(index, a)
  const uint64_t start = __rdtsc();
  for (long i = 0; i < n; ++i) {
    if (kTiles) {
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 4, 5);
    }
    for (int k = 0; k < kVec; ++k) {
      if (kPermutes) {
        TWELVE(PERMUTE)
      } else {
        TWELVE(FMA)
      }
    }
  }
  const double ticks = double(__rdtsc() - start) / n;
  volatile float sink = 0.0f;
  for (__m512 a : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11}) sink = sink + _mm512_cvtss_f32(a);
  return ticks;
}

}  // namespace

int main() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::printf("no AMX tile state on this machine\n");
    return 1;
  }
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
  _tile_loadd(2, operands[0], 64);
  _tile_loadd(3, operands[1], 64);
  _tile_loadd(4, operands[2], 64);
  _tile_loadd(5, operands[3], 64);
  _tile_zero(0);
  _tile_zero(1);
  constexpr long kIterations = 2000000;
  for (int round = 0; round < 2; ++round) {
    std::printf("2 tdpbf16ps alone: %.1f ticks\n", ticks_per_iteration<0, true, false>(kIterations));
    std::printf("24 FMAs alone %.1f, with the 2 tile products %.1f\n", ticks_per_iteration<2, false, false>(kIterations),
                ticks_per_iteration<2, true, false>(kIterations));
    std::printf("48 FMAs alone %.1f, with the 2 tile products %.1f\n", ticks_per_iteration<4, false, false>(kIterations),
                ticks_per_iteration<4, true, false>(kIterations));
    std::printf("48 vpermps alone %.1f, with the 2 tile products %.1f\n",
                ticks_per_iteration<4, false, true>(kIterations), ticks_per_iteration<4, true, true>(kIterations));
  }
  _tile_release();
  return 0;
}
