// The cache's element types and their conversion to fp32: scalar (row tails, the
// reference for the vector paths) and VW elements at a time (widened in registers). Part of the CPU kernel,
// inside its ISA namespace (see vec.h).
#pragma once

#include "vec.h"

struct Bf16 { uint16_t bits; };
// bf16 rows read in place in split order (AVX2; see load2_as_float(const Bf16Split*)).
struct Bf16Split { uint16_t bits; };
struct Fp16 { uint16_t bits; };
struct Fp8E4M3 { uint8_t bits; };  // torch.float8_e4m3fn
struct Fp8E5M2 { uint8_t bits; };  // torch.float8_e5m2
// The per-token formats (token_quantization.py): each row with its own fp32 scale beside
// the cache. int8 rows, read in place like fp8 ones (the driver applies each key's scale
// to its scores and each value's to its probabilities; on the AVX512_VBMI kernels
// converted by the fp8 byte tables, fp8_bf16_tables.h, elsewhere widened in registers), or
// widened once per chunk with the scale folded in; int4 rows of two values a byte, even
// channel in the low nibble, rotated, read in place by vdpbf16ps on AVX512_BF16
// (int4_bf16_tiles.h) or widened with scale and low folded in (token_row_to_float) for the
// fp32 tiles.
struct Int8Row { int8_t bits; };
struct Int4Row { uint8_t bits; };
// How a format's per-token scales reach the products, which is all the attention driver asks of
// a format about them: none; one scale per row (int8), which the driver's softmax applies to
// rows read in place (scores times the key's scale, probabilities times the value's); a scale
// and a low (zero point) per row (int4), which the format's tiles apply around the softmax
// (finish_scores, weigh_values). Lane tiles take the chunk's scales with its rows
// (ChunkTokenScales, lane_tiles.h) and apply them themselves. Another per-token format picks
// one of these and leaves the driver as it is.
enum class TokenScales { kNone, kScale, kScaleAndLow };
template <typename T>
constexpr TokenScales kTokenScales = TokenScales::kNone;
template <>
constexpr TokenScales kTokenScales<Int8Row> = TokenScales::kScale;
template <>
constexpr TokenScales kTokenScales<Int4Row> = TokenScales::kScaleAndLow;
template <typename T>
constexpr bool kPerToken = kTokenScales<T> != TokenScales::kNone;
// Per-token rows the attention driver reads in place: int8's, and int4's where AVX512_BF16 takes
// them (elsewhere they are always widened).
#if PAGED_ISA_AVX512_BF16
template <typename T>
constexpr bool kPerTokenInPlace = std::is_same_v<T, Int8Row> || std::is_same_v<T, Int4Row>;
#else
template <typename T>
constexpr bool kPerTokenInPlace = std::is_same_v<T, Int8Row>;
#endif
// Values an element holds (a row of head_size values is head_size / this elements).
template <typename T>
constexpr int kValuesPerElement = std::is_same_v<T, Int4Row> ? 2 : 1;

// The loaders below return a stored element divided by its type's unit: e4m3 is widened
// to fp16 by moving its bits into place without rebiasing the exponent (bias 7 read as
// fp16's 15), which divides every value by 2^8 exactly; the kernel folds the 2^8 into
// the fp8 scales. 1 for every other type.
template <typename T> struct StoredUnit { static constexpr float value = 1.0f; };
template <> struct StoredUnit<Fp8E4M3> { static constexpr float value = 256.0f; };

// Rows widened in registers for no more than a load costs: fp32, bf16 (a shift) and fp16
// where F16C converts it (one instruction, the load folded in).
template <typename T>
constexpr bool kSplitRows = std::is_same_v<T, Bf16Split>;

template <typename T>
constexpr bool kCheapToWiden = sizeof(T) == 4 || std::is_same_v<T, Bf16> || kSplitRows<T> ||
                               (std::is_same_v<T, Fp16> && kAvxIsa);

