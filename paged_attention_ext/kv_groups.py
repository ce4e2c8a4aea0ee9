"""KV groups: which layers share a block table.

A model whose layers all attend the same way keeps one block table per sequence. A
hybrid model (full-attention layers beside sliding-window ones: Gemma-2/3, GPT-OSS,
Cohere-2) would then keep every block of its sliding layers although no query can see
most of them again. So layers are split into *KV groups* of one attention kind and
window, each with its own block table; a sliding group frees the blocks that fall out
of its window, and a chunked group (Llama-4's chunked local attention, :class:`Chunked`) the
blocks of its finished chunks (:class:`~paged_attention_ext.block_table.BlockTable`).

As in vLLM's hybrid KV-cache manager, every group has the same number of layers, so a
block (one page) is the same size in every group and all groups draw from one pool:
physical block ``b`` of group ``g`` holds the K/V of group ``g``'s layers, layer ``j``
of the group in pool tensor ``j``. A kind whose layer count is not a multiple of the
group size leaves its last group short; its pages' unused part is the padding this
layout costs (:attr:`KVGroupLayout.padded_layers`).

Layers may also differ in what they store per token (Gemma-4: sliding layers of head 256
beside full layers of head 512 and fewer KV heads). Each group then holds layers of one
shape, and groups are sized by bytes instead of layer count: every group's page holds
about the same number of elements (:meth:`KVGroupLayout.from_windows` with ``shapes``), and
the cache lays each group's layers out in one page buffer of that size
(:class:`~paged_attention_ext.kv_cache.PagedKVCache`). A layer that reuses another layer's
K/V (Gemma-4's KV-shared layers) is in no group: it reads its source layer's blocks
(:attr:`KVGroupLayout.readers`).

Layers that keep no K/V (a hybrid model's linear-attention layers, whose fixed-size state
lives in :mod:`paged_attention_ext.state_cache`) are in no group: ``without_kv``.
"""

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union


