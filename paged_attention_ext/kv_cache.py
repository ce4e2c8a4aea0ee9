"""The KV cache of a whole model: every layer's K and V pools plus host swap pools.

Sizes the device pool from a block count or a memory budget and applies the block
manager's copy-on-write and swap mappings with the paged ops, all layers at once.
An fp8 cache also holds each layer's ``k_scale``/``v_scale`` (given, or calibrated from the
first keys and values the layer stores) and passes them to every op call
(:meth:`PagedKVCache.write`, :meth:`PagedKVCache.scales`). A per-token cache (int8, packed
int4: :mod:`paged_attention_ext.token_quantization`) holds a scale tensor per layer and K or V
inside its blocks' pages, which ``write_kv`` fills and the attention ops read.
"""

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import ops, token_quantization
from .block_table import BlockPair
from .host_memory import zeros_huge_pages
from .kv_groups import KVGroupLayout
from .quantization import (CACHE_DTYPES, CALIBRATIONS, ScaleLike, calibrate, check_scale,
                           dtype_label, is_fp8)


SUPPORTED_DTYPES = CACHE_DTYPES
# Scale tensors start on a float32 boundary of the page.
_SCALE_ALIGN = 4
# Scales for every layer: one ScaleLike for all layers, a sequence of one per layer, or a
# float tensor [num_layers, 1 or num_kv_heads].
LayerScales = Union[ScaleLike, Sequence[ScaleLike]]


def bytes_per_block(num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                    dtype: torch.dtype, head_size_v: Optional[int] = None) -> int:
    """K and V of one block across all layers (``head_size_v``: the value head size, if it
    differs); a per-token format's scales included."""
    head_size_v = head_size if head_size_v is None else head_size_v
    if token_quantization.is_per_token(dtype):
        return num_layers * sum(token_slot_bytes(dtype, num_kv_heads, size, block_size)
                                for size in (head_size, head_size_v))
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * num_kv_heads * block_size * (head_size + head_size_v) * element


