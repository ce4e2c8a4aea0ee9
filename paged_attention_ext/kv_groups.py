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

Layers that keep no K/V (a hybrid model's linear-attention layers, whose fixed-size state
lives in :mod:`paged_attention_ext.state_cache`) are in no group: ``without_kv``.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union


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


@dataclass(frozen=True)
class KVGroup:
    sliding_window: Window
    layers: Tuple[int, ...]

    @property
    def chunk_size(self) -> Optional[int]:
        """Tokens per chunk of a chunked group, else None."""
        return self.sliding_window.size if isinstance(self.sliding_window, Chunked) else None


@dataclass(frozen=True)
class KVGroupLayout:
    groups: Tuple[KVGroup, ...]
    without_kv: Tuple[int, ...] = ()  # layers in no group: they store no K/V

    @classmethod
    def uniform(cls, num_layers: int, sliding_window: Window = None) -> "KVGroupLayout":
        """Every layer in one group (a model without mixed layer kinds)."""
        return cls((KVGroup(sliding_window, tuple(range(num_layers))),))

    @classmethod
    def from_windows(cls, windows: Sequence[Window],
                     without_kv: Sequence[int] = ()) -> "KVGroupLayout":
        """Groups for layers with these windows (one entry per layer, None: full; an int: a
        sliding window; :class:`Chunked`: chunked local attention).

        One kind: one group. Several: groups of as many layers as the rarest kind has,
        full attention first, then each window in order of first appearance. Layers in
        ``without_kv`` store no K/V (their window entry is ignored) and are in no group.
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
        kinds: Dict[Window, List[int]] = {}
        for layer, window in sorted(enumerate(windows), key=lambda lw: lw[1] is not None):
            if layer not in without_kv:
                kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1:
            [(window, layers)] = kinds.items()
            return cls((KVGroup(window, tuple(layers)),), without_kv)
        size = min(len(layers) for layers in kinds.values())
        return cls(tuple(KVGroup(window, tuple(layers[i:i + size]))
                         for window, layers in kinds.items()
                         for i in range(0, len(layers), size)), without_kv)

    @property
    def num_layers(self) -> int:
        """Layers that store K/V (those in a group)."""
        return sum(len(g.layers) for g in self.groups)

    @property
    def layers_per_group(self) -> int:
        """Layers a page holds: the number of pool tensors."""
        return max(len(g.layers) for g in self.groups)

    @property
    def padded_layers(self) -> int:
        """Layer slots of short groups that hold nothing (memory this layout wastes per page)."""
        return len(self.groups) * self.layers_per_group - self.num_layers

    @property
    def windows(self) -> Tuple[Window, ...]:
        """Each group's sliding window (None: full attention; :class:`Chunked`: chunked)."""
        return tuple(g.sliding_window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def place(self, layer: int) -> Tuple[int, int]:
        """(group, pool tensor) of a layer."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise IndexError(f"layer {layer} is not in this layout ({self.num_layers} layers)")
