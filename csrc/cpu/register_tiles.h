// Scores and weighted value sums of a tile of G queries against rows of R, in G x K
// register accumulators. Part of the CPU kernel, inside its ISA namespace (see vec.h).
#pragma once

#include "convert.h"
#include "prefetch.h"

// Register tiles: the queries of a tile share every loaded (and widened) key or value
// vector. A score tile holds G x VW/G accumulators (VW/G keys), a value tile as many
// (VW/G vectors of the row). AVX-512's 32 registers take 4 x 4. The 16 of AVX2 take
// 2 x 4, or 4 x 2 for fp8 rows: their widening costs more than their multiply-adds,
// so a tile covering a whole group of 4 queries (32/8 heads) widens each row once, not
// twice (measured faster for e4m3 and e5m2; fp32 and fp16 rows measured slower in 4 x 2
// tiles). So do split bf16 rows (AVX2, convert.h): read two
// vectors per key a step, a 2 x 4 tile would need 8 key registers beside 8 accumulators.
// Two queries left over then take a 2 x 4 tile. The baseline's 4-lane vectors take 2 x 2
// (a score tile sums to one vector, value tiles load pairs); 4 x 1 score tiles measured
// no faster there (four accumulators wait on the add latency).
template <typename R>
constexpr int kTileQueries = VW == 4 ? 2 : VW == 16 || sizeof(R) == 1 || kSplitRows<R> ? 4 : 2;

#if PAGED_VEC_WIDTH == 16
// Lanes l of x without bit S and of y with it, each plus its partner lane l ^ S of the
// same vector (see hsum_tile).
template <int S>
__attribute__((always_inline)) static inline vfloat fold_lanes(vfloat x, vfloat y) {
  // The blend as vblendmps (a shufflevector of it became a second shuffle).
  constexpr __mmask16 y_lanes = S == 8 ? 0xff00 : S == 4 ? 0xf0f0 : S == 2 ? 0xcccc : 0xaaaa;
  const vfloat kept = (vfloat)_mm512_mask_blend_ps(y_lanes, (__m512)x, (__m512)y);
#define PAGED_FOLD_PARTNER(l) (((l) & S) ? 16 + ((l) ^ S) : ((l) ^ S))
  return kept + __builtin_shufflevector(x, y, PAGED_FOLD_PARTNER(0), PAGED_FOLD_PARTNER(1),
                                        PAGED_FOLD_PARTNER(2), PAGED_FOLD_PARTNER(3), PAGED_FOLD_PARTNER(4),
                                        PAGED_FOLD_PARTNER(5), PAGED_FOLD_PARTNER(6), PAGED_FOLD_PARTNER(7),
                                        PAGED_FOLD_PARTNER(8), PAGED_FOLD_PARTNER(9), PAGED_FOLD_PARTNER(10),
                                        PAGED_FOLD_PARTNER(11), PAGED_FOLD_PARTNER(12), PAGED_FOLD_PARTNER(13),
                                        PAGED_FOLD_PARTNER(14), PAGED_FOLD_PARTNER(15));
#undef PAGED_FOLD_PARTNER
}
#endif

