// The machine's bf16 dot-product ceiling: independent chains of vdpbf16ps (each a pair of
// bf16 products added into 16 fp32 lanes: 32 multiply-adds), no memory, on one thread and
// on two. docs/performance.md sets MLA decode over latent rows (every query head reads
// each 576-wide row: compute-bound) against it; fma_peak.cpp is the fp32 counterpart.
//
//   g++ -O2 -mavx512f -mavx512bf16 -fopenmp bench/microbench/bf16_dot_peak.cpp -o /tmp/bf16_dot_peak
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

namespace {

// bf16 multiply-adds per second of one thread: 12 chains cover vdpbf16ps' latency on the
// pipes that run it; the best of 400 runs of about 2 ms each: on a shared machine longer
// runs (five of 50M steps, about 0.2 s each) are cut by other jobs' time slices and
// measured 20-97 GMAC/s under load against the core's 118 (docs/performance.md).
double bf16_macs_per_second() {
  constexpr long kIterations = 500000;
  constexpr int kChains = 12;
  double best = 0;
  for (int run = 0; run < 400; ++run) {
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1e-7f * i);
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // 2^-24: the sums stay finite
    const auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < kIterations; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile float sink = 0;
    for (int i = 0; i < kChains; ++i) sink = sink + _mm512_reduce_add_ps(acc[i]);
    const double rate = double(kIterations) * kChains * 32 / seconds;
    if (rate > best) best = rate;
  }
  return best;
}

}  // namespace

int main() {
  const double one = bf16_macs_per_second();
  double total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
  total += bf16_macs_per_second();
  std::printf("avx512_bf16 (vdpbf16ps, 32 multiply-adds): 1 thread %.1f GMAC/s, 2 threads %.1f GMAC/s\n",
              one / 1e9, total / 1e9);
}
