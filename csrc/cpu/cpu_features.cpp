#include "cpu_features.h"

#include <cstdlib>

#include "../errors.h"

namespace paged::cpu {

AttentionKernelFn avx512_bf16_attention_kernel(ScalarKind kind);
AttentionKernelFn avx512_attention_kernel(ScalarKind kind);
AttentionKernelFn avx2_attention_kernel(ScalarKind kind);
AttentionKernelFn generic_attention_kernel(ScalarKind kind);

namespace {

int isa_rank(const std::string& isa) {
  if (isa == "generic") return 0;
  if (isa == "avx2") return 1;
  if (isa == "avx512") return 2;
  if (isa == "avx512_bf16") return 3;
  return -1;
}

std::string best_supported_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    // avx512_bf16 also uses AVX512_VBMI (fp8 -> bf16 lookups): every CPU with AVX512_BF16
    // but Cooper Lake has it; Cooper Lake takes the avx512 kernel.
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi")
               ? "avx512_bf16"
               : "avx512";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return "avx2";
  }
#endif
  return "generic";
}

}  // namespace

std::string selected_isa() {
  static const std::string best = best_supported_isa();
  const char* requested = std::getenv("PAGED_ATTENTION_CPU_ISA");
  if (requested == nullptr || *requested == '\0') return best;
  const std::string want(requested);
  PAGED_CHECK_VALUE(isa_rank(want) >= 0, "PAGED_ATTENTION_CPU_ISA must be one of generic, avx2, ",
                    "avx512, avx512_bf16; got '", want, "'");
  PAGED_CHECK_VALUE(isa_rank(want) <= isa_rank(best), "PAGED_ATTENTION_CPU_ISA=", want,
                    " but this CPU supports at most ", best);
  return want;
}

AttentionKernelFn attention_kernel_for(ScalarKind kind) {
  const std::string isa = selected_isa();
  if (isa == "avx512_bf16") return avx512_bf16_attention_kernel(kind);
  if (isa == "avx512") return avx512_attention_kernel(kind);
  if (isa == "avx2") return avx2_attention_kernel(kind);
  return generic_attention_kernel(kind);
}

}  // namespace paged::cpu
