// Op schemas of the `paged` library, their Autograd-key kernel and the Python module
// stub. Backends register implementations in their own files (cpu/, cuda/).
#include <Python.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include "cpu/cpu_features.h"

// Importing paged_attention_ext._C loads this shared object, which runs the
// static TORCH_LIBRARY registrations. The module itself is empty, so the
// extension needs only Python's limited API (one wheel for every CPython 3.10+).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace {
std::string cpu_isa() { return paged::cpu::selected_isa(); }

bool requires_grad(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor().requires_grad();
  if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList()) {
      if (t.requires_grad()) return true;
    }
  }
  return false;
}

// The ops have no backward. Without this kernel an argument that requires grad would
// give a result without a gradient, silently; here it raises before any work, unless
// grad mode is off (torch.no_grad(); torch.inference_mode() skips this kernel).
void refuse_grad(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                 torch::jit::Stack* stack) {
  if (at::GradMode::is_enabled()) {
    const std::string& name = op.schema().name();  // "paged::attention"
    const auto& arguments = op.schema().arguments();
    const auto values = torch::jit::last(*stack, arguments.size());
    for (size_t i = 0; i < arguments.size(); ++i) {
      TORCH_CHECK_NOT_IMPLEMENTED(
          !requires_grad(values[i]), "paged.", name.substr(name.find("::") + 2),
          ": argument '", arguments[i].name(), "' requires grad, but the paged ops have no "
          "backward (they are for inference); call them under torch.no_grad() or "
          "torch.inference_mode(), or pass a detached tensor");
    }
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}
}  // namespace

TORCH_LIBRARY(paged, m) {
  m.def(
      "attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor? query_start_loc=None, Tensor? alibi_slopes=None, "
      "int sliding_window=-1, float soft_cap=0.0, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def(
      "attention_with_lse(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, Tensor? query_start_loc=None, "
      "Tensor? alibi_slopes=None, int sliding_window=-1, float soft_cap=0.0, Tensor? sinks=None, "
      "Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor, Tensor)");
  m.def(
      "attention_out(Tensor(a!) out, Tensor(b!)? lse, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, "
      "Tensor? query_start_loc=None, Tensor? alibi_slopes=None, int sliding_window=-1, "
      "float soft_cap=0.0, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // Each group's query rows (query_start_loc) over its shared prefix (a row of block_tables,
  // seq_lens tokens), every query after every key: the first level of cascade attention.
  m.def(
      "shared_prefix_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "float soft_cap=0.0, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) "
      "-> (Tensor, Tensor)");
  m.def("merge_attention_states(Tensor[] outputs, Tensor[] lses) -> (Tensor, Tensor)");
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // The CPU kernel's instruction set ("avx512_bf16", "avx512", "avx2" or "generic").
  m.def("cpu_isa() -> str", &cpu_isa);
}

TORCH_LIBRARY_IMPL(paged, Autograd, m) {
  for (const char* op : {"attention", "attention_with_lse", "attention_out",
                         "shared_prefix_attention", "merge_attention_states", "write_kv",
                         "copy_blocks", "swap_blocks"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_grad>());
  }
}
