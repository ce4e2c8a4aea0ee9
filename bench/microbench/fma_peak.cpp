// The machine's fp32 multiply-add ceiling: independent AVX-512 FMA chains (no memory), on
// one thread and on two. docs/performance.md uses it for the decode roofline, where
// torch.mm (BLAS) runs well below it on this CPU.
//
//   g++ -O2 -mavx512f -fopenmp bench/microbench/fma_peak.cpp -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

namespace {

// Lane multiply-adds per second of one thread: 12 chains, enough to cover the FMA
// latency on two pipes.
double lane_fmas_per_second() {
  constexpr long kIterations = 100000000;
  constexpr int kChains = 12;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + 1e-7f * i);
  const __m512 b = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-8f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < kIterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], b, c);
    // Uses every chain, so none is dead code (an in-out "+v" constraint would make GCC
    // store the array to the stack on every iteration).
    asm volatile("" ::"v"(acc[0]), "v"(acc[1]), "v"(acc[2]), "v"(acc[3]), "v"(acc[4]), "v"(acc[5]),
                 "v"(acc[6]), "v"(acc[7]), "v"(acc[8]), "v"(acc[9]), "v"(acc[10]), "v"(acc[11]));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  if (sink == 12345.0f) std::puts("");
  return double(kIterations) * kChains * 16 / seconds;
}

}  // namespace

int main() {
  const double one = lane_fmas_per_second();
  double total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
  total += lane_fmas_per_second();
  std::printf("fp32 multiply-adds: 1 thread %.1f G/s (%.1f AVX-512 FMA instructions/ns), "
              "2 threads %.1f G/s (%.1f GFLOP/s)\n",
              one / 1e9, one / 16e9, total / 1e9, 2 * total / 1e9);
}
