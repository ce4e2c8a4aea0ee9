// Vector helpers of the CPU attention kernel (attention_kernel.h): GCC vector types of
// PAGED_VEC_WIDTH floats, loads that widen fp16/bf16 to fp32, exp, horizontal sums,
// prefetches, and the register-tile dot products and weighted sums (with vdpbf16ps
// versions for AVX512_BF16). Compiled once per instruction set like the kernel
// (isa_kernel.h), textually inside its ISA namespace, after attention_params.h; the
// macros that select the instructions:
//   PAGED_VEC_WIDTH        fp32 lanes per vector (16, 8)
//   PAGED_ISA_AVX512       1 when AVX-512F intrinsics may be used
//   PAGED_ISA_AVX512_BF16  1 when AVX512_BF16 dot products may be used (optional)
//   PAGED_ISA_F16C         1 when AVX2 and F16C intrinsics may be used

constexpr int VW = PAGED_VEC_WIDTH;
typedef float vfloat __attribute__((vector_size(VW * 4)));
typedef int32_t vint __attribute__((vector_size(VW * 4)));
typedef uint32_t vuint __attribute__((vector_size(VW * 4)));
typedef uint16_t vhalfword __attribute__((vector_size(VW * 2)));

struct Bf16 { uint16_t bits; };
struct Fp16 { uint16_t bits; };
struct Fp8E4M3 { uint8_t bits; };  // torch.float8_e4m3fn
struct Fp8E5M2 { uint8_t bits; };  // torch.float8_e5m2

// The loaders below return a stored element divided by its type's unit: e4m3 is widened
// to fp16 by moving its bits into place without rebiasing the exponent (bias 7 read as
// fp16's 15), which divides every value by 2^8 exactly; the kernel folds the 2^8 into
// the fp8 scales. 1 for every other type.
template <typename T> struct StoredUnit { static constexpr float value = 1.0f; };
template <> struct StoredUnit<Fp8E4M3> { static constexpr float value = 256.0f; };

static inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// A broadcast. x - 0 is exactly x (for -0 too), so this folds to one broadcast; the
// `vfloat{} + x` it replaces cost a scalar add first (0 + -0 is +0).
static inline vfloat splat(float x) { return x - vfloat{}; }

typedef float v8float __attribute__((vector_size(32)));
typedef float v4float __attribute__((vector_size(16)));

// The low half plus the high half, down to 8 lanes.
static inline v8float fold8(vfloat v) {
#if PAGED_VEC_WIDTH == 16
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}

static inline float hsum(vfloat v) {
  const v8float a = fold8(v);
  v4float c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c += __builtin_shufflevector(c, c, 2, 3, 0, 1);
  c += __builtin_shufflevector(c, c, 1, 0, 3, 2);
  return c[0];
}

template <typename V>
static inline V vmax(V a, V b) { return a > b ? a : b; }

#if !PAGED_ISA_F16C && !PAGED_ISA_AVX512
// The baseline: without AVX, GCC compares a vector wider than 16 bytes lane by lane in
// scalar code (a cmov per lane), so its lane masks come from 16-byte halves and its selects
// are bit operations.
static inline vint less_mask(vfloat a, vfloat b) {
  typedef int32_t v4int __attribute__((vector_size(16)));
  static_assert(VW == 8, "the baseline's vectors are two 16-byte halves");
  auto low = [](vfloat v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); };
  auto high = [](vfloat v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); };
  const v4int m0 = low(a) < low(b), m1 = high(a) < high(b);
  return __builtin_shufflevector(m0, m1, 0, 1, 2, 3, 4, 5, 6, 7);
}
static inline vfloat select(vint mask, vfloat yes, vfloat no) {
  return (vfloat)(((vint)yes & mask) | ((vint)no & ~mask));
}
static inline vfloat vmax(vfloat a, vfloat b) { return select(less_mask(b, a), a, b); }
#endif

