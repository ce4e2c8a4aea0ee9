"""The state pools of a hybrid model's linear-attention layers, beside its paged K/V.

Each linear layer keeps named states (a convolution window, a recurrent matrix; a layer
may have several of each) as one tensor ``[num_slots, *state_shape]`` per state, and a
host swap tensor ``[num_host_slots, *state_shape]``: a sequence's state is row ``slot`` of
every tensor (the slot :class:`~paged_attention_ext.state_slots.StateSlots` gave it).
:class:`StatePools` moves rows on the block layer's instructions
(:class:`~paged_attention_ext.state_slots.StateMove`), never decides which: as
:class:`~paged_attention_ext.kv_cache.PagedKVCache` moves blocks.

A state's shape and dtype are those of the first state the layer stores (transformers'
linear layers create theirs on first use, too); a pool created after some moves were
applied starts at zero, which is what those moves gave every slot so far.
"""

from typing import Dict, Hashable, Iterator, List, Sequence, Tuple

import torch

from .state_slots import COPY, SWAP_IN, SWAP_OUT, ZERO, StateMove

__all__ = ["StatePools", "state_bytes"]


def state_bytes(shapes: Sequence[Tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of one sequence's states of these shapes (one slot)."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(int(torch.Size(shape).numel()) for shape in shapes) * element


class StatePools:
    """Every linear layer's state tensors, keyed by ``(layer, name)``."""

    def __init__(self, num_slots: int, num_host_slots: int = 0) -> None:
        self.num_slots = num_slots
        self.num_host_slots = num_host_slots
        self.device: Dict[Hashable, torch.Tensor] = {}
        self.host: Dict[Hashable, torch.Tensor] = {}

    def pool(self, key: Hashable, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """The ``[num_slots, *shape]`` tensor of state ``key``, created (zero) on first use; a
        later request must ask for the same shape and dtype."""
        tensor = self.device.get(key)
        if tensor is None:
            tensor = torch.zeros((self.num_slots, *shape), dtype=dtype, device=device)
            self.device[key] = tensor
            self.host[key] = torch.zeros((self.num_host_slots, *shape), dtype=dtype)
        elif tuple(tensor.shape[1:]) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"state {key!r} is {tuple(tensor.shape[1:])} {tensor.dtype}, the "
                             f"layer now stores {tuple(shape)} {dtype}: a state's shape is fixed")
        return tensor

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot across every state created so far."""
        return sum(t[0].numel() * t.element_size() for t in self.device.values())

    def apply(self, moves: Sequence[StateMove]) -> None:
        """Apply the block layer's moves, in order, to every state tensor."""
        for kind, sources, targets in _runs(moves):
            for key, tensor in self.device.items():
                host = self.host[key]
                if kind == ZERO:
                    tensor.index_fill_(0, targets.to(tensor.device), 0)
                elif kind == COPY:
                    tensor.index_copy_(0, targets.to(tensor.device), tensor.index_select(0, sources.to(tensor.device)))
                elif kind == SWAP_OUT:
                    host.index_copy_(0, targets, tensor.index_select(0, sources.to(tensor.device)).cpu())
                else:
                    tensor.index_copy_(0, targets.to(tensor.device),
                                       host.index_select(0, sources).to(tensor.device))


def _runs(moves: Sequence[StateMove]) -> Iterator[Tuple[str, torch.Tensor, torch.Tensor]]:
    """Consecutive moves of one kind as index tensors, split where a move reads or writes a
    slot an earlier move of the run wrote (a run is applied as one gather, then one scatter)."""
    run: List[StateMove] = []
    written: set = set()

    def flush():
        if run:
            yield (run[0].kind, torch.tensor([m.source for m in run], dtype=torch.int64),
                   torch.tensor([m.target for m in run], dtype=torch.int64))

    for move in moves:
        if move.kind not in (ZERO, COPY, SWAP_OUT, SWAP_IN):
            raise ValueError(f"unknown state move {move!r}")
        reads_written = move.kind in (COPY, SWAP_OUT) and move.source in written
        if run and (move.kind != run[0].kind or reads_written or move.target in written):
            yield from flush()
            run, written = [], set()
        run.append(move)
        written.add(move.target)
    yield from flush()
