"""Llama-4's attention temperature at each token's real position in a packed forward.

transformers' ``Llama4TextAttention`` scales the queries of its NoPE layers by a temperature
of each query's position, and reads that position neither from ``position_ids`` nor from
``cache_position`` (neither reaches the layer) but as the token's index in the forward plus
its cache's ``get_seq_length(layer_idx)``::

    positions = torch.arange(hidden_states.shape[1], ...) + past_seen_tokens

The engine packs every sequence's new tokens into one row and passes no cache, so a token's
index is its place in the row, not its position. For the engine's packed forwards only (eager
and compiled), :class:`RealPositions` hands each such layer, in its cache argument (``None``
there otherwise), a stand-in whose ``get_seq_length`` is each token's offset (its position minus
its index) and whose ``update`` returns the K/V unchanged (the paged attention function
writes them): transformers' own formula then sees the real positions.

What it relies on is checked before the engine serves such a model (:func:`check`): a
release that computes the positions otherwise gets ``NotImplementedError`` naming the
change, never a wrong temperature.
"""

import contextlib
import inspect
from typing import Iterator, List, Optional, Sequence

import torch
from transformers.models.llama4 import modeling_llama4

# The lines of Llama4TextAttention.forward the stand-in feeds (transformers 5.18: the cache
# argument is ``past_key_values``; 5.25: ``cache``).
_POSITIONS = ("positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)"
              " + past_seen_tokens")
_SEEN = ".get_seq_length(self.layer_idx)"
_CACHE_ARGUMENTS = ("cache", "past_key_values")
_INSTALLED = "_paged_attention_ext_real_positions"


def tempered_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's attention modules whose queries get the position temperature (Llama-4's
    NoPE layers with ``attn_temperature_tuning``)."""
    return [m for m in model.modules() if isinstance(m, modeling_llama4.Llama4TextAttention)
            and m.attn_temperature_tuning and not m.use_rope]


def check() -> None:
    """Raise NotImplementedError, naming what changed, when this transformers release no
    longer computes the temperature's positions as the hook expects."""
    forward = inspect.unwrap(modeling_llama4.Llama4TextAttention.forward)
    try:
        source = " ".join(inspect.getsource(forward).split())
    except (OSError, TypeError):  # an install without sources: nothing to check against
        source = ""
    parameters = inspect.signature(forward).parameters
    missing = [line for line in (_POSITIONS, _SEEN) if line not in source]
    if missing or not any(name in parameters for name in _CACHE_ARGUMENTS):
        raise NotImplementedError(
            "the engine cannot serve Llama-4's attention temperature tuning on this transformers "
            f"release: Llama4TextAttention.forward no longer has {missing or _CACHE_ARGUMENTS} "
            "(the engine gives each packed token its real position through it); use "
            "model.generate with a PagedCache")


class _Offsets:
    """What a tempered layer reads from its cache argument in a packed forward."""

    def __init__(self, offsets: torch.Tensor) -> None:
        self.offsets = offsets

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.offsets  # [num_tokens]: added to each token's index in the row

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        return key_states, value_states  # the paged attention function writes them


class RealPositions:
    """Hooks on a model's tempered layers, installed once (:func:`installed`): a forward run
    inside :meth:`at` (or between :meth:`feed` and :meth:`clear`, which a compiled forward
    traces, while adding a hook it cannot) tempers each query at its position in
    ``position_ids``; every other forward of the model, ``generate``'s with a cache
    included, goes through unchanged."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self._offsets: Optional[_Offsets] = None
        for layer in layers:
            layer.register_forward_pre_hook(self._hand_offsets, with_kwargs=True)
            setattr(layer, _INSTALLED, self)

    def feed(self, position_ids: torch.Tensor) -> None:
        """The next forward is one row with ``position_ids`` ``[1, num_tokens]``."""
        row = position_ids.reshape(-1)
        self._offsets = _Offsets(row - torch.arange(row.numel(), device=row.device))

    def clear(self) -> None:
        self._offsets = None

    @contextlib.contextmanager
    def at(self, position_ids: torch.Tensor) -> Iterator[None]:
        self.feed(position_ids)
        try:
            yield
        finally:
            self.clear()

    def _hand_offsets(self, module, args, kwargs):
        offsets = self._offsets
        if offsets is None:
            return None
        names = [name for name in _CACHE_ARGUMENTS if name in kwargs]
        if len(names) != 1 or kwargs[names[0]] is not None:
            raise RuntimeError(
                f"Llama-4 layer {module.layer_idx}: expected one empty cache argument in a packed "
                f"forward, got {[(n, type(kwargs[n]).__name__) for n in names]}")
        return args, {**kwargs, names[0]: offsets}


def installed(model: torch.nn.Module) -> Optional[RealPositions]:
    """The model's :class:`RealPositions` (installed on the first call; the same one after),
    or None for a model without tempered layers."""
    layers = tempered_layers(model)
    if not layers:
        return None
    hook = getattr(layers[0], _INSTALLED, None)
    return hook if hook is not None else RealPositions(layers)