static inline float hmax(vfloat v) {
#if PAGED_VEC_WIDTH == 16
  const v8float a = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  const v8float a = v;
#endif
  v4float c = vmax(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
  c = vmax(c, __builtin_shufflevector(c, c, 2, 3, 0, 1));
  c = vmax(c, __builtin_shufflevector(c, c, 1, 0, 3, 2));
  return c[0];
}

// Four horizontal sums at once (a shuffle tree instead of four separate ones).
static inline void hsum4(vfloat a, vfloat b, vfloat c, vfloat d, float* out) {
  const v8float a8 = fold8(a), b8 = fold8(b), c8 = fold8(c), d8 = fold8(d);
  // [a0+a4 .. a3+a7, b0+b4 .. b3+b7] and the same for c, d.
  const v8float ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8float cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  // Pairs: [a, a, c, c, b, b, d, d] partial sums.
  const v8float pairs = __builtin_shufflevector(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14) +
                        __builtin_shufflevector(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15);
  const v4float sums = __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6) +
                       __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7);  // [a, c, b, d]
  out[0] = sums[0];
  out[1] = sums[2];
  out[2] = sums[1];
  out[3] = sums[3];
}

// ---- scalar conversions (tails and the generic fp16 path) -------------------
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

// ---- vector conversions: VW elements of the cache type -> VW floats ---------

// fp16 bits (one per 32-bit lane) to fp32 without F16C, branch-free: normal values are
// rebiased in the exponent bits, subnormals are their integer mantissa times 2^-24 (both
// exact), exponent 31 is inf / NaN.
static inline vfloat half_bits_to_float(vuint h) {
  const vuint sign = (h & 0x8000u) << 16;
  const vuint exponent = h & 0x7c00u;
  const vuint mantissa = h & 0x3ffu;
  const vuint normal = ((h & 0x7fffu) << 13) + (112u << 23);
  const vuint special = 0x7f800000u | (mantissa << 13);
  const vuint subnormal = (vuint)(__builtin_convertvector((vint)mantissa, vfloat) * splat(0x1p-24f));
  // Selects as bit masks made by shifts: without AVX GCC compares wide vectors lane by
  // lane in scalar code. exponent - 1 is negative only for 0; exponent + 0x400 reaches
  // bit 15 only for 0x7c00.
  const vuint is_subnormal = (vuint)((vint)(exponent - 1u) >> 31);
  const vuint is_special = (vuint)((vint)((exponent + 0x400u) << 16) >> 31);
  const vuint bits = (subnormal & is_subnormal) | (special & is_special) |
                     (normal & ~(is_subnormal | is_special));
  return (vfloat)(bits | sign);
}

static inline vfloat load_as_float(const float* p) { return load(p); }
static inline vfloat load_as_float(const Bf16* p) {
  // bf16 is the top half of an fp32: widen and shift.
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  vhalfword h;
  std::memcpy(&h, p, sizeof(h));
  return (vfloat)(__builtin_convertvector(h, vuint) << 16);
#endif
}
static inline vfloat load_as_float(const Fp16* p) {
#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
  return (vfloat)_mm512_maskz_cvtph_ps(__mmask16(0xffff), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif PAGED_ISA_F16C && PAGED_VEC_WIDTH == 8
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vhalfword h;
  std::memcpy(&h, p, sizeof(h));
  return half_bits_to_float(__builtin_convertvector(h, vuint));
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
static inline vfloat load_as_float(const Fp8E5M2* p) { return halves_to_float(h_shl<8>(fp8_lanes(p))); }
static inline vfloat load_as_float(const Fp8E4M3* p) {
  const vhalf_bits h = h_and(h_shl<7>(fp8_lanes(p)), h_splat(0xbf80));
  const vhalf_bits nan = h_eq(h_and(h, h_splat(0x7fff)), h_splat(0x3f80));
  return halves_to_float(h_or(h, h_and(nan, h_splat(0x7e00))));
}
#else
// Without F16C: the bytes become fp16 bits as in half_bits (one per 32-bit lane).
typedef uint8_t vbytes __attribute__((vector_size(VW)));
static inline vuint fp8_bytes(const void* p) {
  vbytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vuint);
}
static inline vfloat load_as_float(const Fp8E5M2* p) { return half_bits_to_float(fp8_bytes(p) << 8); }
static inline vfloat load_as_float(const Fp8E4M3* p) {
  const vuint b = fp8_bytes(p);
  const vuint h = ((b & 0x80u) << 8) | ((b & 0x7fu) << 7);
  const vuint is_nan = (vuint)((vint)(((b & 0x7fu) + 1u) << 24) >> 31);  // magnitude 0x7f
  return half_bits_to_float(h | (is_nan & 0x7e00u));
}
#endif

// Two vectors (elements [0, VW) and [VW, 2 VW)) at once. AVX-512 widens 32 fp8 bytes with
// one zmm of 16-bit lanes: half the integer instructions per element of two single loads
// (the conversion, not the FMAs, bounds fp8 decode when every key serves one query).
template <typename T>
static inline void load2_as_float(const T* p, vfloat& a, vfloat& b) {
  a = load_as_float(p);
  b = load_as_float(p + VW);
}
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
static inline void load2_as_float(const Fp8E5M2* p, vfloat& a, vfloat& b) {
  halves16_to_float(_mm256_slli_epi16(fp8_lanes16(p), 8), a, b);
}
static inline void load2_as_float(const Fp8E4M3* p, vfloat& a, vfloat& b) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(fp8_lanes16(p), 7), _mm256_set1_epi16(short(0xbf80)));
  const __m256i magnitude_bits = _mm256_set1_epi16(0x3f80);
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), magnitude_bits);
  halves16_to_float(_mm256_or_si256(h, nan), a, b);
}
#endif

