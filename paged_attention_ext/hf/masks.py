"""Which of transformers' mask functions the paged attention reproduces, decided by evaluating them.

transformers builds a forward's mask as a function ``(batch, head, q_idx, kv_idx) -> bool``
composed of closures (causal, sliding-window overlay, packed-sequence remapping, image-token
overlays, ...), whose composition changes between releases. The paged ops do not apply that
function: they attend causally over block tables, with the layer's sliding window. So the
check here asks the function itself, on this forward's index grid, whether it is one of the
masks the ops compute:

* causal (key position <= query position), optionally with the config's sliding window
  (a query sees its last ``sliding_window`` positions, itself included);
* in a packed forward without cache and without a padding mask (the engine's, where
  transformers derives sequences from ``position_ids``): the same, within each packed
  sequence, the sequences inferred from where a token stops seeing its predecessor (the
  ops keep sequences apart through their block tables).

Anything else (bidirectional, image-token blocks, chunked attention beyond one chunk) is
refused. A chunked mask over a packed forward looks like packed sequences of one chunk each,
so models with ``attention_chunk_size`` are refused by their config first (support.py).
"""

from typing import Mapping, Optional, Sequence

import torch

# Query rows evaluated at once: bounds the grid's memory for long packed prefills.
_ROWS_PER_CHUNK = 1024


def _evaluate(mask_function, batch_size: int, q_positions: torch.Tensor,
              kv_positions: torch.Tensor) -> torch.Tensor:
    """The mask as ``[batch, q, kv]`` booleans, with the index tensors transformers' own
    non-vmap expansion passes (broadcastable ``[batch, 1, q, kv]`` grids)."""
    device = q_positions.device
    batch = torch.arange(batch_size, device=device)[:, None, None, None]
    head = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    rows = []
    for start in range(0, q_positions.numel(), _ROWS_PER_CHUNK):
        q = q_positions[start:start + _ROWS_PER_CHUNK][None, None, :, None]
        value = mask_function(batch, head, q, kv_positions[None, None, None, :])
        rows.append(torch.as_tensor(value, device=device).to(torch.bool)
                    .expand(batch_size, 1, q.shape[2], kv_positions.numel())[:, 0])
    return torch.cat(rows, dim=1)


def _packed_segments(mask: torch.Tensor) -> torch.Tensor:
    """``[batch, tokens]`` sequence ids of a packed forward: a sequence starts where a token
    does not see the one before it."""
    tokens = mask.shape[1]
    starts = torch.ones(mask.shape[0], tokens, dtype=torch.bool, device=mask.device)
    index = torch.arange(1, tokens, device=mask.device)
    starts[:, 1:] = ~mask[:, index, index - 1]
    return starts.cumsum(-1)


def is_paged_mask(mask_function, batch_size: int, q_length: int, kv_length: int, q_offset,
                  kv_offset: int, packed: bool, sliding_windows: Sequence[Optional[int]],
                  device=None) -> bool:
    """Whether ``mask_function`` equals, on this forward's grid, a mask the paged ops apply.

    ``packed``: the forward may hold several sequences per row (no cache, no padding mask).
    ``sliding_windows``: the windows a layer of this model may attend with (None: none).
    """
    q_offset = int(q_offset)
    q_positions = torch.arange(q_offset, q_offset + q_length, device=device)
    kv_positions = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    mask = _evaluate(mask_function, batch_size, q_positions, kv_positions)
    allowed = (kv_positions[None, :] <= q_positions[:, None])[None]
    if packed and q_offset == kv_offset == 0 and q_length == kv_length and q_length > 1:
        segments = _packed_segments(mask)
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    for window in dict.fromkeys(sliding_windows):
        expected = allowed
        if window is not None:
            expected = allowed & (kv_positions[None, :] > q_positions[:, None] - window)[None]
        if torch.equal(mask, expected.expand_as(mask)):
            return True
    return False


def check_mask_function(mask_function, attention_mask: Optional[torch.Tensor], sizes: Mapping,
                        implementation: str) -> None:
    """Raise ``NotImplementedError`` unless ``mask_function`` is a paged mask on this forward.

    ``sizes``: the keyword arguments transformers passes a mask interface (batch_size,
    q_length, kv_length, q_offset, kv_offset, config, device).
    """
    try:
        grid = {name: sizes[name] for name in ("batch_size", "q_length", "kv_length", "q_offset",
                                               "kv_offset")}
    except KeyError as missing:
        raise TypeError(f"{implementation}'s mask function needs the mask's sizes transformers "
                        f"passes (batch_size, q_length, kv_length, q_offset, kv_offset); "
                        f"{missing} is missing") from None
    if int(grid["q_length"]) == 0:
        # generate drops the input tokens its cache already holds: a cache left by an
        # earlier generate, given a prompt no longer than what it holds, leaves none.
        raise ValueError(
            f"{implementation}: this forward has no new tokens: the cache passed to generate "
            f"already holds {int(grid['kv_length'])} positions per row from an earlier call. "
            "Call cache.reset() (or pass a new PagedCache) before generating from a new prompt; "
            "to continue the earlier generation, pass its whole output as input_ids.")
    config = sizes.get("config")
    text_config = config.get_text_config(decoder=True) if config is not None else None
    windows = (None, getattr(text_config, "sliding_window", None))
    name = getattr(mask_function, "__qualname__", repr(mask_function))
    try:
        paged = is_paged_mask(mask_function, **grid, packed=attention_mask is None,
                              sliding_windows=windows, device=sizes.get("device"))
    except Exception as error:  # a mask function that cannot be evaluated on index tensors
        raise NotImplementedError(
            f"attn_implementation={implementation!r} could not evaluate this model's mask function "
            f"({name}) to check it is causal: {type(error).__name__}: {error}") from error
    if not paged:
        raise NotImplementedError(
            f"attn_implementation={implementation!r} attends causally over block tables (with the "
            f"layer's sliding window); this model asked for another mask ({name}: e.g. "
            "bidirectional, chunked, or image-token blocks), which it cannot apply")
