// The paged decode kernel's memory access pattern with minimal arithmetic: how close to the
// machine's read bandwidth that pattern can get (docs/performance.md, "Where time goes").
//
//   g++ -O3 -march=native -fopenmp bench/microbench/access_pattern.cpp -o /tmp/access_pattern
//   /tmp/access_pattern [kv_heads]      # 32 (MHA) by default
//
// Each variant runs with 1 and with 4 multiply-adds per loaded vector: the arithmetic of
// one query per KV head (MHA) and of four (GQA 32/8). The number is a template argument,
// so the loops are fully unrolled as in the kernel's head-size-128 compile (with a
// run-time count the same walk measured ~20% slower from DRAM).
//
// Layout as the kernel sees it (fp32, HND, block size 16, head size 128): K and V pools of
// 512 MiB each, blocks of kv_heads x 16 rows x 512 B visited in random order, and within a
// block head by head. Per head: the K rows are read four at a time in 64-byte steps (as the
// kernel's dot4 does) while the same lines of the head's V rows are prefetched; then the V
// rows are read 64 floats at a time across all 16 rows (as accumulate_values does) while
// the next head's K rows are prefetched. Two threads, like the benchmarks.
//
// Prints, per variant: GB/s from DRAM, GB/s with the same blocks in cache (arithmetic only),
// and a sequential two-thread sum over 512 MiB as the read reference.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr size_t kPoolBytes = size_t(512) << 20;
constexpr int kRows = 16, kHead = 128;
constexpr size_t kSegment = size_t(kRows) * kHead;  // floats of one head in one block

float* allocate(size_t bytes) {
  void* p = std::aligned_alloc(size_t(2) << 20, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 1, bytes);
  return static_cast<float*>(p);
}

inline void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Queries and probabilities of G query heads (L1-resident, like the kernel's).
alignas(64) float g_queries[4 * kHead];
alignas(64) float g_probabilities[4 * kRows];

// K rows of one head: four rows at a time, one 16-float step of each, prefetching `ahead`;
// every loaded vector meets G query vectors.
template <int G>
inline __m512 keys(const float* k, const float* ahead, __m512 total) {
  for (int r = 0; r < kRows; r += 4) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
    for (int d = 0; d < kHead; d += 16) {
      __m512 kv[4];
      for (int i = 0; i < 4; ++i) {
        if (ahead) prefetch(ahead + (r + i) * kHead + d);
        kv[i] = _mm512_loadu_ps(k + (r + i) * kHead + d);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 q = _mm512_load_ps(g_queries + g * kHead + d);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(kv[i], q, a[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      total = _mm512_add_ps(total, _mm512_add_ps(_mm512_add_ps(a[g][0], a[g][1]), _mm512_add_ps(a[g][2], a[g][3])));
  }
  return total;
}

// V rows of one head: 64 floats of every row, then the next 64, prefetching `ahead`;
// every loaded vector meets G probabilities.
template <int G>
inline __m512 values(const float* v, const float* ahead, __m512 total) {
  for (int d = 0; d < kHead; d += 64) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
    for (int t = 0; t < kRows; ++t) {
      __m512 vv[4];
      for (int i = 0; i < 4; ++i) {
        if (ahead) prefetch(ahead + t * kHead + d + 16 * i);
        vv[i] = _mm512_loadu_ps(v + t * kHead + d + 16 * i);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(g_probabilities[g * kRows + t]);
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_fmadd_ps(vv[i], p, a[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      total = _mm512_add_ps(total, _mm512_add_ps(_mm512_add_ps(a[g][0], a[g][1]), _mm512_add_ps(a[g][2], a[g][3])));
  }
  return total;
}

template <int G>
double walk(const float* K, const float* V, const std::vector<int>& order, int heads,
            bool use_prefetch, bool cached) {
  const size_t block = kSegment * heads;
  float sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for reduction(+ : sink) num_threads(2) schedule(static)
  for (size_t b = 0; b < order.size(); ++b) {
    // cached: every thread cycles over the same 8 blocks (fits the last-level cache).
    const size_t here = cached ? b % 8 : order[b];
    const size_t next = cached ? (b + 1) % 8 : order[std::min(b + 1, order.size() - 1)];
    __m512 total = _mm512_setzero_ps();
    for (int h = 0; h < heads; ++h) {
      const float* k = K + here * block + h * kSegment;
      const float* v = V + here * block + h * kSegment;
      const float* k_next = h + 1 < heads ? k + kSegment : K + next * block;
      total = keys<G>(k, use_prefetch ? v : nullptr, total);
      total = values<G>(v, use_prefetch ? k_next : nullptr, total);
    }
    sink += _mm512_reduce_add_ps(total);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 12345.0f) std::puts("");
  return 2.0 * order.size() * block * sizeof(float) / seconds / 1e9;
}

double sequential_read(const float* K) {
  const size_t n = kPoolBytes / sizeof(float);
  float sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for reduction(+ : sink) num_threads(2) schedule(static)
  for (int half = 0; half < 2; ++half) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (size_t i = half * n / 2; i < (half + 1) * n / 2; i += 64)
      for (int j = 0; j < 4; ++j) a[j] = _mm512_add_ps(a[j], _mm512_loadu_ps(K + i + 16 * j));
    sink += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink == 12345.0f) std::puts("");
  return kPoolBytes / seconds / 1e9;
}


template <int G>
void measure(const float* K, const float* V, const std::vector<int>& order, int heads) {
  for (const bool use_prefetch : {false, true}) {
    double dram = 0, cached = 0, read = 0;
    for (int rep = 0; rep < 3; ++rep) {  // best of three: the host's bandwidth moves
      read = std::max(read, sequential_read(K));
      dram = std::max(dram, walk<G>(K, V, order, heads, use_prefetch, false));
      cached = std::max(cached, walk<G>(K, V, order, heads, use_prefetch, true));
    }
    std::printf("kv_heads %d, %d multiply-add(s) per vector, prefetch %-3s: DRAM %5.1f GB/s "
                "(%3.0f%% of read %5.1f), cached %6.1f GB/s\n",
                heads, G, use_prefetch ? "on" : "off", dram, 100 * dram / read, read, cached);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int heads = argc > 1 ? std::atoi(argv[1]) : 32;
  float* K = allocate(kPoolBytes);
  float* V = allocate(kPoolBytes);
  for (float& x : g_queries) x = 1.0001f;
  for (float& x : g_probabilities) x = 0.9999f;
  std::vector<int> order(kPoolBytes / (kSegment * heads * sizeof(float)));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  measure<1>(K, V, order, heads);
  measure<4>(K, V, order, heads);
}
