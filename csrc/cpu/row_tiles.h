// The queries-in-rows micro-kernel of the attention driver (attention_kernel.h): a work
// item's queries in rows, each query's products with a chunk of keys in register tiles of
// several queries (register_tiles.h, single_query.h), per instruction set: fp32 FMAs on
// rows widened in registers everywhere; AVX512_VBMI: fp8 and int8 rows looked up exactly
// into fp32 (fp8_tiles.h); AVX512_BF16: vdpbf16ps on bf16 rows and on fp8 and int8 rows
// converted to bf16 (bf16_tiles.h).
// Part of the CPU kernel, inside its ISA namespace (see vec.h).
//
// RowTiles<T> declares its layout (kLayout: queries in rows, the driver's per-query
// softmax; kHeadsOuter false: spans outermost), chooses an item's paths once (by its dtype,
// head sizes and query dtype) and supplies what the driver does not own: a KV head's
// query rows in the order its tiles read (load_queries, order_query), a chunk's scores
// (scores), its probability-weighted values (values), the factors of the rows' units
// (key_unit, value_unit) and a finished accumulator row into output order (output_row).
// The chunk functions below also serve the driver's fp32 rows of ragged head sizes.
#pragma once

#include "bf16_tiles.h"
#include "convert.h"
#include "fp8_tiles.h"
#include "prefetch.h"
#include "query_rows.h"
#include "register_tiles.h"
#include "single_query.h"
#include "vec.h"

// The most keys a chunk of rows R takes (CH in the attention driver, attention_kernel.h):
// loops over a chunk's keys that run to this constant rather than to the chunk's n are
// unrolled. Per-token rows take chunks of 32, fp8 rows up to 64.
template <typename R>
constexpr int kMaxChunk = sizeof(R) == 1 && !kPerToken<R> ? 64 : 32;
static_assert(kKeyChunk >= kMaxChunk<uint8_t>, "the chunk capacity");

// Scores of G queries from query m on (a tile) with the chunk's n keys: K at a time, the
// last n % K one by one. `ahead` is prefetched by the tile of query 0 (see
// prefetch_same_line). Forced inline on the AVX kernels: out of line GCC kept the head size
// a run-time loop bound in the head-size-128 compile, which measured slower (fp8 and bf16;
// the baseline's compile, in turn, lost on fp16 MHA with it; see docs/performance.md).
template <int G, int K, typename Q, typename R>
PAGED_AVX_INLINE static inline void tile_scores(const ItemState& st, const Q* q, int m,
                                                const R* const* k_rows, int n,
                                                const R* const* ahead) {
  const int hsp = st.hsp;
  const Q* qm = q + int64_t(m) * hsp;
  float* s = st.scores + int64_t(m) * kKeyChunk;
  auto ahead_at = [&](int t) { return m == 0 && ahead ? ahead + t : nullptr; };
  const int full_keys = n / K * K;
  for (int t = 0; t < full_keys; t += K) dot_tile<G, K>(qm, hsp, k_rows + t, s + t, ahead_at(t));
  for (int g = 0; g < G; ++g)
    for (int t = full_keys; t < n; ++t)
      s[g * kKeyChunk + t] = dot1(qm + int64_t(g) * hsp, k_rows[t], hsp, g == 0 ? ahead_at(t) : nullptr);
}

#if PAGED_ISA_AVX512_BF16
// Scores of 4 queries from query m with the chunk's n fp8 keys by quad tiles; the last
// tile's missing rows repeat row n - 1 (their scores land past n, unused).
template <typename R>
PAGED_AVX_INLINE static inline void quad_scores(const ItemState& st, int m, const R* const* k_rows,
                                                int n, const R* const* ahead) {
  const uint16_t* qm = st.q_quad + int64_t(m) * 4 * st.hsp;
  float* s = st.scores + int64_t(m) * kKeyChunk;
  const R* const* tile_ahead = m == 0 ? ahead : nullptr;
  int t = 0;
  for (; t + kQuadKeys <= n; t += kQuadKeys)
    quad_tile(qm, st.hsp, k_rows + t, s + t, tile_ahead ? tile_ahead + t : nullptr);
  if (t < n) {
    const R* rows[kQuadKeys];
    for (int i = 0; i < kQuadKeys; ++i) rows[i] = k_rows[std::min(t + i, n - 1)];
    if (tile_ahead)
      for (int i = t; i < n; ++i) prefetch_same_line_row(tile_ahead, i, st.hsp);
    quad_tile(qm, st.hsp, rows, s + t, static_cast<const R* const*>(nullptr));
  }
}
#endif

