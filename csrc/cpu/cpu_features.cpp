#include "cpu_features.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <stdexcept>
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
enum IsaRank { kGeneric, kAvx2, kAvx512, kAvx512Vbmi, kAvx512Bf16, kAmx };
// Beside the ranks, never a default: the amx kernel on a software model of its tiles (a
// testing aid, slow), which runs where avx512_bf16's instruction set, its target, does.
constexpr const char* kAmxEmulatedName = "amx_emulated";
constexpr int kAmxEmulated = int(std::size(kIsas));

// The name of a selection: a rank, or kAmxEmulated.
const char* kernel_name(int kernel) { return kernel == kAmxEmulated ? kAmxEmulatedName : kIsas[kernel]; }

int isa_rank(const std::string& isa) {
  for (int i = 0; i < int(std::size(kIsas)); ++i)
    if (isa == kIsas[i]) return i;
  return -1;
}

std::string isa_names() {
  std::string names;
  for (const char* isa : kIsas) names += std::string(names.empty() ? "" : ", ") + isa;
  return names + " or " + kAmxEmulatedName + " (the amx kernel on a software model of its tiles, for tests)";
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

constexpr const char* kIsaVariable = "PAGED_ATTENTION_CPU_ISA";

// A kernel's name as the caller gave it: the environment variable's value, or
// select_cpu_isa's argument. Its refusals name the one the caller used.
struct Request {
  const char* name;  // nullptr or empty: the default
  bool from_call;    // select_cpu_isa(isa), not the variable

  static Request from_variable() { return {std::getenv(kIsaVariable), false}; }

  // The request as the caller wrote it: PAGED_ATTENTION_CPU_ISA=amx or select_cpu_isa('amx').
  std::string written() const {
    return from_call ? "select_cpu_isa('" + std::string(name) + "')" : setting() + "=" + name;
  }

  // What must name a kernel: the variable, or select_cpu_isa's argument.
  std::string setting() const { return from_call ? "select_cpu_isa's isa" : kIsaVariable; }
};

// The kernel `request` names: its rank or kAmxEmulated, or the ValueError of a name that
// is unknown or beyond this CPU.
int requested_kernel(const Request& request) {
  static const std::string best = best_supported_isa();
  static const std::string preferred = preferred_isa(best);
  if (request.name == nullptr || *request.name == '\0') return isa_rank(preferred);
  const std::string want(request.name);
  if (want == kAmxEmulatedName) {
    PAGED_CHECK_VALUE(isa_rank(best) >= kAvx512Bf16, request.written(),
                      " needs avx512_bf16 (its instruction set) but this CPU supports at most ", best);
    return kAmxEmulated;
  }
  PAGED_CHECK_VALUE(isa_rank(want) >= 0, request.setting(), " must be one of ", isa_names(), "; got '",
                    want, "'");
  PAGED_CHECK_VALUE(isa_rank(want) <= isa_rank(best), request.written(),
                    " but this CPU supports at most ", best);
  return isa_rank(want);
}

// The kernel every call runs: chosen from PAGED_ATTENTION_CPU_ISA at first use, changed only
// by select_isa. A variable refused at first use leaves no kernel, and every call raises
// its error until select_isa chooses one.
class Selection {
 public:
  Selection() {
    try {
      kernel_ = requested_kernel(Request::from_variable());
    } catch (const std::runtime_error& error) {
      refusal_ = error.what();
    }
  }

  int kernel() const {
    const int kernel = kernel_.load(std::memory_order_acquire);
    if (kernel < 0) {
      const std::lock_guard<std::mutex> lock(mutex_);
      throw std::runtime_error(refusal_);
    }
    return kernel;
  }

  void set(int kernel) {
    const std::lock_guard<std::mutex> lock(mutex_);
    refusal_.clear();
    kernel_.store(kernel, std::memory_order_release);
  }

 private:
  std::atomic<int> kernel_{-1};  // a rank or kAmxEmulated
  mutable std::mutex mutex_;
  std::string refusal_;  // the tagged error of the refused first request
};

Selection& selection() {
  static Selection chosen;
  return chosen;
}

int selected_kernel() { return selection().kernel(); }

}  // namespace

std::string selected_isa() { return kernel_name(selected_kernel()); }

std::string select_isa(std::optional<std::string> isa) {
  const int kernel = requested_kernel(isa ? Request{isa->c_str(), true} : Request::from_variable());
  selection().set(kernel);
  return kernel_name(kernel);
}

AttentionKernelFn vector_kernel_beside_amx(ScalarKind kind) {
  return bf16_dots_pay() ? avx512_bf16_attention_kernel(kind) : avx512_vbmi_attention_kernel(kind);
}

AttentionKernelFn attention_kernel_for(ScalarKind kind) {
  switch (selected_kernel()) {
    case kAmxEmulated: return amx_emulated_attention_kernel(kind);
    case kAmx: return amx_attention_kernel(kind);
    case kAvx512Bf16: return avx512_bf16_attention_kernel(kind);
    case kAvx512Vbmi: return avx512_vbmi_attention_kernel(kind);
    case kAvx512: return avx512_attention_kernel(kind);
    case kAvx2: return avx2_attention_kernel(kind);
    default: return generic_attention_kernel(kind);
  }
}

PlanHints plan_hints(const AttentionParams& params) {
  const int kernel = selected_kernel();
  const int tiles = kernel == kAmx            ? amx_queries_per_item(params)
                    : kernel == kAmxEmulated ? amx_emulated_queries_per_item(params)
                                             : 0;
  return {std::max(kMaxQueriesPerItem, tiles)};
}

}  // namespace paged::cpu
