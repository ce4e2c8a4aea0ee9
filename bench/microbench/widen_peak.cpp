// The decode kernel's arithmetic limit per cache dtype: its inner loop alone. Each step
// widens two vectors of cache elements to fp32 with the kernel's own loaders (convert.h,
// compiled for one instruction set) and multiply-adds each into G query accumulators: the
// work every K and V element of a decode costs, G = query heads per KV head (1 for 32/32,
// 4 for 32/8). Rows sit in L1 and there is nothing else in the loop (no softmax, no block
// table, no horizontal sums), so no kernel of that instruction set can take an element
// faster: where this limit is below the machine's read bandwidth, decode is arithmetic-bound
// and the limit, not the read, is its target (bench/cpu_perf/isa_matrix.py).
//
// With AVX512_VBMI fp8 rows are converted by table lookups (fp8_bf16_tables.h): a second
// loop for them ("e4m3_lookup", ...) takes a 64-element step as four fp32 vectors.
// On AVX512_BF16 the kernel reads bf16 and fp8 rows with vdpbf16ps instead (bf16_tiles.h:
// fp8 converted to bf16 by table lookups, fp8_bf16_tables.h): for those dtypes a second
// loop ("bf16_vdpbf16ps", ...) converts a 64-element step to two bf16 vectors and does G
// vdpbf16ps per vector, and the limit is the faster of the two loops. Per-token int8 rows
// take the same lookups (by magnitude, ByteLookup) on both: "int8_lookup", "int8_vdpbf16ps"
// (keys), and "int8_value_pairs" (values: two rows' bytes interleaved, then looked up, four
// vdpbf16ps per query against broadcast probability pairs, as accumulate_pairs; beside it
// "bf16_value_pairs"). A per-token int8 decode row (K and V of one token and KV head) costs
// at least head_size / keys + head_size / values: its arithmetic limit.
//
// Built with the -D macros of an isa_*.cpp and its target flags, e.g. for avx2:
//   g++ -O3 -fwrapv -std=c++20 -fopenmp -mavx2 -mfma -mf16c -DPAGED_VEC_WIDTH=8 \
//       -DPAGED_ISA_AVX512=0 -DPAGED_ISA_F16C=1 -I csrc/cpu bench/microbench/widen_peak.cpp
// Prints one line per dtype and G: elements per second on one thread and on two.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace widen {
#include "vec.h"
#include "convert.h"
#if PAGED_ISA_AVX512_VBMI
#include "fp8_bf16_tables.h"
#endif
}  // namespace widen

