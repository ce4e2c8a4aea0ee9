"""Chunked local attention (Llama-4's ``attention_chunk_size``) through the paged ops.

In a chunked layer the query at position ``p`` sees only the keys of its own chunk,
positions ``[p // C * C, p]``. When the chunk size ``C`` is a multiple of the block size, a
chunk starts at a block boundary, so the keys a query sees are exactly those of a shorter
sequence whose block table starts at its chunk's first block. :func:`chunk_local` rewrites a
step's metadata that way, once per step for every chunked layer; the ops then run unchanged
on every backend, cache format and layout:

* decode (one query row per sequence): each sequence becomes the tail of its table from the
  chunk of its last position, with the length counted from the chunk's start;
* multi-token rows: a sequence whose query rows cross chunk boundaries becomes one piece per
  chunk, in row order, so the pieces' rows are the original rows and the op's output needs
  no reordering. This form reads the lengths on the host (a step's host-side plan).

Compiled and graph-captured steps read fixed buffers instead
(:class:`~paged_attention_ext.step_buffers.StepBuffers`): the same pieces
(:func:`chunk_pieces`), computed from the step's plan on the host and padded with empty
pieces to :func:`max_chunk_pieces`, a count fixed per step shape.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch


class ChunkLocalMetadata(NamedTuple):
    """The arguments of the paged ops for a chunked layer (row order unchanged)."""

    block_tables: torch.Tensor  # int32 [pieces, width]
    seq_lens: torch.Tensor  # int32 [pieces]
    query_start_loc: Optional[torch.Tensor]  # int32 [pieces + 1]; None for decode


def _check(chunk_size: int, block_size: int) -> None:
    for name, value in (("chunk_size", chunk_size), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"chunk_local: '{name}' must be a positive int, got {value!r}")
    if chunk_size % block_size:
        raise ValueError(f"chunk_local: chunk_size={chunk_size} is not a multiple of block_size="
                         f"{block_size}, so a chunk would start inside a block; use a block size "
                         f"that divides the chunk size (any power of two up to it does)")


def chunk_pieces(seq_lens: Sequence[int], query_lens: Sequence[int],
                 chunk_size: int) -> List[Tuple[int, int, int, int]]:
    """A multi-token step's sequences as pieces of one chunk each, in row order: per piece
    (sequence, its chunk's first position, KV tokens from there, query rows). A sequence
    without query rows stays one empty piece."""
    pieces: List[Tuple[int, int, int, int]] = []
    for seq, (length, q_len) in enumerate(zip(seq_lens, query_lens)):
        if not 0 <= q_len <= length:
            raise ValueError(f"chunk_local: 'query_start_loc' gives sequence {seq} {q_len} query "
                             f"rows but 'seq_lens' only {length} tokens")
        if q_len == 0:
            pieces.append((seq, 0, 0, 0))
            continue
        position = length - q_len  # of the sequence's first query row
        while position < length:
            start = position // chunk_size * chunk_size
            end = min(start + chunk_size, length)
            pieces.append((seq, start, end - start, end - position))
            position = end
    return pieces


def max_chunk_pieces(num_seqs: int, num_tokens: int, chunk_size: int) -> int:
    """The most pieces :func:`chunk_pieces` makes of ``num_seqs`` sequences with ``num_tokens``
    query rows: a sequence of ``q`` rows touches at most ``q // chunk_size + 2`` chunks, and
    never more pieces than rows (at least one)."""
    return min(2 * num_seqs + num_tokens // chunk_size, num_seqs + num_tokens)


def _shift_tables(block_tables: torch.Tensor, first_blocks: torch.Tensor) -> torch.Tensor:
    """Row i of ``block_tables`` from column ``first_blocks[i]`` on, the tail padded with its
    last column (entries past a sequence's blocks are never read)."""
    width = block_tables.shape[1]
    columns = torch.arange(width, device=block_tables.device) + first_blocks.to(torch.int64)[:, None]
    return torch.gather(block_tables, 1, columns.clamp_(max=max(width - 1, 0)))


def chunk_local(block_tables: torch.Tensor, seq_lens: torch.Tensor, chunk_size: int,
                block_size: int, query_start_loc: Optional[torch.Tensor] = None) -> ChunkLocalMetadata:
    """The metadata under which the paged ops compute chunked local attention.

    Args:
        block_tables, seq_lens, query_start_loc: a step's metadata, as the ops take it.
        chunk_size: the layer's chunk in tokens, a multiple of ``block_size``.
        block_size: tokens per cache block.

    Raises ``ValueError`` naming the argument when the chunk is not a whole number of blocks.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> from paged_attention_ext.chunked import chunk_local
        >>> tables = torch.tensor([[5, 2, 7, 1]], dtype=torch.int32)
        >>> local = chunk_local(tables, torch.tensor([27], dtype=torch.int32), chunk_size=16,
        ...                     block_size=8)
        >>> local.block_tables.tolist(), local.seq_lens.tolist()   # position 26: keys 16-26
        ([[7, 1, 1, 1]], [11])
    """
    _check(chunk_size, block_size)
    if query_start_loc is None:
        lens = seq_lens.to(torch.int64)
        starts = (lens - 1).clamp(min=0) // chunk_size * chunk_size
        return ChunkLocalMetadata(_shift_tables(block_tables, starts // block_size),
                                  (lens - starts).to(torch.int32), None)
    lens, qsl = seq_lens.tolist(), query_start_loc.tolist()
    pieces = chunk_pieces(lens, [qsl[seq + 1] - qsl[seq] for seq in range(len(lens))], chunk_size)
    seqs, starts, piece_lens, piece_rows = zip(*pieces) if pieces else ((), (), (), ())
    device = block_tables.device
    first_blocks = torch.tensor(starts, dtype=torch.int64, device=device) // block_size
    tables = block_tables.index_select(0, torch.tensor(seqs, dtype=torch.int64, device=device))
    rows = torch.tensor((0,) + tuple(piece_rows), dtype=torch.int64).cumsum(0)
    return ChunkLocalMetadata(_shift_tables(tables, first_blocks),
                              torch.tensor(piece_lens, dtype=torch.int32, device=device),
                              rows.to(device=device, dtype=torch.int32))
