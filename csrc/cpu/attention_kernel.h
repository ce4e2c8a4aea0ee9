// The CPU paged-attention kernel for one work item, written once with GCC vector
// extensions and compiled once per instruction set, inside its ISA namespace
// (isa_kernel.h): one online-softmax driver over micro-kernels.
//
// Algorithm (flash-decoding style): a work item is one sequence's query rows for
//   a range of KV heads. Its keys are taken in chunks (up to kKeyChunk) through the block
//   table, block by block and, within a block, head by head (address order in the
//   HND layout). Each key row serves every query head of its GQA group; an online softmax
//   keeps the running max / sum per query so each K and V byte is read exactly once.
//   Software prefetches run one phase ahead into L1 and two phases ahead into L2
//   (prefetch.h).
//
// The driver (attention_driver) owns the walk over spans, KV heads and chunks (the ring of
// row pointers, the prefetch arrays, page touches), the masks, ALiBi, soft cap and windows,
// the online softmax in both forms (per query along its row, chunk_softmax, with the lazy
// rescale; down the lanes a vector of queries at a time, query_vector_softmax), the running
// max and sum, the partitions' sinks and lse and the output rows. Its micro-kernel, a
// template parameter, declares its score layout (ScoreLayout, which picks the softmax form)
// and whether KV heads are walked outermost (kHeadsOuter), and supplies the queries in its
// order, a chunk's scores and probability-weighted values, its own conversion of the cache
// format and the output rows:
//   RowTiles (row_tiles.h; int4 rows: int4_bf16_tiles.h)  queries in rows, register tiles
//       of several queries on rows read in place (or widened to fp32 by the driver:
//       ragged head sizes, per-token rows without in-place tiles); spans outermost;
//   LaneFloatTiles (lane_float_tiles.h: fp32 FMAs), LanePairTiles (lane_pair_tiles.h:
//       vdpbf16ps)  queries in vector lanes (lane_tiles.h), for items of several rows with a
//       vector of queries or more per KV head (attention_work_item picks them); each
//       chunk converted into L1 scratch and the next one fetched at the pace of the score
//       tiles; KV heads outermost, one head's accumulators in L1.
// The driver holds no instruction-set conditional of its own.
#pragma once

#include "convert.h"
#include "lane_float_tiles.h"
#include "lane_pair_tiles.h"
#include "prefetch.h"
#include "query_rows.h"
#include "row_tiles.h"
#include "score_masks.h"
#include "vec.h"
#include "vec_exp.h"

// How far a chunk's max may pass the running max before the accumulators are rescaled to it.
constexpr float kRescaleMargin = 8.0f;

// The lanes of a chunk's n scores of one query, padded with -inf to `chunk`, folded by max.
// kKeyScaled: the scores taken times the keys' scales `ks` (per-token rows; 1 past n).
template <bool kKeyScaled = false>
static inline vfloat padded_max(float* s, int n, int chunk, const float* ks = nullptr) {
  for (int t = n; t < chunk; ++t) s[t] = -__builtin_inff();
  auto score = [&](int t) {
    if constexpr (kKeyScaled) return load(s + t) * load(ks + t);
    return load(s + t);
  };
  vfloat highest = score(0);
  for (int t = VW; t < chunk; t += VW) highest = vmax(highest, score(t));
  return highest;
}

// Whether a query's running max stands for a chunk whose lanes fold to `highest`: set, and
// passed by no score by more than kRescaleMargin (then the chunk's own max is not needed).
static inline bool max_stands(vfloat highest, float run_max) {
  return run_max != -__builtin_inff() && !any_above(highest, run_max + kRescaleMargin);
}

// A chunk's scores of one query replaced by e^(score - max); their sum, by lanes.
// Per-token rows: the scores taken times the keys' scales `ks` (kKeyScaled), and each
// probability stored times its value's scale `vs` (kValueScaled; acc += (p s) q8), the sum
// untouched: the scales ride on the softmax's own pass over the scores.
template <bool kShortExp, bool kKeyScaled = false, bool kValueScaled = kKeyScaled>
static inline vfloat exp_in_place(float* s, int chunk, float max, const float* ks = nullptr,
                                  const float* vs = nullptr) {
  vfloat total{};
  for (int t = 0; t < chunk; t += VW) {
    vfloat x = load(s + t);
    if constexpr (kKeyScaled) x *= load(ks + t);
    const vfloat p = exp_minus<kShortExp>(x, max);
    if constexpr (kValueScaled) store(s + t, p * load(vs + t));
    else store(s + t, p);
    total += p;
  }
  return total;
}

// Whether every row of the item sees the keys [j0, j0 + n) whole and without an ALiBi
// term, so their positions (and order) change nothing but the soft cap, which is
// position-free.
static inline bool keys_plainly_visible(const AttentionParams& P, const WorkItem& w, int j0, int n) {
  return !P.alibi_slopes && keys_visible(P, j0, n, w.first_pos, w.first_pos + (w.row_end - w.row_begin - 1));
}

// One query's scores of the keys [j0, j0 + n) of a chunk of `chunk` keys, keys in lanes:
// masked and biased (`mask`), -inf past n; their max (a NaN score leaves it as it was, the
// exp carries it). Out of line: inlined, it changed the code of chunk_softmax's unmasked
// decode path (MHA decode measured slower).
__attribute__((noinline)) static float mask_query_scores(float* s, int j0, int n, int chunk, const KeyMask mask) {
  const vint end = vint{} + (j0 + n);
  vfloat top = splat(-__builtin_inff());
  for (int t = 0; t < chunk; t += VW) {
    const vint key = positions_from(j0 + t);
    const vfloat x = key < end ? mask.apply(load(s + t), key) : splat(-__builtin_inff());
    store(s + t, x);
    top = vmax(x, top);
  }
  return hmax(top);
}

