// The ops' dtypes on the torch side: the kernels' name of each (scalar_kind.h, torch-free)
// and which are fp8.
#pragma once

#include "scalar_kind.h"
#include "torch_api.h"

namespace paged {

inline bool is_fp8(ScalarType t) { return t == kFloat8_e4m3fn || t == kFloat8_e5m2; }

// The kernels' element type of an (already validated) attention dtype.
inline ScalarKind scalar_kind(ScalarType t) {
  switch (t) {
    case kHalf: return ScalarKind::kFloat16;
    case kBFloat16: return ScalarKind::kBFloat16;
    case kFloat8_e4m3fn: return ScalarKind::kFloat8E4M3;
    case kFloat8_e5m2: return ScalarKind::kFloat8E5M2;
    default: return ScalarKind::kFloat32;
  }
}

}  // namespace paged
