"""A hybrid model's linear-attention layers in a :class:`~paged_attention_ext.hf.PagedCache`.

Qwen3-Next, Qwen3.5 (and MoE), OLMo-hybrid and Kimi-Linear run most layers as linear
attention (gated DeltaNet, KDA): each keeps a convolution window and a recurrent matrix per
row, read and written through transformers' linear-attention cache API
(``has_previous_state``, ``update_conv_state``, ``update_recurrent_state``,
``layers[i].conv_states`` ...). The states belong in the state pools
(:class:`~paged_attention_ext.state_cache.StatePools`), one slot per row's sequence, whose
lifetime the row placement's block manager owns (allocated with the row, copied on a beam
fork, freed with it).

Each linear layer is transformers' own ``LinearAttentionLayer`` (its update rules, on
every supported release) over *working tensors*: the batch rows' states, gathered from the
rows' slots. ``update_recurrent_state`` is the last call every supported layer makes in a
forward, so after it the layer's states are stored back into the rows' slots; a forward's
first linear layers may run before the rows have slots (the first attention layer places
the forward's tokens), so what they stored waits (``_unstored``) until the placement.
When the rows' slots change (beam search's reorder), the working tensors are gathered anew.

Assisted and prompt-lookup decoding verify candidate tokens in one forward and crop the
rejected ones: transformers' layer, recording (``activate_past_recording``), keeps the
convolution window of every new token and the recurrent states of the last positions, and
its ``crop`` restores the state after the last accepted token. The slots hold the state
after the forward's last token meanwhile (a recording layer's window, its last
``conv_kernel_size`` columns), and after a crop the restored states are stored again
(:meth:`LinearStates.cropped`).
"""

from typing import Dict, List, Optional, Sequence, Set

import torch
from transformers.cache_utils import LinearAttentionLayer

from ..state_cache import StatePools
from ..state_slots import StateMove

LINEAR_ATTENTION = "linear_attention"


