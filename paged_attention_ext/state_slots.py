"""Fixed-size state slots for linear-attention layers: one slot per sequence, beside its blocks.

Hybrid models (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear) mix a few full-attention
layers, whose K/V grows with the sequence and lives in paged blocks, with many
linear-attention layers (gated DeltaNet, KDA), which keep a fixed-size state per sequence:
a short convolution window and a recurrent matrix. A sequence holds one *state slot*: the
same slot index in every linear layer's state pools (:class:`~paged_attention_ext.state_cache.StatePools`).

:class:`StateSlots` owns which sequence holds which slot, on the device or in the host swap
pool. Its owner (:class:`~paged_attention_ext.block_manager.BlockSpaceManager`) calls it
beside its block tables, so one manager decides both lifetimes and a sequence is admitted,
forked, swapped and freed with its blocks, all-or-nothing. Every call that gives a slot
content to create records a :class:`StateMove`, in order; whoever holds the tensors takes
them (:meth:`take_moves`) and applies them before the next forward:

* ``zero``: a new sequence's slot starts empty (a freed slot keeps its last content);
* ``copy``: a fork (parallel sample, beam) copies the parent's state once per child (the
  K/V blocks the two share are shared by reference count, never copied);
* ``swap_out`` / ``swap_in``: the state travels with the sequence's blocks.

Unlike a block, a state cannot be shared: it changes with every token, so each sequence
owns its slot outright (no reference counts, no copy-on-write).
"""

from typing import Dict, List, NamedTuple, Sequence, Tuple

from .block_allocator import NoFreeBlocksError

__all__ = ["NoFreeStateSlotsError", "StateMove", "StateSlots"]

ZERO, COPY, SWAP_OUT, SWAP_IN = "zero", "copy", "swap_out", "swap_in"


class NoFreeStateSlotsError(NoFreeBlocksError):
    """Too few free state slots; nothing was changed (a ``NoFreeBlocksError``, so callers
    that handle a full pool handle this too)."""


class StateMove(NamedTuple):
    """What to do with the state tensors: ``kind`` is ``zero`` (``target`` only: a device
    slot), ``copy`` (device to device), ``swap_out`` (device to host) or ``swap_in``
    (host to device)."""

    kind: str
    source: int  # -1 for zero
    target: int


class _Pool:
    """Free slots of one pool; slot 0 is handed out first, freed slots are reused first."""

    def __init__(self, num_slots: int, name: str, setting: str) -> None:
        self.num_slots = num_slots
        self.name = name
        self.setting = setting
        self.free: List[int] = list(range(num_slots - 1, -1, -1))

    def take(self, count: int, who: str) -> List[int]:
        if count > len(self.free):
            raise self.exhausted(count, who)
        return [self.free.pop() for _ in range(count)]

    def exhausted(self, needed: int, who: str) -> NoFreeStateSlotsError:
        return NoFreeStateSlotsError(
            f"{who} needs {needed} {self.name} state slot{'s' if needed != 1 else ''} (one per "
            f"sequence for its linear-attention layers), {len(self.free)} of {self.num_slots} are "
            f"free: raise {self.setting}")