// Score modifiers and masks for the keys [j0, j0 + n) of a chunk of `chunk` keys (lanes
// from n on are padding), then the online-softmax update:
// scores become probabilities (0 where masked) and the accumulators are rescaled.
// kShortExp: the exp of exp_minus<kShortExp>. Forced inline on the AVX kernels, where it
// measured no slower and at times a little faster.
// kScaled: per-token rows' key scales `ks` and value scales `vs` (exp_in_place).
template <bool kShortExp, bool kScaled = false>
PAGED_AVX_INLINE static inline void chunk_softmax(const AttentionParams& P, const WorkItem& w,
                                                  const ItemState& st, int j0, int n, int chunk,
                                                  const float* ks = nullptr, const float* vs = nullptr) {
  const bool soft_cap = P.soft_cap > 0.0f;
  int m = 0;
  // A soft cap on scores without key scales: every query's row first, in one call, so that
  // capped chunks take the four-query path too. Per-token scores are capped below, after
  // their key scales, one query at a time.
  if (!kScaled && soft_cap) soft_cap_rows(st.scores, st.num_queries, chunk, kKeyChunk, P.soft_cap);
  // Four queries at a time while the whole chunk is plainly visible to every row of the
  // item (decode; rows past the chunk) and each query's running max stands for its chunk's
  // (the lazy rescale below): the four sums in one transpose (hsum4) instead of four.
  const bool plain = (!kScaled || !soft_cap) && keys_plainly_visible(P, w, j0, n);
  for (; plain && m + 4 <= st.num_queries; m += 4) {
    bool within = true;
    for (int g = 0; g < 4; ++g)
      within = within && max_stands(padded_max<kScaled>(st.scores + int64_t(m + g) * kKeyChunk, n, chunk, ks),
                                    st.run_max[m + g]);
    if (!within) break;  // these four and the rest: one at a time, below
    vfloat total[4];
    for (int g = 0; g < 4; ++g)
      total[g] = exp_in_place<kShortExp, kScaled>(st.scores + int64_t(m + g) * kKeyChunk, chunk,
                                                  st.run_max[m + g], ks, vs);
    float sums[4];
    hsum4(total[0], total[1], total[2], total[3], sums);
    for (int g = 0; g < 4; ++g) st.run_sum[m + g] += sums[g];
  }
  for (; m < st.num_queries; ++m) {
    float* s = st.scores + int64_t(m) * kKeyChunk;
    int t = 0;
    // Off the four-query path per-token scores take their key scales first, then the soft
    // cap, in place.
    if constexpr (kScaled)
      for (; t < chunk; t += VW) store(s + t, load(s + t) * load(ks + t));
    if (kScaled && soft_cap) soft_cap_scores(s, chunk, P.soft_cap);
    const int head = st.kv_head * st.group + m % st.group;
    const int pos = w.first_pos + m / st.group;
    const float slope = P.alibi_slopes ? P.alibi_slopes[head] : 0.0f;
    float chunk_max = -__builtin_inff();
    const bool all_visible = keys_visible(P, j0, n, pos, pos);
    if (all_visible && !P.alibi_slopes) {
      // The common decode case: nothing to mask or bias (a soft cap is applied above). Most
      // chunks leave the running max standing (below), and then their own max is not needed.
      const vfloat highest = padded_max(s, n, chunk);
      const float run_max = st.run_max[m];
      chunk_max = max_stands(highest, run_max) ? run_max : hmax(highest);
    } else {
      chunk_max = mask_query_scores(s, j0, n, chunk, KeyMask(vint{} + pos, splat(slope), P.sliding_window,
                                                            P.alibi_slopes));
    }
    if (chunk_max == -__builtin_inff()) {  // nothing visible in this chunk
      for (t = 0; t < chunk; ++t) s[t] = 0.0f;
      continue;
    }
    // Lazy rescaling (as FlashAttention-4 does): the running max moves only when a score
    // passes it by more than kRescaleMargin; below that the scores are taken against the
    // max as it stands (probabilities up to e^kRescaleMargin, harmless in fp32 sums), so
    // most chunks skip the rescale of the accumulators.
    const float new_max = chunk_max > st.run_max[m] + kRescaleMargin ? chunk_max : st.run_max[m];
    const vfloat total = [&] {
      if constexpr (kScaled) return exp_in_place<kShortExp, false, true>(s, chunk, new_max, nullptr, vs);
      return exp_in_place<kShortExp>(s, chunk, new_max);
    }();
    float* am = st.acc + int64_t(m) * st.hspv;
    if (new_max != st.run_max[m]) {
      const float alpha = std::exp(st.run_max[m] - new_max);
      st.run_sum[m] *= alpha;
      const vfloat av = splat(alpha);
      for (int d = 0; d < st.hspv; d += VW) store(am + d, load(am + d) * av);
      st.run_max[m] = new_max;
    }
    st.run_sum[m] += hsum(total);
  }
}

// Queries per KV head from which rows that are not cheap to widen are converted once per
// chunk: two register tiles or more, each of which would widen every row again. Multi-token
// on AVX2 measured fp8 faster converted (from below the fp32 rate to above it); fp16 with
// F16C measured slower converted, bf16 the same either way. On the baseline (2-query
// tiles) from 4 queries, so its fp16 and fp8 GQA decode too, where converted fp16 measured
// faster in cache. Measurements: docs/performance.md.
template <typename T>
constexpr int kWidenOnceQueries = 2 * kTileQueries<T>;

// f(blocks) with the number of blocks a chunk interleaves (attention_work_item_for) as a
// compile-time constant where it is a common one: GCC 12 turned the interleaving loops over
// a run-time count into AVX-512 scatters, tens of cycles each on Zen 4; over a constant
// count, into ordered stores (measured faster GQA decode in L2, docs/performance.md).
template <typename F>
static inline void with_blocks(int blocks, F&& f) {
  switch (blocks) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(blocks);
  }
}

