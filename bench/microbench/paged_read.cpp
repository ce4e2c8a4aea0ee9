// How fast blocks in a random order can be read, per software prefetch strategy
// (docs/performance.md, "Method"): every line prefetched some blocks ahead, as the
// kernels do, against only a block's first lines (for the L2 streamer to fetch the rest),
// none, and variants. Nothing but the loads and one add per line (and optional register
// arithmetic): the memory side of a paged decode. Portable C++ (GCC vector extensions), so
// bench/cpu_perf/isa_matrix.py builds it on any x86-64 or Arm CPU.
//
//   g++ -O3 -march=native -fopenmp bench/microbench/paged_read.cpp -o /tmp/paged_read
//   /tmp/paged_read [threads=2] [huge_pages=1] [order=0] [work=0] [block_kib=4]
//   /tmp/paged_read ceiling KIB...
//
// order 0 reads a block's lines in address order (as a value row packing does); order 1 in
// the order 16 rows of 256 B are read by column (as an AMX tile load of a bf16 key block
// does: lines 0, 4, 8, ... then 1, 5, ...), 4 KiB at a time. Each variant runs 5 rounds,
// each paired with a sequential read of 512 MiB; it prints the best rate and the median of
// the per-round ratios.
// block_kib: the bytes read in a row at each place (4: one KV head's rows of a 16-token bf16
// block; 32: the 8 KV heads of such a block, which a decode item reads one after another).
// work: multiply-adds on registers after each line (none on the loaded data; eight chains,
// whole rounds of eight), the arithmetic a kernel does between its loads (bf16 GQA decode
// in L2 takes about 8 cycles a line on the Xeon with AMX, some 16 multiply-adds' worth).
// ceiling: for each block size, two threads on huge pages, lines in address order, no
// work: the best median ratio of the strategies a kernel could use (none, every line one or
// two blocks ahead, a block's first lines two ahead), one line per size:
//   "ceiling 32 KiB: 80.9% of the read (26.40 GB/s, read 32.46 GB/s)"
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

typedef float Line __attribute__((vector_size(64)));

constexpr size_t kPoolBytes = size_t(2) << 30;
constexpr size_t kReadBytes = size_t(512) << 20;
size_t g_block = 4096, g_lines = g_block / 64;  // a block's bytes and lines
size_t g_blocks = kPoolBytes / g_block;
char* g_pool;
std::vector<uint32_t> g_order;  // the blocks in a random order
bool g_by_column = false;
int g_work = 0;  // multiply-adds after each line

enum class Prefetch { kNone, kEveryLine, kEveryLineT0, kFirstLines, kBurst, kOddLines };

struct Variant {
  const char* name;
  Prefetch mode;
  int distance;     // blocks ahead
  int first_lines;  // kFirstLines: how many
  bool ceiling;     // a strategy the ceiling mode tries (one a kernel could use)
};

const Variant kVariants[] = {
    {"none", Prefetch::kNone, 1, 0, true},
    {"every line, 1 ahead", Prefetch::kEveryLine, 1, 0, true},
    {"every line, 2 ahead", Prefetch::kEveryLine, 2, 0, true},
    {"every line, 4 ahead", Prefetch::kEveryLine, 4, 0, false},
    {"every line T0, 1 ahead", Prefetch::kEveryLineT0, 1, 0, false},
    {"first 2 lines, 2 ahead", Prefetch::kFirstLines, 2, 2, false},
    {"first 4 lines, 2 ahead", Prefetch::kFirstLines, 2, 4, true},
    {"first 8 lines, 2 ahead", Prefetch::kFirstLines, 2, 8, false},
    {"first 4 lines, 4 ahead", Prefetch::kFirstLines, 4, 4, false},
    {"first 32 lines, 2 ahead", Prefetch::kFirstLines, 2, 32, false},
    {"burst of every line, 2 ahead", Prefetch::kBurst, 2, 0, false},
    {"odd lines, 2 ahead", Prefetch::kOddLines, 2, 0, false},
};

// Into L2 (prefetcht1 on x86), as the kernels' prefetch(); T0: into L1.
inline void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }
inline void prefetch_l1(const char* p) { __builtin_prefetch(p, 0, 3); }

float lane_sum(Line x) {
  float s = 0;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}

