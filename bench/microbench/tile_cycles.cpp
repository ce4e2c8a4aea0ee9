// The AVX512_BF16 kernel's register tiles alone, against the vdpbf16ps they contain (docs/
// performance.md, sessions 23-24): one chunk of 32 L1-resident keys of one KV head and its
// four queries (32/8 heads, head size 128), scores by dot_tile<4, 4> (and, for e4m3, by
// the kernel's quad_tile) and values by accumulate_pairs<4>, bf16 and e4m3 rows; each does
// 512 vdpbf16ps, timed against a loop of 512 independent vdpbf16ps (16 accumulators) in
// the same process. The gap is what the tiles add beside their dot products (folds,
// conversions, latency), before the kernel's softmax, table walk and prefetches.
//   g++ -std=c++20 -O3 -fwrapv -march=native -DPAGED_VEC_WIDTH=16 -DPAGED_ISA_AVX512=1 \
//       -DPAGED_ISA_F16C=1 -DPAGED_ISA_AVX512_VBMI=1 -DPAGED_ISA_AVX512_BF16=1 -DPAGED_ISA_AMX=0 \
//       -I csrc/cpu -I csrc bench/microbench/tile_cycles.cpp -o /tmp/tile_cycles && /tmp/tile_cycles
#include <immintrin.h>
#include <x86intrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "attention_params.h"
namespace paged::cpu::tiles {
#include "vec.h"
#include "convert.h"
#include "vec_exp.h"
#include "prefetch.h"
#include "single_query.h"
#include "register_tiles.h"
#include "fp8_tiles.h"
#include "bf16_tiles.h"
}  // namespace paged::cpu::tiles

namespace {
using namespace paged::cpu::tiles;
using paged::cpu::kKeyChunk;

constexpr int kKeys = 32, kHead = 128, kQueries = 4;
alignas(64) uint16_t bf16_rows[kKeys][kHead];
alignas(64) uint8_t e4m3_rows[kKeys][kHead];
alignas(64) uint16_t queries[kQueries][kHead];
alignas(64) uint16_t quad_queries[kQueries][4 * kHead];
alignas(64) float scores[kQueries * kKeyChunk];
alignas(64) float acc[kQueries * kHead];
alignas(64) uint32_t pairs[kQueries * kKeyChunk / 2];

enum Kind { kStream, kBf16Scores, kBf16Values, kE4m3Scores, kE4m3QuadScores, kE4m3Values };

template <Kind kKind>
__attribute__((noinline)) double ticks_per_chunk(long iters) {
  const Bf16* bf16[kKeys];
  const Fp8E4M3* e4m3[kKeys];
  for (int i = 0; i < kKeys; ++i) {
    bf16[i] = reinterpret_cast<const Bf16*>(bf16_rows[i]);
    e4m3[i] = reinterpret_cast<const Fp8E4M3*>(e4m3_rows[i]);
  }
  __m512 stream[16];
  for (auto& s : stream) s = _mm512_setzero_ps();
  const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
  const uint64_t start = __rdtsc();
  for (long it = 0; it < iters; ++it) {
    // Opaque per iteration, so the queries are loaded in the tiles (as in the kernel, where
    // they differ per item) rather than hoisted into registers.
    const uint16_t* q = &queries[0][0];
    asm volatile("" : "+r"(q)::"memory");
    if constexpr (kKind == kStream) {
      for (int r = 0; r < 512 / 16; ++r)
        for (auto& s : stream) s = _mm512_dpbf16_ps(s, one, one);
      for (auto& s : stream) asm volatile("" : "+v"(s));
    }
    if constexpr (kKind == kBf16Scores)
      for (int t = 0; t < kKeys; t += 4)
        dot_tile<4, 4>(q, kHead, bf16 + t, scores + t, static_cast<const Bf16* const*>(nullptr));
    if constexpr (kKind == kE4m3Scores)
      for (int t = 0; t < kKeys; t += 4)
        dot_tile<4, 4>(q, kHead, e4m3 + t, scores + t, static_cast<const Fp8E4M3* const*>(nullptr));
    if constexpr (kKind == kE4m3QuadScores) {
      const uint16_t* qq = &quad_queries[0][0];
      asm volatile("" : "+r"(qq)::"memory");
      for (int t = 0; t < kKeys; t += kQuadKeys)
        quad_tile(qq, kHead, e4m3 + t, scores + t, static_cast<const Fp8E4M3* const*>(nullptr));
    }
    if constexpr (kKind == kBf16Values)
      accumulate_pairs<4>(acc, kHead, pairs, bf16, kKeys, static_cast<const Bf16* const*>(nullptr));
    if constexpr (kKind == kE4m3Values)
      accumulate_pairs<4>(acc, kHead, pairs, e4m3, kKeys, static_cast<const Fp8E4M3* const*>(nullptr));
  }
  const double ticks = double(__rdtsc() - start) / iters;
  float sink = 0;
  for (auto& s : stream) sink += _mm512_reduce_add_ps(s);
  if (sink == 1.5f) std::printf(" ");
  return ticks;
}
}  // namespace

int main() {
  for (int i = 0; i < kKeys; ++i)
    for (int d = 0; d < kHead; ++d) {
      bf16_rows[i][d] = uint16_t(0x3f80 + (i * d) % 7);
      e4m3_rows[i][d] = uint8_t(0x30 + (i * d) % 7);
    }
  for (int g = 0; g < kQueries; ++g)
    for (int d = 0; d < kHead; ++d) queries[g][d] = uint16_t(0x3e80 + (g * d) % 5);
  for (int g = 0; g < kQueries; ++g) quad_query_order(queries[g], kHead, quad_queries[g]);
  for (auto& p : pairs) p = 0x3f803f80u;
  const long n = 1000000;
  const double stream = ticks_per_chunk<kStream>(n);
  std::printf("512 independent vdpbf16ps: %.1f TSC ticks\n", stream);
  auto report = [&](const char* name, double ticks) {
    std::printf("%-36s %.1f TSC ticks, %.2fx the vdpbf16ps alone\n", name, ticks, ticks / stream);
  };
  report("bf16 score tiles (8 x dot_tile<4, 4>)", ticks_per_chunk<kBf16Scores>(n));
  report("bf16 value pairs (accumulate_pairs<4>)", ticks_per_chunk<kBf16Values>(n));
  report("e4m3 score tiles (8 x dot_tile<4, 4>)", ticks_per_chunk<kE4m3Scores>(n));
  report("e4m3 score tiles (2 x quad_tile)", ticks_per_chunk<kE4m3QuadScores>(n));
  report("e4m3 value pairs (accumulate_pairs<4>)", ticks_per_chunk<kE4m3Values>(n));
}