// Converts head_size elements into dst (the padded tail of dst is untouched).
template <typename T>
static inline void row_to_float(const T* src, float* dst, int head_size) {
  int d = 0;
  for (; d + VW <= head_size; d += VW) store(dst + d, load_as_float(src + d));
  for (; d < head_size; ++d) dst[d] = to_float(src[d]);
}

// exp(x) for a vector: 0 for -inf and below the float range, NaN for NaN. Cody-Waite
// reduction x = n ln2 + r, |r| <= ln2 / 2, then e^r by exp_reduced and a scale by 2^n.

// e^r for |r| <= ln2 / 2: a degree-6 polynomial.
static inline vfloat exp_reduced(vfloat r) {
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  return p * r * r + r + splat(1.0f);
}

#if PAGED_ISA_AVX512 && PAGED_VEC_WIDTH == 16
// AVX-512: n rounded by vrndscaleps, 2^n applied by vscalefps, which gives inf above the
// float range and denormals, then 0, below it. The one clamp keeps -inf from becoming
// NaN in the reduction; e^-104 is below the smallest denormal, so it still gives 0.
static inline vfloat vexp(vfloat x) {
  const vfloat lo = splat(-104.0f);
  x = x < lo ? lo : x;  // NaN stays NaN
  const __m512 t = (__m512)(x * splat(1.44269504088896341f));
  const vfloat n = (vfloat)_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT);
  vfloat r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  return (vfloat)_mm512_scalef_ps((__m512)exp_reduced(r), (__m512)n);
}
#else
// Elsewhere: clamps, rounding by adding and subtracting 1.5 * 2^23, and 2^n built in the
// exponent bits (0 below the normal range, the largest finite result above it).
static inline vfloat vexp(vfloat x) {
  const vfloat lo = splat(-87.33654f);
  const vfloat hi = splat(88.3762626647949f);
#if PAGED_ISA_F16C
  const vfloat xc = x < lo ? lo : (x > hi ? hi : x);
#else
  const vint below = less_mask(x, lo);
  const vfloat xc = select(below, lo, select(less_mask(hi, x), hi, x));
#endif
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: round to nearest
  const vfloat n = (xc * splat(1.44269504088896341f) + magic) - magic;
  vfloat r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  const vint e = (__builtin_convertvector(n, vint) + 127) << 23;
  const vfloat result = exp_reduced(r) * (vfloat)e;
#if PAGED_ISA_F16C
  return x < lo ? vfloat{} : result;
#else
  return select(below, vfloat{}, result);
#endif
}
#endif

// GCC's dead-code elimination deletes a loop whose only effect is prefetching; the
// empty volatile asm keeps such loops.
static inline void prefetch(const void* p) {
  __builtin_prefetch(p, 0, 3);
  asm volatile("");
}

