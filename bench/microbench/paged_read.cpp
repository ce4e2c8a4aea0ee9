// How fast 4 KiB blocks in a random order can be read, per software prefetch strategy
// (docs/performance.md, session 28): every line prefetched some blocks ahead, as the kernels
// do, against only a block's first lines (for the L2 streamer to fetch the rest), none, and
// variants. Nothing but the loads and one add per line: the memory side of a paged decode.
//
//   g++ -O3 -march=native -fopenmp bench/microbench/paged_read.cpp -o /tmp/paged_read
//   /tmp/paged_read [threads=2] [huge_pages=1] [order=0]
//
// order 0 reads a block's lines in address order (as a value row packing does); order 1 in
// the order 16 rows of 256 B are read by column (as an AMX tile load of a bf16 key block
// does: lines 0, 4, 8, ... then 1, 5, ...). Each variant runs 5 rounds, each paired with a
// sequential read of 512 MiB; it prints the best rate and the median of the per-round ratios.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr size_t kPoolBytes = size_t(2) << 30;
constexpr size_t kReadBytes = size_t(512) << 20;
constexpr size_t kBlock = 4096, kLines = kBlock / 64;
constexpr size_t kBlocks = kPoolBytes / kBlock;
char* g_pool;
std::vector<uint32_t> g_order;  // the blocks in a random order
bool g_by_column = false;

enum class Prefetch { kNone, kEveryLine, kEveryLineT0, kFirstLines, kBurst, kOddLines };

struct Variant {
  const char* name;
  Prefetch mode;
  int distance;     // blocks ahead
  int first_lines;  // kFirstLines: how many
};

// Blocks [begin, end) of the order; line l of each block read as line `line(l)`, with the
// block `distance` ahead prefetched as `v` says (kEveryLine: one line per line read).
float read_blocks(const Variant& v, size_t begin, size_t end) {
  __m512 sum = _mm512_setzero_ps();
  for (size_t i = begin; i < end; ++i) {
    const char* block = g_pool + size_t(g_order[i]) * kBlock;
    const char* ahead = g_pool + size_t(g_order[std::min(i + v.distance, end - 1)]) * kBlock;
    if (v.mode == Prefetch::kFirstLines)
      for (int l = 0; l < v.first_lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
    if (v.mode == Prefetch::kBurst)
      for (size_t l = 0; l < kLines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 8
    for (size_t l = 0; l < kLines; ++l) {
      if (v.mode == Prefetch::kEveryLine) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
      if (v.mode == Prefetch::kEveryLineT0) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      if (v.mode == Prefetch::kOddLines && (l & 1)) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
      const size_t line = g_by_column ? (l % 16) * 4 + l / 16 : l;
      sum = _mm512_add_ps(sum, _mm512_load_ps(reinterpret_cast<const float*>(block + 64 * line)));
    }
  }
  return _mm512_reduce_add_ps(sum);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// GB/s of kReadBytes of blocks in the random order, split between the threads; each call
// starts further along the order, so the blocks come from DRAM, not the L3.
double paged_rate(int threads, const Variant& v) {
  static size_t start = 0;
  const size_t blocks = kReadBytes / kBlock;
  start = (start + blocks) % (kBlocks - blocks);
  float sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    const size_t t = omp_get_thread_num();
    sink += read_blocks(v, start + blocks * t / threads, start + blocks * (t + 1) / threads);
  }
  const double s = seconds_since(t0);
  if (sink == 1.5f) std::puts("");
  return kReadBytes / s / 1e9;
}

// GB/s of a sequential read of kReadBytes, split between the threads.
double sequential_rate(int threads) {
  static size_t start = 0;
  start = (start + kReadBytes) % (kPoolBytes - kReadBytes);
  float sink = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    const size_t t = omp_get_thread_num();
    const char* p = g_pool + start + kReadBytes * t / threads;
    const char* end = g_pool + start + kReadBytes * (t + 1) / threads;
    __m512 sum = _mm512_setzero_ps();
    for (; p < end; p += 64) sum = _mm512_add_ps(sum, _mm512_load_ps(reinterpret_cast<const float*>(p)));
    sink += _mm512_reduce_add_ps(sum);
  }
  const double s = seconds_since(t0);
  if (sink == 1.5f) std::puts("");
  return kReadBytes / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool huge = argc > 2 ? std::atoi(argv[2]) != 0 : true;
  g_by_column = argc > 3 && std::atoi(argv[3]) != 0;
  g_pool = static_cast<char*>(std::aligned_alloc(size_t(2) << 20, kPoolBytes));
  madvise(g_pool, kPoolBytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::memset(g_pool, 0, kPoolBytes);
  g_order.resize(kBlocks);
  for (size_t i = 0; i < kBlocks; ++i) g_order[i] = uint32_t(i);
  std::shuffle(g_order.begin(), g_order.end(), std::mt19937(1));
  const Variant variants[] = {
      {"none", Prefetch::kNone, 1, 0},
      {"every line, 1 ahead", Prefetch::kEveryLine, 1, 0},
      {"every line, 2 ahead", Prefetch::kEveryLine, 2, 0},
      {"every line, 4 ahead", Prefetch::kEveryLine, 4, 0},
      {"every line T0, 1 ahead", Prefetch::kEveryLineT0, 1, 0},
      {"first 2 lines, 2 ahead", Prefetch::kFirstLines, 2, 2},
      {"first 4 lines, 2 ahead", Prefetch::kFirstLines, 2, 4},
      {"first 8 lines, 2 ahead", Prefetch::kFirstLines, 2, 8},
      {"first 4 lines, 4 ahead", Prefetch::kFirstLines, 4, 4},
      {"first 32 lines, 2 ahead", Prefetch::kFirstLines, 2, 32},
      {"burst of every line, 2 ahead", Prefetch::kBurst, 2, 0},
      {"odd lines, 2 ahead", Prefetch::kOddLines, 2, 0},
  };
  std::printf("%d thread(s), %s pages, lines read %s\n", threads, huge ? "huge" : "4 KiB",
              g_by_column ? "by column (tile-load order)" : "in address order");
  for (const Variant& v : variants) {
    double best = 0, read_best = 0;
    std::vector<double> ratios;
    for (int round = 0; round < 5; ++round) {
      const double read = sequential_rate(threads), paged = paged_rate(threads, v);
      ratios.push_back(paged / read);
      best = std::max(best, paged);
      read_best = std::max(read_best, read);
    }
    std::sort(ratios.begin(), ratios.end());
    std::printf("%-30s %6.2f GB/s (read %6.2f)  %5.1f%% of the read\n", v.name, best, read_best,
                100 * ratios[2]);
  }
}