// Scores of every query with the chunk's n keys: register tiles (kTileQueries; a pair
// tile for 2 left over where tiles hold 4 queries of 8 lanes), then single queries.
// Forced inline on the AVX-512 kernels: out of line it is one copy for every head size, so
// the head-size-128 compile runs its tiles with a run-time head size, measured slower. Not
// on AVX2: with 16 registers, inlining measured slower on GQA.
template <typename Q, typename R>
PAGED_AVX512_INLINE static inline void chunk_scores(const ItemState& st, const Q* q,
                                                 const R* const* k_rows, int n,
                                                 const R* const* ahead) {
  constexpr int G = kTileQueries<R>;
  const int hsp = st.hsp;
  int m = 0;
#if PAGED_ISA_AVX512_BF16
  if constexpr (sizeof(R) == 1 && std::is_same_v<Q, uint16_t>)
    for (; m + 4 <= st.num_queries; m += 4) quad_scores(st, m, k_rows, n, ahead);
#endif
  for (; m + G <= st.num_queries; m += G) tile_scores<G, VW / G>(st, q, m, k_rows, n, ahead);
  if constexpr (G == 4 && VW == 8)
    for (; m + 2 <= st.num_queries; m += 2) tile_scores<2, 4>(st, q, m, k_rows, n, ahead);
  for (; m < st.num_queries; ++m) {
    const Q* qm = q + int64_t(m) * hsp;
    float* s = st.scores + int64_t(m) * kKeyChunk;
    const R* const* row_ahead = m == 0 ? ahead : nullptr;
    int t = 0;
    for (; t + 4 <= n; t += 4) dot4(qm, k_rows + t, hsp, s + t, row_ahead ? row_ahead + t : nullptr);
    for (; t < n; ++t) s[t] = dot1(qm, k_rows[t], hsp, row_ahead ? row_ahead + t : nullptr);
  }
  if constexpr (std::is_same_v<Q, uint16_t>) {  // unscaled bf16 queries
    const vfloat scale = splat(st.scale);
    for (int i = 0; i < st.num_queries; ++i) {
      float* s = st.scores + int64_t(i) * kKeyChunk;
      for (int t = 0; t < kMaxChunk<R>; t += VW) store(s + t, load(s + t) * scale);  // keys >= n: unused
    }
  }
}

// Probability-weighted values of G queries from query m on (a tile).
template <int G, int V, typename R>
static inline void tile_values(const ItemState& st, int m, const R* const* v_rows, int n,
                               const R* const* ahead) {
  accumulate_tile<G, V>(st.acc + int64_t(m) * st.hspv, st.hspv, st.scores + int64_t(m) * kKeyChunk,
                        v_rows, n, m == 0 ? ahead : nullptr);
}

// Probability-weighted values of the chunk, in the register tiles of chunk_scores; `ahead`
// as there.
template <typename R>
static inline void chunk_values(const ItemState& st, const R* const* v_rows, int n,
                                const R* const* ahead) {
  constexpr int G = kTileQueries<R>;
  int m = 0;
  for (; m + G <= st.num_queries; m += G) tile_values<G, VW / G>(st, m, v_rows, n, ahead);
  if constexpr (G == 4 && VW == 8)
    for (; m + 2 <= st.num_queries; m += 2) tile_values<2, 4>(st, m, v_rows, n, ahead);
  for (; m < st.num_queries; ++m)
    accumulate_values(st.acc + int64_t(m) * st.hspv, st.scores + int64_t(m) * kKeyChunk, v_rows, n,
                      st.hspv, m == 0 ? ahead : nullptr);
}