class StateSlots:
    """Which sequence holds which state slot (device or host) and the moves still to apply.

    ``setting`` / ``host_setting``: what the caller's user sets to size each pool, named
    when it runs out.
    """

    def __init__(self, num_slots: int, num_host_slots: int = 0,
                 setting: str = "num_state_slots", host_setting: str = "num_host_state_slots") -> None:
        for name, value in (("num_slots", num_slots), ("num_host_slots", num_host_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StateSlots: {name} must be an int >= 0, got {value!r}")
        self.device = _Pool(num_slots, "device", setting)
        self.host = _Pool(num_host_slots, "host", host_setting)
        self._slot_of: Dict[int, Tuple[_Pool, int]] = {}
        self._moves: List[StateMove] = []

    # ---- questions --------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.device.num_slots

    @property
    def num_free(self) -> int:
        return len(self.device.free)

    @property
    def num_free_host(self) -> int:
        return len(self.host.free)

    @property
    def num_used(self) -> int:
        return self.device.num_slots - len(self.device.free)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._slot_of

    def slot(self, seq_id: int) -> int:
        """The sequence's device slot (its index in every linear layer's state pools)."""
        pool, slot = self._slot_of[seq_id]
        if pool is not self.device:
            raise ValueError(f"sequence {seq_id}'s state is swapped out")
        return slot

    def is_on_host(self, seq_id: int) -> bool:
        return self._slot_of[seq_id][0] is self.host

    def pending_moves(self) -> List[StateMove]:
        """The moves recorded and not yet taken (a copy)."""
        return list(self._moves)

    # ---- actions (each checks everything first: a failing call changes nothing) ---------
    def allocate(self, seq_ids: Sequence[int], who: str = "") -> None:
        """A fresh (zeroed) device slot for each new sequence."""
        self._check_new(seq_ids)
        slots = self.device.take(len(seq_ids), who or f"sequences {list(seq_ids)}")
        for seq_id, slot in zip(seq_ids, slots):
            self._slot_of[seq_id] = (self.device, slot)
            self._moves.append(StateMove(ZERO, -1, slot))

    def fork(self, parent_seq: int, child_seq: int) -> None:
        """The child gets a device slot holding a copy of the parent's state."""
        source = self.slot(parent_seq)
        self._check_new([child_seq])
        [target] = self.device.take(1, f"a fork of sequence {parent_seq}")
        self._slot_of[child_seq] = (self.device, target)
        self._moves.append(StateMove(COPY, source, target))

    def free(self, seq_id: int) -> None:
        pool, slot = self._slot_of.pop(seq_id)
        pool.free.append(slot)

    def can_move(self, seq_ids: Sequence[int], to_host: bool) -> bool:
        return len(seq_ids) <= len((self.host if to_host else self.device).free)

    def move(self, seq_ids: Sequence[int], to_host: bool, who: str = "") -> None:
        """Swap these sequences' states out to the host pool (or back in), all or none."""
        source, target = (self.device, self.host) if to_host else (self.host, self.device)
        for seq_id in seq_ids:
            if self._slot_of[seq_id][0] is not source:
                raise ValueError(f"sequence {seq_id}'s state is not in the {source.name} pool")
        slots = target.take(len(seq_ids), who or f"sequences {list(seq_ids)}")
        kind = SWAP_OUT if to_host else SWAP_IN
        for seq_id, new in zip(seq_ids, slots):
            old = self._slot_of[seq_id][1]
            source.free.append(old)
            self._slot_of[seq_id] = (target, new)
            self._moves.append(StateMove(kind, old, new))

    def take_moves(self) -> List[StateMove]:
        """The moves recorded since the last call, in order; the caller applies them all
        (:meth:`~paged_attention_ext.state_cache.StatePools.apply`) before the next forward."""
        moves, self._moves = self._moves, []
        return moves

    # ---- transactions and checks -------------------------------------------------------
    def copy(self) -> "StateSlots":
        """An independent copy (a block manager's checkpoint)."""
        other = StateSlots(self.device.num_slots, self.host.num_slots, self.device.setting,
                           self.host.setting)
        other.device.free, other.host.free = list(self.device.free), list(self.host.free)
        pools = {id(self.device): other.device, id(self.host): other.host}
        other._slot_of = {s: (pools[id(p)], slot) for s, (p, slot) in self._slot_of.items()}
        other._moves = list(self._moves)
        return other

    def check_invariants(self, seq_pools: Dict[int, str]) -> None:
        """Each of these sequences (id -> "device" or "host", where its blocks are) holds
        one slot in that pool; no other sequence holds one; free and held slots partition
        each pool."""
        assert set(self._slot_of) == set(seq_pools), (
            f"state slots held by {sorted(self._slot_of)}, sequences {sorted(seq_pools)}")
        for seq_id, (pool, _) in self._slot_of.items():
            assert pool.name == seq_pools[seq_id], f"sequence {seq_id}: state and blocks in different pools"
        for pool in (self.device, self.host):
            held = [slot for p, slot in self._slot_of.values() if p is pool]
            assert sorted(held + pool.free) == list(range(pool.num_slots)), f"{pool.name} slots leak"

    def _check_new(self, seq_ids: Sequence[int]) -> None:
        held = [s for s in seq_ids if s in self._slot_of]
        if held or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequences {held or list(seq_ids)} already hold state slots or repeat")

