// The machine's fp32 multiply-add ceiling for one instruction set: independent chains of
// vector multiply-adds (no memory), on one thread and on two. docs/performance.md uses it
// for the decode roofline of each kernel (torch.mm runs well below it on these CPUs).
// The -m flags choose the instruction set, as the kernels' target pragmas do:
//
//   g++ -O2 -mavx512f -fopenmp bench/microbench/fma_peak.cpp -o /tmp/fma_peak   # avx512*
//   g++ -O2 -mavx2 -mfma -fopenmp bench/microbench/fma_peak.cpp -o /tmp/fma_peak # avx2
//   g++ -O2 -fopenmp bench/microbench/fma_peak.cpp -o /tmp/fma_peak              # generic
//
// generic is the baseline the `generic` kernel is compiled for (SSE2 on x86-64): a
// separate multiply and add of 4 lanes per multiply-add.
#include <omp.h>

#include <chrono>
#include <cstdio>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr const char* kIsa = "avx512 (FMA, 16 lanes)";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr const char* kIsa = "avx2 (FMA, 8 lanes)";
#else
constexpr int kLanes = 4;
constexpr const char* kIsa = "generic (multiply + add, 4 lanes)";
#endif
typedef float vec __attribute__((vector_size(kLanes * 4)));

// Lane multiply-adds per second of one thread: 12 chains, enough to cover the latency on
// two pipes (GCC contracts a * b + c into one FMA where the ISA has it).
double lane_fmas_per_second() {
  constexpr long kIterations = 100000000;
  constexpr int kChains = 12;
  vec acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = vec{} + (1.0f + 1e-7f * i);
  const vec b = vec{} + 0.9999999f, c = vec{} + 1e-8f;
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < kIterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * b + c;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0;
  for (int i = 0; i < kChains; ++i)
    for (int j = 0; j < kLanes; ++j) sink += acc[i][j];
  if (sink == 12345.0f) std::puts("");
  return double(kIterations) * kChains * kLanes / seconds;
}

}  // namespace

int main() {
  const double one = lane_fmas_per_second();
  double total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
  total += lane_fmas_per_second();
  std::printf("%s: fp32 multiply-adds: 1 thread %.1f G/s, 2 threads %.1f G/s (%.1f GFLOP/s)\n",
              kIsa, one / 1e9, total / 1e9, 2 * total / 1e9);
}