static inline void prefetch_row(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int off = 0; off < bytes; off += 64) prefetch(p + off);
}

// A row into L2 only (prefetcht1), for data read a phase later by a working set that
// fills L1.
static inline void prefetch_row_l2(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int off = 0; off < bytes; off += 64) {
    __builtin_prefetch(p + off, 0, 2);
    asm volatile("");
  }
}

// Prefetching mirrors the loads: while a phase reads bytes [x, x + 64) of its row t,
// it prefetches the same bytes of row t of the next phase's rows (`ahead`, nullable).
// Misses then stay in flight at the pace of the arithmetic instead of in bursts.
template <typename R>
static inline void prefetch_same_line(const R* const* ahead, int t, int element) {
  if (ahead && (element * int(sizeof(R))) % 64 == 0) prefetch(ahead[t] + element);
}

// The row loaders below take rows of R (float, or a 16-bit type read in place and
// widened to fp32 in registers); every row holds hsp elements.

// Dot products of one query with 4 keys.
template <typename R>
static inline void dot4(const float* q, const R* const* k, int hsp, float* out,
                        const R* const* ahead) {
  // Two accumulators per key (even and odd steps): eight independent FMA chains. The
  // loop takes two steps at a time so that both sets stay in registers (indexing them
  // by step parity put them on the stack: a store-forwarding chain per FMA).
  vfloat even[4] = {}, odd[4] = {};
  int d = 0;
  for (; d + 2 * VW <= hsp; d += 2 * VW) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d + VW);
    const vfloat q0 = load(q + d), q1 = load(q + d + VW);
    for (int i = 0; i < 4; ++i) {
      vfloat k0, k1;
      load2_as_float(k[i] + d, k0, k1);
      even[i] += q0 * k0;
      odd[i] += q1 * k1;
    }
  }
  if (d < hsp) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const vfloat q0 = load(q + d);
    for (int i = 0; i < 4; ++i) even[i] += q0 * load_as_float(k[i] + d);
  }
  hsum4(even[0] + odd[0], even[1] + odd[1], even[2] + odd[2], even[3] + odd[3], out);
}

template <typename R>
static inline float dot1(const float* q, const R* k, int hsp, const R* const* ahead) {
  vfloat a{};
  for (int d = 0; d < hsp; d += VW) {
    prefetch_same_line(ahead, 0, d);
    a += load(q + d) * load_as_float(k + d);
  }
  return hsum(a);
}

// acc[d:d + W*VW] += sum_t p[t] * v[t][d:d + W*VW]: W independent accumulator vectors.
template <int W, typename R>
static inline void accumulate_block(float* acc, const float* p, const R* const* v, int n, int d,
                                   const R* const* ahead) {
  vfloat a[W];
  for (int i = 0; i < W; ++i) a[i] = load(acc + d + i * VW);
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < W; ++i) prefetch_same_line(ahead, t, d + i * VW);
    if (p[t] == 0.0f) continue;
    const vfloat pt = splat(p[t]);
    int i = 0;
    for (; i + 2 <= W; i += 2) {
      vfloat v0, v1;
      load2_as_float(v[t] + d + i * VW, v0, v1);
      a[i] += pt * v0;
      a[i + 1] += pt * v1;
    }
    for (; i < W; ++i) a[i] += pt * load_as_float(v[t] + d + i * VW);
  }
  for (int i = 0; i < W; ++i) store(acc + d + i * VW, a[i]);
}

// acc[0:hsp] += sum_t p[t] * v[t][0:hsp], eight accumulator vectors at a time.
template <typename R>
static inline void accumulate_values(float* acc, const float* p, const R* const* v, int n, int hsp,
                                     const R* const* ahead) {
  int d = 0;
  for (; d + 8 * VW <= hsp; d += 8 * VW) accumulate_block<8>(acc, p, v, n, d, ahead);
  for (; d + 4 * VW <= hsp; d += 4 * VW) accumulate_block<4>(acc, p, v, n, d, ahead);
  for (; d < hsp; d += VW) accumulate_block<1>(acc, p, v, n, d, ahead);
}