#if PAGED_ISA_AVX512_BF16
// chunk_values for bf16 and fp8 rows with pair dot products (accumulators permuted). Forced
// inline: GCC kept it out of line, so the head-size-128 compile lost its constant trip
// counts here (measured slower, bf16 decode from L2).
template <typename R>
__attribute__((always_inline)) static inline void chunk_values_pairs(const ItemState& st,
                                                                     const R* const* v_rows, int n,
                                                                     const R* const* ahead) {
  constexpr int G = kTileQueries<R>;
  uint32_t pairs[G * kKeyChunk / 2];
  const int full_queries = st.num_queries / G * G;
  for (int m = 0; m < full_queries; m += G) {
    probability_pairs<G, kMaxChunk<R>>(st.scores + int64_t(m) * kKeyChunk, pairs);
    accumulate_pairs<G>(st.acc + int64_t(m) * st.hspv, st.hspv, pairs, v_rows, n,
                         m == 0 ? ahead : nullptr);
  }
  for (int m = full_queries; m < st.num_queries; ++m) {
    probability_pairs<1, kMaxChunk<R>>(st.scores + int64_t(m) * kKeyChunk, pairs);
    accumulate_pairs<1>(st.acc + int64_t(m) * st.hspv, st.hspv, pairs, v_rows, n,
                        m == 0 ? ahead : nullptr);
  }
}
#endif  // PAGED_ISA_AVX512_BF16

#if PAGED_ISA_AVX512_VBMI
// chunk_values for fp8 rows of whole 64-element steps converted by lookups, accumulators
// permuted: with probabilities rounded to bf16 pairs (`pairs`, AVX512_BF16 only:
// chunk_values_pairs, the fp8 pair order) or in fp32 (fp8_value_slot).
template <typename T>
static inline void chunk_values_fp8(const ItemState& st, const T* const* v_rows, int n,
                                    const T* const* ahead, bool pairs) {
#if PAGED_ISA_AVX512_BF16
  if (pairs) {
    chunk_values_pairs(st, v_rows, n, ahead);
    return;
  }
#endif
  constexpr int G = kTileQueries<T>;
  const int full_queries = st.num_queries / G * G;
  for (int m = 0; m < full_queries; m += G)
    accumulate_fp8<G>(st.acc + int64_t(m) * st.hspv, st.hspv, st.scores + int64_t(m) * kKeyChunk,
                       v_rows, n, m == 0 ? ahead : nullptr);
  for (int m = full_queries; m < st.num_queries; ++m)
    accumulate_fp8<1>(st.acc + int64_t(m) * st.hspv, st.hspv, st.scores + int64_t(m) * kKeyChunk,
                      v_rows, n, m == 0 ? ahead : nullptr);
}
#endif  // PAGED_ISA_AVX512_VBMI

// Each STEP-element step of row x (n elements, whole steps) in a reader's order: element i
// of a step to slot slot(i) (split rows, fp8 lookups).
template <int STEP, typename Slot>
static inline void to_slot_order(float* x, int n, Slot slot) {
  float step[STEP];
  for (int d = 0; d < n; d += STEP) {
    std::memcpy(step, x + d, sizeof(step));
    for (int i = 0; i < STEP; ++i) x[d + slot(i)] = step[i];
  }
}

// A KV head's query rows (ItemState), scaled into st.q (fp32, zero padded), into the order
// of the item's tiles (order_query). An fp8 key scale (and e4m3's unit, see StoredUnit,
// unless the rows are looked up exactly) is folded in: q.(k s) = (q s).k. Padding lanes stay
// zero, so padded key lanes never matter.
template <typename Tiles>
static inline void load_row_queries(const Tiles& tiles, const AttentionParams& P, const WorkItem& w,
                                    const ItemState& st) {
  const char* query = static_cast<const char*>(P.query);
  const int64_t query_elem = P.query_kind == ScalarKind::kFloat32 ? 4 : 2;
  const int hs = P.head_size;
  const float q_scale =
      P.k_scale ? P.scale * (P.k_scale[st.kv_head * P.k_scale_stride] * tiles.key_unit()) : P.scale;
  for (int i = 0; i < st.num_queries; ++i) {
    const int token = w.row_begin + i / st.group;
    const int head = st.kv_head * st.group + i % st.group;
    float* qm = st.q + int64_t(i) * st.hsp;
    const char* q_row = query + (token * P.query_token_stride + head * P.query_head_stride) * query_elem;
    std::memset(qm, 0, sizeof(float) * st.hsp);
    query_row_to_float(P.query_kind, q_row, qm, hs);
    for (int d = 0; d < hs; ++d) qm[d] *= q_scale;
    tiles.order_query(q_row, qm, st.q_bits + int64_t(i) * st.hsp, st.q_quad + int64_t(i) * 4 * st.hsp, hs,
                      st.num_queries);
  }
}

