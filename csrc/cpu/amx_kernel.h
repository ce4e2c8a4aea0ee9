// The AMX kernel for bf16 and fp8 caches (bf16 queries): scores and weighted values as
// tile products (tdpbf16ps), an online softmax with the queries in vector lanes between
// them. Compiled in the amx ISA namespace (isa_kernel.h), and in amx_emulated's over the
// software model of its tiles (amx_tile_model.h); items it does not take run a vector
// kernel (vector_kernel_beside_amx).
//
// Per step (32 keys at 32-aligned positions, masked to the item's range, of one KV head):
//   scores  S^T[key][query] = K . Q^T: K rows are the A operand, 16 keys of one block read
//           in place by one tile load per 32 elements (fp8 rows converted to bf16 first,
//           exactly, in the lane order of fp8_to_bf16_lanes); the queries are B tiles in
//           VNNI order (pairs of elements per dword), built once per item. Up to 16 queries
//           per tile: a KV head's queries (rows x GQA group) in balanced tiles.
//   softmax on the score tile as stored (keys in rows, 16 query lanes): masks, ALiBi, soft
//           cap and window per lane, each lane's running max (moved lazily) and sum, the
//           rescale of its accumulator row where the max moved (score_tile_softmax; a decode tile
//           of 2-8 queries stores its rows compactly, compact_softmax).
//   values  O[query][dv] += P . V: the probabilities, rounded to bf16 and transposed in
//           registers, are the A tile; the step's value rows in the item's range paired into
//           VNNI B tiles of 16 output elements (other rows zero: an unused slot's NaN or inf
//           never meets a zero weight); the accumulator rows themselves are the C tiles
//           (loaded, multiplied into, stored back).
// Query tile by query tile, the next tile's score products and the previous tile's value
// products are issued between the rows of a softmax. The rows of the step two ahead are
// prefetched into L2 in row order, a few with each tile operation.

#pragma once

#include "amx_tiles.h"
#include "bf16_tiles.h"
#include "fp8_bf16_tables.h"
#include "query_rows.h"
#include "score_masks.h"
#include "vec.h"
#include "vec_exp.h"

// Tiles for M queries a tile: 0, 1 scores of keys 0-15 / 16-31 (16 x M fp32); 2 keys
// (16 x 32 bf16); 3 queries (16 dword rows x M); 4 probabilities (M x 32 bf16); 5 values
// (16 x 16 bf16 pairs); 6, 7 accumulators (M x 16 fp32).
static inline TileConfig amx_tile_config(int m) {
  TileConfig c;
  const int query_bytes = 4 * m;
  const uint8_t rows[8] = {16, 16, 16, 16, uint8_t(m), 16, uint8_t(m), uint8_t(m)};
  const uint16_t bytes[8] = {uint16_t(query_bytes), uint16_t(query_bytes), 64, uint16_t(query_bytes),
                             64, 64, 64, 64};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = rows[t];
    c.bytes_per_row[t] = bytes[t];
  }
  return c;
}

constexpr int kAmxKeyChunk = 32;    // keys per online-softmax step
constexpr int kAmxKeyGroup = 16;    // keys per tile (a block holds whole groups)
constexpr int kAmxTileQueries = 16;  // queries per tile at most
constexpr int kAmxStep = 32;         // bf16 elements per tile row (16 dword pairs)
constexpr int kAmxMaxValueBytes = 512;  // a value row at most (kZeroValueRow)
// Fewest queries per KV head an item needs for the tiles. One query per KV head (MHA decode)
// runs a vector kernel (avx512_bf16's measured here): the tiles measured slower than it
// there, faster from two queries per KV head and far faster from eight
// (docs/performance.md).
constexpr int kAmxMinQueries = 2;

// Whether the tiles take a call's items (each item also needs kAmxMinQueries queries per
// KV head and a workspace it fits): bf16 and fp8 caches with a bf16 query (exact in
// bf16), head sizes of whole conversion steps up to 256 (the sizes it was measured and
// tested at on AMX hardware; larger heads take the vector kernels), blocks of whole key groups.
static inline bool amx_takes(const AttentionParams& P) {
  const bool fp8 = P.kind == ScalarKind::kFloat8E4M3 || P.kind == ScalarKind::kFloat8E5M2;
  if (!fp8 && P.kind != ScalarKind::kBFloat16) return false;
  if (P.head_size > 256 || P.head_size_v > 256) return false;
  const int step = fp8 ? 64 : kAmxStep;
  return P.query_kind == ScalarKind::kBFloat16 && P.head_size % step == 0 && P.head_size_v % step == 0 &&
         P.head_size_v * (fp8 ? 1 : 2) <= kAmxMaxValueBytes && P.block_size % kAmxKeyGroup == 0;
}

// Queries per work item for the tiles: larger items share each step's fixed work (the value
// packing, fp8 key conversion, prefetches) among more query tiles. Causal multi-token, 32/8
// heads, one thread: 64 -> 260, 128 -> 300, 256 -> 338 GFLOP/s.
constexpr int kAmxQueriesPerItem = 256;

inline int queries_per_item(const AttentionParams& P) { return amx_takes(P) ? kAmxQueriesPerItem : 0; }

