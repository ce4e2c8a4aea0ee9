"""Random admit / decode / fork / free / swap / preempt sequences of a block manager with
state slots, over real state pools.

Every sequence's state is a number that only it changes (a decode step adds one to its own
slot); the pools follow the manager's moves (zero, copy, swap). After each step every
sequence must read its own number back from its slot, on the device or in the host pool,
and every free slot is poisoned, so a move that loses, leaks or crosses a state is caught.
A refused call (no free slot or block) must change nothing.
"""

from typing import Dict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_attention_ext.block_allocator import NoFreeBlocksError
from paged_attention_ext.block_manager import BlockSpaceManager
from paged_attention_ext.state_cache import StatePools

BLOCK_SIZE = 4
DEVICE_BLOCKS, HOST_BLOCKS = 16, 12
DEVICE_SLOTS, HOST_SLOTS = 5, 3
KEY = (0, "recurrent", 0)


class StateSlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockSpaceManager(DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_SIZE, watermark=0.0,
                                     num_state_slots=DEVICE_SLOTS, num_host_state_slots=HOST_SLOTS)
        self.pools = StatePools(DEVICE_SLOTS, HOST_SLOTS)
        self.pools.pool(KEY, (2,), torch.float64, torch.device("cpu"))
        self.states: Dict[int, float] = {}  # the truth: every sequence's state
        self.next_id = 0
        self.next_value = 1.0

    def apply(self) -> None:
        self.pools.apply(self.mgr.take_state_moves())

    def snapshot(self):
        s = self.mgr.states
        return ({q: [list(t.blocks) for t in ts] for q, ts in self.mgr.tables.items()},
                {k: (p.name, slot) for k, (p, slot) in s._slot_of.items()},
                list(s.device.free), list(s.host.free), self.mgr.device.num_free_blocks)

    def device_groups(self):
        return [g for g in self.mgr.groups if not self.mgr.is_swapped_out(g)]

    def swapped_groups(self):
        return [g for g in self.mgr.groups if self.mgr.is_swapped_out(g)]

    @rule(length=st.integers(1, 12))
    def admit(self, length):
        seq = self.next_id
        self.next_id += 1
        if not self.mgr.can_allocate(length):
            before = self.snapshot()
            try:
                self.mgr.allocate(seq, seq, length)
            except NoFreeBlocksError:
                assert self.snapshot() == before
                return
            raise AssertionError("can_allocate said no, allocate succeeded")
        self.mgr.allocate(seq, seq, length)
        self.apply()
        assert float(self.pools.device[KEY][self.mgr.states.slot(seq), 0]) == 0.0  # zeroed
        # The prefill computes its state.
        self.pools.device[KEY][self.mgr.states.slot(seq)] = self.next_value
        self.states[seq] = self.next_value
        self.next_value += 1

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def decode(self, data):
        group = data.draw(st.sampled_from(self.device_groups()))
        for seq in self.mgr.groups[group]:
            self.pools.device[KEY][self.mgr.states.slot(seq)] += 1
            self.states[seq] += 1

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from([s for g in self.device_groups() for s in self.mgr.groups[g]]))
        child = self.next_id
        self.next_id += 1
        before = self.snapshot()
        try:
            self.mgr.fork(parent, child)
        except NoFreeBlocksError:
            assert self.mgr.states.num_free == 0 and self.snapshot() == before
            return
        self.apply()
        self.states[child] = self.states[parent]

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def free_sequence(self, data):
        seq = data.draw(st.sampled_from(sorted(self.states)))
        self.mgr.free_seq(seq)
        del self.states[seq]

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self.device_groups()))
        before = self.snapshot()
        if not self.mgr.can_swap_out(group):
            try:
                self.mgr.swap_out(group)
            except NoFreeBlocksError:
                assert self.snapshot() == before
                return
            raise AssertionError("can_swap_out said no, swap_out succeeded")
        self.mgr.swap_out(group)
        self.apply()

    @precondition(lambda self: self.swapped_groups())
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.swapped_groups()))
        before = self.snapshot()
        if self.mgr.try_swap_in(group) is None:
            assert self.snapshot() == before
            return
        self.apply()

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        group = data.draw(st.sampled_from(self.device_groups()))
        for seq in list(self.mgr.groups[group]):
            del self.states[seq]
        self.mgr.free_group(group)

    @invariant()
    def manager_invariants(self):
        self.mgr.check_invariants()
        assert self.mgr.states.pending_moves() == []

    @invariant()
    def free_slots_are_garbage(self):
        s = self.mgr.states
        self.pools.device[KEY][s.device.free] = float("nan")
        self.pools.host[KEY][s.host.free] = float("nan")

    @invariant()
    def every_sequence_reads_back_its_state(self):
        s = self.mgr.states
        for seq, value in self.states.items():
            pool, slot = s._slot_of[seq]
            tensor = (self.pools.host if pool is s.host else self.pools.device)[KEY]
            assert tensor[slot].tolist() == [value, value], f"sequence {seq}"


StateSlotMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestStateSlotMachine = StateSlotMachine.TestCase
