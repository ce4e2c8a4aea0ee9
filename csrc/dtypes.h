// The ops' dtypes on the torch side: the kernels' name of each (scalar_kind.h, torch-free)
// and which are fp8 or per-token.
#pragma once

#include "scalar_kind.h"
#include "torch_api.h"

namespace paged {

inline bool is_fp8(ScalarType t) { return t == kFloat8_e4m3fn || t == kFloat8_e5m2; }

// The per-token formats: int8, and int4 packed two a byte in uint8 (token_quantization.py).
inline bool is_per_token(ScalarType t) { return t == kChar || t == kByte; }

// Values a cache element holds: 2 for packed int4, else 1 (head_size = this x size(-1)).
inline int64_t values_per_element(ScalarType t) { return t == kByte ? 2 : 1; }

// The kernels' element type of an (already validated) attention dtype.
inline ScalarKind scalar_kind(ScalarType t) {
  switch (t) {
    case kHalf: return ScalarKind::kFloat16;
    case kBFloat16: return ScalarKind::kBFloat16;
    case kFloat8_e4m3fn: return ScalarKind::kFloat8E4M3;
    case kFloat8_e5m2: return ScalarKind::kFloat8E5M2;
    case kChar: return ScalarKind::kInt8;
    case kByte: return ScalarKind::kInt4;
    default: return ScalarKind::kFloat32;
  }
}

}  // namespace paged
