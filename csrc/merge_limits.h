// Torch-free limits of paged.merge_attention_states, shared by the host checks and the
// CUDA kernel's parameter block.
#pragma once

namespace paged {

// Partial results one call merges at most (the CUDA kernel takes their pointers by value).
constexpr int kMaxMergeInputs = 16;

}  // namespace paged
