"""One step's attention metadata: built and checked once, read by every layer.

A decode or prefill step attends every layer over the same sequences: the same block
tables, lengths and query rows; only the query, the layer's caches and the layer's
options (scale, window, soft cap, sinks, ALiBi, fp8 scales) change. As FlashInfer's
wrappers ``plan()`` once per step and ``run()`` per layer, and vLLM builds one attention
metadata object per step for all layers, :class:`AttentionMetadata` holds the step's part
of the attention arguments, checks it when it is built, and :meth:`AttentionMetadata.run`
attends one layer over it (the step's cascade split included, where the layer can run it).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from . import ops
from .cascade import CascadePlan


def _check_int32(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"AttentionMetadata: '{name}' must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"AttentionMetadata: '{name}' must have dtype torch.int32, got {tensor.dtype}")
    if tensor.dim() != rank:
        raise ValueError(f"AttentionMetadata: '{name}' must be {rank}-D {layout}, got shape "
                         f"{list(tensor.shape)}")


@dataclass
class AttentionMetadata:
    """The per-step attention arguments of :func:`paged_attention_ext.ops.attention`.

    Args:
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
        seq_lens: int32 ``[num_seqs]``, KV tokens of each sequence including this step's.
        query_start_loc: None for decode (one query row per sequence), else int32
            ``[num_seqs + 1]``, each sequence's query rows.
        cascade: the step's split into shared prefixes and suffixes
            (:func:`~paged_attention_ext.cascade.plan_cascade`), or None; layers with a
            sliding window or ALiBi attend without it.

    Raises ``TypeError`` (not a tensor, not int32) or ``ValueError`` (a wrong rank, rows that
    do not match ``seq_lens``, another device) naming the argument. The values (lengths,
    block ids) are checked by the op, which reads them anyway.

    Example::

        >>> import torch, paged_attention_ext as pa
        >>> key_cache, value_cache = torch.randn(4, 2, 16, 64), torch.randn(4, 2, 16, 64)
        >>> step = pa.AttentionMetadata(torch.tensor([[3, 1], [0, 2]], dtype=torch.int32),
        ...                             torch.tensor([20, 5], dtype=torch.int32))
        >>> query = torch.randn(2, 8, 64)             # one decode row per sequence
        >>> out = step.run(query, key_cache, value_cache, 64 ** -0.5)   # once per layer
        >>> torch.testing.assert_close(out, pa.attention(query, key_cache, value_cache,
        ...                            step.block_tables, step.seq_lens, 64 ** -0.5))
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: Optional[torch.Tensor] = None
    cascade: Optional[CascadePlan] = None

    def __post_init__(self) -> None:
        _check_int32("block_tables", self.block_tables, 2, "[num_seqs, max_blocks_per_seq]")
        _check_int32("seq_lens", self.seq_lens, 1, "[num_seqs]")
        tensors = dict(seq_lens=self.seq_lens)
        if self.query_start_loc is not None:
            _check_int32("query_start_loc", self.query_start_loc, 1, "[num_seqs + 1]")
            tensors["query_start_loc"] = self.query_start_loc
        for name, tensor in tensors.items():
            if tensor.device != self.block_tables.device:
                raise ValueError(f"AttentionMetadata: '{name}' must be on the device of "
                                 f"'block_tables' ({self.block_tables.device}), got {tensor.device}")
        # In a trace the sizes are symbolic: comparing them would add a guard tying dynamic
        # dimensions together. The op checks them again when it runs.
        if torch.compiler.is_compiling():
            return
        num_seqs = self.seq_lens.shape[0]
        if self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"AttentionMetadata: 'block_tables' has {self.block_tables.shape[0]} "
                             f"rows but 'seq_lens' has {num_seqs} sequences")
        if self.query_start_loc is not None and self.query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(f"AttentionMetadata: 'query_start_loc' must have num_seqs + 1 = "
                             f"{num_seqs + 1} entries, got {self.query_start_loc.shape[0]}")

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scale: float, *, alibi_slopes: Optional[torch.Tensor] = None,
            sliding_window: int = -1, soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None,
            k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer's attention over the step: :func:`~paged_attention_ext.ops.attention`
        with this metadata (the layer's arguments as documented there), into ``out`` when
        given (:func:`~paged_attention_ext.ops.attention_out`). Returns the output."""
        if self.cascade is not None and self.cascade.applies_to(sliding_window, alibi_slopes):
            # Shared prefixes read once; the same result.
            result = self.cascade.run(query, key_cache, value_cache, scale, soft_cap, sinks,
                                      k_scale, v_scale)
            return result if out is None else out.copy_(result)
        args = (query, key_cache, value_cache, self.block_tables, self.seq_lens, scale,
                self.query_start_loc, alibi_slopes, sliding_window, soft_cap)
        if out is None:
            return ops.attention(*args, sinks, k_scale, v_scale)
        return ops.attention_out(out, *args, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