namespace {

using namespace widen;

// bf16 as the kernel reads it on this instruction set (split order where it has one).
using Bf16Rows = std::conditional_t<kHasSplitRows, Bf16Split, Bf16>;

constexpr int kRowBytes = 4096;  // L1-resident
// Independent accumulators covering the multiply-add latency (with the operands they fit
// 16 registers on every ISA).
constexpr int kChains = 8;

template <typename T>
void fill(std::vector<T>& rows) {
  // Normal values of either sign around 1 (no subnormal, inf or NaN): the baseline's fp16
  // and e5m2 widening takes a slow branch for those, as rare in real K and V as here.
  for (size_t i = 0; i < rows.size(); ++i) {
    uint32_t bits = uint32_t(i * 2654435761u) >> 7;
    if constexpr (std::is_same_v<T, Int8Row>) rows[i] = T{int8_t((bits & 0x8f) | 0x30)};
    else if constexpr (sizeof(T) == 1) rows[i] = T{uint8_t((bits & 0x8f) | 0x30)};
    else if constexpr (sizeof(T) == 2) rows[i] = T{uint16_t(0x3000 + (bits & 0x8fff))};
    else rows[i] = float(int(bits & 0xff) - 128) / 64.0f;
  }
}

// `passes` passes over the rows: widen 2 VW elements, G x 2 multiply-adds, repeated; with
// LOOKUP (fp8 rows as the kernel reads them with AVX512_VBMI, fp8_bf16_tables.h), each
// 64-element step looked up into four fp32 vectors, G multiply-adds per vector. Out of
// line, with the accumulators copied in and out: around the caller's clock calls (which
// clobber every vector register) GCC otherwise stored them to the stack on every step.
template <int G, int U, bool LOOKUP, typename T>
__attribute__((noinline)) void passes_over(const T* rows, int n, int passes, vfloat (&out)[U][G][2],
                                           const vfloat (&q)[G]) {
  constexpr int kStep = LOOKUP ? 64 : 2 * VW;
  vfloat acc[U][G][2];
  std::memcpy(acc, out, sizeof(acc));
  for (int pass = 0; pass < passes; ++pass) {
    const T* p = rows;
    asm volatile("" : "+r"(p));  // an unknown pointer each pass: the rows are loaded again
    for (int d = 0; d < n; d += kStep * U) {
      for (int u = 0; u < U; ++u) {
        vfloat x[4];
#if PAGED_ISA_AVX512_VBMI
        if constexpr (LOOKUP) fp8_to_float64(p + d + kStep * u, x);
        else
#endif
          load2_as_float(p + d + kStep * u, x[0], x[1]);
        for (int g = 0; g < G; ++g)
          for (int j = 0; j < (LOOKUP ? 4 : 2); ++j) acc[u][g][j % 2] += q[g] * x[j];
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// Passes per second over `seconds` of run256, which makes 256 passes a call.
template <typename Run>
double passes_per_second(double seconds, Run run256) {
  long passes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    run256();
    passes += 256;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return double(passes) / elapsed;
}

#if PAGED_ISA_AVX512_BF16
// 64 elements as two bf16 vectors (fp8 in fp8_to_bf16_lanes' order, as the kernel's tiles).
template <typename T>
__attribute__((always_inline)) inline void load_bf16x64(const T* p, __m512bh& a, __m512bh& b) {
  if constexpr (sizeof(T) == 1) {
    __m512i first, second;
    fp8_to_bf16_lanes<T>(_mm512_loadu_si512(p), first, second);
    a = (__m512bh)first;
    b = (__m512bh)second;
  } else {
    a = (__m512bh)_mm512_loadu_si512(p);
    b = (__m512bh)_mm512_loadu_si512(p + 32);
  }
}

// passes_over with vdpbf16ps: each 64-element step as two bf16 vectors, G pair dot
// products per vector.
template <int G, int U, typename T>
__attribute__((noinline)) void dot_passes_over(const T* rows, int n, int passes, __m512 (&out)[U][G][2],
                                               const __m512bh (&q)[G]) {
  __m512 acc[U][G][2];
  std::memcpy(acc, out, sizeof(acc));
  for (int pass = 0; pass < passes; ++pass) {
    const T* p = rows;
    asm volatile("" : "+r"(p));
    for (int d = 0; d < n; d += 64 * U) {
      for (int u = 0; u < U; ++u) {
        __m512bh a, b;
        load_bf16x64(p + d + 64 * u, a, b);
        for (int g = 0; g < G; ++g) {
          acc[u][g][0] = _mm512_dpbf16_ps(acc[u][g][0], q[g], a);
          acc[u][g][1] = _mm512_dpbf16_ps(acc[u][g][1], q[g], b);
        }
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// The value side: two rows' 64-element steps as the kernel pairs them (pair_words,
// bf16_tiles.h: bytes interleaved, then looked up; bf16 words interleaved), each of the four
// pair vectors dotted with G broadcast probability pairs. 128 elements a step.
template <int G, typename T>
__attribute__((noinline)) void pair_passes_over(const T* rows, int n, int passes, __m512 (&out)[G][4],
                                                const __m512bh (&p)[G]) {
  __m512 acc[G][4];
  std::memcpy(acc, out, sizeof(acc));
  for (int pass = 0; pass < passes; ++pass) {
    const T* r = rows;
    asm volatile("" : "+r"(r));
    for (int d = 0; d < n; d += 128) {
      __m512i ab[4];
      const __m512i xa = _mm512_loadu_si512(r + d), xb = _mm512_loadu_si512(r + d + 64);
      if constexpr (sizeof(T) == 1) {
        fp8_to_bf16_lanes<T>(_mm512_unpacklo_epi8(xa, xb), ab[0], ab[1]);
        fp8_to_bf16_lanes<T>(_mm512_unpackhi_epi8(xa, xb), ab[2], ab[3]);
      } else {  // rows a and b: 32 elements each of xa / xb, the next 32 at + 32 bytes
        const __m512i ya = _mm512_loadu_si512(r + d + 32), yb = _mm512_loadu_si512(r + d + 96);
        ab[0] = _mm512_unpacklo_epi16(xa, xb);
        ab[1] = _mm512_unpackhi_epi16(xa, xb);
        ab[2] = _mm512_unpacklo_epi16(ya, yb);
        ab[3] = _mm512_unpackhi_epi16(ya, yb);
      }
      for (int g = 0; g < G; ++g)
        for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_dpbf16_ps(acc[g][k], (__m512bh)ab[k], p[g]);
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

template <int G, typename T>
double pair_elements_per_second(double seconds) {
  constexpr int n = kRowBytes / sizeof(T);
  std::vector<T> rows(n);
  fill(rows);
  __m512 acc[G][4];
  __m512bh p[G];
  for (int g = 0; g < G; ++g) p[g] = (__m512bh)_mm512_set1_epi16(short(0x3e80 + g));
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_setzero_ps();
  const double passes = passes_per_second(seconds, [&] { pair_passes_over<G>(rows.data(), n, 256, acc, p); });
  float sink = 0;
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 4; ++k) sink += _mm512_reduce_add_ps(acc[g][k]);
  if (sink == 1234.5f) std::puts("");
  return passes * n;
}

template <int G, typename T>
double dot_elements_per_second(double seconds) {
  constexpr int n = kRowBytes / sizeof(T);
  constexpr int U = kChains / (2 * G) > 0 ? kChains / (2 * G) : 1;
  std::vector<T> rows(n);
  fill(rows);
  __m512 acc[U][G][2];
  __m512bh q[G];
  for (int g = 0; g < G; ++g) q[g] = (__m512bh)_mm512_set1_epi16(short(0x3e80 + g));  // ~0.25
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < G; ++g) acc[u][g][0] = acc[u][g][1] = _mm512_setzero_ps();
  const double passes = passes_per_second(seconds, [&] { dot_passes_over<G, U>(rows.data(), n, 256, acc, q); });
  float sink = 0;
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < G; ++g) sink += _mm512_reduce_add_ps(acc[u][g][0] + acc[u][g][1]);
  if (sink == 1234.5f) std::puts("");
  return passes * n;
}
#endif

// Elements per second of one thread over `seconds` (fp8 rows: by lookups when LOOKUP).
template <int G, typename T, bool LOOKUP = false>
double elements_per_second(double seconds) {
  constexpr int n = kRowBytes / sizeof(T);
  constexpr int U = kChains / (2 * G) > 0 ? kChains / (2 * G) : 1;  // steps unrolled
  std::vector<T> rows(n);
  fill(rows);
  vfloat acc[U][G][2];
  vfloat q[G];
  for (int g = 0; g < G; ++g) q[g] = splat(1.0f / float(g + 3));
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < G; ++g) acc[u][g][0] = acc[u][g][1] = vfloat{};
  const double passes = passes_per_second(seconds, [&] {
    passes_over<G, U, LOOKUP>(rows.data(), n, 256, acc, q);
  });
  float sink = 0;
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < G; ++g) sink += hsum(acc[u][g][0] + acc[u][g][1]);
  if (sink == 1234.5f) std::puts("");
  return passes * n;
}

// Best of three on one thread, and on two (each thread its own rows), summed.
template <typename Rate>
void report(const char* name, int group, Rate rate) {
  double one = 0, two = 0;
  for (int run = 0; run < 3; ++run) {
    one = std::max(one, rate(0.2));
    double sum = 0;
#pragma omp parallel num_threads(2) reduction(+ : sum)
    sum += rate(0.2);
    two = std::max(two, sum);
  }
  std::printf("%s G=%d: 1 thread %.3f G elements/s, 2 threads %.3f G elements/s\n", name, group,
              one / 1e9, two / 1e9);
}

template <int G>
void report_all() {
  report("fp32", G, elements_per_second<G, float>);
  report("bf16", G, elements_per_second<G, Bf16Rows>);
  report("fp16", G, elements_per_second<G, Fp16>);
  report("e4m3", G, elements_per_second<G, Fp8E4M3>);
  report("e5m2", G, elements_per_second<G, Fp8E5M2>);
  report("int8", G, elements_per_second<G, Int8Row>);
#if PAGED_ISA_AVX512_VBMI
  report("e4m3_lookup", G, elements_per_second<G, Fp8E4M3, true>);
  report("e5m2_lookup", G, elements_per_second<G, Fp8E5M2, true>);
  report("int8_lookup", G, elements_per_second<G, Int8Row, true>);
#endif
#if PAGED_ISA_AVX512_BF16
  report("bf16_vdpbf16ps", G, dot_elements_per_second<G, Bf16>);
  report("e4m3_vdpbf16ps", G, dot_elements_per_second<G, Fp8E4M3>);
  report("e5m2_vdpbf16ps", G, dot_elements_per_second<G, Fp8E5M2>);
  report("int8_vdpbf16ps", G, dot_elements_per_second<G, Int8Row>);
  report("bf16_value_pairs", G, pair_elements_per_second<G, Bf16>);
  report("int8_value_pairs", G, pair_elements_per_second<G, Int8Row>);
#endif
}

}  // namespace

int main() {
  report_all<1>();
  report_all<4>();
}
