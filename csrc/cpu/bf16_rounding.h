// fp32 results rounded to bf16 output rows: one rounding for the merge of partitions
// (attention_cpu.cpp) and the kernels that write a bf16 output directly. Included outside
// the ISA namespaces (isa_kernel.h, before them), so every translation unit compiles it alike.
#pragma once

#include <cstdint>
#include <cstring>

namespace paged::cpu {

// dst[d] = bf16(v[d] * factor), rounded to nearest even from the bit pattern (NaN to the
// quiet 0x7fc0, as c10::BFloat16's constructor does), in a loop the compiler vectorises:
// the per-element constructor made the merge 6% of a causal multi-token call.
inline void store_bf16_row(const float* v, float factor, uint16_t* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) {
    const float x = v[d] * factor;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const uint16_t rounded = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    dst[d] = x != x ? uint16_t(0x7fc0) : rounded;
  }
}

}  // namespace paged::cpu