// What a chunk's lane softmax needs to mask and bias its scores per lane, where some key
// of the chunk is not visible to every query or ALiBi moves the scores: the chunk's first
// key and the positions, heads and windows of the lanes' queries (lane i: row i / group
// of the item, GQA head i % group of its KV head).
struct LaneKeys {
  int j0;           // the chunk's first key
  int first_pos;    // the item's first row's position
  int group;        // query heads per KV head
  int first_head;   // the KV head's first query head
  int window;       // sliding window (<= 0: none)
  const float* alibi_slopes;  // per query head, or nullptr
};

// The queries of the lane vector at v0 as a KeyMask: lane i holds row i / group of the item,
// GQA head i % group of its KV head.
static inline KeyMask lane_mask(const LaneKeys& k, int v0) {
  alignas(64) int32_t pos[VW];
  alignas(64) float slope[VW];
  for (int l = 0; l < VW; ++l) {
    const int i = v0 + l;
    pos[l] = k.first_pos + i / k.group;
    slope[l] = k.alibi_slopes ? k.alibi_slopes[k.first_head + i % k.group] : 0.0f;
  }
  vint positions;
  std::memcpy(&positions, pos, sizeof(positions));
  return KeyMask(positions, load(slope), k.window, k.alibi_slopes);
}

// The online softmax of a chunk's n score rows (s[t][m], rows mp apart) down the lanes of
// the query vector at v0 (micro-kernels with queries in lanes): one max, exp and sum per
// vector; the accumulator rows of queries whose max moved (of the first m) are rescaled.
// kShortExp: the exp of exp_minus<kShortExp>. kMasked: the scores first masked and biased
// per lane (lane_mask of `keys`); a lane that has seen no visible key keeps a max of -inf and
// takes its probabilities against 0 (all 0). Out of line: inlined into the pair tiles'
// chunk loop, GCC kept the running total on the stack (a store and a reload per key;
// multi-token bf16 and fp8 measured faster out of line).
template <bool kShortExp, bool kMasked>
__attribute__((noinline)) static void query_vector_softmax(float* s, int n, int mp, int v0, int m,
                                                           float* run_max, float* run_sum,
                                                           float* acc, int hspv, const LaneKeys* keys) {
  vfloat top;
  if constexpr (kMasked) {
    const KeyMask mask = lane_mask(*keys, v0);
    top = splat(-__builtin_inff());
    for (int t = 0; t < n; ++t) {
      const vfloat x = mask.apply(load(s + int64_t(t) * mp + v0), vint{} + (keys->j0 + t));
      store(s + int64_t(t) * mp + v0, x);
      top = vmax(top, x);
    }
  } else {
    top = load(s + v0);
    for (int t = 1; t < n; ++t) top = vmax(top, load(s + int64_t(t) * mp + v0));
  }
  const vfloat old = load(run_max + v0);
  const vfloat now = vmax(old, top);
  vfloat shift = now;
  if constexpr (kMasked) shift = now == splat(-__builtin_inff()) ? vfloat{} : now;
  vfloat total{};
  for (int t = 0; t < n; ++t) {
    const vfloat p = exp_minus<kShortExp>(load(s + int64_t(t) * mp + v0), shift);
    store(s + int64_t(t) * mp + v0, p);
    total += p;
  }
  float alpha[VW];
  for (int l = 0; l < VW; ++l) alpha[l] = old[l] == now[l] ? 1.0f : std::exp(old[l] - now[l]);
  rescale_rows(acc + int64_t(v0) * hspv, hspv, alpha, std::min(VW, m - v0));
  vfloat alphas;
  std::memcpy(&alphas, alpha, sizeof(alphas));
  store(run_sum + v0, load(run_sum + v0) * alphas + total);
  store(run_max + v0, now);
}

// Keys per chunk of queries-in-rows micro-kernels, by the cache's dtype T: 32, which
// spreads the per-chunk softmax work over more keys; 16 for fp32 with several queries per
// KV head, where the shorter chunk measured faster (8 KiB of a head's rows at head size
// 128, one block at block size 16); 64 for fp8 rows of up to 128 bytes, 8 KiB of rows a
// phase as bf16's 32 (measured faster than 32 from DRAM and from L2; 64 keys of 16-bit
// rows, 16 KiB a phase, measured slower from DRAM). Not for per-token rows: 32 measured
// faster for int8's (docs/performance.md); int4's, widened per chunk, take 32 alike (not
// measured apart).
template <typename T>
static inline int row_chunk_keys(int per_head, int hs, int hsv) {
  return sizeof(T) == sizeof(float) && per_head > 1                       ? 16
         : sizeof(T) == 1 && !kPerToken<T> && std::max(hs, hsv) <= 128 ? 64
                                                                        : 32;
}

