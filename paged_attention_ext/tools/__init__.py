"""The command-line tools built on the library; nothing in the core imports them.

* :mod:`.cli` — the ``paged-attention`` command (also ``python -m paged_attention_ext``);
* :mod:`.demo` — ``paged-attention demo``: the paged engine serves a mixed batch under a small
  KV pool and is checked against transformers ``generate``;
* :mod:`.walkthrough` — ``paged-attention walkthrough``: every op on a small paged cache,
  checked against :mod:`paged_attention_ext.reference`;
* :mod:`.memory` — ``paged-attention memory``: KV-cache bytes per token, sequence and block
  of a model shape (arithmetic only; the cache itself sizes its pool with
  :func:`paged_attention_ext.kv_cache.bytes_per_block`);
* :mod:`.simulator` and :mod:`.workloads` — ``paged-attention simulate``: request traces
  replayed through paged and contiguous allocation strategies.
"""