// The layout of an amx item's workspace (floats).
struct AmxLayout {
  int tiles, m, padded;  // query tiles per KV head, queries per tile, their product
  int64_t acc, scores, run_max, run_sum, lane_slope, lane_pos, queries, keys, values, probs, total;
};

static inline AmxLayout amx_layout(int num_heads, int per_head, int hs, int hsv) {
  AmxLayout l{};
  l.tiles = (per_head + kAmxTileQueries - 1) / kAmxTileQueries;
  l.m = (per_head + l.tiles - 1) / l.tiles;
  l.padded = l.tiles * l.m;
  const int64_t rows = int64_t(num_heads) * l.padded;
  l.acc = 0;                                            // [heads][padded][hsv]
  l.scores = l.acc + rows * hsv;                        // [2][32 keys][16 queries]
  const int64_t lanes = int64_t(num_heads) * l.tiles * kAmxTileQueries;
  l.run_max = l.scores + 2 * kAmxKeyChunk * kAmxTileQueries;  // [heads][tiles][16], log2 units
  l.run_sum = l.run_max + lanes;
  l.lane_slope = l.run_sum + lanes;                      // [heads][tiles][16]
  l.lane_pos = l.lane_slope + lanes;                     // [tiles][16] int32
  l.queries = l.lane_pos + int64_t(l.tiles) * kAmxTileQueries;  // B tiles [heads][tiles][hs/32][16][m]
  l.keys = l.queries + rows * hs / 2;                    // fp8 keys as bf16 [2][16][hs]
  l.values = l.keys + int64_t(kAmxKeyChunk) * hs / 2;       // B tiles [hsv/16][16][16]
  l.probs = l.values + int64_t(kAmxKeyChunk) * hsv / 2;     // A tiles [2][16][32] bf16
  l.total = l.probs + kAmxTileQueries * kAmxKeyChunk;
  return l;
}

// A value row of zeros for a key outside the item's range paired with a key inside it
// (pair_words reads its first row as given; a zero byte is +0 in both fp8 formats).
alignas(64) static const uint8_t kZeroValueRow[kAmxMaxValueBytes] = {};

// The value rows of keys t0 and t0 + 1 (nullptr: a zero row) into the VNNI B tiles at
// `tiles` ([hsv / 16][16 rows][16 dwords]), tile row t0 / 2: pair_words' vectors, the
// columns in its pair orders (unpermute_pairs / unpermute_fp8_pairs put them back).
template <typename T>
static inline void pack_value_pair(const T* a, const T* b, int hsv, uint32_t* tiles, int t0) {
  uint32_t* row = tiles + (t0 / 2) * 16;
  if (!a) a = reinterpret_cast<const T*>(kZeroValueRow);
  auto store = [&](int d, const __m512i* pairs, int count) {
    for (int j = 0; j < count; ++j) _mm512_storeu_si512(row + (d / 16 + j) * 256, pairs[j]);
  };
  int d = 0;
  for (; d + 64 <= hsv; d += 64) {
    __m512i pairs[4];
    pair_words<2>(a + d, b ? b + d : nullptr, pairs);
    store(d, pairs, 4);
  }
  if constexpr (sizeof(T) == 2)
    if (d < hsv) {  // a last 32 elements
      __m512i pairs[2];
      pair_words<1>(a + d, b ? b + d : nullptr, pairs);
      store(d, pairs, 2);
    }
}