// Queries in lanes, a chunk of n keys: the tiles convert its rows, then fetch the next
// chunk's keys and values ([next keys; next values]) at the pace of their score tiles; the
// soft cap, then the softmax down the lanes, query vector by query vector (masked and
// biased per lane where `keys` is given: a key some query may not see, or ALiBi), each
// vector's probabilities handed to the tiles (their rounding to pairs); the weighted values.
// Out of line, its own register allocation: inlined into the chunk loop, the tiles were left
// out of line or spilled their accumulators every step (lane items measured slower). The
// tiles and the state are copies in its frame: reached through the driver's references,
// their fields were read again after every store of probability pairs, which may alias them
// (pair-tile multi-token measured 2-4% slower).
template <typename T, typename Tiles>
__attribute__((noinline)) static void lane_chunk_step(Tiles tiles, const ItemState st, float soft_cap,
                                                      bool short_exp, const LaneKeys* keys, const T* const* k_rows,
                                                      const T* const* v_rows, int n, const ChunkTokenScales scales,
                                                      const T* const* next_rows, int next_n) {
  const int lanes = (st.num_queries + VW - 1) / VW * VW;
  tiles.load_chunk(k_rows, v_rows, n, scales);
  tiles.scores(st, n, next_rows, next_n);
  if (soft_cap > 0.0f) soft_cap_scores(st.scores, int64_t(n) * lanes, soft_cap);
  const bool short_form = sizeof(T) < sizeof(float) && short_exp;
  auto softmax = [&](auto shortened, auto masked, int v0) {
    query_vector_softmax<decltype(shortened)::value, decltype(masked)::value>(
        st.scores, n, lanes, v0, st.num_queries, st.run_max, st.run_sum, st.acc, st.hspv, keys);
  };
  using yes = std::true_type;
  using no = std::false_type;
  for (int v0 = 0; v0 < lanes; v0 += VW) {
    if (keys) short_form ? softmax(yes{}, yes{}, v0) : softmax(no{}, yes{}, v0);
    else short_form ? softmax(yes{}, no{}, v0) : softmax(no{}, no{}, v0);
    tiles.probabilities(st, n, v0);
  }
  tiles.values(st, n);
}

