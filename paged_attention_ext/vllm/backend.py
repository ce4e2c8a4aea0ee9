"""vLLM attention backend on the paged ops: ``paged.write_kv`` stores the step's keys and
values, one multi-token ``paged.attention`` call serves the whole batch (prefill, decode,
chunked prefill, prefix hits and mixes of them), with vLLM's block table, sequence lengths,
query start locations and slot mapping passed straight through.

Cascade attention (:mod:`paged_attention_ext.cascade`): where vLLM passes a common prefix
length (older releases and out-of-tree runners; vLLM 0.32 has removed cascade attention and
always passes 0), every request of the step shares that prefix; otherwise, on the CPU, where
the block table is a host tensor, the builder plans the split itself from the block ids
(parallel samples and requests on cached prompt blocks share them), as the engine does.
``PAGED_ATTENTION_CASCADE_MIN_SAVED_TOKENS`` sets the plan's threshold (``none``: off).

KV cache layout: each layer's cache holds the key tiles of all its blocks, then the value
tiles, each an HND ``[num_kv_heads, block_size, head_size]`` tile, so the two halves are the
ops' contiguous key and value caches (views, no copy). vLLM describes a page as
``[heads, states, content]``; the backend declares two head slots (key, value) of one
state each (the whole block's tile) and the ``LHBNC`` order (the slot outside the block),
or ``LBHNC`` (each block's key tile, then its value tile: the page-compact order vLLM's
hybrid manager needs when linear-attention states share the pages); the ops read either
through the block stride.

Per-token caches (``int8_per_token_head``, ``int4_per_token_head``: vLLM's names, the ops'
formats, :mod:`paged_attention_ext.token_quantization`): each head slot's state is the
block's key (value) rows followed by their float32 scales, the layout of the engine's pages
(``kv_cache.token_slot_views``), so a block's scales live and move with its rows.
"""

import os
from dataclasses import dataclass, replace
from typing import ClassVar, Optional

import torch

from paged_attention_ext import ops, quantization
from paged_attention_ext.cascade import DEFAULT_MIN_SAVED_TOKENS, CascadePlan, plan_cascade
from paged_attention_ext.kv_cache import token_slot_bytes, token_slot_views
from paged_attention_ext.token_quantization import TOKEN_FORMATS, bytes_per_token_head
from paged_attention_ext.vllm.compat import VLLMInterfaceError, need, need_fields, need_member

# What the backend takes from vLLM, each looked up through compat: a vLLM release that
# moved or removed one fails here, naming it, when vLLM first loads the backend.
(AttentionBackend, AttentionImpl, AttentionLayer, AttentionMetadata, AttentionMetadataBuilder,
 AttentionType, CommonAttentionMetadata, MultipleOf) = need(
    "vllm.v1.attention.backend",
    ["AttentionBackend", "AttentionImpl", "AttentionLayer", "AttentionMetadata",
     "AttentionMetadataBuilder", "AttentionType", "CommonAttentionMetadata", "MultipleOf"],
    "the attention backend's base classes and per-step metadata")
# The builder passes these to the ops (and plans cascades from them on the CPU).
need_fields(CommonAttentionMetadata,
            ["query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs",
             "num_actual_tokens", "block_table_tensor", "slot_mapping", "causal"],
            "the step's batch, passed to paged.attention")
AttentionSpec, KVCacheLayout = need(
    "vllm.v1.kv_cache_interface", ["AttentionSpec", "KVCacheLayout"],
    "the KV cache page description the backend customizes")
need_fields(AttentionSpec,
            ["block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
             "num_head_slots", "tokens_per_state", "state_content_bytes", "kv_quant_mode"],
            "customize_spec's page: key and value tiles as two head slots of one state")
(KVQuantMode,) = need("vllm.v1.kv_cache_interface", ["KVQuantMode"],
                      "which per-token format a page holds")
# vLLM's per-token modes -> the cache dtype the ops read (int4 packed in uint8).
TOKEN_MODES = {need_member(KVQuantMode, mode, "the per-token KV cache formats"): dtype
               for mode, dtype in (("INT8_PER_TOKEN_HEAD", torch.int8),
                                   ("INT4_PER_TOKEN_HEAD", torch.uint8))}
# Head slot (key/value) outside the block: all key tiles, then all value tiles.
KEYS_THEN_VALUES = need_member(KVCacheLayout, "LHBNC", "the KV cache order the ops read")
# Each block's key tile then its value tile: one contiguous page, which vLLM's hybrid
# manager needs when a block also holds other specs' pages (linear-attention states).
BLOCK_COMPACT = need_member(KVCacheLayout, "LBHNC", "the page-compact KV cache order the ops read")