// ---- scalar conversions (row tails) ------------------------------------------
static inline float to_float(float x) { return x; }
static inline float to_float(Bf16 x) {
  uint32_t bits = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline float to_float(Fp16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1f;
  uint32_t mantissa = x.bits & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: renormalise
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400) == 0);
    bits = sign | uint32_t(112 - e) << 23 | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp8 -> fp16 bits. e5m2 is the top byte of an fp16 (exact, inf and NaN included).
// e4m3fn: sign to bit 15, exponent and mantissa to bits 13..7 (value / 2^8, subnormals
// included); its NaN (S.1111.111) would land on 1.875, so it gets fp16 NaN bits.
static inline uint16_t half_bits(Fp8E5M2 x) { return uint16_t(x.bits << 8); }
static inline uint16_t half_bits(Fp8E4M3 x) {
  const uint16_t h = uint16_t(((x.bits & 0x80) << 8) | ((x.bits & 0x7f) << 7));
  return (x.bits & 0x7f) == 0x7f ? uint16_t(h | 0x7e00) : h;
}
static inline float to_float(Fp8E5M2 x) { return to_float(Fp16{half_bits(x)}); }
static inline float to_float(Fp8E4M3 x) { return to_float(Fp16{half_bits(x)}); }
static inline float to_float(Int8Row x) { return float(x.bits); }

// ---- vector conversions: VW elements of the cache type -> VW floats ---------

// fp16 bits (one per 32-bit lane) to fp32 without F16C, branch-free: normal values are
// rebiased in the exponent bits, subnormals are their integer mantissa times 2^-24 (both
// exact), exponent 31 is inf / NaN. Forced inline: out of line, a call per vector.
__attribute__((always_inline)) static inline vfloat half_bits_to_float(vuint h) {
  const vuint sign = (h & 0x8000u) << 16;
  const vuint exponent = h & 0x7c00u;
  const vuint mantissa = h & 0x3ffu;
  const vuint normal = ((h & 0x7fffu) << 13) + (112u << 23);
  const vuint special = 0x7f800000u | (mantissa << 13);
  const vuint subnormal = (vuint)(__builtin_convertvector((vint)mantissa, vfloat) * splat(0x1p-24f));
  // Selects as bit masks made by shifts (no compares): exponent - 1 is negative only for
  // 0; exponent + 0x400 reaches bit 15 only for 0x7c00.
  const vuint is_subnormal = (vuint)((vint)(exponent - 1u) >> 31);
  const vuint is_special = (vuint)((vint)((exponent + 0x400u) << 16) >> 31);
  const vuint bits = (subnormal & is_subnormal) | (special & is_special) |
                     (normal & ~(is_subnormal | is_special));
  return (vfloat)(bits | sign);
}

#if !PAGED_ISA_F16C && !PAGED_ISA_AVX512
// The baseline widens eight 16-bit lanes (one 16-byte register) into two vfloats.
static_assert(VW == 4, "the baseline's vectors are single 16-byte registers");
typedef uint16_t vhalf8 __attribute__((vector_size(16)));
typedef int16_t vshort8 __attribute__((vector_size(16)));
typedef uint8_t vbyte16 __attribute__((vector_size(16)));

// Two vfloats (lanes 0-3 and 4-7) from the lower and upper 16 bits of eight fp32s.
__attribute__((always_inline)) static inline void fp32_from_halves(vhalf8 lower, vhalf8 upper, vfloat& a,
                                                                   vfloat& b) {
  a = (vfloat)__builtin_shufflevector(lower, upper, 0, 8, 1, 9, 2, 10, 3, 11);
  b = (vfloat)__builtin_shufflevector(lower, upper, 4, 12, 5, 13, 6, 14, 7, 15);
}

// Whether any of eight 16-bit lane masks is set: one byte-sign mask on x86 (pmovmskb), two
// 64-bit halves elsewhere.
__attribute__((always_inline)) static inline bool any_lane(vshort8 mask) {
#if defined(__x86_64__)
  return _mm_movemask_epi8((__m128i)mask) != 0;
#else
  uint64_t halves[2];
  std::memcpy(halves, &mask, sizeof(halves));
  return (halves[0] | halves[1]) != 0;
#endif
}

