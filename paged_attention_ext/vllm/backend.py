"""vLLM attention backend on the paged ops: ``paged.write_kv`` stores the step's keys and
values, one multi-token ``paged.attention`` call serves the whole batch (prefill, decode,
chunked prefill, prefix hits and mixes of them), with vLLM's block table, sequence lengths,
query start locations and slot mapping passed straight through.

KV cache layout: each layer's cache holds the key tiles of all its blocks, then the value
tiles, each an HND ``[num_kv_heads, block_size, head_size]`` tile, so the two halves are the
ops' contiguous key and value caches (views, no copy). vLLM describes a page as
``[heads, states, content]``; the backend declares two head slots (key, value) of one
state each (the whole block's tile) and the ``LHBNC`` order (the slot outside the block).
"""

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import torch

from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from paged_attention_ext import ops


# vLLM allocates fp8 caches as uint8; the ops read them as these formats.
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}


class PagedAttentionBackend(AttentionBackend):
    """Decoder self-attention on ``paged.write_kv`` and ``paged.attention`` (any device the
    ops are built for)."""

    # vLLM calls do_kv_cache_update (write_kv) before forward.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    # "auto": the model's dtype; "fp8" is e4m3. fp8 caches use vLLM's per-layer scales.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_FORMATS]

    @staticmethod
    def get_name() -> str:
        # The name vLLM's layers look the backend up by (AttentionBackendEnum[name]);
        # register() points it at this class.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["PagedAttentionImpl"]:
        return PagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["PagedAttentionMetadataBuilder"]:
        return PagedAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(8, 257, 8))

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Two head slots (key, value), one state per block: the block's HND tile."""
        if spec.num_head_slots is not None or spec.state_content_bytes is not None:
            return spec
        if spec.head_size != spec.head_size_v:
            raise NotImplementedError(
                "paged_attention_ext's vLLM backend needs equal key and value head sizes, got "
                f"{spec.head_size} and {spec.head_size_v}")
        tile = spec.num_kv_heads * spec.block_size * spec.head_size * get_dtype_size(spec.dtype)
        return replace(spec, num_head_slots=2, tokens_per_state=spec.block_size,
                       state_content_bytes=tile)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Head slot (key/value) outside the block: all key tiles, then all value tiles.
        return (KVCacheLayout.LHBNC,)


def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int,
                   dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's ``[num_blocks, 2, 1, tile]`` page view as contiguous HND key and value
    caches ``[num_blocks, num_kv_heads, block_size, head_size]`` (views into it), read as
    ``dtype`` (a type of the same size) when given."""
    if dtype is not None:
        kv_cache = kv_cache.view(dtype)
    num_blocks, slots, states, tile = kv_cache.shape
    if slots != 2 or states != 1 or tile % (num_kv_heads * head_size):
        raise ValueError(
            f"paged_attention_ext's vLLM backend: unexpected KV cache shape {tuple(kv_cache.shape)}"
            f" (want [num_blocks, 2, 1, num_kv_heads * block_size * head_size]); was the "
            f"cache laid out by another backend?")
    shape = (num_blocks, num_kv_heads, tile // (num_kv_heads * head_size), head_size)
    return kv_cache[:, 0, 0].view(shape), kv_cache[:, 1, 0].view(shape)


@dataclass
class PagedAttentionMetadata(AttentionMetadata):
    """What one step's attention calls need, all as vLLM built them."""

    num_actual_tokens: int  # tokens of this step, without padding
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], context including this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 for padding


class PagedAttentionMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    """Passes vLLM's common metadata through; the ops need no per-step planning."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        # Abstract in vLLM's base class, which stores all four.
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError(
                "paged_attention_ext's vLLM backend supports causal attention only")
        return PagedAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )


class PagedAttentionImpl(AttentionImpl[PagedAttentionMetadata]):
    """One layer's attention: ``write_kv`` then ``attention_out`` into vLLM's output buffer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: Optional[list[float]],
        sliding_window: Optional[int],
        kv_cache_dtype: str,
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> None:
        # Unsupported features raise here, when vLLM builds the model, not mid-generation.
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"paged_attention_ext's vLLM backend supports decoder attention only, got {attn_type}")
        if kv_cache_dtype not in PagedAttentionBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"paged_attention_ext's vLLM backend: kv_cache_dtype={kv_cache_dtype!r} is not "
                f"supported (use one of {PagedAttentionBackend.supported_kv_cache_dtypes})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = FP8_FORMATS.get(kv_cache_dtype)  # None: the cache has the model's dtype
        self._checked_scales: set = set()  # id() of the layers whose fp8 scales were checked
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.tensor(alibi_slopes, dtype=torch.float32))
        # vLLM's window W lets position p see keys p - W < j <= p, as the ops define it.
        self.sliding_window = -1 if sliding_window is None else int(sliding_window)
        self.soft_cap = float(logits_soft_cap or 0.0)
        self.sinks = sinks

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # The ops take fp32 sinks; the loaded parameter has the model's dtype.
        if self.sinks is not None:
            self.sinks = self.sinks.detach().float()

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = split_kv_cache(kv_cache, self.num_kv_heads, self.head_size,
                                                self.fp8)
        n = slot_mapping.shape[0]
        ops.write_kv(key[:n], value[:n], key_cache, value_cache, slot_mapping,
                     **self._scales(layer))

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Optional[PagedAttentionMetadata],
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "paged_attention_ext's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        if self.alibi_slopes is not None and self.alibi_slopes.device != query.device:
            self.alibi_slopes = self.alibi_slopes.to(query.device)  # built on the host
        key_cache, value_cache = split_kv_cache(kv_cache, self.num_kv_heads, self.head_size,
                                                self.fp8)
        ops.attention_out(output[:n], query[:n], key_cache, value_cache, m.block_table,
                          m.seq_lens, self.scale, m.query_start_loc, self.alibi_slopes,
                          self.sliding_window, self.soft_cap, sinks=self.sinks,
                          **self._scales(layer))
        return output

    def _scales(self, layer) -> dict:
        """vLLM's per-layer fp32 scales (shape [] or [1]) for an fp8 cache, else none.

        The ops take any scale tensor without reading it (no device sync); a zero, negative
        or non-finite scale would store and read garbage, so each layer's is checked once."""
        if not self.fp8:
            return {}
        scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale)
        if id(layer) not in self._checked_scales:
            for name, scale in scales.items():
                if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                    raise ValueError(f"paged_attention_ext's vLLM backend: layer {name} must be "
                                     f"finite and positive, got {scale.tolist()}")
            self._checked_scales.add(id(layer))
        return scales