// The paths of an item's rows, chosen once per item, and the products by them.
template <typename T>
class RowTiles {
 public:
  // Queries in rows; the driver walks the item's keys span by span, every KV head of the
  // item reading its rows of a span before the next (address order in the HND layout).
  static constexpr ScoreLayout kLayout = ScoreLayout::kQueriesInRows;
  static constexpr bool kHeadsOuter = false;

  // Byte rows converted by table lookups (fp8_bf16_tables.h): fp8, and int8 (per-token) rows
  // where the kernel has the lookups (the driver applies their scales to scores and
  // probabilities). Elsewhere int8 rows are widened in registers (load_as_float).
#if PAGED_ISA_AVX512_VBMI
  static constexpr bool kLookupBytes = kByteLookup<T>;
#else
  static constexpr bool kLookupBytes = false;
#endif
#if PAGED_ISA_AVX512_BF16
  // bf16 keys and values read in place take vdpbf16ps when their rows are whole
  // 32-element steps. So do fp8 rows under a bf16 query, converted to bf16 exactly (whole
  // 64-element steps): keys (a wider query rounded to bf16 would lose its exactness) and
  // values (probabilities rounded to bf16 as for bf16 caches; a wider query's output is
  // held to fp32 rounding: its values take fp32 FMAs). Measured faster than fp32 FMAs on
  // the widened rows, for e4m3 and e5m2 (docs/performance.md).
  static constexpr bool kBf16Pairs = std::is_same_v<T, Bf16>;
  static constexpr bool kBf16Dot = kBf16Pairs || kLookupBytes;
#else
  static constexpr bool kBf16Pairs = false;
  static constexpr bool kBf16Dot = false;
#endif
  // Other fp8 and int8 rows read in place take the lookups into fp32 (fp8_tiles.h) where
  // they are whole 64-element steps, keys and values each: the query or the value
  // accumulators are then in fp8_value_slot order (values under a bf16 query with
  // AVX512_BF16: pairs).

  // Whether the tiles take the item's rows in place where the driver can read them so.
  static bool reads_in_place(const AttentionParams&, int, int) { return true; }

  // in_place: the driver reads the item's rows in place (else it converts them to fp32).
  RowTiles(const AttentionParams& P, int hs, int hsv, bool in_place)
      : split(kSplitRows<T> && in_place),
        bf16_dot(kBf16Dot && in_place &&
                 (kLookupBytes ? hs % 64 == 0 && P.query_kind == ScalarKind::kBFloat16 : hs % 32 == 0)),
        bf16_pairs(kBf16Pairs && in_place && hsv % 32 == 0),
        lookup_keys(kLookupBytes && in_place && hs % 64 == 0 && !bf16_dot),
        fp8_values(kLookupBytes && in_place && hsv % 64 == 0),
        fp8_pairs(kBf16Dot && fp8_values && P.query_kind == ScalarKind::kBFloat16) {}

  // Split rows (convert.h): queries and value accumulators in split order too.
  const bool split;
  const bool bf16_dot;     // scores by vdpbf16ps on the unscaled bf16 queries
  const bool bf16_pairs;   // bf16 values by vdpbf16ps (accumulators in pair order)
  const bool lookup_keys;  // fp8 keys looked up exactly (query in fp8_value_slot order)
  const bool fp8_values;   // fp8 values looked up exactly (accumulators permuted)
  const bool fp8_pairs;    // ... and taken in bf16 pairs (a bf16 query)

