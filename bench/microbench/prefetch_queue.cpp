// Does this machine drop software prefetches when many misses are outstanding? Issue N
// prefetches to cold, random lines back to back, wait 30 us, then time loading those lines
// (independent loads); compare with no prefetch. If the later loads hit, every prefetch
// was kept (docs/performance.md, "Where time goes").
//
//   g++ -O2 -march=native bench/microbench/prefetch_queue.cpp -o /tmp/pq && /tmp/pq
#include <immintrin.h>
#include <sys/mman.h>
#include <x86intrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr size_t kPoolBytes = size_t(1) << 30;
constexpr size_t kFlushBytes = size_t(64) << 20;  // twice the L3
char* g_pool;
char* g_flush;

char* allocate(size_t bytes) {
  char* p = static_cast<char*>(std::aligned_alloc(size_t(2) << 20, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  return p;
}

void evict_caches() {
  for (size_t i = 0; i < kFlushBytes; i += 64) g_flush[i]++;
}

void spin(double us) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() < us) {
  }
}

// TSC ticks per load of n random lines, prefetched with `hint` 30 us earlier (hint < 0: not).
template <int kHint>
double ticks_per_load(int n, std::mt19937& rng) {
  std::vector<const char*> lines(n);
  for (auto& p : lines) p = g_pool + (rng() % (kPoolBytes / 64)) * 64;
  evict_caches();
  if constexpr (kHint >= 0)
    for (const char* p : lines) _mm_prefetch(p, static_cast<_mm_hint>(kHint));
  spin(30);
  _mm_lfence();
  const uint64_t t0 = __rdtsc();
  long sum = 0;
  for (const char* p : lines) sum += *static_cast<const volatile char*>(p);
  _mm_lfence();  // read the clock after every load has completed
  const uint64_t t1 = __rdtsc();
  if (sum == 12345) std::puts("");
  return double(t1 - t0) / n;
}

template <int kHint>
double median_ticks(int n, std::mt19937& rng) {
  std::vector<double> samples;
  for (int trial = 0; trial < 30; ++trial) samples.push_back(ticks_per_load<kHint>(n, rng));
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main() {
  g_pool = allocate(kPoolBytes);
  g_flush = allocate(kFlushBytes);
  std::mt19937 rng(1);
  for (int i = 0; i < 100; ++i) ticks_per_load<_MM_HINT_T0>(64, rng);  // warm up
  std::printf("TSC ticks per load, median of 30 trials\n   N   none     T0     T1     T2    NTA\n");
  for (const int n : {8, 16, 24, 32, 48, 64, 96, 128, 256, 512}) {
    std::printf("%4d %6.1f %6.1f %6.1f %6.1f %6.1f\n", n, median_ticks<-1>(n, rng),
                median_ticks<_MM_HINT_T0>(n, rng), median_ticks<_MM_HINT_T1>(n, rng),
                median_ticks<_MM_HINT_T2>(n, rng), median_ticks<_MM_HINT_NTA>(n, rng));
  }
}