// Eight fp16s to fp32. When every lane is zero or normal (nearly always) the fp32 halves
// are built in 16-bit lanes: the upper half is the sign and the magnitude shifted right by
// 3 and rebiased, the lower half the magnitude's last three bits; a vector with a
// subnormal, inf or NaN lane takes half_bits_to_float. Exact either way.
__attribute__((always_inline)) static inline void half8_to_float(vhalf8 h, vfloat& a, vfloat& b) {
  const vhalf8 magnitude = h & 0x7fff;
  const vshort8 zero = (vshort8)magnitude == 0;
  // magnitude + 0x400 is below 0x800 as int16 for exponent 0 and negative for exponent 31.
  const vshort8 rare = ((vshort8)(magnitude + 0x0400) < 0x0800) & ~zero;
  if (__builtin_expect(any_lane(rare), 0)) {
    typedef uint16_t v4half __attribute__((vector_size(8)));
    const v4half low = __builtin_shufflevector(h, h, 0, 1, 2, 3), high = __builtin_shufflevector(h, h, 4, 5, 6, 7);
    a = half_bits_to_float(__builtin_convertvector(low, vuint));
    b = half_bits_to_float(__builtin_convertvector(high, vuint));
    return;
  }
  const vhalf8 upper = (((magnitude >> 3) + 0x3800) & ~(vhalf8)zero) | (h & 0x8000);
  fp32_from_halves(h << 13, upper, a, b);
}

// The first 4, 8 or 16 bytes at p in a register, the rest zero: one scalar load placed in
// lane 0 (movd / movq). A copy into a zeroed vector in memory instead made GCC reload it
// whole just after the two stores, a failed store forwarding per load (generic e4m3 at a
// third of its speed).
template <int bytes>
__attribute__((always_inline)) static inline vbyte16 load_bytes(const void* p) {
  static_assert(bytes == 4 || bytes == 8 || bytes == 16, "a whole scalar or the register");
  if constexpr (bytes == 16) {
    vbyte16 v;
    std::memcpy(&v, p, 16);
    return v;
  } else {
    using Word = std::conditional_t<bytes == 8, uint64_t, uint32_t>;
    typedef Word vword __attribute__((vector_size(16)));
    Word x;
    std::memcpy(&x, p, bytes);
    return (vbyte16)(vword{x});
  }
}
#endif

