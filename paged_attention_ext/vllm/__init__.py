"""vLLM plugin: vLLM's attention runs on the paged ops (``pip install paged-attention-ext[vllm]``).

vLLM calls :func:`register` in every process it starts (entry point ``paged_attention`` in the
``vllm.general_plugins`` group). It points two attention-backend names at
:class:`paged_attention_ext.vllm.backend.PagedAttentionBackend`:

* ``CPU_ATTN``: the CPU platform always picks this name, so on vLLM's CPU build every decoder
  attention layer runs ``paged.write_kv`` and ``paged.attention`` instead of vLLM's kernels.
* ``CUSTOM``: on other platforms the backend is chosen explicitly,
  ``LLM(..., attention_config={"backend": "CUSTOM"})``.
* ``CPU_MLA``: the CPU platform's pick for multi-head latent attention models (DeepSeek-V2/V3,
  Kimi-K2): :class:`paged_attention_ext.vllm.mla.PagedMLABackend` writes and decodes over
  the latent rows with the ops.

``VLLM_PLUGINS`` (vLLM's allow-list of plugin names) turns the plugin off, e.g. to compare
against vLLM's own backend. Importing this package does not import vLLM. Which vLLM
releases it is tested with, and what happens on others: :mod:`paged_attention_ext.vllm.compat`.
"""

BACKEND = "paged_attention_ext.vllm.backend.PagedAttentionBackend"
MLA_BACKEND = "paged_attention_ext.vllm.mla.PagedMLABackend"


def register() -> None:
    """Point vLLM's ``CPU_ATTN``, ``CUSTOM`` and ``CPU_MLA`` attention backends at the paged ops."""
    # Imported here: vLLM imports this package's entry point before it is fully set up,
    # and users of the other integrations need not have vLLM installed.
    from paged_attention_ext.vllm import compat

    compat.warn_if_untested()
    AttentionBackendEnum, register_backend = compat.backend_registry()
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    # A release without a CPU MLA backend has nothing for this one to replace.
    if "CPU_MLA" in AttentionBackendEnum.__members__:
        register_backend(AttentionBackendEnum.CPU_MLA, MLA_BACKEND)
