// Vector primitives of the CPU attention kernel (attention_kernel.h): GCC vector types of
// PAGED_VEC_WIDTH floats, loads and stores, broadcasts, horizontal sums and maxima.
// Compiled once per instruction set like the kernel (isa_kernel.h), textually inside its
// ISA namespace, after attention_params.h; the macros that select the instructions (read
// by every kernel header):
//   PAGED_VEC_WIDTH        fp32 lanes per vector (16, 8)
//   PAGED_ISA_AVX512       1 when AVX-512F intrinsics may be used
//   PAGED_ISA_AVX512_BF16  1 when AVX512_BF16 dot products may be used (optional)
//   PAGED_ISA_F16C         1 when AVX2 and F16C intrinsics may be used
#pragma once

constexpr int VW = PAGED_VEC_WIDTH;
typedef float vfloat __attribute__((vector_size(VW * 4)));
typedef int32_t vint __attribute__((vector_size(VW * 4)));
typedef uint32_t vuint __attribute__((vector_size(VW * 4)));
typedef uint16_t vhalfword __attribute__((vector_size(VW * 2)));
typedef int16_t vshort __attribute__((vector_size(VW * 2)));
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
