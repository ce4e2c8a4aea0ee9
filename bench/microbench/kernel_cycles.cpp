// Cycles per 32 keys of the CPU kernel's decode work item, cache-resident, on one core:
// the arithmetic cost of a kernel change measured in seconds of build time instead of a
// full extension build (docs/performance.md, "Running it").
//
//   [BASELINE=DIR] bash bench/microbench/kernel_cycles.sh [SOURCE_DIR] [-DFLAG ...]
//
// The script compiles SOURCE_DIR's csrc/cpu/isa_$ISA.cpp (ISA=avx512_bf16 by default;
// generic, avx2, avx512 for the other kernels) with setup.py's flags plus any -D flags
// given into a shared library (kernel_entry.cpp exports its entry point), and this file
// runs it on decode items of B=1, 32 query heads, head size 128, context 2048 (CONTEXT), block
// size 16, for fp32 / fp16 / bf16 (and, in trees that have them, fp8 e4m3 / e5m2 and
// per-token int8 with a bf16 query) with 32 and 8 KV heads; MODIFIER=alibi, window or
// soft-cap adds ALiBi slopes, a sliding window of 1000 keys or a soft cap of 50. The block
// table cycles over `resident` bytes of K (and as many of V): 128 KiB each by default,
// inside the L2 of every CPU so far (Zen 3 512 KiB, Zen 4 1 MiB, the Xeon 2 MiB; 512 KiB
// each would leave Zen 4's fp32 MHA rows partly in L3: 1.36x slower than at 128 KiB).
// A `resident` of more blocks than a sequence has (e.g. 256 MiB, far beyond the L3) gives
// every call fresh blocks in a random order instead: decode from DRAM on one core.
// Numbers are best-of-five in thread CPU time. With BASELINE, that tree's kernel is a
// second library in the same process and the two run in alternating rounds (order
// flipped each round), reported as the median of the per-round time ratios: on a shared
// machine whose speed moves tens of percent between seconds, trees timed one after the
// other compared the host's states, not the kernels. Both trees must share
// attention_params.h (this file is compiled against SOURCE_DIR's). It calls that ISA's
// kernel directly: the CPU must support the ISA.
#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <ctime>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_params.h"  // from the measured tree (kernel_cycles.sh sets -I)

#ifndef KERNEL_ISA
#define KERNEL_ISA avx512_bf16
#endif
#ifndef KERNEL_CONTEXT
#define KERNEL_CONTEXT 2048  // the item's keys (kernel_cycles.sh: CONTEXT); a multiple of 32
#endif
#define KERNEL_NAME_TOKENS(isa) #isa
#define KERNEL_NAME(isa) KERNEL_NAME_TOKENS(isa)

namespace {

using paged::ScalarKind;
using namespace paged::cpu;

using EntryFn = AttentionKernelFn (*)(int kind);

// One tree's kernel library (kernel_entry.cpp), loaded with its symbols kept to itself so
// two trees' template instances never merge.
EntryFn load_entry(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "kernel_cycles: %s\n", dlerror());
    std::exit(1);
  }
  void* entry = dlsym(lib, "kernel_entry");
  if (!entry) {
    std::fprintf(stderr, "kernel_cycles: %s has no kernel_entry\n", path);
    std::exit(1);
  }
  return reinterpret_cast<EntryFn>(entry);
}

// This thread's CPU time: on a shared machine the wall clock also counts the time the
// thread waits for a core, which moved results by tens of percent between runs.
double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Core clock from a chain of dependent adds (one per cycle), so results are in cycles.
double core_ghz() {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    uint64_t x = 0;
    const long n = 200000000;
    const double t0 = thread_seconds();
    for (long i = 0; i < n; ++i) asm volatile("add $1, %0" : "+r"(x));
    const double s = thread_seconds() - t0;
    best = std::max(best, n / s / 1e9);
  }
  return best;
}

uint16_t to_bits(float x, ScalarKind kind) {
  if (kind == ScalarKind::kFloat16) return _cvtss_sh(x, 0);
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return uint16_t(b >> 16);  // bf16 (truncated: any value will do)
}

