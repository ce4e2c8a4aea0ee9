// The ops' dtypes on the torch side: the kernels' name of each (scalar_kind.h, torch-free)
// and which are fp8.
#pragma once

#include <c10/core/ScalarType.h>

#include "scalar_kind.h"

namespace paged {

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// The kernels' element type of an (already validated) attention dtype.
inline ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return ScalarKind::kFloat16;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    case at::kFloat8_e4m3fn: return ScalarKind::kFloat8E4M3;
    case at::kFloat8_e5m2: return ScalarKind::kFloat8E5M2;
    default: return ScalarKind::kFloat32;
  }
}

}  // namespace paged