// Register tiles: the queries of a tile share every loaded (and widened) key or value
// vector. A score tile holds G x VW/G accumulators (VW/G keys), a value tile as many
// (VW/G vectors of the row). AVX-512's 32 registers take 4 x 4. The 16 of AVX2 and SSE
// take 2 x 4, or 4 x 2 for fp8 rows: their widening costs more than their multiply-adds,
// so a tile covering a whole group of 4 queries (32/8 heads) widens each row once, not
// twice (kernel_cycles, AVX2, 32/8: e4m3 -37%, e5m2 -14% per item; fp32 and fp16 rows
// measured 7-11% slower in 4 x 2 tiles). Two queries left over then take a 2 x 4 tile.
template <typename R>
constexpr int kTileQueries = VW == 16 || sizeof(R) == 1 ? 4 : 2;

// The G x K accumulators of a score tile summed to G x K scores by one transpose tree
// (each level halves the lanes per accumulator and packs two vectors into one): cheaper
// than separate four-way sums. G x K is one vector of sums; scores land in
// s[g * kKeyChunk + i].
template <int G, int K>
__attribute__((always_inline)) static inline void hsum_tile(const vfloat (&acc)[G][K], float* s) {
  static_assert(G * K == VW, "a tile sums to one vector");
  auto flat = [&](int f) { return acc[f / K][f % K]; };
#if PAGED_VEC_WIDTH == 16
  vfloat l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) {
    const vfloat a = flat(2 * i), b = flat(2 * i + 1);
    l1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const vfloat a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const vfloat a = l2[2 * i], b = l2[2 * i + 1];
    l3[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  const vfloat r =
      __builtin_shufflevector(l3[0], l3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
      __builtin_shufflevector(l3[0], l3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vfloat l1[4], l2[2];
  for (int i = 0; i < 4; ++i) {
    const vfloat a = flat(2 * i), b = flat(2 * i + 1);
    l1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const vfloat a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  const vfloat r = __builtin_shufflevector(l2[0], l2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                   __builtin_shufflevector(l2[0], l2[1], 1, 3, 5, 7, 9, 11, 13, 15);
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
  if constexpr (sizeof(R) == 1) {  // fp8: rows widened two vectors at a time (load2_as_float)
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
  for (; d < hsp; d += VW) {
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
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < V; ++i) prefetch_same_line(ahead, t, d + i * VW);
      const R* vr = v[t] + d;
      vfloat x[V];
      for (int i = 0; i < V; i += 2) load2_as_float(vr + i * VW, x[i], x[i + 1]);
      for (int g = 0; g < G; ++g) {
        const vfloat pg = splat(p[g * kKeyChunk + t]);
        for (int i = 0; i < V; ++i) a[g][i] += pg * x[i];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) store(acc + int64_t(g) * hsp + d + i * VW, a[g][i]);
  }
  for (; d < hsp; d += VW) {
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

#if PAGED_ISA_AVX512_BF16
// bf16 keys against bf16 queries with vdpbf16ps: pairs of products summed in fp32,
// 32 elements a step, no widening. The query is the caller's unscaled bf16 (exact);
// the softmax scale is applied to the scores afterwards.
static inline __m512bh load_bf16x32(const void* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

template <int G, int K>
static inline void dot_tile(const uint16_t* q, int hsp, const Bf16* const* k, float* s,
                            const Bf16* const* ahead) {
  static_assert(G == 4 && K == 4, "the AVX-512 score tile");
  __m512 acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 32) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const __m512bh k0 = load_bf16x32(k[0] + d), k1 = load_bf16x32(k[1] + d),
                   k2 = load_bf16x32(k[2] + d), k3 = load_bf16x32(k[3] + d);
    for (int g = 0; g < G; ++g) {
      const __m512bh qv = load_bf16x32(q + int64_t(g) * hsp + d);
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], qv, k0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], qv, k1);
      acc[g][2] = _mm512_dpbf16_ps(acc[g][2], qv, k2);
      acc[g][3] = _mm512_dpbf16_ps(acc[g][3], qv, k3);
    }
  }
  vfloat sums[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = (vfloat)acc[g][i];
  hsum_tile<G, K>(sums, s);
}

static inline void dot4(const uint16_t* q, const Bf16* const* k, int hsp, float* out,
                        const Bf16* const* ahead) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int d = 0; d < hsp; d += 32) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const __m512bh qv = load_bf16x32(q + d);
    a0 = _mm512_dpbf16_ps(a0, qv, load_bf16x32(k[0] + d));
    a1 = _mm512_dpbf16_ps(a1, qv, load_bf16x32(k[1] + d));
    a2 = _mm512_dpbf16_ps(a2, qv, load_bf16x32(k[2] + d));
    a3 = _mm512_dpbf16_ps(a3, qv, load_bf16x32(k[3] + d));
  }
  hsum4((vfloat)a0, (vfloat)a1, (vfloat)a2, (vfloat)a3, out);
}

static inline float dot1(const uint16_t* q, const Bf16* k, int hsp, const Bf16* const* ahead) {
  __m512 a = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 32) {
    prefetch_same_line(ahead, 0, d);
    a = _mm512_dpbf16_ps(a, load_bf16x32(q + d), load_bf16x32(k + d));
  }
  return hsum((vfloat)a);
}