// N(0, 1) values as fp8 with scale 1 (rounded to nearest, ties away: any rounding will do).
uint8_t to_fp8(float x, ScalarKind kind) {
  const bool e4m3 = int(kind) == 3;
  const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const uint8_t sign = x < 0 ? 0x80 : 0;
  const float a = std::fabs(x);
  const float smallest_normal = std::ldexp(1.0f, 1 - bias);
  if (a < smallest_normal) {  // subnormal: multiples of 2^(1 - bias - mantissa_bits)
    const int m = int(std::lround(std::ldexp(a, bias - 1 + mantissa_bits)));
    return uint8_t(sign | m);  // m == 2^mantissa_bits is the smallest normal's encoding
  }
  int e = int(std::floor(std::log2(a)));
  int m = int(std::lround((std::ldexp(a, -e) - 1.0f) * (1 << mantissa_bits)));
  if (m == (1 << mantissa_bits)) m = 0, ++e;
  return uint8_t(sign | ((e + bias) << mantissa_bits) | m);  // |x| < 8 for N(0, 1): no overflow
}

size_t element_size(ScalarKind kind) {
  switch (int(kind)) {
    case 0: return 4;
    case 1: case 2: return 2;
    default: return 1;  // fp8, int8
  }
}

// N(0, 1) elements: up to 2^20 drawn, then repeated (pools larger than the L3 would take
// minutes to draw element by element).
std::vector<char> random_rows(size_t elements, ScalarKind kind, uint32_t seed) {
  const size_t esize = element_size(kind);
  std::vector<char> buf(elements * esize);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const size_t drawn = std::min<size_t>(elements, size_t(1) << 20);
  for (size_t i = 0; i < drawn; ++i) {
    const float x = normal(rng);
    if (kind == ScalarKind::kInt8) buf[i] = char(std::clamp(int(std::lround(x * 40.0f)), -127, 127));
    else if (esize == 1) buf[i] = char(to_fp8(x, kind));
    else if (esize == 4) std::memcpy(&buf[i * 4], &x, 4);
    else {
      const uint16_t h = to_bits(x, kind);
      std::memcpy(&buf[i * 2], &h, 2);
    }
  }
  for (size_t i = drawn; i < elements; ++i) std::memcpy(&buf[i * esize], &buf[(i % drawn) * esize], esize);
  return buf;
}