// 16 x 16 dwords transposed in registers: row i of the result is column i of the input.
static inline void transpose_dwords(__m512i (&r)[16]) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {  // within 128-bit lanes: pairs of rows
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // quads: u[4k + j] holds column 4 L + j in lane L
    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit lanes across the quads
    const __m512i even01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i odd01 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    const __m512i even23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_i32x4(even01, even23, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(even01, even23, 0xdd);
    t[4 + j] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(odd01, odd23, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// One query tile's B tiles: dword j * m + col holds elements 2j and 2j + 1 (fp8 caches: of
// the key's converted order, fp8_to_bf16_lanes' slot i of each 64 holding element
// fp8_lane_element(i)) of query col,
// for the `real` queries at `rows` (the other columns zero). 32 elements of each query at a
// time, transposed in registers (element by element it was a visible share of a
// multi-token call).
template <typename T>
static inline void pack_query_tile(const uint16_t* const* rows, int real, int m, int hs, uint32_t* tile) {
  const __mmask16 columns = __mmask16((1u << m) - 1);
  // Slots 0-31 and 32-63 of a 64-element step in fp8_lane_element order.
  const __m512i first = _mm512_set_epi16(55, 54, 53, 52, 51, 50, 49, 48, 39, 38, 37, 36, 35, 34, 33, 32,
                                         23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(8));
  for (int d = 0; d < hs; d += kAmxStep) {
    __m512i r[16];
    for (int l = 0; l < 16; ++l) {
      r[l] = _mm512_setzero_si512();
      if (l >= real) continue;
      if constexpr (sizeof(T) == 1) {
        const uint16_t* group = rows[l] + d / 64 * 64;
        r[l] = _mm512_permutex2var_epi16(_mm512_loadu_si512(group), d % 64 == 0 ? first : second,
                                         _mm512_loadu_si512(group + 32));
      } else {
        r[l] = _mm512_loadu_si512(rows[l] + d);
      }
    }
    transpose_dwords(r);
    for (int j = 0; j < 16; ++j) _mm512_mask_storeu_epi32(tile + (d / 2 + j) * m, columns, r[j]);
  }
}

// A lane's running max moves only when a score passes it by this much (log2 units), as
// in FlashAttention-4: the probabilities stay below 2^8 (far from overflow in bf16 and
// fp32, same relative precision) and most steps leave the accumulator rows alone.
constexpr float kLazyRescaleLog2 = 8.0f;

// 16 x 32 probabilities (rows of keys, queries in lanes) as the A tile of P . V: row l holds
// query l's probabilities in key order, rounded to bf16. pairs[r] dword l holds keys 2r and
// 2r + 1 of query l.
static inline void store_probability_tile(__m512i (&pairs)[16], uint16_t* tile) {
  transpose_dwords(pairs);
  for (int l = 0; l < 16; ++l) _mm512_storeu_si512(tile + 32 * l, pairs[l]);
}

// Keys t, t + 1 of one lane set (16 fp32 each) as bf16 pairs: dword l = (p0[l], p1[l]).
static inline __m512i pair_probabilities(__m512 p0, __m512 p1) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
}

// A softmax step's lane maxima `top` against the running ones (log2 units). A lane's shift
// moves to its new max only past the lazy margin; lanes that have seen nothing keep a shift
// of 0 (2^(-inf - 0) = 0).
struct LaneShift {
  __m512 old_max, new_max, shift;
  __mmask16 moved;
};

static inline LaneShift lane_shift(__m512 top, const float* run_max) {
  const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
  LaneShift l;
  l.old_max = _mm512_loadu_ps(run_max);
  l.moved = _mm512_cmp_ps_mask(top, _mm512_add_ps(l.old_max, _mm512_set1_ps(kLazyRescaleLog2)), _CMP_GT_OQ);
  l.new_max = _mm512_mask_blend_ps(l.moved, l.old_max, top);
  l.shift = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(l.new_max, minus_inf, _CMP_EQ_OQ), l.new_max,
                                 _mm512_setzero_ps());
  return l;
}

// The end of a softmax step per lane: the running sum (and max, where it moved), and the
// accumulator rows of the tile's `real` queries rescaled where it moved.
static inline void update_lanes(const LaneShift& l, __m512 total, float* run_max, float* run_sum, float* acc,
                                int hsv, int real) {
  if (l.moved == 0) {
    _mm512_storeu_ps(run_sum, _mm512_add_ps(_mm512_loadu_ps(run_sum), total));
    return;
  }
  const __m512 alpha = _mm512_mask_blend_ps(l.moved, _mm512_set1_ps(1.0f),
                                            exp2_shifted(l.old_max, _mm512_set1_ps(1.0f), l.shift));
  _mm512_storeu_ps(run_sum, _mm512_fmadd_ps(_mm512_loadu_ps(run_sum), alpha, total));
  _mm512_storeu_ps(run_max, l.new_max);
  alignas(64) float alphas[16];
  _mm512_store_ps(alphas, alpha);
  rescale_rows(acc, hsv, alphas, real);
}

// The lanes of one query tile: each lane's query position and ALiBi slope, set once per item.
struct TileLanes {
  const int32_t* pos;  // [16]
  const float* slope;  // [16], or nullptr without ALiBi
  int real;            // lanes holding a query
};

// The online softmax of one query tile with its queries in lanes: `s` holds the scores of
// the chunk's keys a + t (row t, 16 lanes, unscaled), valid for t in [lo, hi). The
// probabilities (0 where masked or outside) go to the A tile `tile`; each lane's running
// max and sum are updated and the accumulator rows of the tile's real queries rescaled
// where the max moved. between(r) runs after each pair of probability rows r (16 in all).
template <typename Between>
static inline void score_tile_softmax(const AttentionParams& P, const TileLanes& lanes, float scale, int a, int lo,
                                int hi, float* s, float* run_max, float* run_sum,
                                float* acc, int hsv, uint16_t* tile, Between between) {
  const bool soft_cap = P.soft_cap > 0.0f;
  // Every key of [lo, hi) visible to every lane (lane 0 holds the tile's first position).
  const bool all_visible =
      a + hi - 1 <= lanes.pos[0] && P.sliding_window <= 0 && !lanes.slope && !soft_cap && scale > 0.0f;
  const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
  const float log2e = 1.44269504088896341f;
  __m512 top = minus_inf;
  // The max of the rows as scaled: without masks from the stored scores (scale > 0), else
  // the masked, capped and biased scores are stored back in log2 units.
  float row_factor = scale * log2e;  // stored row -> log2 units
  if (all_visible) {
    __m512 tops[4] = {top, top, top, top};  // four chains: the max's latency, not 32 in a row
    for (int t = lo; t < hi; ++t) tops[t & 3] = _mm512_max_ps(tops[t & 3], _mm512_loadu_ps(s + 16 * t));
    top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
    top = _mm512_mul_ps(top, _mm512_set1_ps(row_factor));
  } else {
    vint pos;
    std::memcpy(&pos, lanes.pos, sizeof(pos));
    const KeyMask mask(pos, lanes.slope ? load(lanes.slope) : vfloat{}, P.sliding_window, lanes.slope);
    const vfloat vscale = splat(scale);
    // The cap and its inverse once: the stores into s may alias P, so read in the loop they
    // would be loaded (and divided) again for every key.
    const vfloat cap = splat(soft_cap ? P.soft_cap : 1.0f), inv_cap = splat(soft_cap ? 1.0f / P.soft_cap : 1.0f);
    for (int t = lo; t < hi; ++t) {
      vfloat x = load(s + 16 * t) * vscale;
      if (soft_cap) x = cap * vtanh(x * inv_cap);
      x = mask.apply(x, vint{} + (a + t)) * splat(log2e);
      store(s + 16 * t, x);
      top = _mm512_max_ps(top, (__m512)x);
    }
    row_factor = 1.0f;
  }
  const LaneShift lane = lane_shift(top, run_max);  // run_max in log2 units
  const __m512 factor = _mm512_set1_ps(row_factor);
  __m512 totals[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512i pairs[16];
  for (int r = 0; r < 16; ++r) {
    __m512 p[2];
    for (int h = 0; h < 2; ++h) {
      const int t = 2 * r + h;
      p[h] = _mm512_setzero_ps();
      if (t < lo || t >= hi) continue;
      p[h] = exp2_shifted(_mm512_loadu_ps(s + 16 * t), factor, lane.shift);
      totals[h] = _mm512_add_ps(totals[h], p[h]);
    }
    pairs[r] = pair_probabilities(p[0], p[1]);
    between(r);
  }
  store_probability_tile(pairs, tile);
  update_lanes(lane, _mm512_add_ps(totals[0], totals[1]), run_max, run_sum, acc, hsv, lanes.real);
}

// Compact score rows (GQA decode): a query tile of m = 2, 4 or 8 queries stores its scores
// with m lanes per key (ScoreTileOps::row_floats), so the 32 keys of a step fill 2m vectors
// (key 16 v / m + l / m, query l % m in lane l of vector v) where score_tile_softmax's rows of 16
// lanes take 32 with 16 - m of them idle.
constexpr bool compact_rows(int m) { return m == 2 || m == 4 || m == 8; }

// Per query tile of m queries: the lane permutations of compact_softmax.
struct CompactLanes {
  int m;
  __m512i spread;   // lane l <- lane l % m: a query's lane to its lanes in a compact vector
  __m512i rows[8];  // query q's probabilities from two bf16 vectors (compact_softmax)
};

static inline CompactLanes compact_lanes(int m) {
  CompactLanes c{};
  c.m = m;
  alignas(64) int32_t spread[16];
  for (int l = 0; l < 16; ++l) spread[l] = l % m;
  c.spread = _mm512_load_si512(spread);
  // bf16 vector w holds keys [w 32 / m, (w + 1) 32 / m), element (key - w 32 / m) m + q. From
  // the pair (2u, 2u + 1), query q's 64 / m keys in order: element q + m o of the first for
  // o < 32 / m, then of the second.
  const int per = 32 / m;
  for (int q = 0; q < m; ++q) {
    alignas(64) int16_t index[32] = {};
    for (int o = 0; o < 2 * per; ++o) index[o] = int16_t(o < per ? q + m * o : 32 + q + m * (o - per));
    c.rows[q] = _mm512_load_si512(index);
  }
  return c;
}

// Every lane: the max (or sum) over the lanes congruent to it mod m.
template <bool kMax>
static inline __m512 fold_lanes_mod(__m512 v, int m) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int shift = 8; shift >= m; shift /= 2) {
    const __m512 other = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(shift)), v);
    v = kMax ? _mm512_max_ps(v, other) : _mm512_add_ps(v, other);
  }
  return v;
}