@dataclass(frozen=True)
class Chunked:
    """Chunked local attention's span: the query at position ``p`` sees only the keys of its
    own chunk, positions ``[p // size * size, p]`` (Llama-4's ``attention_chunk_size``)."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"Chunked: 'size' must be a positive int (tokens per chunk), "
                             f"got {self.size!r}")


# What a layer attends over: None, every earlier key (full attention); an int, its last that
# many positions (a sliding window); Chunked, the keys of its own chunk.
Window = Union[None, int, Chunked]


def first_visible_position(window: Window, position: int) -> int:
    """The first key position the query at ``position`` sees."""
    if window is None:
        return 0
    if isinstance(window, Chunked):
        return position // window.size * window.size
    return max(0, position - window + 1)


# What one layer stores per token: (KV heads, key head size, value head size).
LayerShape = Tuple[int, int, int]


def shape_elements(shape: LayerShape) -> int:
    """Elements one token of a layer of this shape stores (keys and values)."""
    heads, head_size, head_size_v = shape
    return heads * (head_size + head_size_v)


def trailing_readers(kinds: Sequence, num_shared: int) -> Dict[int, int]:
    """Layers that reuse K/V as Gemma-4's ``num_kv_shared_layers`` declares it: each of the
    last ``num_shared`` layers reads the last layer before them of its own kind (``kinds``:
    one per layer, e.g. its attention type). ``ValueError`` when a kind has no such layer."""
    first = max(len(kinds) - num_shared, 0)
    readers: Dict[int, int] = {}
    for layer in range(first, len(kinds)):
        sources = [j for j in range(first) if kinds[j] == kinds[layer]]
        if not sources:
            raise ValueError(f"layer {layer} ({kinds[layer]}) reuses K/V (the last {num_shared} "
                             "layers do), but no earlier layer of its kind stores any")
        readers[layer] = sources[-1]
    return readers


@dataclass(frozen=True)
class KVGroup:
    sliding_window: Window
    layers: Tuple[int, ...]
    # What each of the group's layers stores per token; None: the cache's one shape.
    shape: Optional[LayerShape] = None

    @property
    def chunk_size(self) -> Optional[int]:
        """Tokens per chunk of a chunked group, else None."""
        return self.sliding_window.size if isinstance(self.sliding_window, Chunked) else None


@dataclass(frozen=True)
class KVGroupLayout:
    groups: Tuple[KVGroup, ...]
    # (layer, source layer): layers that store nothing and read their source's K/V.
    readers: Tuple[Tuple[int, int], ...] = ()
    without_kv: Tuple[int, ...] = ()  # layers in no group: they store no K/V

    @classmethod
    def uniform(cls, num_layers: int, sliding_window: Window = None) -> "KVGroupLayout":
        """Every layer in one group (a model without mixed layer kinds)."""
        return cls((KVGroup(sliding_window, tuple(range(num_layers))),))

    @classmethod
    def from_windows(cls, windows: Sequence[Window],
                     shapes: Optional[Sequence[LayerShape]] = None,
                     readers: Optional[Mapping[int, int]] = None,
                     without_kv: Sequence[int] = ()) -> "KVGroupLayout":
        """Groups for layers with these windows (one entry per layer, None: full; an int: a
        sliding window; :class:`Chunked`: chunked local attention).

        One kind: one group. Several: groups of as many layers as the rarest kind has,
        full attention first, then each window in order of first appearance.

        ``shapes`` (one per layer; None: every layer stores the cache's one shape): a kind
        is then a window and a shape, and each kind's group holds ``P // elements`` of its
        layers for one page of ``P`` elements per token (a kind of half the bytes per layer
        has groups of twice the layers); ``P`` is the whole number of some kind's layers
        that leaves the fewest page elements unused. ``readers`` maps a layer that stores
        nothing to the layer whose K/V it reads (same window and shape); such a layer is in
        no group. Layers in ``without_kv`` store no K/V at all (a hybrid model's
        linear-attention layers; their window and shape entries are ignored) and are in no
        group either.
        """
        if not windows:
            raise ValueError("a model needs at least one layer")
        without_kv = tuple(sorted(set(without_kv)))
        if any(not 0 <= layer < len(windows) for layer in without_kv):
            raise ValueError(f"without_kv {list(without_kv)} names layers outside the model's "
                             f"{len(windows)}")
        if len(without_kv) == len(windows):
            raise ValueError("a model needs at least one layer that stores K/V")
        for layer, window in enumerate(windows):
            if window is not None and not isinstance(window, Chunked) and (
                    isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ValueError(f"layer {layer}: sliding window must be a positive int, a "
                                 f"Chunked span or None (full attention), got {window!r}")
        if shapes is not None:
            shapes = [tuple(s) for s in shapes]
            if len(shapes) != len(windows):
                raise ValueError(f"shapes has {len(shapes)} entries for {len(windows)} layers")
            if len(set(shapes)) == 1:
                shapes = None  # one shape: the cache's
        readers = dict(readers or {})
        cls._check_readers(readers, windows, shapes)
        kinds: Dict[Tuple[Window, Optional[LayerShape]], List[int]] = {}
        for layer, window in sorted(enumerate(windows), key=lambda lw: lw[1] is not None):
            if layer not in readers and layer not in without_kv:
                kinds.setdefault((window, shapes[layer] if shapes else None), []).append(layer)
        pairs = tuple(sorted(readers.items()))
        if len(kinds) == 1:
            [((window, shape), layers)] = kinds.items()
            return cls((KVGroup(window, tuple(layers), shape),), pairs, without_kv)
        if shapes is None:
            sizes = dict.fromkeys(kinds, min(len(layers) for layers in kinds.values()))
        else:
            sizes = cls._sizes_by_bytes({kind: len(layers) for kind, layers in kinds.items()})
        return cls(tuple(KVGroup(window, tuple(layers[i:i + sizes[window, shape]]), shape)
                         for (window, shape), layers in kinds.items()
                         for i in range(0, len(layers), sizes[window, shape])), pairs, without_kv)

    @staticmethod
    def _sizes_by_bytes(counts: Mapping[Tuple[Window, LayerShape], int]) -> Dict[Tuple[Window, LayerShape], int]:
        """Layers per group of each kind for one page size: the page (a whole number of some
        kind's layers) that leaves the fewest elements unused over all groups, the largest
        such page on a tie (fewer groups, fewer block tables)."""
        def waste(page: int) -> int:
            return sum(-(-n // (page // shape_elements(shape))) * page - n * shape_elements(shape)
                       for (_, shape), n in counts.items())
        largest = max(shape_elements(shape) for _, shape in counts)
        pages = {k * shape_elements(shape) for (_, shape), n in counts.items()
                 for k in range(1, n + 1) if k * shape_elements(shape) >= largest}
        page = min(pages, key=lambda p: (waste(p), -p))
        return {kind: page // shape_elements(kind[1]) for kind in counts}

    @staticmethod
    def _check_readers(readers: Mapping[int, int], windows: Sequence[Window],
                       shapes: Optional[Sequence[LayerShape]]) -> None:
        for layer, source in readers.items():
            if not (0 <= layer < len(windows) and 0 <= source < len(windows)):
                raise ValueError(f"readers: layer {layer} reads layer {source}, but the model has "
                                 f"layers 0-{len(windows) - 1}")
            if source in readers:
                raise ValueError(f"readers: layer {layer} reads layer {source}, which stores "
                                 f"nothing itself (it reads layer {readers[source]})")
            if windows[layer] != windows[source] or (shapes and shapes[layer] != shapes[source]):
                raise ValueError(f"readers: layer {layer} reads layer {source}, whose window or "
                                 "shape differs from its own")

    @property
    def num_layers(self) -> int:
        """Every layer of the model: those in groups, the readers and those without K/V."""
        return self.stored_layers + len(self.readers) + len(self.without_kv)

    @property
    def stored_layers(self) -> int:
        """Layers that store K/V (in a group)."""
        return sum(len(g.layers) for g in self.groups)

    @property
    def is_shaped(self) -> bool:
        """Groups differ in what a layer stores per token (pools per shape)."""
        return any(g.shape is not None for g in self.groups)

    def page_elements(self, group: int, block_size: int) -> int:
        """Elements of one page of a shaped layout's ``group`` (keys and values)."""
        g = self.groups[group]
        return len(g.layers) * block_size * shape_elements(g.shape)

    @property
    def layers_per_group(self) -> int:
        """Layers a page holds: the number of pool tensors."""
        return max(len(g.layers) for g in self.groups)

    @property
    def padded_layers(self) -> int:
        """Layer slots of short groups that hold nothing (memory this layout wastes per page)."""
        return len(self.groups) * self.layers_per_group - self.stored_layers

    @property
    def windows(self) -> Tuple[Window, ...]:
        """Each group's sliding window (None: full attention; :class:`Chunked`: chunked)."""
        return tuple(g.sliding_window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def place(self, layer: int) -> Tuple[int, int]:
        """(group, pool tensor) of a layer (a reader: its source's)."""
        layer = dict(self.readers).get(layer, layer)
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise IndexError(f"layer {layer} is not in this layout ({self.num_layers} layers)")