void measure(const char* name, ScalarKind kind, int kv_heads, size_t resident, double ghz,
             EntryFn entry, EntryFn baseline) {
  constexpr int kContext = KERNEL_CONTEXT, kBlock = 16, kHead = 128, kHeads = 32;
  constexpr int kWindow = 1000;        // MODIFIER=window: Mistral-like, not a multiple of the block
  constexpr float kSoftCap = 50.0f;    // MODIFIER=soft-cap: Gemma 2's
  const size_t esize = element_size(kind);
  // fp8 caches take a bf16 query (the model's dtype).
  const ScalarKind query_kind = esize == 1 ? ScalarKind::kBFloat16 : kind;
  const size_t block_elements = size_t(kv_heads) * kBlock * kHead;
  const int blocks = int(std::max<size_t>(1, resident / (block_elements * esize)));
  const std::vector<char> K = random_rows(block_elements * blocks, kind, 1);
  const std::vector<char> V = random_rows(block_elements * blocks, kind, 2);
  const std::vector<char> Q = random_rows(size_t(kHeads) * kHead, query_kind, 3);
  // Block tables: one cycling over the resident blocks when they are fewer than a
  // sequence's; otherwise every call takes the next of tables that share out all the blocks
  // in a random order, so a pool much larger than the L3 is read from DRAM (one core's
  // decode from memory, both trees in one process).
  constexpr int kTableBlocks = kContext / kBlock;
  const int num_tables = std::max(1, blocks / kTableBlocks);
  std::vector<int32_t> tables(size_t(num_tables) * kTableBlocks);
  if (num_tables == 1) {
    for (int i = 0; i < kTableBlocks; ++i) tables[i] = int32_t((i * 7) % blocks);
  } else {
    std::vector<int32_t> order(blocks);
    for (int i = 0; i < blocks; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(4));
    std::copy(order.begin(), order.begin() + tables.size(), tables.begin());
  }
  int next_table = 0;
  const int32_t length = kContext;
  std::vector<float> out(kHeads * kHead);

  AttentionParams P{};
  P.kind = kind;
  P.query = Q.data();
  P.query_token_stride = kHeads * kHead;
  P.query_head_stride = kHead;
  P.key_cache = K.data();
  P.value_cache = V.data();
  P.block_tables = tables.data();
  P.block_table_stride = kTableBlocks;
  P.seq_lens = &length;
  P.num_heads = kHeads;
  P.num_kv_heads = kv_heads;
  P.head_size = kHead;
  // Trees from before the value head size could differ from the key's have no head_size_v.
  [](auto& params) {
    if constexpr (requires { params.head_size_v; }) params.head_size_v = kHead;
  }(P);
  P.block_size = kBlock;
  // Trees with strided caches and fp8 scales: HND strides, per-layer scales of 1.
  const float one = 1.0f;
  [&](auto& params) {
    if constexpr (requires { params.k_block_stride; }) {
      params.query_kind = query_kind;
      params.k_block_stride = params.v_block_stride = int64_t(block_elements);
      params.k_head_stride = params.v_head_stride = int64_t(kBlock) * kHead;
      params.k_token_stride = params.v_token_stride = kHead;
      if (esize == 1 && kind != ScalarKind::kInt8) params.k_scale = params.v_scale = &one;
    }
  }(P);
  // int8 rows: a scale per (block, KV head, slot), as the cache's scale tensors lay them out.
  const std::vector<float> token_scales(size_t(blocks) * kv_heads * kBlock, 1.0f / 40.0f);
  [&](auto& params) {
    if constexpr (requires { params.k_token_scale; }) {
      params.k_token_scale = params.v_token_scale = token_scales.data();
      for (auto* s : {params.k_token_scale_strides, params.v_token_scale_strides}) {
        s[0] = int64_t(kv_heads) * kBlock;
        s[1] = kBlock;
        s[2] = 1;
      }
    }
  }(P);
  P.scale = 1.0f / std::sqrt(float(kHead));
  // MODIFIER (kernel_cycles.sh): the scores' options of the models that use them.
  const std::vector<float> slopes = [] {
    std::vector<float> s(kHeads);
    for (int h = 0; h < kHeads; ++h) s[h] = std::exp2(-8.0f * float(h + 1) / kHeads);  // ALiBi's geometric slopes
    return s;
  }();
  const std::string modifier = std::getenv("MODIFIER") ? std::getenv("MODIFIER") : "";
  if (modifier == "alibi") P.alibi_slopes = slopes.data();
  else if (modifier == "window") P.sliding_window = kWindow;
  else if (modifier == "soft-cap") P.soft_cap = kSoftCap;
  else if (!modifier.empty()) {
    std::fprintf(stderr, "MODIFIER must be alibi, window or soft-cap, not '%s'\n", modifier.c_str());
    std::exit(2);
  }
  P.out = out.data();
  P.out_token_stride = kHeads * kHead;
  P.out_head_stride = kHead;
  // One item per sequence holding every KV head (as attention_cpu.cpp plans decode rows).
  const int group = kHeads / kv_heads;
  const int item_heads = std::clamp(kMaxQueriesPerItem / group, 1, kv_heads);
  const WorkItem item{0, 0, item_heads, 0, 1, kContext - 1, 0, kContext, 0};
  // The workspace where run_items' std::vector<float> puts it: a vector this large is
  // mmap'd by glibc, its storage 16 bytes past a page (so past a cache line) boundary.
  std::vector<float> workspace_storage(kernel_workspace_floats(kHead, item_heads * group) + kCacheLineFloats);
  float* workspace = aligned_workspace(workspace_storage.data()) + 4;
  const AttentionKernelFn kernel = entry(int(kind));
  const AttentionKernelFn base_kernel = baseline ? baseline(int(kind)) : nullptr;
  auto time_item = [&](AttentionKernelFn fn) {
    const int reps = 40;
    const double t0 = thread_seconds();
    for (int i = 0; i < reps; ++i) {
      P.block_tables = tables.data() + int64_t(next_table) * kTableBlocks;
      next_table = (next_table + 1) % num_tables;
      fn(P, item, workspace);
    }
    return (thread_seconds() - t0) / reps;
  };
  const double bytes = 2.0 * kContext * item_heads * kHead * esize;
  const double chunks = double(kContext) / 32 * item_heads;
  if (!base_kernel) {
    double best = 1e30;
    for (int round = 0; round < 5; ++round) best = std::min(best, time_item(kernel));
    std::printf("%-4s 32/%-2d  %7.1f us/item  %6.1f GB/s per core  %5.0f cycles per 32 keys of a KV head"
                "  (check %.4f)\n",
                name, kv_heads, best * 1e6, bytes / best / 1e9, best * ghz * 1e9 / chunks, out[0]);
    return;
  }
  // Each tree's first output element (their difference is a wrong result, not noise).
  next_table = 0;
  time_item(kernel);
  const float check = out[0];
  next_table = 0;  // the same tables, so the same last one
  time_item(base_kernel);
  const float base_check = out[0];
  std::vector<double> ratios;
  double best = 1e30, base_best = 1e30;
  const char* rounds_env = std::getenv("ROUNDS");
  const int rounds = rounds_env ? std::max(1, std::atoi(rounds_env)) : 15;
  for (int round = 0; round < rounds; ++round) {
    double t, tb;
    if (round % 2) t = time_item(kernel), tb = time_item(base_kernel);
    else tb = time_item(base_kernel), t = time_item(kernel);
    ratios.push_back(tb / t);
    best = std::min(best, t);
    base_best = std::min(base_best, tb);
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("%-4s 32/%-2d  %5.0f vs baseline %5.0f cycles per 32 keys of a KV head (%.1f vs %.1f GB/s)"
              "  speedup %.3fx (rounds %.3f-%.3f)  check %.4f / %.4f\n",
              name, kv_heads, best * ghz * 1e9 / chunks, base_best * ghz * 1e9 / chunks,
              bytes / best / 1e9, bytes / base_best / 1e9,
              ratios[ratios.size() / 2], ratios.front(), ratios.back(), check, base_check);
}

}  // namespace