// fp8 keys against bf16 queries with vdpbf16ps: each key row is converted to bf16 exactly
// (every e4m3 / e5m2 value is a bf16 value, subnormals included) by two byte lookups,
// vpermi2b (AVX512_VBMI) over 128-entry tables of the bf16's high and low byte indexed by
// the byte's low 7 bits (the sign is OR-ed in), then paired into 16-bit lanes by shifts
// and masks (no further shuffles: port 5 runs the lookups): a 64-byte step yields the even
// elements in its first vector and the odd ones in its second (fp8_key_element); the caller
// permutes the query the same way. Values take the same lookups into fp32 (bf16 << 16),
// four vectors of elements 4k + r (fp8_value_slot), in accumulators kept in that order.
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
struct Fp8Bf16Table {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};
template <typename T>
constexpr Fp8Bf16Table fp8_bf16_table() {
  Fp8Bf16Table t{};
  for (int i = 0; i < 128; ++i) {
    const uint16_t bits = fp8_bf16_bits(T{uint8_t(i)});
    t.high[i] = uint8_t(bits >> 8);
    t.low[i] = uint8_t(bits & 0xff);
  }
  return t;
}
template <typename T>
inline constexpr Fp8Bf16Table kFp8Bf16 = fp8_bf16_table<T>();

// Slot i of a key step holds element fp8_key_element(i); element i of a value step is in
// slot fp8_value_slot(i).
static inline int fp8_key_element(int i) { return i < 32 ? 2 * i : 2 * (i - 32) + 1; }
static inline int fp8_value_slot(int i) { return 16 * (i % 4) + i / 4; }

// ternarylogic immediate for a | (b & c).
constexpr int kOrAnd = 0xf8;

template <typename T>
static inline void fp8_to_bf16x64(const T* p, __m512i& even, __m512i& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  const __m512i* table = reinterpret_cast<const __m512i*>(&kFp8Bf16<T>);
  const __m512i high = _mm512_ternarylogic_epi32(  // with the sign: high | (x & 0x80)
      _mm512_permutex2var_epi8(_mm512_load_si512(table), x, _mm512_load_si512(table + 1)), x,
      _mm512_set1_epi8(char(0x80)), kOrAnd);
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(table + 2), x, _mm512_load_si512(table + 3));
  even = _mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 8), low, _mm512_set1_epi16(0x00ff), kOrAnd);
  odd = _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 8), high, _mm512_set1_epi16(short(0xff00)), kOrAnd);
}

// 64 fp8 values as fp32: v[r] holds elements 4k + r.
template <typename T>
static inline void fp8_to_float64(const T* p, vfloat (&v)[4]) {
  __m512i even, odd;
  fp8_to_bf16x64(p, even, odd);
  const __m512i top = _mm512_set1_epi32(int(0xffff0000u));
  v[0] = (vfloat)_mm512_slli_epi32(even, 16);
  v[1] = (vfloat)_mm512_slli_epi32(odd, 16);
  v[2] = (vfloat)_mm512_and_si512(even, top);
  v[3] = (vfloat)_mm512_and_si512(odd, top);
}

