"""Which of transformers' mask functions the paged attention reproduces, decided by evaluating them.

transformers builds a forward's mask as a function ``(batch, head, q_idx, kv_idx) -> bool``
composed of closures (causal, sliding-window overlay, packed-sequence remapping, image-token
overlays, ...), whose composition changes between releases. The paged ops do not apply that
function: they attend causally over block tables, with the layer's sliding window. So the
check here asks the function itself, on this forward's index grid, whether it is one of the
masks the ops compute:

* causal (key position <= query position), optionally with the config's sliding window
  (a query sees its last ``sliding_window`` positions, itself included) or its
  ``attention_chunk_size`` (a query sees the keys of its own chunk, chunks counted from each
  row's first token after its left padding, as transformers counts them);
* in a packed forward without cache and without a padding mask (the engine's, where
  transformers derives sequences from ``position_ids``): the same, within each packed
  sequence, the sequences inferred from where a token stops seeing its predecessor (the
  ops keep sequences apart through their block tables).

Anything else (bidirectional, image-token blocks) is refused. A chunked mask over a packed
forward counts chunks from the packed row's start, not from each sequence's; it looks like
packed sequences of one chunk each and passes as such. The chunking the ops apply is the
layer's KV group's (per sequence), whatever mask transformers built.
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
                  device=None, chunk_size: Optional[int] = None,
                  left_padding: Optional[torch.Tensor] = None) -> bool:
    """Whether ``mask_function`` equals, on this forward's grid, a mask the paged ops apply.

    ``packed``: the forward may hold several sequences per row (no cache, no padding mask).
    ``sliding_windows``: the windows a layer of this model may attend with (None: none).
    ``chunk_size``: the chunk of the model's chunked layers (None: none), counted from each
    row's ``left_padding`` (``[batch]`` padding tokens; None: none).
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
    if chunk_size is not None:
        pad = (torch.zeros(batch_size, dtype=torch.long, device=kv_positions.device)
               if left_padding is None else left_padding.to(kv_positions.device))[:, None, None]
        same_chunk = ((kv_positions[None, None, :] - pad).div(chunk_size, rounding_mode="floor")
                      == (q_positions[None, :, None] - pad).div(chunk_size, rounding_mode="floor"))
        return torch.equal(mask, (allowed & same_chunk).expand_as(mask))
    return False


def left_padding_of(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[batch]`` leading padding tokens of a 2D padding mask (0: padding), or None."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return (attention_mask.cumsum(-1) == 0).sum(-1)


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
                              sliding_windows=windows, device=sizes.get("device"),
                              chunk_size=getattr(text_config, "attention_chunk_size", None),
                              left_padding=left_padding_of(attention_mask))
    except Exception as error:  # a mask function that cannot be evaluated on index tensors
        raise NotImplementedError(
            f"attn_implementation={implementation!r} could not evaluate this model's mask function "
            f"({name}) to check it is causal: {type(error).__name__}: {error}") from error
    if not paged:
        raise NotImplementedError(
            f"attn_implementation={implementation!r} attends causally over block tables (with the "
            f"layer's sliding window or chunk); this model asked for another mask ({name}: e.g. "
            "bidirectional, or image-token blocks), which it cannot apply")