  // The factor of the scores and of the weighted sums for the rows' unit (StoredUnit),
  // unless the rows are looked up exactly.
  float key_unit() const { return lookup_keys ? 1.0f : StoredUnit<T>::value; }
  float value_unit() const { return fp8_values ? 1.0f : StoredUnit<T>::value; }

  void load_queries(const AttentionParams& P, const WorkItem& w, const ItemState& st) const {
    load_row_queries(*this, P, w, st);
  }

  // A query row, scaled into qm (fp32, hs elements of a zero-padded row), into the order
  // of the item's tiles; with bf16_dot also its unscaled bf16 copy into qb (from q_row, the
  // stored query), for fp8 keys of 4 queries or more per KV head in quad order into q_quad.
  void order_query(const char* q_row, float* qm, uint16_t* qb, uint16_t* q_quad, int hs, int per_head) const {
    if (split) to_slot_order<2 * VW>(qm, hs, split_slot);
#if PAGED_ISA_AVX512_VBMI
    if (lookup_keys) to_slot_order<64>(qm, hs, fp8_value_slot);
#endif
    if (!bf16_dot) return;
#if PAGED_ISA_AVX512_BF16
    if constexpr (kLookupBytes) {  // in the order fp8_to_bf16_lanes leaves a key's elements
      const uint16_t* src = reinterpret_cast<const uint16_t*>(q_row);
      for (int d = 0; d < hs; d += 64)
        for (int i = 0; i < 64; ++i) qb[d + i] = src[d + fp8_lane_element(i)];
      if (per_head >= 4) quad_query_order(src, hs, q_quad);
      return;
    }
#endif
    std::memcpy(qb, q_row, 2 * hs);
  }

  // The chunk's scores by the item's key path: vdpbf16ps on bf16 queries (bf16_dot), fp8
  // looked up into fp32 (lookup_keys), or rows widened to fp32 in registers.
  __attribute__((always_inline)) void scores(const ItemState& st, const T* const* k_rows, int n,
                                             const T* const* ahead) const {
#if PAGED_ISA_AVX512_BF16
    if constexpr (kBf16Dot)
      if (bf16_dot) return chunk_scores(st, st.q_bits, k_rows, n, ahead);
#endif
#if PAGED_ISA_AVX512_VBMI
    if constexpr (kLookupBytes)
      if (lookup_keys)
        return chunk_scores(st, reinterpret_cast<const LookupQuery*>(st.q), k_rows, n, ahead);
#endif
    chunk_scores(st, st.q, k_rows, n, ahead);
  }

  // The chunk's probability-weighted values by the item's value path.
  __attribute__((always_inline)) void values(const ItemState& st, const T* const* v_rows, int n,
                                             const T* const* ahead) const {
#if PAGED_ISA_AVX512_BF16
    if constexpr (kBf16Pairs)
      if (bf16_pairs) return chunk_values_pairs(st, v_rows, n, ahead);
#endif
#if PAGED_ISA_AVX512_VBMI
    if constexpr (kLookupBytes)
      if (fp8_values) return chunk_values_fp8(st, v_rows, n, ahead, fp8_pairs);
#endif
    chunk_values(st, v_rows, n, ahead);
  }

  // A finished accumulator row (hsv values) into output order, times inv.
  void output_row(const float* am, float* o, int hsv, float inv) const {
#if PAGED_ISA_AVX512_BF16
    if (bf16_pairs) return unpermute_pairs(am, o, hsv, inv);
    if (fp8_pairs) return unpermute_fp8_pairs(am, o, hsv, inv);
#endif
#if PAGED_ISA_AVX512_VBMI
    if (fp8_values) return unpermute_fp8_values(am, o, hsv, inv);
#endif
    if (split)
      for (int d = 0; d < hsv; ++d) o[d] = am[split_slot(d)] * inv;
    else
      for (int d = 0; d < hsv; ++d) o[d] = am[d] * inv;
  }
};

#include "int4_bf16_tiles.h"
