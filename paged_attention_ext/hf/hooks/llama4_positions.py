"""Llama-4's attention temperature at each token's real position in a packed forward.

transformers' ``Llama4TextAttention`` scales the queries of its NoPE layers by a temperature
of each query's position, and reads that position neither from ``position_ids`` nor from
``cache_position`` (neither reaches the layer) but as the token's index in the forward plus
its cache's ``get_seq_length(layer_idx)``::

    positions = torch.arange(hidden_states.shape[1], ...) + past_seen_tokens

The engine packs every sequence's new tokens into one row and passes no cache, so a token's
index is its place in the row, not its position. For the engine's packed forwards only,
:func:`real_positions` hands each such layer, in its cache argument (``None`` there
otherwise), a stand-in whose ``get_seq_length`` is each token's offset (its position minus
its index) and whose ``update`` returns the K/V unchanged (the paged attention function
writes them): transformers' own formula then sees the real positions.

What it relies on is checked before the engine serves such a model (:func:`check`): a
release that computes the positions otherwise gets ``NotImplementedError`` naming the
change, never a wrong temperature.
"""

import contextlib
import inspect
from typing import Iterator, List, Sequence

import torch
from transformers.models.llama4 import modeling_llama4

# The lines of Llama4TextAttention.forward the stand-in feeds (transformers 5.18: the cache
# argument is ``past_key_values``; 5.25: ``cache``).
_POSITIONS = ("positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)"
              " + past_seen_tokens")
_SEEN = ".get_seq_length(self.layer_idx)"
_CACHE_ARGUMENTS = ("cache", "past_key_values")


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


def _hand_offsets(offsets: _Offsets):
    def hook(module, args, kwargs):
        names = [name for name in _CACHE_ARGUMENTS if name in kwargs]
        if len(names) != 1 or kwargs[names[0]] is not None:
            raise RuntimeError(
                f"Llama-4 layer {module.layer_idx}: expected one empty cache argument in a packed "
                f"forward, got {[(n, type(kwargs[n]).__name__) for n in names]}")
        return args, {**kwargs, names[0]: offsets}
    return hook


@contextlib.contextmanager
def real_positions(layers: Sequence[torch.nn.Module], position_ids: torch.Tensor) -> Iterator[None]:
    """Within this context, a forward over one row with ``position_ids`` ``[1, num_tokens]``
    tempers each query of ``layers`` (the model's :func:`tempered_layers`) by its position in
    ``position_ids``."""
    if not layers:
        yield
        return
    row = position_ids.reshape(-1)
    offsets = _Offsets(row - torch.arange(row.numel(), device=row.device))
    handles = [layer.register_forward_pre_hook(_hand_offsets(offsets), with_kwargs=True)
               for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
