"""One engine step of a hybrid model's linear-attention layers over the state pools.

The engine packs every scheduled sequence's uncomputed tokens into one row; a linear
layer (gated DeltaNet, KDA) must instead run each sequence from that sequence's own state.
A :class:`LinearStep` says how: per sequence its state slot, its tokens' place in the row
and whether it has a state yet (``num_computed > 0``). Its :meth:`runs` split the row into
the calls a linear module makes: every sequence that computes one token from a state, as
one batch (a decode step's sequences), and every other sequence alone (a prompt, a
recomputation). For each call :meth:`cache` gives a transformers ``Cache`` whose layer is
transformers' own ``LinearAttentionLayer`` holding the run's states, gathered from their
slots through the layer's public update calls (a fresh sequence's layer starts empty, as
transformers' first forward does, so its prompt takes the same chunked path as eager
``generate``); :meth:`keep` collects what the call left in it.

Nothing is written to the pools during the forward: :meth:`commit` stores every layer's new
states into their slots once the engine adopts the step, so a step that fails anywhere
before leaves every state as it was (the engine then runs the step again).
"""

from typing import Dict, Hashable, List, NamedTuple, Sequence, Tuple

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from ..cascade import query_starts
from ..state_cache import StatePools

__all__ = ["LinearStep", "Run", "probe_states", "state_key"]

StateKey = Tuple[int, str, int]  # (layer, "conv" | "recurrent", state index), as PagedCache's


def state_key(layer_idx: int, kind: str, state_idx: int) -> StateKey:
    return (layer_idx, kind, state_idx)


class Run(NamedTuple):
    """One call of a linear module: these sequences' tokens of the packed row."""

    seqs: List[int]          # indices into the step's sequences
    rows: torch.Tensor       # int64 positions in the packed row, sequence after sequence
    batched: bool            # one token per sequence, as a [len(seqs), 1] batch; else one sequence


class LinearStep:
    """The linear layers' view of one packed forward: ``slots[i]``, ``query_lens[i]`` and
    ``has_state[i]`` of the step's i-th sequence (in the row's order)."""

    def __init__(self, pools: StatePools, slots: Sequence[int], query_lens: Sequence[int],
                 has_state: Sequence[bool]) -> None:
        if not len(slots) == len(query_lens) == len(has_state):
            raise ValueError(f"{len(slots)} slots, {len(query_lens)} query lengths and "
                             f"{len(has_state)} state flags for one step")
        self.pools = pools
        self.num_tokens = sum(query_lens)
        self._slots = torch.tensor(list(slots), dtype=torch.int64)
        self._has_state = list(has_state)
        starts = query_starts(query_lens)
        decode = [i for i, (n, state) in enumerate(zip(query_lens, has_state)) if n == 1 and state]
        self.runs: List[Run] = []
        if decode:
            self.runs.append(Run(decode, torch.tensor([starts[i] for i in decode]), True))
        for i, count in enumerate(query_lens):
            if i not in decode:
                self.runs.append(Run([i], torch.arange(starts[i], starts[i] + count), False))
        self._pending: Dict[Hashable, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self._keys: Dict[Tuple[int, str], List[StateKey]] = {}  # per (layer, kind), in order
        for key in sorted(pools.device):
            self._keys.setdefault(key[:2], []).append(key)

    def cache(self, layer_idx: int, run: Run) -> Cache:
        """A Cache whose layer ``layer_idx`` holds the run's states (the only linear layer in
        it, so the calls without a layer index find it too)."""
        layer = LinearAttentionLayer()
        if self._has_state[run.seqs[0]]:  # a run's sequences all have states or it is one
            slots = self._slots[run.seqs]
            for kind in ("conv", "recurrent"):
                for key in self._keys.get((layer_idx, kind), ()):
                    pool = self.pools.device[key]
                    state = pool.index_select(0, slots.to(pool.device))
                    if kind == "conv":  # the window as the layer keeps it after a forward
                        layer.update_conv_state(state, key[2], conv_kernel_size=state.shape[-1])
                    else:
                        layer.update_recurrent_state(state, key[2])
        return Cache(layers=[None] * layer_idx + [layer])

    def keep(self, layer_idx: int, run: Run, cache: Cache) -> None:
        """The states the run's call left in ``cache``, for :meth:`commit`."""
        layer = cache.layers[layer_idx]
        slots = self._slots[run.seqs]
        for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            for state_idx, tensor in states.items():
                if tensor is None:
                    continue
                key = state_key(layer_idx, kind, state_idx)
                if key not in self.pools.device:
                    raise ValueError(f"layer {layer_idx} stored a {kind} state {state_idx} that the "
                                     "state pools do not have (ModelSpec.linear_states)")
                self._pending.setdefault(key, []).append((slots, tensor))

    def commit(self) -> None:
        """Store the kept states into their slots (once: the step is adopted)."""
        for key, parts in self._pending.items():
            pool = self.pools.device[key]
            slots = torch.cat([s for s, _ in parts]).to(pool.device)
            pool.index_copy_(0, slots, torch.cat([t for _, t in parts]).to(pool.dtype))
        self._pending = {}


def probe_states(call, layer_idx: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> List[Tuple[StateKey, Tuple[int, ...], torch.dtype]]:
    """The states one sequence keeps in layer ``layer_idx``: ``call(hidden, cache)`` runs the
    layer on one zero token with an empty Cache, whose states are then read."""
    layer = LinearAttentionLayer()
    cache = Cache(layers=[None] * layer_idx + [layer])
    with torch.no_grad():
        call(torch.zeros(1, 1, hidden_size, dtype=dtype, device=device), cache)
    found = []
    for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
        for state_idx, tensor in states.items():
            if tensor is not None:
                found.append((state_key(layer_idx, kind, state_idx), tuple(tensor.shape[1:]),
                              tensor.dtype))
    if not found:
        raise ValueError(f"linear-attention layer {layer_idx} stored no state in the Cache it was "
                         "handed")
    return found
