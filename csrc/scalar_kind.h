// Element type of the attention tensors, shared by the CPU and CUDA kernels.
// Deliberately free of torch headers (included by the ISA-specific CPU kernels and
// by nvcc-compiled code).
#pragma once

namespace paged {

// Queries and outputs are one of the first three; caches any of the seven (fp8 and
// per-token caches take a query of any float kind).
enum class ScalarKind : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // torch.float8_e4m3fn: no infinities, NaN is S.1111.111, max 448
  kFloat8E5M2 = 4,  // torch.float8_e5m2: the top byte of an fp16, max 57344
  // Per-token formats (paged_attention_ext/token_quantization.py): each (token, KV head) row
  // with its own fp32 scale, in a tensor beside the cache.
  kInt8 = 5,  // torch.int8: x = q * scale
  kInt4 = 6,  // torch.uint8, two values a byte (low nibble first), rotated: r = q * scale + low
};

}  // namespace paged