// kernel_cycles LIBRARY BASELINE_LIBRARY|- RESIDENT_BYTES [DTYPE [KV_HEADS]]
int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: kernel_cycles LIBRARY BASELINE_LIBRARY|- RESIDENT [DTYPE [KV_HEADS]]\n");
    return 2;
  }
  const EntryFn entry = load_entry(argv[1]);
  const EntryFn baseline = std::strcmp(argv[2], "-") != 0 ? load_entry(argv[2]) : nullptr;
  const size_t resident = size_t(std::atol(argv[3]));
  // Optional: one cache dtype and one KV head count (a single case to profile).
  const char* only_dtype = argc > 4 ? argv[4] : nullptr;
  const int only_kv_heads = argc > 5 ? std::atoi(argv[5]) : 0;
  const double ghz = core_ghz();
  std::printf("kernel %s, core clock %.2f GHz, %zu KiB of K and of V%s\n", KERNEL_NAME(KERNEL_ISA), ghz,
              resident >> 10, baseline ? ", against the baseline tree in alternating rounds" : "");
  const struct { const char* name; int kind; } kinds[] = {
      {"fp32", 0}, {"fp16", 1}, {"bf16", 2}, {"e4m3", 3}, {"e5m2", 4}, {"int8", 5}};
  for (const auto& k : kinds) {
    if (entry(k.kind) == nullptr || (baseline && baseline(k.kind) == nullptr)) continue;  // older tree
    if (only_dtype && std::strcmp(only_dtype, k.name) != 0) continue;
    for (const int kv_heads : {32, 8})
      if (only_kv_heads == 0 || kv_heads == only_kv_heads)
        measure(k.name, ScalarKind(k.kind), kv_heads, resident, ghz, entry, baseline);
  }
}