def _aligned(n: int) -> int:
    return -(-n // _SCALE_ALIGN) * _SCALE_ALIGN


def token_slot_bytes(dtype: torch.dtype, heads: int, head_size: int, block_size: int) -> int:
    """Bytes of one layer's K (or V) of a block in a per-token format: its rows, then their
    scales (from a float32 boundary)."""
    rows = heads * block_size * token_quantization.stored_head_size(dtype, head_size)
    scales = token_quantization.bytes_per_token_head(dtype, head_size) - (
        token_quantization.stored_head_size(dtype, head_size))
    return _aligned(rows) + heads * block_size * scales


def token_slot_views(slots: torch.Tensor, heads: int, head_size: int,
                     block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows ``[num_blocks, heads, block_size, stored head size]`` and float32 scales
    (``token_quantization.scale_shape``) of per-token slots ``[num_blocks,
    token_slot_bytes(...)]`` (cache dtype, one byte an element; views, any block stride
    that keeps the scales on float32 boundaries)."""
    stored = token_quantization.stored_head_size(slots.dtype, head_size)
    rows = heads * block_size * stored
    num_blocks = slots.shape[0]
    shape = token_quantization.scale_shape(slots.dtype, num_blocks, heads, block_size)
    return (slots[:, :rows].view(num_blocks, heads, block_size, stored),
            slots[:, _aligned(rows):].view(torch.float32).view(shape))


def check_int(name: str, value, minimum: Optional[int], optional: bool = False,
              type_error: type = TypeError) -> None:
    """A ValueError (or ``type_error`` for a value that is no int) naming the argument unless
    ``value`` is an int >= ``minimum`` (None: any int). The one integer-argument check of
    the package (the engine's ``SamplingParams`` raise ValueError for both)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise type_error(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class PagedKVCache:
    """Every layer's K and V pools (``[num_blocks, num_kv_heads, block_size, head_size]``).

    ``head_size_v`` is the value head size when it differs from the key head size (MLA
    models as transformers runs them: key ``qk_nope + qk_rope``, value ``v_head_dim``);
    None means ``head_size``.

    fp8 caches (``dtype`` ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, see
    :mod:`paged_attention_ext.quantization`) need a ``k_scale`` and ``v_scale`` per layer:

    * given: ``k_scale``/``v_scale`` each a number or a float tensor of 1 or
      ``num_kv_heads`` elements for every layer, a sequence with one such entry per layer,
      or a tensor ``[num_layers, 1 or num_kv_heads]``;
    * or calibrated (both None): each layer's first :meth:`write` sets the scales from
      the absolute maxima of the keys and values it stores (``amax / fmax``), one per layer
      (``calibration="per_layer"``) or per KV head (``"per_head"``). Later values beyond
      that range saturate. ``calibration=None`` makes missing scales an error.

    Per-token caches (``torch.int8``: ``int8_per_token_head``, ``torch.uint8``:
    ``int4_per_token_head``, head size even) take no scales: ``write_kv`` computes each
    token's scales from its own row and stores them in the layer's scale tensors
    (``token_quantization.scale_shape``), views of the same page as the layer's rows, so a
    block's bytes (:attr:`block_bytes`) count its scales and copies and swaps move them with
    their rows. :meth:`layer` returns the rows (int4: ``head_size // 2`` bytes a row),
    :meth:`scales` the scale tensors. Latent rows (``values_in_keys``) are quantized whole
    (``write_latent``): the value view is the rows' leading columns and its scales are the
    rows' own (one tensor for ``k_scale`` and ``v_scale``).

    Float caches take no scales. Bytes are counted per element of the cache dtype (fp8:
    one byte per value; the scales' few bytes per layer are not counted).

    ``values_in_keys``: one tensor per pool holds both (MLA latent rows, vLLM's layout): a
    token's row is its key (``head_size`` columns) and its value is the row's first
    ``head_size_v`` columns, a view of the same memory, never a copy. Such a cache is written
    with :meth:`write_columns` and its fp8 scale (per-token: its scale tensor) is one for
    both views.

    ``kv_groups``: a hybrid model's KV groups (:mod:`paged_attention_ext.kv_groups`). A
    block then holds one group's layers, so the pools are ``layers_per_group`` tensors
    (not one per layer), :meth:`layer` finds a layer's, and the block manager gives each
    group its own block tables and slots. None: one group of every layer.

    A shaped layout (groups whose layers store different shapes: ``KVGroup.shape``) keeps
    one key and one value page buffer, ``[num_blocks, 1, 1, elements]`` (:attr:`key_caches`
    and :attr:`value_caches` then hold these two, so copies and swaps move whole pages),
    each page as large as the largest group's; :meth:`layer` returns views of a block's
    slice for the layer, in its own shape (``num_kv_heads``, ``head_size`` and
    ``head_size_v`` then name layer 0's). A reader layer (``KVGroupLayout.readers``) stores
    nothing: :meth:`layer` and :meth:`scales` answer its source layer's.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float16, device: "str | torch.device" = "cpu",
                 num_blocks: Optional[int] = None, memory_bytes: Optional[int] = None,
                 num_host_blocks: int = 0, head_size_v: Optional[int] = None,
                 k_scale: Optional[LayerScales] = None, v_scale: Optional[LayerScales] = None,
                 calibration: Optional[str] = "per_layer",
                 kv_groups: Optional[KVGroupLayout] = None, values_in_keys: bool = False) -> None:
        check_int("num_layers", num_layers, 1)
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("head_size", head_size, 1)
        check_int("head_size_v", head_size_v, 1, optional=True)
        check_int("block_size", block_size, 1)
        check_int("num_blocks", num_blocks, 1, optional=True)
        check_int("memory_bytes", memory_bytes, 0, optional=True)
        check_int("num_host_blocks", num_host_blocks, 0)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        if not isinstance(values_in_keys, bool):
            raise TypeError(f"values_in_keys must be a bool, got {type(values_in_keys).__name__}")
        if values_in_keys and not (head_size_v is not None and head_size_v < head_size):
            raise ValueError(f"values_in_keys needs head_size_v < head_size (the values are the "
                             f"rows' first head_size_v columns), got head_size={head_size}, "
                             f"head_size_v={head_size_v}")
        if (values_in_keys and dtype == torch.uint8
                and head_size_v % token_quantization.rotation_block(head_size)):
            raise ValueError(f"int4_per_token_head latent rows of {head_size} values are rotated "
                             f"in blocks of {token_quantization.rotation_block(head_size)}, so "
                             f"their values (the leading {head_size_v} columns) must be whole "
                             "blocks; use int8_per_token_head")
        if kv_groups is None:
            kv_groups = KVGroupLayout.uniform(num_layers)
        if kv_groups.num_layers != num_layers:
            raise ValueError(f"kv_groups places {kv_groups.num_layers} layers, the cache has {num_layers}")
        self.kv_groups = kv_groups
        # Layers without K/V (kv_groups.without_kv) have no place: writing one raises.
        self._place = {layer: kv_groups.place(layer) for layer in range(num_layers)
                       if layer not in kv_groups.without_kv}
        readers = dict(kv_groups.readers)
        self._source = [readers.get(layer, layer) for layer in range(num_layers)]
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.head_size_v = head_size if head_size_v is None else head_size_v
        self.values_in_keys = values_in_keys
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.per_token = token_quantization.is_per_token(dtype)
        one_shape = (num_kv_heads, head_size, self.head_size_v)
        self._shapes = [kv_groups.groups[self._place[layer][0]].shape or one_shape
                        if layer in self._place else one_shape for layer in range(num_layers)]
        # Layers in page slices: groups of several shapes, and per-token rows beside their scales.
        self._paged = kv_groups.is_shaped or self.per_token
        if self._paged:
            if values_in_keys and kv_groups.is_shaped:
                raise ValueError("values_in_keys needs one shape for every layer; these "
                                 "kv_groups have layers of several")
            # Key and value elements of the largest group's page.
            self._page = tuple(max(len(g.layers) * self._slot(g.shape or one_shape, part)
                                   for g in kv_groups.groups) for part in (1, 2))
            element = torch.empty((), dtype=dtype).element_size()
            self.block_bytes = sum(self._page) * element
        else:
            self.block_bytes = bytes_per_block(kv_groups.layers_per_group, num_kv_heads, head_size,
                                               block_size, dtype, 0 if values_in_keys else self.head_size_v)
        if num_blocks is None:
            num_blocks = memory_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"the pool must hold at least one block ({self.block_bytes} bytes), "
                             f"memory_bytes={memory_bytes} holds none")
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self._recalibrate = [False] * num_layers
        self.k_scales, self.v_scales, self.calibration = self._layer_scales(k_scale, v_scale,
                                                                            calibration)
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        shape_v = shape[:3] + (self.head_size_v,)
        host_shape = (num_host_blocks,) + shape[1:]
        host_shape_v = (num_host_blocks,) + shape_v[1:]
        # Pinned host memory lets device <-> host swaps run asynchronously.
        pin = self.device.type == "cuda"
        if self._paged:
            self._paged_pools(pin)
            return
        self.key_caches: List[torch.Tensor] = []
        self.value_caches: List[torch.Tensor] = []
        self.host_key_caches: List[torch.Tensor] = []
        self.host_value_caches: List[torch.Tensor] = []
        for _ in range(kv_groups.layers_per_group):
            self.key_caches.append(self._device_pool(shape))
            self.host_key_caches.append(torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
            if values_in_keys:
                self.value_caches.append(self.key_caches[-1][..., :self.head_size_v])
                self.host_value_caches.append(self.host_key_caches[-1][..., :self.head_size_v])
            else:
                self.value_caches.append(self._device_pool(shape_v))
                self.host_value_caches.append(torch.zeros(host_shape_v, dtype=dtype, pin_memory=pin))

    def _slot(self, shape: Tuple[int, int, int], part: int) -> int:
        """Elements of one layer's keys (``part`` 1) or values (2) in a page."""
        heads, size = shape[0], shape[part]
        if self.values_in_keys and part == 2:
            return 0  # the values are the key rows' leading columns
        if self.per_token:
            return token_slot_bytes(self.dtype, heads, size, self.block_size)
        return heads * size * self.block_size

    def _paged_pools(self, pin: bool) -> None:
        """One key and one value page buffer; each stored layer's pools (and a per-token
        layer's scales) are views of its slice of every page (layer ``j`` of a group at
        ``j`` slots in)."""
        keys, values = ((self.num_blocks, 1, 1, n) for n in self._page)
        self.key_caches, self.value_caches = [self._device_pool(keys)], [self._device_pool(values)]
        self.host_key_caches = [torch.zeros((self.num_host_blocks,) + keys[1:], dtype=self.dtype,
                                            pin_memory=pin)]
        self.host_value_caches = [torch.zeros((self.num_host_blocks,) + values[1:], dtype=self.dtype,
                                              pin_memory=pin)]
        self._views: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._scale_views: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        one_shape = (self.num_kv_heads, self.head_size, self.head_size_v)
        for group in self.kv_groups.groups:
            shape = group.shape or one_shape
            for j, layer in enumerate(group.layers):
                if self.values_in_keys:  # latent rows: one row and one scale serve both views
                    key, k_scale = self._page_slice(self.key_caches[0], j, shape, 1)
                    value = key[..., :token_quantization.stored_head_size(self.dtype, shape[2])]
                    v_scale = k_scale
                else:
                    (key, k_scale), (value, v_scale) = (
                        self._page_slice(pages[0], j, shape, part)
                        for pages, part in ((self.key_caches, 1), (self.value_caches, 2)))
                self._views[layer] = (key, value)
                if self.per_token:
                    self._scale_views[layer] = (k_scale, v_scale)

    def _page_slice(self, pages: torch.Tensor, j: int, shape: Tuple[int, int, int],
                    part: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The ``j``-th layer slot of every page: its rows ``[num_blocks, heads, block_size,
        size]`` and, per-token, their float32 scales after them."""
        heads, size = shape[0], shape[part]
        n = self._slot(shape, part)
        slot = pages.view(self.num_blocks, -1)[:, j * n:(j + 1) * n]
        if not self.per_token:
            return slot.view(self.num_blocks, heads, self.block_size, size), None
        return token_slot_views(slot, heads, size, self.block_size)

    def _device_pool(self, shape: Tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return zeros_huge_pages(shape, self.dtype)  # random block order: spare the TLB
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _layer_scales(self, k_scale, v_scale, calibration):
        """Per-layer scale lists (None: to calibrate) and the calibration in force."""
        if calibration is not None and calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS} or None, got {calibration!r}")
        given = [name for name, s in (("k_scale", k_scale), ("v_scale", v_scale)) if s is not None]
        if not self.is_fp8:
            if given:
                verb = "apply" if len(given) == 2 else "applies"
                fix = ("its scales are computed per token as it is written: pass none"
                       if self.per_token else "pass no scales, or an fp8 dtype")
                raise ValueError(f"{' and '.join(given)} {verb} to fp8 caches only; this cache is "
                                 f"{dtype_label(self.dtype)} ({fix})")
            return [None] * self.num_layers, [None] * self.num_layers, None
        if len(given) == 1:
            raise ValueError(f"an fp8 cache needs both k_scale and v_scale, or neither (to "
                             f"calibrate them); got only {given[0]}")
        if not given:
            if calibration is None:
                raise ValueError(f"an {self.dtype} cache needs k_scale and v_scale (or a "
                                 f"calibration: {CALIBRATIONS})")
            return [None] * self.num_layers, [None] * self.num_layers, calibration
        k_scales, v_scales = self._per_layer("k_scale", k_scale), self._per_layer("v_scale", v_scale)
        if self.values_in_keys and not all(torch.equal(k, v) for k, v in zip(k_scales, v_scales)):
            raise ValueError("a cache with values_in_keys stores each row once, under one scale: "
                             "give equal k_scale and v_scale")
        return k_scales, v_scales, None

    def _per_layer(self, name: str, scales: LayerScales) -> List[torch.Tensor]:
        if isinstance(scales, torch.Tensor) and scales.dim() == 2:
            if scales.shape[0] != self.num_layers:
                raise ValueError(f"{name} of shape {tuple(scales.shape)} must have one row per "
                                 f"layer ({self.num_layers})")
            scales = list(scales)
        elif isinstance(scales, torch.Tensor) or not isinstance(scales, Sequence):
            scales = [scales] * self.num_layers
        elif len(scales) != self.num_layers:
            raise ValueError(f"{name} must be one scale for every layer or a sequence of one per "
                             f"layer ({self.num_layers}), got {len(scales)} entries")
        return [check_scale(f"{name}[{i}]", s, self._shapes[i][0], self.device)
                for i, s in enumerate(scales)]

    @property
    def is_quantized(self) -> bool:
        """An fp8 or per-token cache: not the model's values exactly."""
        return self.is_fp8 or self.per_token

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def calibrated(self) -> bool:
        """Every layer has its scales (always true for float and per-token caches)."""
        return not self.is_fp8 or all(s is not None for s in self.k_scales)

    def layer(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s key and value pools (shared by one layer of each KV group)."""
        if self._paged:
            return self._views[self._source[index]]
        pool = self._place[index][1]
        return self.key_caches[pool], self.value_caches[pool]

    def layer_shape(self, index: int) -> Tuple[int, int, int]:
        """(KV heads, key head size, value head size) of layer ``index``'s pools."""
        return self._shapes[index]

    def source(self, index: int) -> int:
        """The layer whose K/V layer ``index`` reads: itself, or a reader's source."""
        return self._source[index]

    def kv_group(self, index: int) -> int:
        """The KV group of layer ``index`` (whose block tables and slots it uses)."""
        return self._place[index][0]

    def scales(self, index: int) -> Dict[str, torch.Tensor]:
        """Layer ``index``'s ``k_scale``/``v_scale`` keywords for the paged ops: empty for a
        float cache (the ops' default, None); a per-token layer's scale tensors (views of its
        pages). Every op call on the pools passes them."""
        if not self.is_quantized:
            return {}
        index = self._source[index]
        if self.per_token:
            k_scale, v_scale = self._scale_views[index]
            return {"k_scale": k_scale, "v_scale": v_scale}
        if self.k_scales[index] is None:
            raise RuntimeError(f"layer {index} of the {self.dtype} cache has no scales yet: they "
                               "are calibrated by the layer's first write(), or give k_scale/v_scale")
        return {"k_scale": self.k_scales[index], "v_scale": self.v_scales[index]}

    def write(self, index: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store tokens' K/V (``[tokens, kv_heads, head size]``) of layer ``index`` at their slots.

        An fp8 layer without scales first calibrates them from the tokens that have a slot
        (``slot_mapping >= 0``); keys and values go to the op in the model dtype, which
        quantizes (a per-token layer: with each row's scales, which the op stores). Float
        caches get them converted to the cache dtype.
        """
        if self.values_in_keys:
            raise ValueError("this cache keeps the values in the keys' rows: store them with "
                             "write_columns(index, values, rest_of_key, slot_mapping)")
        if self._source[index] != index:
            raise ValueError(f"layer {index} reads layer {self._source[index]}'s K/V and stores "
                             "nothing of its own")
        key_cache, value_cache = self.layer(index)
        if not self.is_quantized:
            key, value = key.to(self.dtype), value.to(self.dtype)
        elif self.is_fp8 and not self._calibrated(index, key, value, slot_mapping, one_scale=False):
            return
        ops.write_kv(key, value, key_cache, value_cache, slot_mapping, **self.scales(index))

    def _calibrated(self, index: int, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, one_scale: bool) -> bool:
        """An fp8 layer's scales, calibrated first where due from the tokens that have a slot
        (``one_scale``: the larger of both, for rows that hold keys and values at once).
        False when that is due but no token has a slot: nothing to store or calibrate from."""
        if self.k_scales[index] is not None and not self._recalibrate[index]:
            return True
        stored = slot_mapping >= 0
        if not bool(stored.any()):
            return False
        per_head = self.calibration == "per_head"
        k_scale = calibrate(key[stored], self.dtype, per_head).to(self.device)
        v_scale = calibrate(value[stored], self.dtype, per_head).to(self.device)
        if one_scale:
            k_scale = v_scale = torch.maximum(k_scale, v_scale)
        if self._recalibrate[index] and self.k_scales[index].shape == k_scale.shape:
            # In place: a compiled forward holding these tensors reads the new scales.
            self.k_scales[index].copy_(k_scale)
            self.v_scales[index].copy_(v_scale)
        else:
            self.k_scales[index], self.v_scales[index] = k_scale, v_scale
        self._recalibrate[index] = False
        return True

    def write_columns(self, index: int, head: torch.Tensor, tail: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Store tokens' rows of a ``values_in_keys`` layer given as two column ranges:
        ``head`` (``[tokens, kv_heads, head_size_v]``: the values, an MLA model's latent) in
        the first columns, ``tail`` (the rest of the key: the rotary part) after them.

        An fp8 layer without scales first calibrates one scale for the whole row (the larger
        of both ranges'), which both views then use; a per-token layer quantizes each whole
        row under its own scale (``write_latent``).
        """
        if not self.values_in_keys:
            raise ValueError("write_columns stores rows of a values_in_keys cache; this cache "
                             "keeps keys and values apart: use write()")
        rows = self.layer(index)[0]
        if self.per_token:  # the whole row quantized once, its scale into the layer's scales
            ops.write_latent(head, tail, rows, slot_mapping, self.scales(index)["k_scale"])
            return
        if not self.is_quantized:
            head, tail = head.to(self.dtype), tail.to(self.dtype)
        elif not self._calibrated(index, head, tail, slot_mapping, one_scale=True):
            return
        # The op writes its "keys" and "values" into two column views of the same rows.
        ops.write_kv(head, tail, rows[..., :self.head_size_v], rows[..., self.head_size_v:],
                     slot_mapping, **self.scales(index))

    def recalibrate(self) -> None:
        """Calibrate every layer anew on its next write (a cache reused for new requests);
        no-op for float caches and for given scales."""
        if self.calibration is not None:
            self._recalibrate = [True] * self.num_layers

    def as_query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` in the dtype the attention op takes with these pools: the cache dtype
        for float caches; fp8 caches take fp32/fp16/bf16 queries as they are."""
        return query if self.is_quantized else query.to(self.dtype)

    def with_blocks(self, num_blocks: int) -> "PagedKVCache":
        """A cache of ``num_blocks`` (>= this one's) device blocks holding this one's
        blocks, host pools and scales (calibrated or still to calibrate)."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"with_blocks({num_blocks}) would drop blocks of a {self.num_blocks}-block cache")
        bigger = PagedKVCache(self.num_layers, self.num_kv_heads, self.head_size, self.block_size,
                              self.dtype, self.device, num_blocks=num_blocks,
                              num_host_blocks=self.num_host_blocks, head_size_v=self.head_size_v,
                              kv_groups=self.kv_groups, values_in_keys=self.values_in_keys)
        bigger.k_scales, bigger.v_scales = list(self.k_scales), list(self.v_scales)
        bigger.calibration, bigger._recalibrate = self.calibration, list(self._recalibrate)
        for old, new in zip(self._pools(), bigger._pools()):
            new[:self.num_blocks].copy_(old)
        for old, new in zip(self._host_pools(), bigger._host_pools()):
            new.copy_(old)
        return bigger

    def apply_copies(self, copies: Sequence[BlockPair]) -> None:
        """Copy-on-write / fork copies for every layer in one op call."""
        if not copies:
            return
        # The CUDA kernel reads the mapping on the device, the CPU one on the host.
        mapping = self._mapping(copies, self.device)
        if self.values_in_keys and not self._paged:  # each column once: the values', the rest
            ops.copy_blocks(self.value_caches, [rows[..., self.head_size_v:] for rows in self.key_caches],
                            mapping)
        else:
            ops.copy_blocks(self.key_caches, self.value_caches, mapping)

    def _pools(self) -> List[torch.Tensor]:
        """The device tensors that hold the contents (a values_in_keys cache: the rows)."""
        return self.key_caches if self.values_in_keys else self.key_caches + self.value_caches

    def _host_pools(self) -> List[torch.Tensor]:
        return (self.host_key_caches if self.values_in_keys
                else self.host_key_caches + self.host_value_caches)

    def swap_out(self, mapping: Sequence[BlockPair]) -> None:
        """Copy (device block, host block) rows from the device pools to the host pools."""
        self._swap(mapping, self._pools(), self._host_pools())

    def swap_in(self, mapping: Sequence[BlockPair]) -> None:
        """Copy (host block, device block) rows from the host pools to the device pools."""
        self._swap(mapping, self._host_pools(), self._pools())

    def usage(self, used_blocks: int, used_host_blocks: int = 0) -> Dict[str, float]:
        """Bytes reserved and in use, given the block manager's counts."""
        return {
            "dtype": dtype_label(self.dtype),
            "device_tokens": self.num_blocks * self.block_size,
            "device_bytes": self.num_blocks * self.block_bytes,
            "device_bytes_used": used_blocks * self.block_bytes,
            "device_fraction_used": used_blocks / self.num_blocks,
            "host_bytes": self.num_host_blocks * self.block_bytes,
            "host_bytes_used": used_host_blocks * self.block_bytes,
        }

    def _swap(self, mapping, sources: List[torch.Tensor], targets: List[torch.Tensor]) -> None:
        if not mapping:
            return
        rows = self._mapping(mapping, torch.device("cpu"))  # swaps plan their copies on the host
        for src, dst in zip(sources, targets):
            ops.swap_blocks(src, dst, rows)

    @staticmethod
    def _mapping(pairs: Sequence[BlockPair], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(pairs), dtype=torch.int64, device=device).view(-1, 2)
