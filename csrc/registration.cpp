// Op schemas of the `paged` library and the Python module stub.
// Backends register implementations in their own files (cpu/, cuda/).
#include <Python.h>

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
}  // namespace

TORCH_LIBRARY(paged, m) {
  m.def(
      "attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor? query_start_loc=None, Tensor? alibi_slopes=None, "
      "int sliding_window=-1, float soft_cap=0.0, Tensor? sinks=None) -> Tensor");
  m.def(
      "attention_with_lse(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, Tensor? query_start_loc=None, "
      "Tensor? alibi_slopes=None, int sliding_window=-1, float soft_cap=0.0, Tensor? sinks=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "attention_out(Tensor(a!) out, Tensor(b!)? lse, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, "
      "Tensor? query_start_loc=None, Tensor? alibi_slopes=None, int sliding_window=-1, "
      "float soft_cap=0.0, Tensor? sinks=None) -> ()");
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // The CPU kernel's instruction set ("avx512_bf16", "avx512", "avx2" or "generic").
  m.def("cpu_isa() -> str", &cpu_isa);
}