__attribute__((always_inline)) static inline vfloat load_as_float(const float* p) { return load(p); }
__attribute__((always_inline)) static inline vfloat load_as_float(const Bf16* p) {
  // bf16 is the top half of an fp32: widen and shift.
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  vfloat a, b;
  fp32_from_halves(vhalf8{}, (vhalf8)load_bytes<8>(p), a, b);
  return a;
#endif
}
__attribute__((always_inline)) static inline vfloat load_as_float(const Fp16* p) {
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
  return (vfloat)_mm512_maskz_cvtph_ps(__mmask16(0xffff), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfloat a, b;
  half8_to_float((vhalf8)load_bytes<8>(p), a, b);
  return a;
#endif
}

#if PAGED_ISA_F16C
// VW fp8 bytes sign-extended to VW 16-bit lanes (AVX2: 8 in an __m128i; AVX-512: 16 in an
// __m256i), the bit operations on them, and their conversion as fp16 to VW floats.
#if PAGED_VEC_WIDTH == 16
typedef __m256i vhalf_bits;
static inline vhalf_bits fp8_lanes(const void* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vhalf_bits h_and(vhalf_bits a, vhalf_bits b) { return _mm256_and_si256(a, b); }
static inline vhalf_bits h_or(vhalf_bits a, vhalf_bits b) { return _mm256_or_si256(a, b); }
static inline vhalf_bits h_eq(vhalf_bits a, vhalf_bits b) { return _mm256_cmpeq_epi16(a, b); }
static inline vhalf_bits h_splat(uint16_t x) { return _mm256_set1_epi16(short(x)); }
template <int N> static inline vhalf_bits h_shl(vhalf_bits a) { return _mm256_slli_epi16(a, N); }
static inline vfloat halves_to_float(vhalf_bits h) { return (vfloat)_mm512_cvtph_ps(h); }
#else
typedef __m128i vhalf_bits;
static inline vhalf_bits fp8_lanes(const void* p) {
  return _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
static inline vhalf_bits h_and(vhalf_bits a, vhalf_bits b) { return _mm_and_si128(a, b); }
static inline vhalf_bits h_or(vhalf_bits a, vhalf_bits b) { return _mm_or_si128(a, b); }
static inline vhalf_bits h_eq(vhalf_bits a, vhalf_bits b) { return _mm_cmpeq_epi16(a, b); }
static inline vhalf_bits h_splat(uint16_t x) { return _mm_set1_epi16(short(x)); }
template <int N> static inline vhalf_bits h_shl(vhalf_bits a) { return _mm_slli_epi16(a, N); }
static inline vfloat halves_to_float(vhalf_bits h) { return (vfloat)_mm256_cvtph_ps(h); }
#endif
// The lanes are sign-extended bytes, so a shift puts the sign in bit 15: e5m2 by 8 is
// exactly its fp16; e4m3 by 7, then bit 14 (a copy of the sign) cleared, is half_bits'
// placement, and NaN lanes (magnitude bits 0x3f80) get fp16 NaN bits.
__attribute__((always_inline)) static inline vfloat load_as_float(const Fp8E5M2* p) {
  return halves_to_float(h_shl<8>(fp8_lanes(p)));
}
__attribute__((always_inline)) static inline vfloat load_as_float(const Fp8E4M3* p) {
  const vhalf_bits h = h_and(h_shl<7>(fp8_lanes(p)), h_splat(0xbf80));
  const vhalf_bits nan = h_eq(h_and(h, h_splat(0x7fff)), h_splat(0x3f80));
  return halves_to_float(h_or(h, h_and(nan, h_splat(0x7e00))));
}
#else
// Without F16C: eight bytes in 16-bit lanes, in their high half (e5m2: its fp16) or low
// half, by interleaving with zero bytes (the exact interleave pattern: GCC builds others
// byte by byte in scalar code).
__attribute__((always_inline)) static inline vhalf8 bytes_high(vbyte16 b) {
  return (vhalf8)__builtin_shufflevector(vbyte16{}, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
__attribute__((always_inline)) static inline vhalf8 bytes_low(vbyte16 b) {
  return (vhalf8)__builtin_shufflevector(b, vbyte16{}, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
// e4m3 straight to fp32 (divided by its unit 2^8, see StoredUnit), exact and branch-free:
// as fp16 bits its subnormals (1 in 10 vectors of N(0, 1) data) took half8_to_float's
// slow branch. The upper 16 bits get the sign and the magnitude under an exponent rebiased
// by 127 - 7 - 8 = 112; a subnormal lane (exponent 0) gets exponent 1 instead, which reads
// as 2^-14 + m 2^-17, and 2^-14 with the lane's sign is subtracted (exact; -0 comes out
// +0, which no product or sum in the kernel can tell apart).
__attribute__((always_inline)) static inline void e4m3_to_float(vhalf8 b, vfloat& lo, vfloat& hi) {
  const vhalf8 magnitude = b & 0x7f;
  const vhalf8 sign = (b & 0x80) << 8;
  const vhalf8 subnormal = (vhalf8)((vshort8)(b & 0x78) == 0);
  const vhalf8 nan = (vhalf8)((vshort8)magnitude == 0x7f);
  // The fp32 exponent field is bits 7..14 of the upper half.
  const vhalf8 upper = ((magnitude << 4) + 0x3800 + (subnormal & 0x80)) | (nan & 0x7fc0) | sign;
  vfloat value_lo, value_hi, unit_lo, unit_hi;
  fp32_from_halves(vhalf8{}, upper, value_lo, value_hi);
  fp32_from_halves(vhalf8{}, subnormal & (0x3880 | sign), unit_lo, unit_hi);
  lo = value_lo - unit_lo;
  hi = value_hi - unit_hi;
}
__attribute__((always_inline)) static inline vfloat load_as_float(const Fp8E5M2* p) {
  vfloat a, b;
  half8_to_float(bytes_high(load_bytes<VW>(p)), a, b);
  return a;
}
__attribute__((always_inline)) static inline vfloat load_as_float(const Fp8E4M3* p) {
  vfloat a, b;
  e4m3_to_float(bytes_low(load_bytes<VW>(p)), a, b);
  return a;
}
#endif

// VW int8s sign-extended and converted (vpmovsxbd and vcvtdq2ps on AVX-512 / AVX2; GCC
// compiles a one-step __builtin_convertvector from bytes element by element: docs/performance.md).
__attribute__((always_inline)) static inline vfloat load_as_float(const Int8Row* p) {
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
  return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8
  return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t vint8 __attribute__((vector_size(VW)));
  vint8 bytes;
  std::memcpy(&bytes, p, VW);
  return __builtin_convertvector(__builtin_convertvector(bytes, vint), vfloat);
#endif
}

// Two vectors (elements [0, VW) and [VW, 2 VW)) at once. AVX-512 widens 32 fp8 bytes with
// one zmm of 16-bit lanes: half the integer instructions per element of two single loads
// (the conversion, not the FMAs, bounds fp8 decode when every key serves one query).
template <typename T>
__attribute__((always_inline)) static inline void load2_as_float(const T* p, vfloat& a, vfloat& b) {
  a = load_as_float(p);
  b = load_as_float(p + VW);
}
#if !PAGED_ISA_F16C && !PAGED_ISA_AVX512
// The baseline widens a register of eight 16-bit lanes into both vectors at once.
__attribute__((always_inline)) static inline void load2_as_float(const Bf16* p, vfloat& a, vfloat& b) {
  fp32_from_halves(vhalf8{}, (vhalf8)load_bytes<16>(p), a, b);
}
__attribute__((always_inline)) static inline void load2_as_float(const Fp16* p, vfloat& a, vfloat& b) {
  half8_to_float((vhalf8)load_bytes<16>(p), a, b);
}
__attribute__((always_inline)) static inline void load2_as_float(const Fp8E5M2* p, vfloat& a, vfloat& b) {
  half8_to_float(bytes_high(load_bytes<8>(p)), a, b);
}
__attribute__((always_inline)) static inline void load2_as_float(const Fp8E4M3* p, vfloat& a, vfloat& b) {
  e4m3_to_float(bytes_low(load_bytes<8>(p)), a, b);
}
#endif
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
static inline __m512i fp8_lanes32(const void* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline void halves32_to_float(__m512i h, vfloat& a, vfloat& b) {
  a = (vfloat)_mm512_cvtph_ps(_mm512_castsi512_si256(h));
  b = (vfloat)_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
static inline void load2_as_float(const Fp8E5M2* p, vfloat& a, vfloat& b) {
  halves32_to_float(_mm512_slli_epi16(fp8_lanes32(p), 8), a, b);
}
// As load_as_float(const Fp8E4M3*); NaN lanes take fp16 NaN bits by a masked blend.
static inline void load2_as_float(const Fp8E4M3* p, vfloat& a, vfloat& b) {
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(fp8_lanes32(p), 7),
                                     _mm512_set1_epi16(short(0xbf80)));
  const __m512i magnitude_bits = _mm512_set1_epi16(0x3f80);
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, magnitude_bits), magnitude_bits);
  halves32_to_float(_mm512_mask_blend_epi16(nan, h, _mm512_set1_epi16(0x7e00)), a, b);
}
#endif

#if PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8
// AVX2: 16 fp8 bytes as one ymm of 16-bit lanes, half the integer instructions per element
// of two single loads; an e4m3 NaN lane becomes 0xffff (an fp16 NaN) by one OR.
static inline __m256i fp8_lanes16(const void* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline void halves16_to_float(__m256i h, vfloat& a, vfloat& b) {
  a = (vfloat)_mm256_cvtph_ps(_mm256_castsi256_si128(h));
  b = (vfloat)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
// e5m2 bytes interleaved with zero bytes are their fp16s: two in-lane unpacks, no
// lane-crossing widening or shift (measured faster than widening, Zen 3, in cache).
static inline void load2_as_float(const Fp8E5M2* p, vfloat& a, vfloat& b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  a = (vfloat)_mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), bytes));
  b = (vfloat)_mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), bytes));
}
static inline void load2_as_float(const Fp8E4M3* p, vfloat& a, vfloat& b) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(fp8_lanes16(p), 7), _mm256_set1_epi16(short(0xbf80)));
  const __m256i magnitude_bits = _mm256_set1_epi16(0x3f80);
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), magnitude_bits);
  halves16_to_float(_mm256_or_si256(h, nan), a, b);
}
#endif