// accumulate_tile / accumulate_values for fp8 rows of whole 64-element steps, accumulators
// in fp8_value_slot order.
template <int G, typename T>
static inline void accumulate_fp8(float* acc, int hsp, const float* p, const T* const* v, int n,
                                  const T* const* ahead) {
  for (int d = 0; d < hsp; d += 64) {
    vfloat a[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = load(acc + int64_t(g) * hsp + d + i * VW);
    for (int t = 0; t < n; ++t) {
      prefetch_same_line(ahead, t, d);
      if (G == 1 && p[t] == 0.0f) continue;
      vfloat x[4];
      fp8_to_float64(v[t] + d, x);
      for (int g = 0; g < G; ++g) {
        const vfloat pg = splat(p[g * kKeyChunk + t]);
        for (int i = 0; i < 4; ++i) a[g][i] += pg * x[i];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) store(acc + int64_t(g) * hsp + d + i * VW, a[g][i]);
  }
}

static inline void unpermute_fp8_values(const float* acc, float* out, int hsp, float factor) {
  for (int d = 0; d < hsp; d += 64)
    for (int i = 0; i < 64; ++i) out[d + i] = acc[d + fp8_value_slot(i)] * factor;
}

template <int G, int K, typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline void dot_tile(const uint16_t* q, int hsp, const T* const* k, float* s,
                            const T* const* ahead) {
  static_assert(G == 4 && K == 4, "the AVX-512 score tile");
  __m512 acc[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    __m512i first[4], second[4];
    for (int i = 0; i < 4; ++i) fp8_to_bf16x64(k[i] + d, first[i], second[i]);
    for (int g = 0; g < G; ++g) {
      const __m512bh q0 = load_bf16x32(q + int64_t(g) * hsp + d);
      const __m512bh q1 = load_bf16x32(q + int64_t(g) * hsp + d + 32);
      for (int i = 0; i < 4; ++i) {
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q0, (__m512bh)first[i]);
        acc[g][i] = _mm512_dpbf16_ps(acc[g][i], q1, (__m512bh)second[i]);
      }
    }
  }
  vfloat sums[G][K];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) sums[g][i] = (vfloat)acc[g][i];
  hsum_tile<G, K>(sums, s);
}

template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline void dot4(const uint16_t* q, const T* const* k, int hsp, float* out,
                        const T* const* ahead) {
  __m512 even[4], odd[4];
  for (int i = 0; i < 4; ++i) even[i] = odd[i] = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    for (int i = 0; i < 4; ++i) prefetch_same_line(ahead, i, d);
    const __m512bh q0 = load_bf16x32(q + d), q1 = load_bf16x32(q + d + 32);
    for (int i = 0; i < 4; ++i) {
      __m512i lo, hi;
      fp8_to_bf16x64(k[i] + d, lo, hi);
      even[i] = _mm512_dpbf16_ps(even[i], q0, (__m512bh)lo);
      odd[i] = _mm512_dpbf16_ps(odd[i], q1, (__m512bh)hi);
    }
  }
  hsum4((vfloat)even[0] + (vfloat)odd[0], (vfloat)even[1] + (vfloat)odd[1],
        (vfloat)even[2] + (vfloat)odd[2], (vfloat)even[3] + (vfloat)odd[3], out);
}

template <typename T, std::enable_if_t<sizeof(T) == 1, int> = 0>
static inline float dot1(const uint16_t* q, const T* k, int hsp, const T* const* ahead) {
  __m512 a = _mm512_setzero_ps();
  for (int d = 0; d < hsp; d += 64) {
    prefetch_same_line(ahead, 0, d);
    __m512i first, second;
    fp8_to_bf16x64(k + d, first, second);
    a = _mm512_dpbf16_ps(a, load_bf16x32(q + d), (__m512bh)first);
    a = _mm512_dpbf16_ps(a, load_bf16x32(q + d + 32), (__m512bh)second);
  }
  return hsum((vfloat)a);
}