// The G x K accumulators of a score tile summed to G x K scores by one transpose tree
// (each level halves the lanes per accumulator and packs two vectors into one): cheaper
// than separate four-way sums. G x K is one vector of sums; scores land in
// s[g * kKeyChunk + i].
template <int G, int K>
__attribute__((always_inline)) static inline void hsum_tile(const vfloat (&acc)[G][K], float* s) {
  static_assert(G * K == VW, "a tile sums to one vector");
  auto flat = [&](int f) { return acc[f / K][f % K]; };
#if PAGED_VEC_WIDTH == 16
  // Each level folds pairs (x, y) at lane stride S: a blend keeps x's lanes without bit S
  // and y's with it, one permute brings each lane its partner (l ^ S) from the same
  // vector, so a level costs one shuffle per add instead of two. Strides 8 and 2 first
  // (8 and 4 folds; vshuff32x4 and vshufps), then 4 and 1 (vpermt2ps). Folding
  // accumulators f and f + S at stride S leaves score f in lane f.
  vfloat l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = fold_lanes<8>(flat(i), flat(i + 8));
  for (int i = 0; i < 4; ++i) l2[i] = fold_lanes<2>(l1[i / 2 * 4 + i % 2], l1[i / 2 * 4 + i % 2 + 2]);
  for (int i = 0; i < 2; ++i) l3[i] = fold_lanes<4>(l2[i], l2[i + 2]);
  const vfloat r = fold_lanes<1>(l3[0], l3[1]);
#elif PAGED_VEC_WIDTH == 4
  const vfloat ab = __builtin_shufflevector(flat(0), flat(1), 0, 4, 1, 5) +
                    __builtin_shufflevector(flat(0), flat(1), 2, 6, 3, 7);
  const vfloat cd = __builtin_shufflevector(flat(2), flat(3), 0, 4, 1, 5) +
                    __builtin_shufflevector(flat(2), flat(3), 2, 6, 3, 7);
  const vfloat r = __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
#else
  // 8 lanes: the first two levels within 128-bit halves (unpck{l,h}ps, unpck{l,h}pd), the
  // halves joined once at the end; halving the lanes across the halves first cost a
  // lane-crossing vpermd per vector at the second level.
  vfloat l1[4], l2[2];
  for (int i = 0; i < 4; ++i) {
    const vfloat a = flat(2 * i), b = flat(2 * i + 1);
    l1[i] = __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13) +
            __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const vfloat a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
            __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  const vfloat r = __builtin_shufflevector(l2[0], l2[1], 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(l2[0], l2[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
  for (int g = 0; g < G; ++g)
    std::memcpy(s + g * kKeyChunk, reinterpret_cast<const float*>(&r) + K * g, sizeof(float) * K);
}

// Scores of G queries (rows of q, hsp apart) with K keys: G x K register accumulators,
// so every loaded key vector serves G queries and every query vector K keys.
// Forced inline, as is hsum_tile: GCC kept these tiles out of line, a call per 4 keys.
template <int G, int K, typename R>
__attribute__((always_inline)) static inline void dot_tile(const float* q, int hsp, const R* const* k,
                                                           float* s, const R* const* ahead) {
  vfloat acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < K; ++i) acc[g][i] = vfloat{};
  int d = 0;
  if constexpr (sizeof(R) == 1 || kSplitRows<R>) {  // fp8 and split rows: two vectors a step
    for (; d + 2 * VW <= hsp; d += 2 * VW) {
      for (int i = 0; i < K; ++i) prefetch_same_line(ahead, i, d);
      vfloat lo[K], hi[K];
      for (int i = 0; i < K; ++i) load2_as_float(k[i] + d, lo[i], hi[i]);
      for (int g = 0; g < G; ++g) {
        const vfloat q0 = load(q + int64_t(g) * hsp + d), q1 = load(q + int64_t(g) * hsp + d + VW);
        for (int i = 0; i < K; ++i) acc[g][i] += q0 * lo[i];
        for (int i = 0; i < K; ++i) acc[g][i] += q1 * hi[i];
      }
    }
  }
  if constexpr (!kSplitRows<R>) for (; d < hsp; d += VW) {
    for (int i = 0; i < K; ++i) prefetch_same_line(ahead, i, d);
    vfloat kv[K];
    for (int i = 0; i < K; ++i) kv[i] = load_as_float(k[i] + d);
    for (int g = 0; g < G; ++g) {
      const vfloat qv = load(q + int64_t(g) * hsp + d);
      for (int i = 0; i < K; ++i) acc[g][i] += qv * kv[i];
    }
  }
  hsum_tile<G, K>(acc, s);
}

// acc[g] += sum_t p[g][t] * v[t] for G queries: G x V register accumulators per step,
// so every loaded value vector serves G queries.
template <int G, int V, typename R>
static inline void accumulate_tile(float* acc, int hsp, const float* p, const R* const* v, int n,
                                   const R* const* ahead) {
  static_assert(V % 2 == 0, "value vectors are loaded in pairs");
  int d = 0;
  for (; d + V * VW <= hsp; d += V * VW) {
    vfloat a[G][V];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) a[g][i] = load(acc + int64_t(g) * hsp + d + i * VW);
    // One key's step. Its probabilities are read at constant offsets from p + t (an int
    // index g * kKeyChunk + t costs a sign extension per load under -fwrapv).
    auto step = [&](int t) __attribute__((always_inline)) {
      const R* vr = v[t] + d;
      const float* pt = p + t;
      vfloat x[V];
      for (int i = 0; i < V; i += 2) load2_as_float(vr + i * VW, x[i], x[i + 1]);
      for (int g = 0; g < G; ++g) {
        const vfloat pg = splat(pt[g * kKeyChunk]);
        for (int i = 0; i < V; ++i) a[g][i] += pg * x[i];
      }
    };
    // Whether this step starts a cache line of the rows is known before the key loop: the
    // loop is written twice rather than testing it per key.
    if (ahead && d * int(sizeof(R)) % 64 == 0) {
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < V; ++i) prefetch_same_line(ahead, t, d + i * VW);
        step(t);
      }
    } else {
      for (int t = 0; t < n; ++t) step(t);
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) store(acc + int64_t(g) * hsp + d + i * VW, a[g][i]);
  }
  if constexpr (!kSplitRows<R>) for (; d < hsp; d += VW) {
    vfloat a[G];
    for (int g = 0; g < G; ++g) a[g] = load(acc + int64_t(g) * hsp + d);
    for (int t = 0; t < n; ++t) {
      prefetch_same_line(ahead, t, d);
      const vfloat vt = load_as_float(v[t] + d);
      for (int g = 0; g < G; ++g) a[g] += splat(p[g * kKeyChunk + t]) * vt;
    }
    for (int g = 0; g < G; ++g) store(acc + int64_t(g) * hsp + d, a[g]);
  }
}
