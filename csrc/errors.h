// Argument errors. Across the stable ABI every C++ exception reaches Python as whatever
// the running torch makes of it (std::invalid_argument is a ValueError in some releases,
// a RuntimeError in others), so the ops throw std::runtime_error only, with the Python
// type as a tag in front of the message ("[paged:ValueError] paged.attention: ...").
// The ops' Python entry (paged_attention_ext/op_entry.py) raises the tagged type with the
// bare message: ValueError for shapes and values, TypeError for dtypes, IndexError for ids
// out of range.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch_api.h"

namespace paged {

namespace detail {

inline void append(std::ostringstream& os, Sizes sizes) {
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
}
inline void append(std::ostringstream& os, const std::vector<int64_t>& sizes) {
  append(os, Sizes(sizes.data(), sizes.size()));
}
// As torch prints devices: "cpu", "cuda:0", "meta".
inline void append(std::ostringstream& os, const Device& device) {
  const auto type = device.type();
  if (type == torch::headeronly::DeviceType::CPU) os << "cpu";
  else if (type == torch::headeronly::DeviceType::CUDA) os << "cuda";
  else if (type == torch::headeronly::DeviceType::Meta) os << "meta";
  else os << "device type " << int(type);
  if (device.has_index()) os << ":" << int(device.index());
}
template <typename T>
void append(std::ostringstream& os, const T& value) {
  os << value;
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (append(os, args), ...);
  return os.str();
}

[[noreturn]] inline void raise(const char* python_type, const std::string& message) {
  throw std::runtime_error(std::string("[paged:") + python_type + "] " + message);
}

}  // namespace detail

#define PAGED_CHECK_AS(python_type, cond, ...)                                      \
  do {                                                                              \
    if (!(cond)) [[unlikely]]                                                       \
      ::paged::detail::raise(python_type, ::paged::detail::concat(__VA_ARGS__));   \
  } while (0)

// Shapes and values.
#define PAGED_CHECK_VALUE(cond, ...) PAGED_CHECK_AS("ValueError", cond, __VA_ARGS__)
// Dtypes.
#define PAGED_CHECK_TYPE(cond, ...) PAGED_CHECK_AS("TypeError", cond, __VA_ARGS__)
// Ids out of range.
#define PAGED_CHECK_INDEX(cond, ...) PAGED_CHECK_AS("IndexError", cond, __VA_ARGS__)

}  // namespace paged