// The attention driver: one work item of T rows on the micro-kernel Tiles (row_tiles.h:
// queries in rows; lane_float_tiles.h, lane_pair_tiles.h: queries in lanes).
// kHeadSize > 0: both head sizes are kHeadSize.
template <typename T, int kHeadSize, typename Tiles>
void attention_driver(const AttentionParams& P, const WorkItem& w, float* ws) {
  constexpr bool kInLanes = Tiles::kLayout == ScoreLayout::kQueriesInLanes;
  const int hs = kHeadSize > 0 ? kHeadSize : P.head_size;
  const int hsv = kHeadSize > 0 ? kHeadSize : P.head_size_v;
  const int hsp = (hs + VW - 1) / VW * VW;
  const int hspv = (hsv + VW - 1) / VW * VW;
  const int group = P.num_heads / P.num_kv_heads;
  const int num_rows = w.row_end - w.row_begin;
  const int num_heads = w.kv_head_end - w.kv_head_begin;
  const int per_head = num_rows * group;  // queries of one KV head
  const int num_queries = num_heads * per_head;
  // Queries in lanes: padded to whole vectors; their softmax state is kept for every lane.
  const int lane_queries = (per_head + VW - 1) / VW * VW;
  const int CH = kInLanes ? kLaneChunk : row_chunk_keys<T>(per_head, hs, hsv);

  // Workspace, queries in rows: queries, accumulators, scores, running max and sum of every
  // query (ordered KV head, row, GQA head), one chunk of fp32 keys and values (ragged head
  // sizes), then the unscaled bf16 queries (bf16 dot products), for fp8 keys in quad
  // order too; each region from a cache line (aligned_workspace). Queries in lanes: one KV
  // head's (lane_workspace), the driver walking the item head by head.
  float* q_f = aligned_workspace(ws);
  float* acc = q_f + int64_t(num_queries) * hsp;
  float* scores = acc + int64_t(num_queries) * hspv;
  float* run_max = scores + int64_t(num_queries) * kKeyChunk;
  float* run_sum = run_max + cache_lines_floats(num_queries);
  float* k_f = run_sum + cache_lines_floats(num_queries);
  float* v_f = k_f + int64_t(CH) * hsp;
  uint16_t* q_bits = reinterpret_cast<uint16_t*>(v_f + int64_t(CH) * hspv);
  uint16_t* q_quad = q_bits + 2 * cache_lines_floats((int64_t(num_queries) * hsp + 1) / 2);
  const LaneShape lane_shape{hs, hsv, hsp, hspv, per_head, lane_queries};
  LaneWorkspace lanes{};
  if constexpr (kInLanes) lanes = lane_workspace(ws, lane_shape);
  // Per chunk, so forced inline, as block_rows and touch_blocks: grown by the KV heads'
  // opening and closing, the driver left them out of line, and decode measured slower.
  auto head_state = [&](int i) __attribute__((always_inline)) {
    const int kv = w.kv_head_begin + i;
    const float score_scale = P.k_scale ? P.scale * P.k_scale[kv * P.k_scale_stride] : P.scale;
    if constexpr (kInLanes)
      return ItemState{kv, per_head, group, hsp, hspv, lanes.queries, nullptr, nullptr, score_scale,
                       lanes.acc, lanes.scores, lanes.run_max, lanes.run_sum};
    const int64_t m0 = int64_t(i) * per_head;
    return ItemState{kv, per_head, group, hsp, hspv, q_f + m0 * hsp,
                     q_bits + m0 * hsp, q_quad + m0 * 4 * hsp, score_scale, acc + m0 * hspv,
                     scores + m0 * kKeyChunk, run_max + m0, run_sum + m0};
  };
  // Queries in rows: rows of whole vectors are read in place; others are converted to fp32
  // rows first. So are rows that serve many queries (multi-token items) and cost more to
  // widen than a load: in place, every register tile of queries would widen each row again.
  // Queries in lanes: the stored rows go to the tiles, which convert them.
  const bool widen_once = !kCheapToWiden<T> && per_head >= kWidenOnceQueries<T>;
  constexpr bool kInPlace = kInLanes || !kPerToken<T> || kPerTokenInPlace<T>;  // as RowTilesFor
  const bool in_place = [&] {
    if constexpr (kInLanes) return true;
    else return kInPlace && hsp == hs && hspv == hsv && !widen_once && Tiles::reads_in_place(P, hs, hsv);
  }();
  // The item's products: their paths by dtype, head sizes and query dtype. Pieces that may
  // run out of line (the KV heads' opening and closing, the lane chunk step) take copies:
  // with its address handed to them, the chunk loop would read the tiles' fields from
  // memory instead of keeping them in registers.
  const Tiles tiles = [&] {
    if constexpr (kInLanes) return Tiles(P, lanes, lane_shape);
    else return Tiles(P, hs, hsv, in_place);
  }();
  // The shorter exp (exp_minus) where the output is 16-bit.
  const bool short_exp = short_exp_output<T>(P.query_kind);
  auto softmax = [&](const ItemState& st, int j0, int n) {
    if constexpr (sizeof(T) < sizeof(float))
      if (short_exp) return chunk_softmax<true>(P, w, st, j0, n, CH);
    chunk_softmax<false>(P, w, st, j0, n, CH);
  };
  // int8 rows read in place: their key and value scales applied by the softmax.
  auto scaled_softmax = [&](const ItemState& st, int j0, int n, const float* ks, const float* vs) {
    if constexpr (kPerToken<T>) {
      if (short_exp) return chunk_softmax<true, true>(P, w, st, j0, n, CH, ks, vs);
      chunk_softmax<false, true>(P, w, st, j0, n, CH, ks, vs);
    }
  };

  // A KV head's state before its first chunk: its queries (the tiles' order), running max,
  // sum and accumulators (queries in lanes: every lane's). Left to GCC to inline, as
  // close_head: forced out of line, the row items' chunk loop compiled differently and some
  // dtypes' decode measured slower (docs/performance.md).
  const int state_queries = kInLanes ? lane_queries : per_head;
  auto open_head = [&](int i, const Tiles item_tiles) {
    const ItemState st = head_state(i);
    item_tiles.load_queries(P, w, st);
    std::fill(st.run_max, st.run_max + state_queries, -__builtin_inff());
    std::fill(st.run_sum, st.run_sum + state_queries, 0.0f);
    std::memset(st.acc, 0, sizeof(float) * state_queries * hspv);
  };
  // A KV head's epilogue after its last chunk: each query's sink, lse, value scale and output.
  auto close_head = [&](int i, const Tiles item_tiles) {
    const ItemState st = head_state(i);
    // An fp8 value scale (and e4m3's unit, unless the values were looked up exactly)
    // applies to the weighted sum once.
    const float v_factor = P.v_scale ? P.v_scale[st.kv_head * P.v_scale_stride] * item_tiles.value_unit() : 1.0f;
    for (int q = 0; q < per_head; ++q) {
      const int token = w.row_begin + q / group;
      const int head = st.kv_head * group + q % group;
      const float* am = st.acc + int64_t(q) * hspv;
      const float inv = finish_query(P, w, token, head, st.run_max[q], st.run_sum[q], v_factor);
      write_output(P, w, token, head, [&](float* o) { item_tiles.output_row(am, o, hsv, inv); });
    }
  };

  const T* key_cache = static_cast<const T*>(P.key_cache);
  const T* value_cache = static_cast<const T*>(P.value_cache);
  const int bs = P.block_size;
  const int32_t* table = P.block_tables + int64_t(w.seq) * P.block_table_stride;
  const int k_row_bytes = hs / kValuesPerElement<T> * int(sizeof(T));
  const int v_row_bytes = hsv / kValuesPerElement<T> * int(sizeof(T));
  // Pointers to the key and value rows of keys [j0, j0 + n) of one KV head, by the caches'
  // strides: one division per chunk, then block by block through the table, each block's
  // run of rows a stride walk (GCC vectorises it; the walk with a multiply and a block test
  // per row was a large share of the chunk loop's own cost in profiles).
  const int64_t k_token_stride = P.k_token_stride, v_token_stride = P.v_token_stride;
  // The key and value rows of slot `slot` of logical block `logical` of a KV head.
  auto block_rows = [&](int logical, int kv_head, int slot) __attribute__((always_inline)) {
    const int64_t block = table[logical];
    return std::pair{key_cache + block * P.k_block_stride + kv_head * P.k_head_stride + slot * k_token_stride,
                     value_cache + block * P.v_block_stride + kv_head * P.v_head_stride + slot * v_token_stride};
  };
  auto walk_rows = [&](int j0, int n, int kv_head, const T** __restrict k, const T** __restrict v) {
    int logical = j0 / bs, slot = j0 - logical * bs;
    for (int t = 0; t < n; ++logical, slot = 0) {
      auto [k_row, v_row] = block_rows(logical, kv_head, slot);
      const int end = t + std::min(bs - slot, n - t);
      for (; t < end; ++t, k_row += k_token_stride, v_row += v_token_stride) {
        k[t] = k_row;
        v[t] = v_row;
      }
    }
  };

  // Per-token rows: the scales of keys [j0, j0 + n) of one KV head, which follow the block
  // table as the rows do.
  auto walk_token_scales = [&](int j0, int n, int kv_head, const float** k, const float** v) {
    const int64_t* ks = P.k_token_scale_strides;
    const int64_t* vs = P.v_token_scale_strides;
    for (int t = 0; t < n; ++t) {
      const int64_t block = table[(j0 + t) / bs], slot = (j0 + t) % bs;
      k[t] = P.k_token_scale + block * ks[0] + kv_head * ks[1] + slot * ks[2];
      v[t] = P.v_token_scale + block * vs[0] + kv_head * vs[1] + slot * vs[2];
    }
  };

  // Per-token rows read in place: the chunk's key and value scales in the order its rows
  // were walked (1 past n): key order, or with `blocks` > 1 interleaved across the chunk's
  // blocks as the GQA walk below takes them (slot r of block b at r * blocks + b). Each
  // key's scale multiplies its scores (q . k = s (q . q8)) and each value's its
  // probabilities (acc += (p s) q8), the running sums untouched, in the softmax's own
  // passes where a row has one scale (scaled_softmax; two passes of their own measured
  // slower); rows with a scale and a low (0 past n) leave both to their tiles
  // (finish_scores, weigh_values; kTokenScales).
  float chunk_k_scale[kKeyChunk], chunk_v_scale[kKeyChunk];
  float chunk_k_low[kKeyChunk], chunk_v_low[kKeyChunk];
  auto store_scales = [&](int t, const float* k, const float* v) {
    chunk_k_scale[t] = *k;
    chunk_v_scale[t] = *v;
    if constexpr (kTokenScales<T> == TokenScales::kScaleAndLow) {
      chunk_k_low[t] = k[1];
      chunk_v_low[t] = v[1];
    }
  };
  // Block by block, as walk_rows (a division per key took a visible share of the chunk).
  auto gather_token_scales = [&](int j0, int n, int kv_head, int blocks) {
    const int64_t* ks = P.k_token_scale_strides;
    const int64_t* vs = P.v_token_scale_strides;
    auto scales_at = [&](int logical, int slot) {
      const int64_t block = table[logical];
      return std::pair{P.k_token_scale + block * ks[0] + kv_head * ks[1] + slot * ks[2],
                       P.v_token_scale + block * vs[0] + kv_head * vs[1] + slot * vs[2]};
    };
    if (blocks > 1) {
      with_blocks(blocks, [&](auto count) {
        for (int b = 0, first = j0 / bs; b < count; ++b) {
          auto [k, v] = scales_at(first + b, 0);
          for (int r = 0; r < bs; ++r, k += ks[2], v += vs[2]) store_scales(r * count + b, k, v);
        }
      });
      return;
    }
    int logical = j0 / bs, slot = j0 - logical * bs;
    for (int t = 0; t < n; ++logical, slot = 0) {
      auto [k, v] = scales_at(logical, slot);
      for (const int end = t + std::min(bs - slot, n - t); t < end; ++t, k += ks[2], v += vs[2])
        store_scales(t, k, v);
    }
    for (int t = n; t < CH; ++t) {
      chunk_k_scale[t] = chunk_v_scale[t] = 1.0f;
      chunk_k_low[t] = chunk_v_low[t] = 0.0f;
    }
  };

  // One line of each block of keys [j0, j0 + n) of a KV head, keys and values: where pages
  // are 4 KiB a head's rows of a block are a page of their own, and this touch, a chunk
  // before the rows' prefetches, walks it early: the page walk no longer stalls the
  // prefetches (measured faster GQA decode on 4 KiB pages, about even on huge pages).
  // Only where a block's rows of a head fill 2 KiB or more (at most 1 prefetch in 32 more):
  // with small blocks the extra touches cost more than the walks they save (measured). Not
  // for queries in lanes, whose tiles fetch the next chunk's rows all through a chunk: there
  // the touches stalled on their page walks (lane items measured slower).
  const bool touch_pages = !kInLanes && int64_t(bs) * k_row_bytes >= 2048;
  auto touch_blocks = [&](int j0, int n, int kv_head) __attribute__((always_inline)) {
    for (int logical = j0 / bs, end = j0 + n; logical * bs < end; ++logical) {
      const auto [k_row, v_row] = block_rows(logical, kv_head, std::max(j0 - logical * bs, 0));
      prefetch(k_row);
      prefetch(v_row);
    }
  };

  // Traversal: the keys are cut into spans of one block (at least one chunk); for each
  // span, every KV head of the item reads its rows of the span chunk by chunk. In the
  // HND layout a head's rows of a block are contiguous and the heads of a block are
  // adjacent, so the item reads memory in address order within a block. Spans are aligned
  // to multiples of `span` keys and clipped to the item's keys; a chunk carries its span,
  // so stepping from chunk to chunk divides nothing. Micro-kernels that walk KV heads
  // outermost (Tiles::kHeadsOuter: queries in lanes, one head's accumulators in L1) take
  // every span of a head before the next head.
  const int span = bs > CH ? bs : CH;
  struct Chunk {
    int j0, n, head;  // keys [j0, j0 + n) of the item's head `head` (0-based); n = 0: done
    int begin, end;   // the span
  };
  auto span_chunk = [&](int begin, int end, int head) {
    return Chunk{begin, std::min(CH, end - begin), head, begin, end};
  };
  auto first_chunk = [&](int head) {
    return span_chunk(w.kv_begin, std::min(w.kv_end, (w.kv_begin / span + 1) * span), head);
  };
  auto next_chunk = [&](const Chunk& c) {
    if (c.j0 + CH < c.end) return Chunk{c.j0 + CH, std::min(CH, c.end - c.j0 - CH), c.head, c.begin, c.end};
    if constexpr (Tiles::kHeadsOuter) {
      if (c.end < w.kv_end) return span_chunk(c.end, std::min(w.kv_end, c.end + span), c.head);
      if (c.head + 1 < num_heads) return first_chunk(c.head + 1);
    } else {
      if (c.head + 1 < num_heads) return span_chunk(c.begin, c.end, c.head + 1);
      if (c.end < w.kv_end) return span_chunk(c.end, std::min(w.kv_end, c.end + span), 0);
    }
    return Chunk{w.kv_end, 0, 0, w.kv_end, w.kv_end};
  };
  // KV heads are opened before their first chunk and closed after their last: all of them
  // around the walk, or (kHeadsOuter) each as the walk enters and leaves it.
  auto enter = [&](const Chunk& c) {
    if constexpr (Tiles::kHeadsOuter)
      if (c.j0 == w.kv_begin) open_head(c.head, tiles);  // a head's first chunk
  };
  auto leave = [&](const Chunk& c, const Chunk& next) {
    if constexpr (Tiles::kHeadsOuter)
      if (next.n == 0 || next.head != c.head) close_head(c.head, tiles);
  };
  // Spans outermost, every KV head is opened before the walk and closed after it; so is each
  // head of an item without keys (its rows see nothing: zeros, lse -inf), which the walk
  // never enters.
  const bool around_walk = !Tiles::kHeadsOuter || w.kv_begin >= w.kv_end;
  if (around_walk)
    for (int i = 0; i < num_heads; ++i) open_head(i, tiles);

  // The chunk loop is written out in both branches below: a shared generic lambda for it
  // measured slower on bf16 GQA decode.
  bool widened = true;
  if constexpr (kInPlace) {
    if (in_place) {
      widened = false;
      // Rows are whole vectors: read them in place. While a chunk's scores are computed
      // its values are prefetched into L1 and the next chunk's keys into L2; while its
      // values are accumulated, the next chunk's keys into L1 and its values into L2
      // (prefetch_same_line). So one phase's arithmetic overlaps the misses of the next two.
      // The row pointers live in a ring of chunk rows (one flat array, rows kKeyChunk apart):
      // a chunk's keys, its values, the next chunk's keys and the next chunk's values are four
      // consecutive rows, so [values; next keys] and [next keys; next values] are the `ahead`
      // arrays of its two phases, filled by the table walk. Chunks alternate between rows 0-3
      // and 2-5; every other chunk first copies its rows from 4-5 to 0-1.
      const T* ring[6 * kKeyChunk];
      auto row = [&](int i) { return ring + i * kKeyChunk; };
      // GQA: a chunk of whole blocks whose keys every row of the item sees unmodified (a
      // key's position then changes nothing) takes its rows interleaved across its blocks,
      // row r of each block, then row r + 1, so the reads and prefetches of every phase
      // stream from all its blocks at once, as amx's do, with no bookkeeping: measured a
      // little faster from DRAM, even in L2 and L3. MHA rows keep the row order (no gain
      // measured), and so do queries in lanes (interleaved, fp8 multi-token measured slower).
      // Measurements: docs/performance.md.
      // Per-token rows gather their scales in the same order (gather_token_scales).
      const int chunk_blocks = !kInLanes && per_head > 1 && bs < CH && CH % bs == 0 ? CH / bs : 0;
      auto free_order = [&](const Chunk& f) {
        return chunk_blocks > 1 && f.n == CH && keys_plainly_visible(P, w, f.j0, f.n);
      };
      auto walk_chunk = [&](const Chunk& f, const T** __restrict k, const T** __restrict v) {
        if (!free_order(f)) return walk_rows(f.j0, f.n, w.kv_head_begin + f.head, k, v);
        // Spans are then CH keys aligned to CH, so a chunk of CH keys starts a block.
        with_blocks(chunk_blocks, [&](auto blocks) {
          const T* k_first[kKeyChunk];
          const T* v_first[kKeyChunk];
          for (int b = 0, first = f.j0 / bs; b < blocks; ++b) {
            const auto [k_row, v_row] = block_rows(first + b, w.kv_head_begin + f.head, 0);
            k_first[b] = k_row;
            v_first[b] = v_row;
          }
          for (int r = 0; r < bs; ++r)
            for (int b = 0; b < blocks; ++b) {
              k[r * blocks + b] = k_first[b] + r * k_token_stride;
              v[r * blocks + b] = v_first[b] + r * v_token_stride;
            }
        });
      };
      int r = 0;
      Chunk c = first_chunk(0);
      walk_chunk(c, row(0), row(1));
      while (c.n > 0) {
        const Chunk next = next_chunk(c);
        enter(c);
        const ItemState st = head_state(c.head);
        const T** k_rows = row(r);
        const T** v_rows = row(r + 1);
        const T** next_k = row(r + 2);
        const T** next_v = row(r + 3);
        if (next.n > 0) {
          walk_chunk(next, next_k, next_v);
          const Chunk after = next_chunk(next);
          if (touch_pages && after.n > 0) touch_blocks(after.j0, after.n, w.kv_head_begin + after.head);
          // A shorter next chunk: its last row stands in for the missing ones.
          for (int t = next.n; t < c.n; ++t) {
            next_k[t] = next_k[next.n - 1];
            next_v[t] = next_v[next.n - 1];
          }
        } else {
          // After the last chunk the scores phase prefetches this chunk's values twice.
          for (int t = 0; t < c.n; ++t) next_k[t] = v_rows[t];
        }
        const T* const* scores_ahead = v_rows;
        const T* const* keys_ahead = next.n > 0 ? next_k : nullptr;
        if constexpr (kPerToken<T>)
          gather_token_scales(c.j0, c.n, w.kv_head_begin + c.head, free_order(c) ? chunk_blocks : 0);
        if constexpr (kInLanes) {
          const LaneKeys masks{c.j0, w.first_pos, group, st.kv_head * group, P.sliding_window, P.alibi_slopes};
          const bool plain = keys_plainly_visible(P, w, c.j0, c.n);
          const ChunkTokenScales scales =
              kPerToken<T> ? ChunkTokenScales{chunk_k_scale, chunk_v_scale} : ChunkTokenScales{};
          lane_chunk_step<T>(tiles, st, P.soft_cap, short_exp, plain ? nullptr : &masks, k_rows, v_rows, c.n, scales,
                             next_k, next.n);
        } else {
          tiles.scores(st, k_rows, c.n, scores_ahead);
          if constexpr (kTokenScales<T> == TokenScales::kScaleAndLow) {
            tiles.finish_scores(st, chunk_k_scale, chunk_k_low);
            softmax(st, c.j0, c.n);
            tiles.weigh_values(st, chunk_v_scale, chunk_v_low, c.n);
          } else if constexpr (kPerToken<T>) {
            scaled_softmax(st, c.j0, c.n, chunk_k_scale, chunk_v_scale);
          } else {
            softmax(st, c.j0, c.n);
          }
          tiles.values(st, v_rows, c.n, keys_ahead);
        }
        leave(c, next);
        if (r == 0) {
          r = 2;
        } else {
          // Keys and values: as many pointers as T's chunks take at most, a constant size
          // (one 1 KiB copy of both rows, or a run-time size, measured slower bf16 decode).
          std::memcpy(row(0), row(4), sizeof(ring[0]) * kMaxChunk<T>);
          std::memcpy(row(1), row(5), sizeof(ring[0]) * kMaxChunk<T>);
          r = 0;
        }
        c = next;
      }
    }
  }
  // Queries in rows, ragged head sizes (and per-token rows): convert each chunk into
  // zero-padded fp32 rows first.
  if (!kInLanes && widened) {
    std::memset(k_f, 0, sizeof(float) * CH * hsp);
    std::memset(v_f, 0, sizeof(float) * CH * hspv);
    const float* k_rows[kKeyChunk];
    const float* v_rows[kKeyChunk];
    for (int t = 0; t < CH; ++t) {
      k_rows[t] = k_f + int64_t(t) * hsp;
      v_rows[t] = v_f + int64_t(t) * hspv;
    }
    const float* const* none = nullptr;
    // The cache rows of the current chunk ([0]: keys, [1]: values) and of the next one.
    const T* rows[2][2][kKeyChunk];
    // Per-token rows: the scales of the current chunk's rows, [0] keys and [1] values.
    const float* token_scales[2][kKeyChunk];
    int cur = 0;
    Chunk c = first_chunk(0);
    walk_rows(c.j0, c.n, w.kv_head_begin + c.head, rows[0][0], rows[0][1]);
    while (c.n > 0) {
      const Chunk next = next_chunk(c);
      enter(c);
      const ItemState st = head_state(c.head);
      const T** next_k = rows[1 - cur][0];
      const T** next_v = rows[1 - cur][1];
      walk_rows(next.j0, next.n, w.kv_head_begin + next.head, next_k, next_v);
      if constexpr (kPerToken<T>)
        walk_token_scales(c.j0, c.n, w.kv_head_begin + c.head, token_scales[0], token_scales[1]);
      for (int t = 0; t < c.n; ++t) {
        if constexpr (kPerToken<T>) {
          token_row_to_float(rows[cur][0][t], token_scales[0][t], k_f + int64_t(t) * hsp, hs);
          token_row_to_float(rows[cur][1][t], token_scales[1][t], v_f + int64_t(t) * hspv, hsv);
        } else {
          row_to_float(rows[cur][0][t], k_f + int64_t(t) * hsp, hs);
          row_to_float(rows[cur][1][t], v_f + int64_t(t) * hspv, hsv);
        }
        if (t < next.n) {
          prefetch_row(next_k[t], k_row_bytes);
          prefetch_row(next_v[t], v_row_bytes);
        }
      }
      chunk_scores(st, st.q, k_rows, c.n, none);
      softmax(st, c.j0, c.n);
      chunk_values(st, v_rows, c.n, none);
      leave(c, next);
      cur = 1 - cur;
      c = next;
    }
  }

  if (around_walk)
    for (int i = 0; i < num_heads; ++i) close_head(i, tiles);
}

