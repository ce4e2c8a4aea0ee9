// The many-query kernel's ceiling (csrc/cpu/many_query_tiles.h): one chunk of 32 bf16 rows
// (MLA's latent rows: keys 576, values their first 512 columns; or head size 128) read by
// 16 to 128 queries over and over, rows and queries in L1/L2, no softmax, block table or
// output: the scores (the keys' transpose and the query tiles) and the weighted values (the
// value rows' interleave and the query tiles) alone, against the row driver's register
// tiles of 4 queries on the same chunk (chunk_scores with dot_tile, chunk_values_pairs).
// Reports multiply-adds per second of one thread (a key's row and a value's row per query)
// and its share of the vdpbf16ps peak (bf16_dot_peak.cpp); checks both kernels' scores and
// values against double sums first.
//
//   g++ -O3 -fwrapv -std=c++20 -Wno-psabi -march=native -DPAGED_VEC_WIDTH=16 -DPAGED_ISA_AVX512=1 \
//       -DPAGED_ISA_AVX512_VBMI=1 -DPAGED_ISA_AVX512_BF16=1 -DPAGED_ISA_F16C=1 -I csrc/cpu \
//       bench/microbench/many_query_tiles.cpp -o /tmp/mq && /tmp/mq
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_params.h"

namespace mq {
using namespace paged::cpu;
using namespace paged;
#include "vec.h"
#include "row_tiles.h"
}  // namespace mq