// Split order: 2 VW bf16 elements from one load, the even ones (shifted up) in the first
// vector and the odd ones (masked) in the second: one integer instruction per VW elements,
// half of them a plain AND, instead of a widening and a shift each (vpmovzxwd, vpslld). A
// dot product does not care about the order when the query is in the same one; value
// accumulators stay in it for the whole item (split_slot). So every reader of such rows
// takes whole 2 x VW steps: the kernel splits rows of whole 4 x VW-element steps only.
// AVX2 and AVX-512 without AVX512_BF16 (which reads bf16 rows with vdpbf16ps).
#if (PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8) || (PAGED_ISA_AVX512 && !PAGED_ISA_AVX512_BF16)
constexpr bool kHasSplitRows = true;
static inline void load2_as_float(const Bf16Split* p, vfloat& even, vfloat& odd) {
#if PAGED_VEC_WIDTH == 16
  const __m512i x = _mm512_loadu_si512(p);
  even = (vfloat)_mm512_slli_epi32(x, 16);
  odd = (vfloat)_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u)));
#else
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = (vfloat)_mm256_slli_epi32(x, 16);
  odd = (vfloat)_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u)));
#endif
}
#else
constexpr bool kHasSplitRows = false;
#endif

// Element d of a split row -> its slot in split order (2 x VW-element steps).
static inline int split_slot(int d) {
  const int i = d % (2 * VW);
  return d - i + (i % 2) * VW + i / 2;
}