// score_tile_softmax's all-visible case on compact rows: the step's 32 keys all in range and
// visible to every query, no ALiBi, soft cap or window, scale > 0. The same probabilities,
// A tile and lane updates; the lanes past m hold copies of real lanes (unused).
static inline void compact_softmax(const CompactLanes& c, float scale, const float* s, float* run_max,
                                   float* run_sum, float* acc, int hsv, int real, uint16_t* tile) {
  const int m = c.m, vectors = 2 * m;
  const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
  __m512 tops[2] = {minus_inf, minus_inf};
  for (int v = 0; v < vectors; ++v) tops[v & 1] = _mm512_max_ps(tops[v & 1], _mm512_loadu_ps(s + 16 * v));
  const float row_factor = scale * 1.44269504088896341f;
  const __m512 top =
      _mm512_mul_ps(fold_lanes_mod<true>(_mm512_max_ps(tops[0], tops[1]), m), _mm512_set1_ps(row_factor));
  const LaneShift lane = lane_shift(top, run_max);
  const __m512 spread_shift = _mm512_permutexvar_ps(c.spread, lane.shift);
  const __m512 factor = _mm512_set1_ps(row_factor);
  __m512 totals[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512i words[8];
  for (int w = 0; w < m; ++w) {
    const __m512 p0 = exp2_shifted(_mm512_loadu_ps(s + 32 * w), factor, spread_shift);
    const __m512 p1 = exp2_shifted(_mm512_loadu_ps(s + 32 * w + 16), factor, spread_shift);
    totals[0] = _mm512_add_ps(totals[0], p0);
    totals[1] = _mm512_add_ps(totals[1], p1);
    words[w] = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
  }
  // Row q: a run of 64 / m keys from each pair of bf16 vectors, the runs side by side.
  const int run = 64 / m;
  const __mmask32 run_mask = __mmask32((1ull << run) - 1);
  for (int q = 0; q < m; ++q)
    for (int u = 0; u < m / 2; ++u)
      _mm512_mask_storeu_epi16(tile + 32 * q + u * run, run_mask,
                               _mm512_permutex2var_epi16(words[2 * u], c.rows[q], words[2 * u + 1]));
  update_lanes(lane, fold_lanes_mod<false>(_mm512_add_ps(totals[0], totals[1]), m), run_max, run_sum, acc, hsv,
               real);
}

// One query tile's scores, S^T = K . Q^T, as parts to issue between another tile's vector
// work: part c of `steps` (32 elements each) accumulates key groups 0 and 1 into tiles 0 and
// 1; the last part stores them at s as rows of `row_floats` lanes (16, or the tile's queries
// for compact_softmax).
struct ScoreTileOps {
  const uint32_t* q;  // the tile's queries as B tiles, q_step dwords apart
  int64_t q_step;
  int q_bytes;
  const uint16_t* const* k;  // each key group's first row (bf16), k_stride bytes apart
  const bool* used;
  int64_t k_stride;
  int steps;
  float* s;
  int row_floats;

  void part(int c) const {
    if (c == 0) {
      PAGED_TILE_ZERO(0);
      PAGED_TILE_ZERO(1);
    }
    PAGED_TILE_LOAD(3, q + c * q_step, q_bytes);
    if (used[0]) {
      PAGED_TILE_LOAD(2, k[0] + c * kAmxStep, k_stride);
      PAGED_TILE_DPBF16PS(0, 2, 3);
    }
    if (used[1]) {
      PAGED_TILE_LOAD(2, k[1] + c * kAmxStep, k_stride);
      PAGED_TILE_DPBF16PS(1, 2, 3);
    }
    if (c == steps - 1) {
      PAGED_TILE_STORE(0, s, 4 * row_floats);
      PAGED_TILE_STORE(1, s + kAmxKeyGroup * row_floats, 4 * row_floats);
    }
  }
};

// One query tile's out[query][dv] += P . V as parts: part g loads the accumulator rows of
// output columns [16 g, 16 g + 16) as a C tile (6 or 7, alternating), adds the A tile of
// probabilities (tile 4, loaded by part 0) times the packed values' B tile g, stores it back.
struct ValueTileOps {
  float* out;
  int64_t out_stride;
  const uint32_t* v_tiles;  // [hsv / 16][16][16]
  const uint16_t* probs;

  void part(int g) const {
    if (g == 0) PAGED_TILE_LOAD(4, probs, 64);
    float* c = out + g * 16;
    PAGED_TILE_LOAD(5, v_tiles + g * 256, 64);
    if (g & 1) {
      PAGED_TILE_LOAD(7, c, out_stride);
      PAGED_TILE_DPBF16PS(7, 4, 5);
      PAGED_TILE_STORE(7, c, out_stride);
    } else {
      PAGED_TILE_LOAD(6, c, out_stride);
      PAGED_TILE_DPBF16PS(6, 4, 5);
      PAGED_TILE_STORE(6, c, out_stride);
    }
  }
};

template <typename T>
static void amx_work_item(const AttentionParams& P, const WorkItem& w, float* ws) {
  const int hs = P.head_size, hsv = P.head_size_v;
  const int group = P.num_heads / P.num_kv_heads;
  const int num_heads = w.kv_head_end - w.kv_head_begin;
  const int per_head = (w.row_end - w.row_begin) * group;
  const AmxLayout L = amx_layout(num_heads, per_head, hs, hsv);
  const int padded_head = (std::max(hs, hsv) + 15) / 16 * 16;
  const bool fits = kCacheLineFloats + L.total <= kernel_workspace_floats(padded_head, num_heads * per_head + kWorkspacePaddingQueries);
  if (!amx_takes(P) || per_head < kAmxMinQueries || !fits) {
    static const AttentionKernelFn fallback = vector_kernel_beside_amx(P.kind);
    fallback(P, w, ws);
    return;
  }
  const int M = L.m;
  const int steps = hs / kAmxStep;  // query / key tiles per score tile
  ws = aligned_workspace(ws);
  float* acc = ws + L.acc;
  float* scores = ws + L.scores;
  float* run_max = ws + L.run_max;
  float* run_sum = ws + L.run_sum;
  uint32_t* q_tiles = reinterpret_cast<uint32_t*>(ws + L.queries);
  uint16_t* keys_bf16 = reinterpret_cast<uint16_t*>(ws + L.keys);
  uint32_t* v_tiles = reinterpret_cast<uint32_t*>(ws + L.values);
  uint16_t* probs = reinterpret_cast<uint16_t*>(ws + L.probs);
  float* lane_slope = ws + L.lane_slope;
  int32_t* lane_pos = reinterpret_cast<int32_t*>(ws + L.lane_pos);
  const int64_t q_tile_dwords = int64_t(steps) * 16 * M;  // one query tile's B tiles

  // Queries as B tiles (pack_query_tile), padding queries zero.
  const uint16_t* query = static_cast<const uint16_t*>(P.query);
  for (int i = 0; i < num_heads; ++i) {
    const int kv = w.kv_head_begin + i;
    for (int qt = 0; qt < L.tiles; ++qt) {
      const uint16_t* rows[kAmxTileQueries];
      const int real = std::min(M, per_head - qt * M);
      for (int l = 0; l < real; ++l) {
        const int q = qt * M + l, token = w.row_begin + q / group, head = kv * group + q % group;
        rows[l] = query + token * P.query_token_stride + head * P.query_head_stride;
      }
      pack_query_tile<T>(rows, real, M, hs, q_tiles + (int64_t(i) * L.tiles + qt) * q_tile_dwords);
    }
  }
  for (int64_t l = 0; l < int64_t(num_heads) * L.tiles * kAmxTileQueries; ++l) {
    run_max[l] = -__builtin_inff();
    run_sum[l] = 0.0f;
  }
  // Each lane's position and ALiBi slope (padding lanes repeat the tile's last query).
  for (int qt = 0; qt < L.tiles; ++qt) {
    const int real = std::min(M, per_head - qt * M);
    for (int l = 0; l < kAmxTileQueries; ++l) {
      const int q = qt * M + std::min(l, real - 1);
      lane_pos[qt * kAmxTileQueries + l] = w.first_pos + q / group;
      if (!P.alibi_slopes) continue;
      for (int i = 0; i < num_heads; ++i)
        lane_slope[(i * L.tiles + qt) * kAmxTileQueries + l] =
            P.alibi_slopes[(w.kv_head_begin + i) * group + q % group];
    }
  }
  std::memset(acc, 0, sizeof(float) * int64_t(num_heads) * L.padded * hsv);

  const TileConfig config = amx_tile_config(M);
  PAGED_TILE_CONFIG(&config);

  const T* key_cache = static_cast<const T*>(P.key_cache);
  const T* value_cache = static_cast<const T*>(P.value_cache);
  const int32_t* table = P.block_tables + int64_t(w.seq) * P.block_table_stride;
  const int k_lines = (hs * int(sizeof(T)) + 63) / 64, v_lines = (hsv * int(sizeof(T)) + 63) / 64;
  // A step: the keys [a, a + 32) of the item's range, of its KV head i. Its key group g (16
  // keys from a + 16 g, in one block) is used when it holds a key of the range; k and v
  // point at the group's first rows.
  struct Step {
    int a, i, j0, j1;
    bool used[2];
    const T* k[2];
    const T* v[2];
  };
  auto make_step = [&](int a, int i) {
    Step st{a, i, std::max(a, w.kv_begin), std::min(a + kAmxKeyChunk, w.kv_end), {}, {}, {}};
    const int kv = w.kv_head_begin + i;
    for (int g = 0; g < 2; ++g) {
      const int first = a + g * kAmxKeyGroup;
      st.used[g] = st.j0 < first + kAmxKeyGroup && st.j1 > first;
      if (!st.used[g]) continue;
      const int64_t block = table[first / P.block_size], slot = first % P.block_size;
      st.k[g] = key_cache + block * P.k_block_stride + kv * P.k_head_stride + slot * P.k_token_stride;
      st.v[g] = value_cache + block * P.v_block_stride + kv * P.v_head_stride + slot * P.v_token_stride;
    }
    return st;
  };
  auto step_after = [&](const Step& st) {
    return st.i + 1 < num_heads ? make_step(st.a, st.i + 1) : make_step(st.a + kAmxKeyChunk, 0);
  };
  // Into L2: row r of each used group of `st`, keys and values. A step's 16 rows are
  // prefetched two steps ahead, a row at a time between the tile operations of its phases
  // (4 in the scores, 8 in the value packing, 4 in the products): in a burst they held the
  // core's fill buffers while the packing loads waited (spread out, GQA decode from DRAM
  // measured faster).
  auto prefetch_row_of = [&](const Step& st, int r) {
    if (st.j0 >= st.j1) return;
    for (int g = 0; g < 2; ++g) {
      if (!st.used[g]) continue;
      const char* k = reinterpret_cast<const char*>(st.k[g] + r * P.k_token_stride);
      const char* v = reinterpret_cast<const char*>(st.v[g] + r * P.v_token_stride);
      for (int l = 0; l < k_lines; ++l) prefetch(k + 64 * l);
      for (int l = 0; l < v_lines; ++l) prefetch(v + 64 * l);
    }
  };
  // The step ahead's rows go out in row order, a few with each tile operation as it is
  // issued (and 8 in the value packing with one query tile, as tuned for decode): a step of
  // 16 query tiles issuing them all in its first tile stalled that step's loads behind them
  // (its first tile took several times as long as the others), and out of row order decode
  // measured slower.
  const int pack_rows = L.tiles == 1 ? kAmxKeyGroup / 2 : 0;
  const int value_parts = hsv / 16;
  const int tile_ops = L.tiles * (steps + value_parts);  // score and value parts of a step
  // The parts issued after a softmax's pair of rows r: [first[r], first[r + 1]), as tables
  // (a division per row pair and query tile was a visible share of a multi-token call).
  struct RowShares {
    int score[17], value[17];
  } first{};
  for (int r = 0; r <= 16; ++r) {
    first.score[r] = r * steps / 16;
    first.value[r] = r * value_parts / 16;
  }
  // Rows due after n tile operations: n * (16 - pack_rows) / tile_ops, kept as a quotient
  // and remainder (a division per operation was a visible share of a multi-token call).
  struct RowPrefetch {
    int op_rows, credit, packed, rows;  // rows due from operations (and remainder), packing shares, prefetched
    void add_op(int share, int per_row) {
      for (credit += share; credit >= per_row; credit -= per_row) ++op_rows;
    }
  };
  // One query tile of 2, 4 or 8 queries per head (GQA decode): compact score rows in the steps
  // that allow them (compact_softmax: 2m vectors a step, not 32 with idle lanes; measured
  // faster, bf16 and e4m3).
  const bool compact_item =
      L.tiles == 1 && compact_rows(M) && !P.alibi_slopes && P.soft_cap <= 0.0f && P.sliding_window <= 0;
  const CompactLanes item_lanes = compact_item ? compact_lanes(M) : CompactLanes{};
  auto prefetch_due = [&](const Step& st, RowPrefetch& pf) {
    for (const int due = pf.op_rows + pf.packed; pf.rows < due; ++pf.rows) prefetch_row_of(st, pf.rows);
  };
  // The step, the next (prefetched), the one after (being prefetched) and the one after
  // that (touched), each made once, as it enters `far`.
  Step cur = make_step(w.kv_begin / kAmxKeyChunk * kAmxKeyChunk, 0);
  Step next = step_after(cur);
  Step ahead = step_after(next);
  Step far{};
  for (int r = 0; r < kAmxKeyGroup; ++r) {
    prefetch_row_of(cur, r);
    prefetch_row_of(next, r);
  }
  for (; cur.j0 < cur.j1; cur = next, next = ahead, ahead = far) {
    far = step_after(ahead);
    // One line of each group of `far`: on 4 KiB pages a group's rows are a page of their
    // own, and this touch walks it a step before its rows' prefetches need the translation
    // (measured faster bf16 GQA decode on 4 KiB pages, no loss on huge pages). Whole rows
    // that early gain no more, and touching every fourth row measured slower.
    if (far.j0 < far.j1)
      for (int g = 0; g < 2; ++g)
        if (far.used[g]) prefetch(far.k[g]), prefetch(far.v[g]);
    const int kv = w.kv_head_begin + cur.i;
    const int n = cur.j1 - cur.j0, off = cur.j0 - cur.a;
    const int i = cur.i;
    const bool* group_used = cur.used;
    // Key group g: in place (bf16) or converted.
    const uint16_t* k_group[2] = {nullptr, nullptr};
    int64_t k_stride_bytes = 0;
    for (int g = 0; g < 2; ++g) {
      if (!group_used[g]) continue;
      const T* first = cur.k[g];
      if constexpr (sizeof(T) == 1) {
        uint16_t* dst = keys_bf16 + int64_t(g) * kAmxKeyGroup * hs;
        for (int r = 0; r < kAmxKeyGroup; ++r) {
          const T* src = first + int64_t(r) * P.k_token_stride;
          for (int d = 0; d < hs; d += 64) {
            __m512i words[2];
            fp8_to_bf16_lanes<T>(_mm512_loadu_si512(src + d), words[0], words[1]);
            _mm512_storeu_si512(dst + int64_t(r) * hs + d, words[0]);
            _mm512_storeu_si512(dst + int64_t(r) * hs + d + 32, words[1]);
          }
        }
        k_group[g] = dst;
        k_stride_bytes = int64_t(hs) * 2;
      } else {
        k_group[g] = reinterpret_cast<const uint16_t*>(first);
        k_stride_bytes = P.k_token_stride * 2;
      }
    }
    const float score_scale = P.k_scale ? P.scale * P.k_scale[kv * P.k_scale_stride] : P.scale;
    float* head_acc = acc + int64_t(i) * L.padded * hsv;
    const bool compact =
        compact_item && n == kAmxKeyChunk && score_scale > 0.0f && cur.a + kAmxKeyChunk - 1 <= lane_pos[0];

    // The value rows of the step's keys in range as B tiles (the others stay zero: a key
    // outside the range never meets its zero weight). Every key in range is seen by some
    // query of the item: its last row's position ends the range and its first row's
    // window starts it.
    RowPrefetch pf{0, 0, 0, 0};
    auto value_row = [&](int t) -> const T* {
      return t >= off && t < off + n ? cur.v[t / kAmxKeyGroup] + (t % kAmxKeyGroup) * P.v_token_stride : nullptr;
    };
    auto pack_values = [&] {
      for (int t = 0; t < kAmxKeyChunk; t += 2) {
        pack_value_pair(value_row(t), value_row(t + 1), hsv, v_tiles, t);
        if (t % 4 == 0 && t / 4 < pack_rows) {
          ++pf.packed;
          prefetch_due(ahead, pf);
        }
      }
    };

    // Per query tile: scores (keys in rows, queries in lanes), softmax, weighted values into
    // the accumulator rows. The next tile's scores and the previous tile's values are issued
    // a part at a time between the softmax's rows, so that the tile unit has work while the
    // vector units run it (the next tile's scores issued whole before the softmax measured
    // no faster: 409 vs 402 GFLOP/s, one thread).
    auto scores_of = [&](int qt) { return scores + int64_t(qt & 1) * kAmxKeyChunk * kAmxTileQueries; };
    auto probs_of = [&](int qt) { return probs + int64_t(qt & 1) * kAmxTileQueries * kAmxKeyChunk; };
    auto score_ops = [&](int qt) {
      return ScoreTileOps{q_tiles + (int64_t(i) * L.tiles + qt) * q_tile_dwords, 16 * M, 4 * M, k_group,
                          group_used, k_stride_bytes, steps, scores_of(qt), compact ? M : kAmxTileQueries};
    };
    auto value_ops = [&](int qt) {
      return ValueTileOps{head_acc + int64_t(qt) * M * hsv, int64_t(hsv) * 4, v_tiles, probs_of(qt)};
    };
    auto issue = [&](const auto& ops, int part) {  // a score or value part, with its prefetch share
      pf.add_op(kAmxKeyGroup - pack_rows, tile_ops);
      prefetch_due(ahead, pf);
      ops.part(part);
    };
    {
      const ScoreTileOps first_scores = score_ops(0);
      for (int c = 0; c < steps; ++c) issue(first_scores, c);
    }
    for (int qt = 0; qt < L.tiles; ++qt) {
      const bool next = qt + 1 < L.tiles, prev = qt > 0;
      const ScoreTileOps next_scores = score_ops(next ? qt + 1 : qt);
      const ValueTileOps prev_values = value_ops(prev ? qt - 1 : qt);
      const int64_t lane0 = (int64_t(i) * L.tiles + qt) * kAmxTileQueries;
      const TileLanes lanes{lane_pos + qt * kAmxTileQueries, P.alibi_slopes ? lane_slope + lane0 : nullptr,
                            std::min(M, per_head - qt * M)};
      if (compact)  // one tile: no other tile's parts to issue between its rows
        compact_softmax(item_lanes, score_scale, scores_of(qt), run_max + lane0, run_sum + lane0,
                        head_acc + int64_t(qt) * M * hsv, hsv, lanes.real, probs_of(qt));
      else
        score_tile_softmax(P, lanes, score_scale, cur.a, off, off + n, scores_of(qt), run_max + lane0, run_sum + lane0,
                   head_acc + int64_t(qt) * M * hsv, hsv, probs_of(qt), [&](int r) {
                     if (next)
                       for (int c = first.score[r]; c < first.score[r + 1]; ++c) issue(next_scores, c);
                     if (prev)
                       for (int g = first.value[r]; g < first.value[r + 1]; ++g) issue(prev_values, g);
                   });
      if (qt == 0) pack_values();  // after the first softmax: packed first, decode ran slower
    }
    const ValueTileOps last = value_ops(L.tiles - 1);
    for (int g = 0; g < value_parts; ++g) issue(last, g);
  }
  PAGED_TILE_RELEASE();

  // Scores used the exact bf16 keys (no e4m3 unit), and so did the values.
  for (int i = 0; i < num_heads; ++i) {
    const int kv = w.kv_head_begin + i;
    const float v_factor = P.v_scale ? P.v_scale[kv * P.v_scale_stride] : 1.0f;
    for (int m = 0; m < per_head; ++m) {
      const int token = w.row_begin + m / group, head = kv * group + m % group;
      const int64_t lane = (int64_t(i) * L.tiles + m / M) * kAmxTileQueries + m % M;
      const float top = run_max[lane] * 0.693147180559945309f;  // from log2 units
      const float inv = finish_query(P, w, token, head, top, run_sum[lane], v_factor);
      const float* am = acc + (int64_t(i) * L.padded + m) * hsv;
      write_output(P, w, token, head, [&](float* o) {
        if constexpr (sizeof(T) == 1)
          unpermute_fp8_pairs(am, o, hsv, inv);
        else
          unpermute_pairs(am, o, hsv, inv);
      });
    }
  }
}

// The amx compile's entry: tiles for bf16 and fp8 caches, a vector kernel for the rest.
inline AttentionKernelFn amx_kernel_for(ScalarKind kind) {
  switch (kind) {
    case ScalarKind::kBFloat16: return &amx_work_item<Bf16>;
    case ScalarKind::kFloat8E4M3: return &amx_work_item<Fp8E4M3>;
    case ScalarKind::kFloat8E5M2: return &amx_work_item<Fp8E5M2>;
    default: return vector_kernel_beside_amx(kind);
  }
}