// Blocks [begin, end) of the order; line l of each block read as line `line(l)`, with the
// block `distance` ahead prefetched as `v` says (kEveryLine: one line per line read).
float read_blocks(const Variant& v, size_t begin, size_t end) {
  Line sum = {};
  Line c0 = sum, c1 = sum, c2 = sum, c3 = sum, c4 = sum, c5 = sum, c6 = sum, c7 = sum;
  const Line factor = sum + 0.999f, addend = sum + 1e-3f;
  for (size_t i = begin; i < end; ++i) {
    const char* block = g_pool + size_t(g_order[i]) * g_block;
    const char* ahead = g_pool + size_t(g_order[std::min(i + v.distance, end - 1)]) * g_block;
    if (v.mode == Prefetch::kFirstLines)
      for (int l = 0; l < v.first_lines; ++l) prefetch_l2(ahead + 64 * l);
    if (v.mode == Prefetch::kBurst)
      for (size_t l = 0; l < g_lines; ++l) prefetch_l2(ahead + 64 * l);
#pragma GCC unroll 8
    for (size_t l = 0; l < g_lines; ++l) {
      if (v.mode == Prefetch::kEveryLine) prefetch_l2(ahead + 64 * l);
      if (v.mode == Prefetch::kEveryLineT0) prefetch_l1(ahead + 64 * l);
      if (v.mode == Prefetch::kOddLines && (l & 1)) prefetch_l2(ahead + 64 * l);
      const size_t line = g_by_column ? l / 64 * 64 + (l % 16) * 4 + l % 64 / 16 : l;
      sum += *reinterpret_cast<const Line*>(block + 64 * line);
      for (int w = 0; w < g_work; w += 8) {  // eight chains: the multiply-adds' latency covered
        c0 = c0 * factor + addend, c1 = c1 * factor + addend, c2 = c2 * factor + addend;
        c3 = c3 * factor + addend, c4 = c4 * factor + addend, c5 = c5 * factor + addend;
        c6 = c6 * factor + addend, c7 = c7 * factor + addend;
      }
    }
  }
  return lane_sum(sum + c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// GB/s of kReadBytes of blocks in the random order, split between the threads; each call
// starts further along the order, so the blocks come from DRAM, not the L3.
double paged_rate(int threads, const Variant& v) {
  static size_t start = 0;
  const size_t blocks = kReadBytes / g_block;
  start = (start + blocks) % (g_blocks - blocks);
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
    Line sum = {};
    for (; p < end; p += 64) sum += *reinterpret_cast<const Line*>(p);
    sink += lane_sum(sum);
  }
  const double s = seconds_since(t0);
  if (sink == 1.5f) std::puts("");
  return kReadBytes / s / 1e9;
}

void set_block_kib(size_t kib) {
  g_block = kib << 10;
  g_lines = g_block / 64;
  g_blocks = kPoolBytes / g_block;
  g_order.resize(g_blocks);
  for (size_t i = 0; i < g_blocks; ++i) g_order[i] = uint32_t(i);
  std::shuffle(g_order.begin(), g_order.end(), std::mt19937(1));
}

struct Measured {
  double ratio, best, read_best;  // median of the rounds' paged / sequential, best rates
};

Measured measure(int threads, const Variant& v) {
  double best = 0, read_best = 0;
  std::vector<double> ratios;
  for (int round = 0; round < 5; ++round) {
    const double read = sequential_rate(threads), paged = paged_rate(threads, v);
    ratios.push_back(paged / read);
    best = std::max(best, paged);
    read_best = std::max(read_best, read);
  }
  std::sort(ratios.begin(), ratios.end());
  return {ratios[2], best, read_best};
}

void allocate_pool(bool huge) {
  g_pool = static_cast<char*>(std::aligned_alloc(size_t(2) << 20, kPoolBytes));
  madvise(g_pool, kPoolBytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::memset(g_pool, 0, kPoolBytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "ceiling") {
    allocate_pool(true);
    for (int i = 2; i < argc; ++i) {
      set_block_kib(size_t(std::atoi(argv[i])));
      Measured top{0, 0, 0};
      for (const Variant& v : kVariants) {
        if (!v.ceiling) continue;
        const Measured m = measure(2, v);
        if (m.ratio > top.ratio) top = m;
      }
      std::printf("ceiling %s KiB: %.1f%% of the read (%.2f GB/s, read %.2f GB/s)\n", argv[i], 100 * top.ratio,
                  top.best, top.read_best);
      std::fflush(stdout);
    }
    return 0;
  }
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const bool huge = argc > 2 ? std::atoi(argv[2]) != 0 : true;
  g_by_column = argc > 3 && std::atoi(argv[3]) != 0;
  g_work = argc > 4 ? std::atoi(argv[4]) : 0;
  allocate_pool(huge);
  set_block_kib(size_t(argc > 5 ? std::atoi(argv[5]) : 4));
  std::printf("%d thread(s), %s pages, %zu KiB blocks, lines read %s, %d multiply-adds a line\n", threads,
              huge ? "huge" : "4 KiB", g_block >> 10, g_by_column ? "by column (tile-load order)" : "in address order",
              g_work);
  for (const Variant& v : kVariants) {
    const Measured m = measure(threads, v);
    std::printf("%-30s %6.2f GB/s (read %6.2f)  %5.1f%% of the read\n", v.name, m.best, m.read_best, 100 * m.ratio);
  }
}
