// fp8 rows (and per-token int8 rows, ByteLookup) converted to bf16 (and fp32) by AVX512_VBMI
// table lookups, for the vdpbf16ps tiles (bf16_tiles.h), the fp32 tiles (fp8_tiles.h) and
// the lane tiles. Part of the CPU
// kernel, inside its ISA namespace (see vec.h).
#pragma once

#include "convert.h"

#if PAGED_ISA_AVX512_VBMI
// fp8 keys against bf16 queries with vdpbf16ps: each key row is converted to bf16 exactly
// (every e4m3 / e5m2 value is a bf16 value, subnormals included) by two byte lookups,
// vpermi2b (AVX512_VBMI) over 128-entry tables of the bf16's high and low byte indexed by
// the byte's low 7 bits (the sign is OR-ed in), joined into words by two byte unpacks
// (fp8_to_bf16_lanes): a 64-byte step leaves its elements in 128-bit lane order
// (fp8_lane_element), and the caller permutes the query the same way. Values take the same
// words into fp32 (bf16 << 16; fp8_value_slot order), or, for bf16 queries, two rows'
// bytes interleaved before the lookups into pairs (pair_words, bf16_tiles.h; the AMX
// kernel's value tiles alike).
constexpr uint16_t fp8_bf16_bits(int mantissa, int exponent) {  // mantissa * 2^exponent
  if (mantissa == 0) return 0;
  int top = 0;
  while ((mantissa >> (top + 1)) != 0) ++top;
  return uint16_t(((exponent + top + 127) << 7) | ((mantissa - (1 << top)) << (7 - top)));
}
constexpr uint16_t fp8_bf16_bits(Fp8E4M3 x) {  // bias 7, 3 mantissa bits; 0x7f is NaN
  const int e = x.bits >> 3, m = x.bits & 7;
  if ((x.bits & 0x7f) == 0x7f) return 0x7fc0;
  return e == 0 ? fp8_bf16_bits(m, -9) : fp8_bf16_bits(8 + m, e - 10);
}
constexpr uint16_t fp8_bf16_bits(Fp8E5M2 x) {  // bias 15, 2 mantissa bits; exponent 31: inf, NaN
  const int e = x.bits >> 2, m = x.bits & 3;
  if (e == 31) return m == 0 ? 0x7f80 : 0x7fc0;
  return e == 0 ? fp8_bf16_bits(m, -16) : fp8_bf16_bits(4 + m, e - 17);
}
// The byte types looked up into bf16 by the tables below: the fp8 types by their low 7 bits
// (sign OR-ed in), and per-token int8 by its magnitude (vpabsb; every int8 is a bf16 value)
// with its sign bit OR-ed in the same way. -128, whose magnitude does not fit the 7-bit index
// (write_kv never stores it, another writer may), is set apart (fp8_bf16_bytes).
template <typename T>
struct ByteLookup {
  static constexpr bool kMagnitude = false;  // index by |x| rather than by x's low 7 bits
  static constexpr uint16_t bits(int i) { return fp8_bf16_bits(T{uint8_t(i)}); }
};
template <>
struct ByteLookup<Int8Row> {
  static constexpr bool kMagnitude = true;
  static constexpr uint16_t bits(int i) { return fp8_bf16_bits(i, 0); }
};
template <typename T>
constexpr bool kByteLookup = std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2> ||
                             std::is_same_v<T, Int8Row>;

struct Fp8Bf16Table {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};
template <typename T>
constexpr Fp8Bf16Table fp8_bf16_table() {
  Fp8Bf16Table t{};
  for (int i = 0; i < 128; ++i) {
    const uint16_t bits = ByteLookup<T>::bits(i);
    t.high[i] = uint8_t(bits >> 8);
    t.low[i] = uint8_t(bits & 0xff);
  }
  return t;
}
template <typename T>
inline constexpr Fp8Bf16Table kFp8Bf16 = fp8_bf16_table<T>();

// ternarylogic immediate for a | (b & c).
constexpr int kOrAnd = 0xf8;

// The two lookups of 64 fp8 (or int8) bytes: each byte's bf16 high byte (its sign OR-ed in)
// and low byte.
template <typename T>
__attribute__((always_inline)) static inline void fp8_bf16_bytes(__m512i x, __m512i& high, __m512i& low) {
  const __m512i* table = reinterpret_cast<const __m512i*>(&kFp8Bf16<T>);
  const __m512i index = ByteLookup<T>::kMagnitude ? _mm512_abs_epi8(x) : x;
  high = _mm512_ternarylogic_epi32(  // with the sign: high | (x & 0x80)
      _mm512_permutex2var_epi8(_mm512_load_si512(table), index, _mm512_load_si512(table + 1)), x,
      _mm512_set1_epi8(char(0x80)), kOrAnd);
  low = _mm512_permutex2var_epi8(_mm512_load_si512(table + 2), index, _mm512_load_si512(table + 3));
  // int8 -128 looked up entry 0 (0's low byte, 0x00, is -128's too); its high byte is 0xc3.
  if constexpr (ByteLookup<T>::kMagnitude)
    high = _mm512_mask_mov_epi8(high, _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8(char(0x80))),
                                _mm512_set1_epi8(char(0xc3)));
}

// 64 fp8 bytes as bf16 words in 128-bit lane order, the lookups' bytes joined by two
// unpacks (two operations fewer than shifts and blends into even / odd order): lane l of
// `first` holds the words of bytes 16 l + j, of `second` bytes 16 l + 8 + j (j < 8).
template <typename T>
__attribute__((always_inline)) static inline void fp8_to_bf16_lanes(__m512i x, __m512i& first,
                                                                    __m512i& second) {
  __m512i high, low;
  fp8_bf16_bytes<T>(x, high, low);
  first = _mm512_unpacklo_epi8(low, high);
  second = _mm512_unpackhi_epi8(low, high);
}
// Slot i of a key step converted by fp8_to_bf16_lanes holds element fp8_lane_element(i).
static inline int fp8_lane_element(int i) {
  const int half = i / 32, word = i % 32;
  return 16 * (word / 8) + 8 * half + word % 8;
}

// 64 fp8 values as fp32, element i in slot fp8_value_slot(i) of four vectors: the words of
// fp8_to_bf16_lanes, low halves of their 32-bit lanes first. fp8_words_to_float<J> makes
// vector J, fp8_to_float64 all four.
template <int J>
__attribute__((always_inline)) static inline vfloat fp8_words_to_float(__m512i first, __m512i second) {
  const __m512i words = J % 2 == 0 ? first : second;
  if constexpr (J < 2) return (vfloat)_mm512_slli_epi32(words, 16);
  else return (vfloat)_mm512_and_si512(words, _mm512_set1_epi32(int(0xffff0000u)));
}
template <typename T>
__attribute__((always_inline)) static inline void fp8_to_float64(const T* p, vfloat (&v)[4]) {
  __m512i first, second;
  fp8_to_bf16_lanes<T>(_mm512_loadu_si512(p), first, second);
  v[0] = fp8_words_to_float<0>(first, second);
  v[1] = fp8_words_to_float<1>(first, second);
  v[2] = fp8_words_to_float<2>(first, second);
  v[3] = fp8_words_to_float<3>(first, second);
}
static inline int fp8_value_slot(int i) {
  const int lane = i / 16, word = i % 8, second = i % 16 / 8;
  return 16 * (second + 2 * (word % 2)) + 4 * lane + word / 2;
}

#endif  // PAGED_ISA_AVX512_VBMI
