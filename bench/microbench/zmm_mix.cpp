// What one more zmm operation costs beside vdpbf16ps (docs/performance.md, session 22): TSC
// ticks per iteration of 16 independent vdpbf16ps plus 4 or 8 independent operations of one
// kind (each on its own register, so only throughput counts).
//   g++ -O2 -mavx512f -mavx512bw -mavx512bf16 -mavx512vbmi bench/microbench/zmm_mix.cpp -o /tmp/zmm_mix && /tmp/zmm_mix
#include <immintrin.h>
#include <x86intrin.h>
#include <cstdio>
#include <cstdint>
alignas(64) static uint32_t buf[64];
template <int KIND, int N>
__attribute__((noinline)) double run(long iters) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  __m512i x = _mm512_set1_epi32(0x3f803f80), y = _mm512_set1_epi32(0x3f003f00);
  __m512i t0 = _mm512_set1_epi8(3), t1 = _mm512_set1_epi8(5);
  __m512i side[8];
  for (int i = 0; i < 8; ++i) side[i] = _mm512_set1_epi32(i);
  uint64_t c0 = __rdtsc();
  for (long it = 0; it < iters; ++it) {
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)x, (__m512bh)y);
    for (int j = 0; j < N; ++j) {
      if constexpr (KIND == 1) side[j] = _mm512_unpacklo_epi16(side[j], x);
      if constexpr (KIND == 2) side[j] = _mm512_add_epi32(side[j], _mm512_set1_epi32((int)buf[j]));
      if constexpr (KIND == 3) side[j] = _mm512_add_epi32(side[j], _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i*)(buf + 8 * j))));
      if constexpr (KIND == 4) side[j] = _mm512_permutex2var_epi8(t0, side[j], t1);
      if constexpr (KIND == 5) side[j] = _mm512_add_epi32(side[j], x);
      if constexpr (KIND == 6) side[j] = _mm512_add_epi32(side[j], _mm512_load_si512(buf + 16 * (j & 3)));
      asm volatile("" : "+v"(side[j]));
    }
  }
  uint64_t c1 = __rdtsc();
  float s = 0;
  for (int i = 0; i < 16; ++i) s += _mm512_reduce_add_ps(acc[i]);
  for (int i = 0; i < 8; ++i) s += _mm512_reduce_add_epi32(side[i]);
  if (s == 1.2345f) printf("x");
  return double(c1 - c0) / iters;
}
int main() {
  const long n = 20000000;
  const char* names[] = {"none", "vpunpcklwd zmm", "vpbroadcastd zmm,m32 (+vpaddd)", "vbroadcasti64x4 zmm,m256 (+vpaddd)", "vpermi2b zmm", "vpaddd zmm", "vmovdqu64 zmm load (+vpaddd)"};
  printf("16 vdpbf16ps alone: %.2f TSC ticks/iter\n", run<0, 0>(n));
  #define R(K) printf("%-36s x4: %.2f  x8: %.2f ticks/iter\n", names[K], run<K, 4>(n), run<K, 8>(n));
  R(1) R(2) R(3) R(4) R(5) R(6)
}