class LinearStates:
    """The linear layers' working states and their pools, for one PagedCache."""

    def __init__(self, layer_types: Sequence[str]) -> None:
        self.layer_ids = [i for i, kind in enumerate(layer_types) if kind == LINEAR_ATTENTION]
        # What the model reads as cache.layers[i]: a linear layer, or None for attention.
        self.layers: List[Optional[LinearAttentionLayer]] = [
            LinearAttentionLayer() if kind == LINEAR_ATTENTION else None for kind in layer_types]
        self.pools: Optional[StatePools] = None
        self._slots: Optional[torch.Tensor] = None  # the rows' slots the working tensors hold
        self._unstored: Set[int] = set()
        self._stores = 0  # update_recurrent_state calls so far, every forward's

    def start(self, num_slots: int) -> None:
        """The pools, once the block manager's slot count is known (first forward)."""
        self.pools = StatePools(num_slots)

    @property
    def slot_bytes(self) -> int:
        return self.pools.slot_bytes if self.pools is not None else 0

    def whole(self, forwards_done: int, first_kv_layer: int) -> bool:
        """Whether, at ``first_kv_layer``'s call in the forward after ``forwards_done`` whole
        ones, every linear layer has stored its states once per forward (an exception
        between two linear layers leaves the rows' states partly updated)."""
        before = sum(1 for layer in self.layer_ids if layer < first_kv_layer)
        return self._stores == forwards_done * len(self.layer_ids) + before

    def stored(self, layer_idx: int) -> None:
        """The layer's forward is done (its update_recurrent_state): into the rows' slots."""
        self._stores += 1
        self._unstored.add(layer_idx)
        if self._slots is not None:
            self._store()

    def placed(self, moves: Sequence[StateMove], slots: Sequence[int]) -> None:
        """The block manager placed the rows: apply its moves (new rows' slots zeroed),
        then store what the layers computed before (the first forward's early layers)."""
        self.pools.apply(moves)
        self._set_slots(slots)
        self._store()

    def replaced(self, moves: Sequence[StateMove], slots: Sequence[int]) -> None:
        """The rows were placed again before their forward's first attention layer (a
        compiled cache's eager first forward, with prefix fingerprints): the layers that ran
        already store their states into the rows' new slots."""
        self.pools.apply(moves)
        self._set_slots(slots)
        self._unstored.update(self.layer_ids)
        self._store()

    def _set_slots(self, slots: Sequence[int]) -> None:
        """In place once allocated: a compiled forward reads the same tensor every step."""
        new = torch.tensor(list(slots), dtype=torch.int64)
        if self._slots is not None and self._slots.shape == new.shape:
            self._slots.copy_(new)
        else:
            self._slots = new

    def reselect(self, moves: Sequence[StateMove], slots: Sequence[int]) -> None:
        """The rows now hold other sequences (beam search): apply the block manager's moves
        (one copy per forked row) and gather every layer's working tensors anew (in place
        where the shape allows: a compiled forward reads transformers' tensors at fixed
        addresses)."""
        self.pools.apply(moves)
        self._set_slots(slots)
        for layer_idx in self.layer_ids:
            layer = self.layers[layer_idx]
            for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                for state_idx, tensor in states.items():
                    if tensor is not None:
                        pool = self.pools.device[(layer_idx, kind, state_idx)]
                        gathered = pool.index_select(0, self._slots.to(pool.device))
                        if tensor.shape == gathered.shape:
                            tensor.copy_(gathered)
                        else:
                            states[state_idx] = gathered

    def store_traced(self, layer_idx: int) -> None:
        """A compiled forward's layer: its states into the rows' slots with tensor ops only
        (the pools exist since the eager prefill; the slots are a fixed tensor)."""
        layer = self.layers[layer_idx]
        for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            for state_idx, tensor in states.items():
                if tensor is None:
                    continue
                pool = self.pools.device.get((layer_idx, kind, state_idx))
                if pool is None:
                    raise NotImplementedError(
                        f"a compiled forward stores layer {layer_idx}'s linear-attention states "
                        "into pools that an eager first forward creates: run the prefill "
                        "eagerly (generate's compile_config path does; in a loop of one's own, "
                        "call the uncompiled forward first)")
                pool.index_copy_(0, self._slots.to(pool.device), tensor)

    def cropped(self, tokens_to_remove: int) -> None:
        """Assisted decoding rejected the last ``tokens_to_remove`` tokens (0: none): each
        layer restores its states as they were after the last kept one (transformers' crop,
        which also shrinks a recording window back to the kernel), stored into the slots.
        Raises before any layer changes when a layer does not record or recorded fewer."""
        for layer_idx in self.layer_ids:
            layer = self.layers[layer_idx]
            if not getattr(layer, "record_past", False):
                raise RuntimeError(
                    f"PagedCache.crop: linear-attention layer {layer_idx} records no past states; "
                    "call cache.activate_past_recording() before the forwards to crop "
                    "(generate does for assisted and prompt-lookup decoding)")
            recorded = [len(layer.recurrent_states_history[i]) for i in range(layer.number_of_states)
                        if layer.is_recurrent_states_initialized[i]]
            if recorded and min(recorded) < tokens_to_remove:
                raise ValueError(
                    f"PagedCache.crop: cannot remove {tokens_to_remove} tokens: linear-attention "
                    f"layer {layer_idx} recorded the states of the last {min(recorded)} only "
                    "(activate_past_recording(recurrent_states_to_keep=...))")
        for layer_idx in self.layer_ids:
            self.layers[layer_idx].crop(-tokens_to_remove)
            self._unstored.add(layer_idx)
        self._store()

    def _store(self) -> None:
        for layer_idx in sorted(self._unstored):
            layer = self.layers[layer_idx]
            for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                for state_idx, tensor in states.items():
                    if tensor is None:
                        continue
                    if kind == "conv" and getattr(layer, "record_past", False):
                        tensor = _window(tensor, layer.conv_kernel_size[state_idx])
                    if tensor.shape[0] != len(self._slots):
                        raise ValueError(f"layer {layer_idx}'s {kind} state has {tensor.shape[0]} "
                                         f"rows, the cache holds {len(self._slots)}")
                    pool = self.pools.pool((layer_idx, kind, state_idx), tensor.shape[1:],
                                           tensor.dtype, tensor.device)
                    pool.index_copy_(0, self._slots.to(pool.device), tensor)
        self._unstored.clear()


def _window(conv_states: torch.Tensor, kernel: int) -> torch.Tensor:
    """A recording layer's convolution states (every new token's columns) as the window the
    next token reads: the last ``kernel`` columns, zero-padded on the left if fewer."""
    if conv_states.shape[-1] >= kernel:
        return conv_states[..., -kernel:]
    return torch.nn.functional.pad(conv_states, (kernel - conv_states.shape[-1], 0))


def state_pool_summary(pools: Optional[StatePools], used_slots: int) -> Dict[str, int]:
    """Bytes the state pools hold and bytes of the slots in use."""
    if pools is None:
        return {"state_pool_bytes": 0, "state_used_bytes": 0}
    return {"state_pool_bytes": pools.num_slots * pools.slot_bytes,
            "state_used_bytes": used_slots * pools.slot_bytes}
