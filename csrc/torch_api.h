// The only part of torch the compiled library sees: the stable ABI (torch/csrc/stable,
// torch/headeronly), at the oldest supported torch (setup.py sets TORCH_TARGET_VERSION),
// so one build loads into every torch of the supported range. No ATen or c10 header may
// be included anywhere in csrc/ (tests/test_stable_abi.py checks the library's symbols).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Float8_e4m3fn.h>
#include <torch/headeronly/util/Float8_e5m2.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace paged {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using ScalarType = torch::headeronly::ScalarType;
using Sizes = torch::headeronly::IntHeaderOnlyArrayRef;
// A `Tensor[]` argument.
using TensorList = std::vector<Tensor>;

using Half = torch::headeronly::Half;
using BFloat16 = torch::headeronly::BFloat16;
using Float8_e4m3fn = torch::headeronly::Float8_e4m3fn;
using Float8_e5m2 = torch::headeronly::Float8_e5m2;

constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kFloat8_e4m3fn = ScalarType::Float8_e4m3fn;
constexpr ScalarType kFloat8_e5m2 = ScalarType::Float8_e5m2;
constexpr ScalarType kChar = ScalarType::Char;  // int8
constexpr ScalarType kByte = ScalarType::Byte;  // uint8
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kLong = ScalarType::Long;

// A new tensor on `like`'s device.
inline Tensor empty(Sizes sizes, ScalarType dtype, const Tensor& like) {
  return torch::stable::empty(sizes, dtype, std::nullopt, like.device());
}

// Calls f.template operator()<T>() with T the C++ type of a float dtype (float32, float16,
// bfloat16; the checks have refused the others).
template <typename F>
void dispatch_float(ScalarType dtype, F&& f) {
  switch (dtype) {
    case kHalf: f.template operator()<Half>(); break;
    case kBFloat16: f.template operator()<BFloat16>(); break;
    default: f.template operator()<float>(); break;
  }
}

}  // namespace paged
