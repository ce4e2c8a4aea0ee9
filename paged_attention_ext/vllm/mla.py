"""vLLM MLA backend on the paged ops: DeepSeek-V2/V3 and kin decode over their latent rows.

vLLM's CPU platform picks ``CPU_MLA`` for multi-head latent attention models. Its shared MLA
code (``MLACommonImpl``) absorbs the up-projections into the query, runs prefill itself, and
hands each backend two hooks, which this backend implements on the ops:

* ``do_kv_cache_update``: the step's latents (``kv_c_normed``, 512 wide) and rotated keys
  (``k_pe``, 64) into their columns of each token's row of the layer's
  ``[num_blocks, block_size, 576]`` cache: one ``paged.write_kv`` into the two column views;
* ``forward_mqa``: decode, one ``paged.attention`` over the rows as keys and their leading
  512 columns as values (a view of the same memory), every query head on the one latent head.

Everything else (the page size, prefill, the metadata) is vLLM's CPU MLA backend's, which
this one extends: it is the one vLLM's platform expects for these models.
"""

from typing import Optional, Tuple, Union

import torch

from paged_attention_ext import ops
from paged_attention_ext.vllm.compat import need

# vLLM's CPU MLA backend (what CPU_MLA names): a release that moved it fails here, naming it.
CPUMLABackend, CPUMLAImpl = need(
    "vllm.v1.attention.backends.mla.cpu_mla", ["CPUMLABackend", "CPUMLAImpl"],
    "the CPU MLA backend whose decode and cache-write hooks run on the ops")


class PagedMLAImpl(CPUMLAImpl):
    """vLLM's CPU MLA implementation with the latent cache written and read by the ops."""

    def forward_mqa(self, q: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata,
                    layer) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(q, tuple):  # (absorbed q_nope, q_pe)
            q = torch.cat(q, dim=-1)
        decode = attn_metadata.decode
        rows = latent_rows(kv_c_and_k_pe_cache)
        out = ops.attention(q, rows, rows[..., :self.kv_lora_rank],
                            decode.block_table.to(torch.int32), decode.seq_lens.to(torch.int32),
                            self.scale)
        return out, None  # no lse: can_return_lse_for_decode is False, as vLLM's

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                           k_scale: torch.Tensor, skip_scale: bool = False) -> None:
        if kv_cache.numel() == 0:  # profiling runs before the caches exist
            return
        rows = latent_rows(kv_cache)
        if rows.dtype.itemsize == 1:
            raise NotImplementedError(
                f"PagedMLABackend: kv_cache_dtype={kv_cache_dtype!r} (a quantized latent cache: "
                "fp8 or per-token) is not supported by the vLLM MLA backend yet; use "
                "kv_cache_dtype='auto'")
        tokens = slot_mapping.shape[0]
        ops.write_kv(kv_c_normed[:tokens].reshape(tokens, 1, -1).to(rows.dtype),
                     k_pe[:tokens].reshape(tokens, 1, -1).to(rows.dtype),
                     rows[..., :self.kv_lora_rank], rows[..., self.kv_lora_rank:],
                     slot_mapping.to(torch.int64))


def latent_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's ``[num_blocks, block_size, width]`` MLA cache as the ops' one-head
    ``[num_blocks, 1, block_size, width]`` (a view)."""
    if kv_cache.dim() != 3:
        raise ValueError(f"PagedMLABackend: expected vLLM's MLA cache [num_blocks, block_size, "
                         f"kv_lora_rank + qk_rope_head_dim], got shape {list(kv_cache.shape)}")
    return kv_cache.unsqueeze(1)


class PagedMLABackend(CPUMLABackend):
    """``CPU_MLA`` with :class:`PagedMLAImpl`."""

    @staticmethod
    def get_impl_cls() -> type:
        return PagedMLAImpl
