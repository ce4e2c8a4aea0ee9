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
static const size_t kBytes = size_t(1) << 30;
char* buf; char* flushbuf;
void flush() { for (size_t i = 0; i < (size_t(64) << 20); i += 64) flushbuf[i]++; }
void spin(double us) { auto t0 = std::chrono::steady_clock::now(); while (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() < us) {} }
template <int HINT>
double trial(int n, std::mt19937& rng, bool do_prefetch) {
  std::vector<char*> lines(n);
  for (auto& p : lines) p = buf + (rng() % (kBytes / 64)) * 64;
  flush();
  if (do_prefetch) for (char* p : lines) _mm_prefetch(p, (_mm_hint)HINT);
  spin(30);
  _mm_lfence();
  uint64_t t0 = __rdtsc();
  long s = 0;
  for (char* p : lines) s += *(volatile char*)p;
  _mm_lfence();  // rdtsc after every load has completed
  uint64_t t1 = __rdtsc();
  if (s == 12345) puts("");
  return double(t1 - t0) / n;
}
int main() {
  buf = (char*)std::aligned_alloc(2 << 20, kBytes); madvise(buf, kBytes, MADV_HUGEPAGE); memset(buf, 1, kBytes);
  flushbuf = (char*)std::aligned_alloc(2 << 20, 64 << 20); memset(flushbuf, 1, 64 << 20);
  std::mt19937 rng(1);
  for (int i = 0; i < 100; ++i) trial<_MM_HINT_T0>(64, rng, true);  // fault in the pages first
  printf("TSC ticks per load (2.6 GHz TSC), median of 30 trials\n   N   none     T0     T1     T2    NTA\n");
  for (int n : {8, 16, 24, 32, 48, 64, 96, 128, 256, 512}) {
    double r[5];
    for (int k = 0; k < 5; ++k) {
      std::vector<double> v;
      for (int t = 0; t < 30; ++t) {
        switch (k) {
          case 0: v.push_back(trial<_MM_HINT_T0>(n, rng, false)); break;
          case 1: v.push_back(trial<_MM_HINT_T0>(n, rng, true)); break;
          case 2: v.push_back(trial<_MM_HINT_T1>(n, rng, true)); break;
          case 3: v.push_back(trial<_MM_HINT_T2>(n, rng, true)); break;
          case 4: v.push_back(trial<_MM_HINT_NTA>(n, rng, true)); break;
        }
      }
      std::sort(v.begin(), v.end()); r[k] = v[v.size() / 2];
    }
    printf("%4d %6.1f %6.1f %6.1f %6.1f %6.1f\n", n, r[0], r[1], r[2], r[3], r[4]);
  }
}