// Probability-weighted bf16 values with vdpbf16ps, two keys per instruction: the rows
// of keys t and t+1 are interleaved (vpunpck{l,h}wd) and dotted with the pair
// (p[t], p[t+1]) rounded to bf16, as flash-attention kernels do on GPUs.
//
// The interleave works within 128-bit lanes, so each 32-element step of a row leaves
// its results in a fixed permutation (pair_lane): the accumulators stay permuted for
// the whole item and unpermute_pairs restores the order at the end.
static inline int pair_lane(int i) {  // element i of a 32-element step -> accumulator slot
  const int lane = i / 8, j = i % 8;
  return (j < 4 ? 0 : 16) + 4 * lane + j % 4;
}

static inline void unpermute_pairs(const float* acc, float* out, int hsp, float factor) {
  for (int d = 0; d < hsp; d += 32)
    for (int i = 0; i < 32; ++i) out[d + i] = acc[d + pair_lane(i)] * factor;
}

// acc[g] += sum_t p[g][t] v[t] for G queries; `pairs[g * kKeyChunk / 2 + t / 2]` holds
// (p[g][t], p[g][t+1]) as two bf16. An odd last key is paired with a zero row.
template <int G, int STEPS>
static inline void accumulate_pairs_block(float* acc, int hsp, int d, const uint32_t* pairs,
                                          const Bf16* const* v, int n, const Bf16* const* ahead) {
  // STEPS 32-element steps of the rows at once: each broadcast pair serves them all.
  const __m512i zero = _mm512_setzero_si512();
  __m512 lo[G][STEPS], hi[G][STEPS];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < STEPS; ++k) {
      lo[g][k] = _mm512_loadu_ps(acc + int64_t(g) * hsp + d + 32 * k);
      hi[g][k] = _mm512_loadu_ps(acc + int64_t(g) * hsp + d + 32 * k + 16);
    }
  for (int t = 0; t < n; t += 2) {
    const bool odd = t + 1 == n;
    __m512bh ab_lo[STEPS], ab_hi[STEPS];
    for (int k = 0; k < STEPS; ++k) {
      prefetch_same_line(ahead, t, d + 32 * k);
      if (!odd) prefetch_same_line(ahead, t + 1, d + 32 * k);
      const __m512i a = _mm512_loadu_si512(v[t] + d + 32 * k);
      const __m512i b = odd ? zero : _mm512_loadu_si512(v[t + 1] + d + 32 * k);
      ab_lo[k] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      ab_hi[k] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pairs[g * (kKeyChunk / 2) + t / 2]));
      for (int k = 0; k < STEPS; ++k) {
        lo[g][k] = _mm512_dpbf16_ps(lo[g][k], ab_lo[k], pp);
        hi[g][k] = _mm512_dpbf16_ps(hi[g][k], ab_hi[k], pp);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < STEPS; ++k) {
      _mm512_storeu_ps(acc + int64_t(g) * hsp + d + 32 * k, lo[g][k]);
      _mm512_storeu_ps(acc + int64_t(g) * hsp + d + 32 * k + 16, hi[g][k]);
    }
}

template <int G>
static inline void accumulate_pairs(float* acc, int hsp, const uint32_t* pairs, const Bf16* const* v,
                                    int n, const Bf16* const* ahead) {
  int d = 0;
  for (; d + 64 <= hsp; d += 64) accumulate_pairs_block<G, 2>(acc, hsp, d, pairs, v, n, ahead);
  if (d < hsp) accumulate_pairs_block<G, 1>(acc, hsp, d, pairs, v, n, ahead);
}

// The chunk's probabilities of G queries as bf16 pairs (see accumulate_pairs).
template <int G>
static inline void probability_pairs(const float* scores, uint32_t* pairs) {
  static_assert(kKeyChunk % 16 == 0, "whole fp32 vectors of probabilities per query");
  for (int g = 0; g < G; ++g) {
    for (int t = 0; t < kKeyChunk; t += 16) {
      const __m256bh p = _mm512_cvtneps_pbh(_mm512_loadu_ps(scores + g * kKeyChunk + t));
      std::memcpy(pairs + g * (kKeyChunk / 2) + t / 2, &p, sizeof(p));
    }
  }
}
#endif  // PAGED_ISA_AVX512_BF16