// The queries-in-rows micro-kernel of T rows: per-token rows the driver widens to fp32
// are taken by the fp32 tiles.
template <typename T>
using RowTilesFor = RowTiles<std::conditional_t<!kPerToken<T> || kPerTokenInPlace<T>, T, float>>;

// A work item's micro-kernel, and its driver's compile. Items of several rows (multi-token,
// a shared prefix) with at least a vector of queries per KV head: queries in lanes, pair
// tiles (vdpbf16ps) where the compile has them and they take the item's dtype and head sizes
// (per-token int8 included), else fp32 tiles (one compile for every head size) but for
// per-token rows. Those and other items: queries in rows. Head size 128 (most models) gets
// its own compile of the rows' driver: with constant trip counts the compiler unrolls the
// row loops.
template <typename T>
void attention_work_item(const AttentionParams& P, const WorkItem& w, float* ws) {
  // bf16 rows of whole 4 x VW-element steps are read in split order where the ISA has it
  // (AVX2, convert.h): every reader's steps then cover them exactly.
  if constexpr (std::is_same_v<T, Bf16> && kHasSplitRows) {
    if (P.head_size % (4 * VW) == 0 && P.head_size_v % (4 * VW) == 0) {
      attention_work_item<Bf16Split>(P, w, ws);
      return;
    }
  }
  const bool many_rows = P.queries_after_keys || w.row_end - w.row_begin >= 2;
  if (many_rows && (w.row_end - w.row_begin) * (P.num_heads / P.num_kv_heads) >= VW) {
    if constexpr (LanePairTiles<T>::kAvailable)
      if (LanePairTiles<T>::takes(P)) return attention_driver<T, 0, LanePairTiles<T>>(P, w, ws);
    // Per-token rows widened into the fp32 lane tiles measured no faster than in rows (int8
    // and int4 on avx2) or slower (int4 against its in-place rows on avx512_bf16).
    if constexpr (!kPerToken<T>) return attention_driver<T, 0, LaneFloatTiles<T>>(P, w, ws);
  }
  if (P.head_size == 128 && P.head_size_v == 128) attention_driver<T, 128, RowTilesFor<T>>(P, w, ws);
  else attention_driver<T, 0, RowTilesFor<T>>(P, w, ws);
}

// The vector compile's entry: the work-item function for a cache dtype.
inline AttentionKernelFn vector_kernel_for(ScalarKind kind) {
  switch (kind) {
    case ScalarKind::kFloat32: return &attention_work_item<float>;
    case ScalarKind::kFloat16: return &attention_work_item<Fp16>;
    case ScalarKind::kBFloat16: return &attention_work_item<Bf16>;
    case ScalarKind::kFloat8E4M3: return &attention_work_item<Fp8E4M3>;
    case ScalarKind::kFloat8E5M2: return &attention_work_item<Fp8E5M2>;
    case ScalarKind::kInt8: return &attention_work_item<Int8Row>;
    case ScalarKind::kInt4: return &attention_work_item<Int4Row>;
  }
  return nullptr;
}