def cascade_threshold() -> Optional[int]:
    """PAGED_ATTENTION_CASCADE_MIN_SAVED_TOKENS: an integer >= 1, or "none" (no cascade)."""
    value = os.environ.get("PAGED_ATTENTION_CASCADE_MIN_SAVED_TOKENS", str(DEFAULT_MIN_SAVED_TOKENS))
    if value.strip().lower() == "none":
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError("PAGED_ATTENTION_CASCADE_MIN_SAVED_TOKENS must be an integer >= 1 or "
                         f"'none', got {value!r}")
    return int(value)


# vLLM allocates fp8 caches as uint8; the ops read them as these formats ("fp8" is e4m3).
FP8_FORMATS = {"fp8": quantization.FP8_FORMATS["fp8_e4m3"], **quantization.FP8_FORMATS}


class PagedAttentionBackend(AttentionBackend):
    """Decoder self-attention on ``paged.write_kv`` and ``paged.attention`` (any device the
    ops are built for)."""

    # vLLM calls do_kv_cache_update (write_kv) before forward.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = list(quantization.FLOAT_DTYPES)
    # "auto": the model's dtype; "fp8" is e4m3. fp8 caches use vLLM's per-layer scales;
    # per-token caches keep their scales in their pages.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_FORMATS, *TOKEN_FORMATS]

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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # The ops take any block size: vLLM keeps its default (16, 64 from vLLM 0.34) or
        # the user's.
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(range(8, 257, 8))

    @classmethod
    def supports_head_size_v(cls, head_size: int, head_size_v: int) -> bool:
        # vLLM 0.34 asks before choosing the backend; customize_spec refuses on 0.32.
        return head_size_v == head_size

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Two head slots (key, value), one state per block: the block's HND tile (a
        per-token format: then its scales)."""
        if spec.num_head_slots is not None or spec.state_content_bytes is not None:
            return spec
        if spec.head_size != spec.head_size_v:
            raise NotImplementedError(
                "paged_attention_ext's vLLM backend needs equal key and value head sizes, got "
                f"{spec.head_size} and {spec.head_size_v}")
        token_dtype = TOKEN_MODES.get(spec.kv_quant_mode)
        if token_dtype is not None:
            tile = token_slot_bytes(token_dtype, spec.num_kv_heads, spec.head_size, spec.block_size)
        else:
            tile = spec.num_kv_heads * spec.block_size * spec.head_size * spec.dtype.itemsize
        return replace(spec, num_head_slots=2, tokens_per_state=spec.block_size,
                       state_content_bytes=tile)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KEYS_THEN_VALUES, BLOCK_COMPACT)


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


def split_token_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int,
                         dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A per-token layer's ``[num_blocks, 2, 1, slot bytes]`` page view as the ops' key and
    value caches of ``dtype`` (int8, or uint8 for packed int4) and their ``k_scale`` and
    ``v_scale`` tensors (views into it)."""
    kv_cache = kv_cache.view(dtype)
    num_blocks, slots, states, tile = kv_cache.shape
    # A token's bytes without the rows' alignment padding (under 4 bytes a block, less than
    # one token's): the floor is the block size.
    per_token = num_kv_heads * bytes_per_token_head(dtype, head_size)
    block_size = tile // per_token
    if (slots != 2 or states != 1 or not block_size
            or token_slot_bytes(dtype, num_kv_heads, head_size, block_size) != tile):
        raise ValueError(
            f"paged_attention_ext's vLLM backend: unexpected {dtype} KV cache shape "
            f"{tuple(kv_cache.shape)} (want [num_blocks, 2, 1, block_size * num_kv_heads * "
            f"{per_token} bytes]: rows and their scales); was the cache laid out by another "
            "backend?")
    (key_cache, k_scale), (value_cache, v_scale) = (
        token_slot_views(kv_cache[:, part, 0], num_kv_heads, head_size, block_size)
        for part in (0, 1))
    return key_cache, value_cache, k_scale, v_scale


@dataclass
class PagedAttentionMetadata(AttentionMetadata):
    """What one step's attention calls need, all as vLLM built them."""

    num_actual_tokens: int  # tokens of this step, without padding
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], context including this step's tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 for padding
    cascade: Optional[CascadePlan] = None  # shared prefixes read once (layers without a window)
    cascade_block_size: int = 0  # the block size the plan counted in


class PagedAttentionMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    """Passes vLLM's common metadata through, plus the step's cascade split where one pays."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        # Abstract in vLLM's base class, which stores all four.
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.cascade_min_saved_tokens = cascade_threshold()
        self.cascade_steps = 0  # steps built with a split

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError(
                "paged_attention_ext's vLLM backend supports causal attention only")
        block_size = self.kv_cache_spec.block_size
        cascade = self._cascade(common_prefix_len, m, block_size)
        self.cascade_steps += cascade is not None
        return PagedAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            cascade=cascade,
            cascade_block_size=block_size,
        )

    def _cascade(self, common_prefix_len: int, m: CommonAttentionMetadata,
                 block_size: int) -> Optional[CascadePlan]:
        if self.cascade_min_saved_tokens is None:
            return None
        shared = common_prefix_len // block_size
        if shared > 0:
            # vLLM's common prefix: every request of the step, from device tensors only
            # (no sync; a captured graph replays it).
            prefix = shared * block_size
            return CascadePlan(
                prefix_block_tables=m.block_table_tensor[:1, :shared],
                prefix_lens=torch.full((1,), prefix, dtype=torch.int32, device=m.seq_lens.device),
                group_starts=m.query_start_loc[[0, m.num_reqs]],
                suffix_block_tables=m.block_table_tensor[:m.num_reqs, shared:],
                suffix_lens=m.seq_lens[:m.num_reqs] - prefix,
                query_start_loc=m.query_start_loc[:m.num_reqs + 1],
                saved_tokens=(m.num_reqs - 1) * prefix)
        if m.block_table_tensor.device.type != "cpu":
            return None  # planning from block ids would read the device
        lens = m.seq_lens[:m.num_reqs].tolist()
        starts = m.query_start_loc_cpu[:m.num_reqs + 1].tolist()
        rows = m.block_table_tensor[:m.num_reqs, :-(-max(lens, default=0) // block_size)].tolist()
        tables = [row[:-(-n // block_size)] for row, n in zip(rows, lens)]
        return plan_cascade(tables, lens, [b - a for a, b in zip(starts, starts[1:])], block_size,
                            m.block_table_tensor.device, self.cascade_min_saved_tokens)


class PagedAttentionImpl(AttentionImpl[PagedAttentionMetadata]):
    """One layer's attention: ``write_kv`` then ``attention_out`` into vLLM's output buffer."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[list[float]] = None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
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
        # None: as many KV heads as query heads, as vLLM's layer reads it.
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = FP8_FORMATS.get(kv_cache_dtype)  # None: the cache has the model's dtype
        self.per_token = TOKEN_FORMATS.get(kv_cache_dtype)  # int8, or uint8 (packed int4)
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
        key_cache, value_cache, scales = self._caches(layer, kv_cache)
        n = slot_mapping.shape[0]
        ops.write_kv(key[:n], value[:n], key_cache, value_cache, slot_mapping, **scales)

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
        key_cache, value_cache, scales = self._caches(layer, kv_cache)
        plan = m.cascade
        if (plan is not None and plan.applies_to(self.sliding_window, self.alibi_slopes)
                and key_cache.shape[2] == m.cascade_block_size):
            output[:n] = plan.run(query[:n], key_cache, value_cache, self.scale, self.soft_cap,
                                  self.sinks, **scales)
            return output
        ops.attention_out(output[:n], query[:n], key_cache, value_cache, m.block_table,
                          m.seq_lens, self.scale, m.query_start_loc, self.alibi_slopes,
                          self.sliding_window, self.soft_cap, sinks=self.sinks, **scales)
        return output

    def _caches(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The layer's key and value caches in the ops' dtype, and the scales the ops take
        with them (a per-token cache's are in its pages)."""
        if self.per_token is not None:
            key_cache, value_cache, k_scale, v_scale = split_token_kv_cache(
                kv_cache, self.num_kv_heads, self.head_size, self.per_token)
            return key_cache, value_cache, dict(k_scale=k_scale, v_scale=v_scale)
        key_cache, value_cache = split_kv_cache(kv_cache, self.num_kv_heads, self.head_size, self.fp8)
        return key_cache, value_cache, self._scales(layer)

    def _scales(self, layer) -> dict:
        """vLLM's per-layer fp32 scales (shape [] or [1]) for an fp8 cache, else none.

        The ops take any scale tensor without reading it (no device sync); a zero, negative
        or non-finite scale would store and read garbage, so each layer's is checked once."""
        if not self.fp8:
            return {}
        if not (hasattr(layer, "_k_scale") and hasattr(layer, "_v_scale")):
            raise VLLMInterfaceError(
                "paged_attention_ext's vLLM backend reads an fp8 cache's scales from the "
                "attention layer's _k_scale and _v_scale, which this vLLM's layer lacks")
        scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale)
        if id(layer) not in self._checked_scales:
            for name, scale in scales.items():
                if not bool(torch.isfinite(scale).all() and (scale > 0).all()):
                    raise ValueError(f"paged_attention_ext's vLLM backend: layer {name} must be "
                                     f"finite and positive, got {scale.tolist()}")
            self._checked_scales.add(id(layer))
        return scales