// Converts head_size elements into dst (the padded tail of dst is untouched).
template <typename T>
static inline void row_to_float(const T* src, float* dst, int head_size) {
  int d = 0;
  for (; d + 2 * VW <= head_size; d += 2 * VW) {
    vfloat a, b;
    load2_as_float(src + d, a, b);
    store(dst + d, a);
    store(dst + d + VW, b);
  }
  for (; d + VW <= head_size; d += VW) store(dst + d, load_as_float(src + d));
  for (; d < head_size; ++d) dst[d] = to_float(src[d]);
}
// A per-token row of head_size values to fp32 with its scale: q * scale (int8),
// q * scale + low (int4, still rotated; scale_low = (scale, low)).
static inline void token_row_to_float(const Int8Row* src, const float* scale, float* dst, int head_size) {
  const float s = *scale;
  for (int d = 0; d < head_size; ++d) dst[d] = float(src[d].bits) * s;
}
static inline void token_row_to_float(const Int4Row* src, const float* scale_low, float* dst, int head_size) {
  const float s = scale_low[0], low = scale_low[1];
  for (int d = 0; d < head_size / 2; ++d) {
    dst[2 * d] = float(src[d].bits & 15) * s + low;
    dst[2 * d + 1] = float(src[d].bits >> 4) * s + low;
  }
}
// A split row converted in element order (the ragged path and the lane tiles read fp32 rows).
static inline void row_to_float(const Bf16Split* src, float* dst, int head_size) {
  row_to_float(reinterpret_cast<const Bf16*>(src), dst, head_size);
}
