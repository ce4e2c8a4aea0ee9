// Vector primitives of the CPU attention kernel (attention_kernel.h): GCC vector types of
// PAGED_VEC_WIDTH floats, loads and stores, broadcasts, horizontal sums and maxima.
// Compiled once per instruction set like the kernel (isa_kernel.h), textually inside its
// ISA namespace, after attention_params.h; the macros that select the instructions (read
// by every kernel header):
//   PAGED_VEC_WIDTH        fp32 lanes per vector (16, 8; 4 for the baseline, whose 16-byte
//                          registers GCC cannot keep wider vectors in)
//   PAGED_ISA_AVX512       1 when AVX-512F intrinsics may be used
//   PAGED_ISA_AVX512_VBMI  1 when AVX512_VBMI byte permutes may be used (optional)
//   PAGED_ISA_AVX512_BF16  1 when AVX512_BF16 dot products may be used (optional; implies
//                          PAGED_ISA_AVX512_VBMI)
//   PAGED_ISA_AMX          1 when AMX-TILE and AMX-BF16 may be used, or their software model
//                          with PAGED_AMX_EMULATED (optional; implies PAGED_ISA_AVX512_BF16)
//   PAGED_ISA_F16C         1 when AVX2 and F16C intrinsics may be used
#pragma once

constexpr int VW = PAGED_VEC_WIDTH;
// Forced inlining where it measured faster, by instruction set (the kernel headers' hot
// functions say why): PAGED_AVX_INLINE on AVX2 and AVX-512, PAGED_AVX512_INLINE on AVX-512
// only (16-register AVX2 loses by it).
#if PAGED_ISA_F16C || PAGED_ISA_AVX512
#define PAGED_AVX_INLINE __attribute__((always_inline))
#else
#define PAGED_AVX_INLINE
#endif
#if PAGED_ISA_AVX512
#define PAGED_AVX512_INLINE __attribute__((always_inline))
#else
#define PAGED_AVX512_INLINE
#endif

typedef float vfloat __attribute__((vector_size(VW * 4)));
typedef int32_t vint __attribute__((vector_size(VW * 4)));
typedef uint32_t vuint __attribute__((vector_size(VW * 4)));
// AVX2 or AVX-512 (16 or 32 vector registers), not the baseline's 16 SSE registers.
constexpr bool kAvxIsa = PAGED_ISA_F16C || PAGED_ISA_AVX512;

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

// The low half plus the high half, down to 4 lanes.
static inline v4float fold4(vfloat v) {
#if PAGED_VEC_WIDTH == 16
  const v8float a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif PAGED_VEC_WIDTH == 8
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  return v;
#endif
}

static inline float hsum(vfloat v) {
  v4float c = fold4(v);
  c += __builtin_shufflevector(c, c, 2, 3, 0, 1);
  c += __builtin_shufflevector(c, c, 1, 0, 3, 2);
  return c[0];
}

template <typename V>
static inline V vmax(V a, V b) { return a > b ? a : b; }

static inline float hmax(vfloat v) {
#if PAGED_VEC_WIDTH == 16
  const v8float a = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  v4float c = vmax(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
#elif PAGED_VEC_WIDTH == 8
  v4float c = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7));
#else
  v4float c = v;
#endif
  c = vmax(c, __builtin_shufflevector(c, c, 2, 3, 0, 1));
  c = vmax(c, __builtin_shufflevector(c, c, 1, 0, 3, 2));
  return c[0];
}

// Whether any lane of v is above limit (false for NaN lanes).
static inline bool any_above(vfloat v, float limit) {
#if PAGED_ISA_AVX512
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(limit), _CMP_GT_OQ) != 0;
#elif PAGED_ISA_F16C
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(limit), _CMP_GT_OQ)) != 0;
#else
  return hmax(v) > limit;
#endif
}

// Four horizontal sums at once (a shuffle tree instead of four separate ones).
static inline void hsum4(vfloat a, vfloat b, vfloat c, vfloat d, float* out) {
#if PAGED_VEC_WIDTH >= 8
  auto fold8 = [](vfloat v) {
#if PAGED_VEC_WIDTH == 16
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return v;
#endif
  };
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
#else
  // [a0 + a2, b0 + b2, a1 + a3, b1 + b3] and the same for c, d, then [a, b, c, d].
  const v4float ab = __builtin_shufflevector(a, b, 0, 4, 1, 5) + __builtin_shufflevector(a, b, 2, 6, 3, 7);
  const v4float cd = __builtin_shufflevector(c, d, 0, 4, 1, 5) + __builtin_shufflevector(c, d, 2, 6, 3, 7);
  const v4float sums = __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
  std::memcpy(out, &sums, sizeof(sums));
#endif
}
