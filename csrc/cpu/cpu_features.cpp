#include "cpu_features.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#endif

#include "../errors.h"
#include "amx_permission.h"
#include "isa_entry_points.h"

namespace paged::cpu {

namespace {

// The kernels' instruction sets, each a superset of the ones before it (ops.CPU_ISAS).
constexpr const char* kIsas[] = {"generic", "avx2", "avx512", "avx512_vbmi", "avx512_bf16", "amx"};

int isa_rank(const std::string& isa) {
  for (int i = 0; i < int(std::size(kIsas)); ++i)
    if (isa == kIsas[i]) return i;
  return -1;
}

std::string isa_names() {
  std::string names;
  for (const char* isa : kIsas) names += std::string(names.empty() ? "" : ", ") + isa;
  return names;
}

// AMX-TILE and AMX-BF16, and Linux's permission to use the tile data registers.
bool amx_usable() {
#if defined(__x86_64__) && defined(__linux__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((edx & kAmxBf16) == 0 || (edx & kAmxTile) == 0) return false;
  return request_amx_tile_permission();
#else
  return false;
#endif
}

std::string best_supported_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    // AVX512_VBMI's byte permutes convert fp8 (avx512_vbmi); avx512_bf16 uses them too:
    // every CPU with AVX512_BF16 but Cooper Lake has it, and Cooper Lake takes avx512.
    if (!__builtin_cpu_supports("avx512vbmi")) return "avx512";
    if (!__builtin_cpu_supports("avx512bf16")) return "avx512_vbmi";
    return amx_usable() ? "amx" : "avx512_bf16";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return "avx2";
  }
#endif
  return "generic";
}

// Whether the avx512_bf16 kernel's pair dot products outrun the avx512_vbmi kernel's fp32
// multiply-adds on this core: a vdpbf16ps issues as often as an FMA on Zen 4 (twice the
// multiply-adds) but at a quarter of the rate on the Xeon with AMX (half of them), where the
// pair kernel measured slower than avx512_vbmi multi-token and on fp8 GQA decode
// (docs/performance.md).
bool bf16_dots_pay() {
  static const bool pay = avx512_bf16_dot_gain() >= 1.25;
  return pay;
}

// The kernel chosen when PAGED_ATTENTION_CPU_ISA is unset: the best supported one, but
// avx512_vbmi's where bf16 dot products do not pay.
std::string preferred_isa(const std::string& best) {
  return best == "avx512_bf16" && !bf16_dots_pay() ? "avx512_vbmi" : best;
}

}  // namespace

std::string selected_isa() {
  static const std::string best = best_supported_isa();
  static const std::string preferred = preferred_isa(best);
  const char* requested = std::getenv("PAGED_ATTENTION_CPU_ISA");
  if (requested == nullptr || *requested == '\0') return preferred;
  const std::string want(requested);
  PAGED_CHECK_VALUE(isa_rank(want) >= 0, "PAGED_ATTENTION_CPU_ISA must be one of ", isa_names(), "; got '",
                    want, "'");
  PAGED_CHECK_VALUE(isa_rank(want) <= isa_rank(best), "PAGED_ATTENTION_CPU_ISA=", want,
                    " but this CPU supports at most ", best);
  return want;
}

AttentionKernelFn vector_kernel_beside_amx(ScalarKind kind) {
  return bf16_dots_pay() ? avx512_bf16_attention_kernel(kind) : avx512_vbmi_attention_kernel(kind);
}

AttentionKernelFn attention_kernel_for(ScalarKind kind) {
  const std::string isa = selected_isa();
  if (isa == "amx") return amx_attention_kernel(kind);
  if (isa == "avx512_bf16") return avx512_bf16_attention_kernel(kind);
  if (isa == "avx512_vbmi") return avx512_vbmi_attention_kernel(kind);
  if (isa == "avx512") return avx512_attention_kernel(kind);
  if (isa == "avx2") return avx2_attention_kernel(kind);
  return generic_attention_kernel(kind);
}

PlanHints plan_hints(const AttentionParams& params) {
  const int tiles = selected_isa() == "amx" ? amx_queries_per_item(params) : 0;
  // The vector kernels run a split-off visible range with queries in lanes and no masks;
  // the tile kernel checks masks per step and tile, so a split only adds items and a merge
  // (causal multi-token on amx measured faster without it).
  return {std::max(kMaxQueriesPerItem, tiles), tiles == 0};
}

}  // namespace paged::cpu
