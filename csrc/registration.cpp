// Op schemas of the `paged` library and the Python module stub. Backends register
// implementations in their own files (cpu/, cuda/); every call enters through
// paged_attention_ext/op_entry.py (grad refusal, Python error types).
#include <Python.h>

#include <string>

#include "cpu/cpu_features.h"
#include "torch_api.h"

// Importing paged_attention_ext._C loads this shared object, which runs the
// static TORCH_LIBRARY registrations. The module itself is empty, so the
// extension needs only Python's limited API (one wheel for every CPython 3.10+).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

STABLE_TORCH_LIBRARY(paged, m) {
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
  // Per-token caches (int8, uint8) get each written row's scales in k_scale / v_scale.
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
  // MLA latent rows: each token's [latent | rotary_key] stored as one row of `cache`
  // (vLLM's concat_and_cache_mla); a per-token cache gets each row's scale in `scale`.
  m.def(
      "write_latent(Tensor latent, Tensor rotary_key, Tensor(a!) cache, Tensor slot_mapping, "
      "Tensor(b!)? scale=None) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // The CPU kernel's instruction set (one of ops.CPU_ISAS).
  m.def("cpu_isa() -> str");
  // Chooses the CPU kernel of every later call (tests); None: as PAGED_ATTENTION_CPU_ISA says now.
  m.def("select_cpu_isa(str? isa=None) -> str");
}

STABLE_TORCH_LIBRARY_IMPL(paged, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&paged::cpu::selected_isa));
  m.impl("select_cpu_isa", TORCH_BOX(&paged::cpu::select_isa));
}
