// Which keys a query sees, and the ALiBi term of its scores: one rule for every softmax of
// the CPU kernel (attention_kernel.h's, over a query's row or down a vector of queries, and
// amx_kernel.h's). Part of the CPU kernel, inside its ISA namespace (see vec.h).
//
// Key j is visible to the query at position pos when j <= pos and, with a sliding window of
// w keys, j > pos - w. ALiBi adds slope x (j - pos) to the score of every visible key.
#pragma once

#include "vec.h"

// Whether every query at positions [first_pos, last_pos] sees every key of [j0, j0 + n):
// none past the first query's position, none outside the last one's window.
static inline bool keys_visible(const AttentionParams& P, int j0, int n, int first_pos, int last_pos) {
  return j0 + n - 1 <= first_pos && (P.sliding_window <= 0 || j0 > last_pos - P.sliding_window);
}

// The rule over vectors of positions, the queries' side fixed: a vector of scores of keys
// `key` becomes masked (-inf where not visible) and biased. Either side may be the vector:
// one query's scores of a vector of keys (its positions and slope broadcast), or one key's
// scores of a vector of queries (their own positions and slopes).
struct KeyMask {
  vint pos, window_start;  // the queries' positions; keys at or before window_start are out
  vfloat slope;            // ALiBi slopes (alibi)
  bool alibi, window;

  KeyMask(vint positions, vfloat slopes, int sliding_window, bool with_alibi)
      : pos(positions), window_start(positions - (sliding_window > 0 ? sliding_window : 0)), slope(slopes),
        alibi(with_alibi), window(sliding_window > 0) {}

  vfloat apply(vfloat x, vint key) const {
    if (alibi) x += slope * __builtin_convertvector(key - pos, vfloat);
    vint seen = key <= pos;
    if (window) seen &= key > window_start;
    return seen ? x : splat(-__builtin_inff());
  }
};

// Lane l of a vector of positions: first + l.
static inline vint positions_from(int first) {
  vint v;
  for (int l = 0; l < VW; ++l) v[l] = first + l;
  return v;
}