namespace {

using namespace mq;

uint16_t to_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

struct Case {
  int queries, hs, hsv, n;
};

struct Buffers {
  std::vector<uint16_t> rows;  // 32 rows of hs
  std::vector<uint16_t> q;     // queries x hs
  std::vector<float> scores, acc, run;
  std::vector<const Bf16*> k_rows;
  ItemState st;
};

Buffers make(const Case& c) {
  Buffers b;
  b.rows.resize(32 * c.hs);
  b.q.resize(size_t(c.queries) * c.hs);
  uint32_t seed = 12345;
  auto rnd = [&] {
    seed = seed * 1664525u + 1013904223u;
    return float(int(seed >> 9) % 2001 - 1000) / 1000.0f;
  };
  for (auto& x : b.rows) x = to_bf16(rnd());
  for (auto& x : b.q) x = to_bf16(rnd());
  b.scores.assign(size_t(c.queries) * kKeyChunk, 0.0f);
  b.acc.assign(size_t(c.queries) * c.hsv, 0.0f);
  b.run.assign(2 * c.queries, 0.0f);
  for (int t = 0; t < 32; ++t) b.k_rows.push_back(reinterpret_cast<const Bf16*>(b.rows.data()) + t * c.hs);
  b.st = ItemState{0, c.queries, c.queries, c.hs, c.hsv, nullptr, b.q.data(), nullptr, 1.0f,
                   b.acc.data(), b.scores.data(), b.run.data(), b.run.data() + c.queries};
  return b;
}

// Scores (kPhase 0 or 1), then values weighted by probabilities 1/32 (exact in bf16;
// kPhase 0 or 2), by one kernel.
template <bool kMany, int kPhase = 0>
void chunk(Buffers& b, const Case& c) {
  const ItemState& st = b.st;
  if constexpr (kPhase == 2) {
  } else if constexpr (kMany) many_query_scores(st.q_bits, st.num_queries, st.hsp, st.hsp, st.scale, st.scores, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  else chunk_scores(st, st.q_bits, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  for (int m = 0; m < c.queries; ++m)
    for (int t = 0; t < kKeyChunk; ++t) st.scores[m * kKeyChunk + t] = t < c.n ? 1.0f / 32 : 0.0f;
  if constexpr (kPhase == 1) {
  } else if constexpr (kMany) many_query_values(st.acc, st.num_queries, st.hspv, st.hspv, st.scores, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  else chunk_values_pairs(st, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
}

// The largest difference from double sums, relative to the largest magnitude.
template <bool kMany>
double check(const Case& c) {
  Buffers b = make(c);
  const float scale = 1.0f;
  b.st.scale = scale;
  const ItemState& st = b.st;
  if constexpr (kMany) many_query_scores(st.q_bits, st.num_queries, st.hsp, st.hsp, st.scale, st.scores, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  else chunk_scores(st, st.q_bits, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  double worst = 0, top = 1e-30;
  for (int m = 0; m < c.queries; ++m)
    for (int t = 0; t < c.n; ++t) {
      double want = 0;
      for (int d = 0; d < c.hs; ++d) want += double(from_bf16(b.q[m * c.hs + d])) * from_bf16(b.rows[t * c.hs + d]);
      worst = std::max(worst, std::abs(want - b.scores[m * kKeyChunk + t]));
      top = std::max(top, std::abs(want));
    }
  const double score_error = worst / top;
  // Values: probabilities of varied size, exact in bf16.
  for (int m = 0; m < c.queries; ++m)
    for (int t = 0; t < kKeyChunk; ++t) b.scores[m * kKeyChunk + t] = t < c.n ? from_bf16(to_bf16(float((m + 3 * t) % 7) / 8)) : 0.0f;
  if constexpr (kMany) many_query_values(st.acc, st.num_queries, st.hspv, st.hspv, st.scores, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  else chunk_values_pairs(st, b.k_rows.data(), c.n, static_cast<const Bf16* const*>(nullptr));
  std::vector<float> out(c.hsv);
  worst = 0;
  top = 1e-30;
  for (int m = 0; m < c.queries; ++m) {
    unpermute_pairs(b.acc.data() + m * c.hsv, out.data(), c.hsv, 1.0f);
    for (int d = 0; d < c.hsv; ++d) {
      double want = 0;
      for (int t = 0; t < c.n; ++t) want += double(b.scores[m * kKeyChunk + t]) * from_bf16(b.rows[t * c.hs + d]);
      worst = std::max(worst, std::abs(want - out[d]));
      top = std::max(top, std::abs(want));
    }
  }
  return std::max(score_error, worst / top);
}

// Multiply-adds per second of one kernel on one chunk (kPhase: its scores' or values'
// alone, 1 or 2), best of 5 runs.
template <bool kMany, int kPhase = 0>
double rate(const Case& c) {
  Buffers b = make(c);
  const int reps = std::max(20, int(4e8 / (double(c.queries) * 32 * (c.hs + c.hsv))));
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) chunk<kMany, kPhase>(b, c);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int row = kPhase == 0 ? c.hs + c.hsv : kPhase == 1 ? c.hs : c.hsv;
    best = std::max(best, double(reps) * c.queries * 32.0 * row / s);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  // The vdpbf16ps peak of one core (bf16_dot_peak.cpp, docs/performance.md).
  const double peak = argc > 1 ? std::atof(argv[1]) * 1e9 : 97e9;
  const Case checks[] = {{16, 576, 512, 32}, {19, 576, 512, 1}, {23, 576, 512, 17}, {128, 576, 512, 15},
                         {16, 128, 128, 32}, {21, 160, 96, 31}};
  for (const Case& c : checks) {
    const double e_many = check<true>(c), e_rows = check<false>(c);
    std::printf("check %3d queries %d/%d n=%2d: max error %.2e (row tiles %.2e)\n", c.queries, c.hs, c.hsv, c.n,
                e_many, e_rows);
    if (!(e_many < 2e-2)) return 1;
  }
  const Case cases[] = {{16, 576, 512, 32}, {64, 576, 512, 32}, {128, 576, 512, 32}, {16, 128, 128, 32},
                        {64, 128, 128, 32}};
  for (const Case& c : cases) {
    double many = 0, rows = 0;
    for (int round = 0; round < 3; ++round) {  // alternating, best of each
      many = std::max(many, rate<true>(c));
      rows = std::max(rows, rate<false>(c));
    }
    double scores = 0, values = 0;
    for (int round = 0; round < 3; ++round) {
      scores = std::max(scores, rate<true, 1>(c));
      values = std::max(values, rate<true, 2>(c));
    }
    std::printf("%3d queries, %d/%d: many-query %.1f GMAC/s (%.0f%% of peak; scores %.1f, values %.1f), "
                "4-query tiles %.1f GMAC/s (%.0f%%)\n",
                c.queries, c.hs, c.hsv, many / 1e9, 100 * many / peak, scores / 1e9, values / 1e9, rows / 1e9,
                100 * rows / peak);
  }
  return 0;
}
