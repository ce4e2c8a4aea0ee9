// The arithmetic ceiling of int4 rows read in place (csrc/cpu/int4_bf16_tiles.h): the
// kernel's inner loops alone, L1-resident, one thread. A chunk of 64 keys of head size 128
// (32 bytes a 64-channel step) against G queries: scores (each row's nibbles to bf16
// 128 + n, vpmovzxbw + vpternlogd / vpsrlw + vpord, then vdpbf16ps against G queries of two
// bf16 parts each, 4 keys a tile) and values (two keys' rows interleaved into 32-bit lanes,
// vpmovzxbw x 2 + vpunpck{l,h}wd + 2 x (vpternlogd, vpsrld + vpternlogd), then vdpbf16ps
// with G broadcast weight pairs of two parts each), without the sums of the score tiles,
// the softmax or the scales. The same loops over bf16 rows with one part (the bf16 cache's
// tiles, no conversion) for comparison. Multiply-adds counted once per element (keys and
// values, G x 64 x 128 each a chunk), as the decode rows count them.
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512bf16 bench/microbench/int4_dot_peak.cpp -o /tmp/int4_dot_peak
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kKeys = 64, kHead = 128;

alignas(64) uint8_t keys[kKeys][kHead / 2], values[kKeys][kHead / 2];
alignas(64) uint16_t keys16[kKeys][kHead], values16[kKeys][kHead];
alignas(64) uint16_t query[8][kHead], query_low[8][kHead];
alignas(64) float acc_out[8][kHead];
alignas(64) uint32_t pairs[8][kKeys / 2], pairs_low[8][kKeys / 2];

__attribute__((always_inline)) inline void nibbles(const uint8_t* row, __m512i& even, __m512i& odd) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  const __m512i bits = _mm512_set1_epi16(0x4300);
  even = _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(15), bits, 0xea);
  odd = _mm512_or_si512(_mm512_srli_epi16(w, 4), bits);
}

template <int G, bool kInt4>
__attribute__((noinline)) void chunk(float* sink) {
  // Scores.
  for (int t = 0; t < kKeys; t += 4) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int d = 0; d < kHead; d += 64) {
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        if constexpr (kInt4) {
          nibbles(keys[t + i] + d / 2, lo[i], hi[i]);
        } else {
          lo[i] = _mm512_loadu_si512(keys16[t + i] + d);
          hi[i] = _mm512_loadu_si512(keys16[t + i] + d + 32);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(query[g] + d);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(query[g] + d + 32);
        const __m512bh r0 = (__m512bh)_mm512_loadu_si512(query_low[g] + d);
        const __m512bh r1 = (__m512bh)_mm512_loadu_si512(query_low[g] + d + 32);
        for (int i = 0; i < 4; ++i) {
          acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q0, (__m512bh)lo[i]);
          acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q1, (__m512bh)hi[i]);
          if constexpr (kInt4) {
            acc[g][i] = _mm512_dpbf16_ps(acc[g][i], r0, (__m512bh)lo[i]);
            acc[g][i] = _mm512_dpbf16_ps(acc[g][i], r1, (__m512bh)hi[i]);
          }
        }
      }
    }
    __m512 total = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) total = _mm512_add_ps(total, acc[g][i]);
    _mm512_storeu_ps(sink, _mm512_add_ps(_mm512_loadu_ps(sink), total));
  }
  // Values.
  const __m512i low_nibbles = _mm512_set1_epi32(0x000f000f), bits = _mm512_set1_epi32(0x43004300);
  for (int d = 0; d < kHead; d += 64) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 4; ++k) a[g][k] = _mm512_loadu_ps(acc_out[g] + d + 16 * k);
    for (int t = 0; t < kKeys; t += 2) {
      __m512i ab[4];
      if constexpr (kInt4) {
        const __m512i wa = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t] + d / 2)));
        const __m512i wb = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t + 1] + d / 2)));
        const __m512i lo = _mm512_unpacklo_epi16(wa, wb), hi = _mm512_unpackhi_epi16(wa, wb);
        ab[0] = _mm512_ternarylogic_epi32(lo, low_nibbles, bits, 0xea);
        ab[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 4), low_nibbles, bits, 0xea);
        ab[2] = _mm512_ternarylogic_epi32(hi, low_nibbles, bits, 0xea);
        ab[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(hi, 4), low_nibbles, bits, 0xea);
      } else {
        for (int k = 0; k < 2; ++k) {
          const __m512i xa = _mm512_loadu_si512(values16[t] + d + 32 * k);
          const __m512i xb = _mm512_loadu_si512(values16[t + 1] + d + 32 * k);
          ab[2 * k] = _mm512_unpacklo_epi16(xa, xb);
          ab[2 * k + 1] = _mm512_unpackhi_epi16(xa, xb);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pairs[g][t / 2]));
        const __m512bh pl = (__m512bh)_mm512_set1_epi32(int(pairs_low[g][t / 2]));
        for (int k = 0; k < 4; ++k) {
          a[g][k] = _mm512_dpbf16_ps(a[g][k], (__m512bh)ab[k], pp);
          if constexpr (kInt4) a[g][k] = _mm512_dpbf16_ps(a[g][k], (__m512bh)ab[k], pl);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc_out[g] + d + 16 * k, a[g][k]);
  }
}

// Multiply-adds per second (keys and values), the best of five runs (the machine is shared).
template <int G, bool kInt4>
double macs_per_second() {
  constexpr long kChunks = 200000;
  alignas(64) float sink[16] = {};
  double best = 0;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long c = 0; c < kChunks; ++c) chunk<G, kInt4>(sink);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = double(kChunks) * G * kKeys * kHead * 2 / seconds;
    if (rate > best) best = rate;
  }
  volatile float keep = sink[0] + acc_out[0][0];
  (void)keep;
  return best;
}

}  // namespace

int main() {
  for (int t = 0; t < kKeys; ++t)
    for (int d = 0; d < kHead; ++d) {
      keys[t][d / 2] = uint8_t(t * 7 + d);
      values[t][d / 2] = uint8_t(t * 5 + d);
      keys16[t][d] = values16[t][d] = 0x3f80;
    }
  for (int g = 0; g < 8; ++g) {
    for (int d = 0; d < kHead; ++d) query[g][d] = query_low[g][d] = 0x3380;  // 2^-24: the sums stay finite
    for (int t = 0; t < kKeys / 2; ++t) pairs[g][t] = pairs_low[g][t] = 0x33803380u;
  }
  std::printf("int4 rows (nibbles to bf16, two-part vdpbf16ps), L1, 1 thread: G=1 %.1f, G=4 %.1f GMAC/s\n",
              macs_per_second<1, true>() / 1e9, macs_per_second<4, true>() / 1e9);
  std::printf("bf16 rows (vdpbf16ps alone),                    L1, 1 thread: G=1 %.1f, G=4 %.1f GMAC/s\n",
              macs_per_second<1, false>() / 1e9, macs_per_second<4, false>() / 1e9);
}
