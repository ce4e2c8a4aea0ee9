"""State slots of linear-attention layers: their owner in the block manager and their pools."""

import pytest
import torch

from paged_attention_ext.block_allocator import NoFreeBlocksError
from paged_attention_ext.block_manager import BlockSpaceManager, SeqSpec
from paged_attention_ext.block_table import block_hashes
from paged_attention_ext.state_cache import StatePools, state_bytes
from paged_attention_ext.state_slots import NoFreeStateSlotsError, StateMove, StateSlots


def hybrid(blocks=16, host_blocks=16, slots=4, host_slots=4, **kwargs) -> BlockSpaceManager:
    return BlockSpaceManager(blocks, host_blocks, 4, num_state_slots=slots,
                             num_host_state_slots=host_slots, **kwargs)


def state(manager: BlockSpaceManager):
    """Everything the manager knows, to compare before and after a refused call."""
    s = manager.states
    return ({q: [list(t.blocks) for t in ts] for q, ts in manager.tables.items()},
            {g: list(q) for g, q in manager.groups.items()},
            list(manager.device._free), list(manager.host._free),
            {k: (p.name, slot) for k, (p, slot) in s._slot_of.items()},
            list(s.device.free), list(s.host.free), s.pending_moves())


def test_admit_takes_a_zeroed_slot_and_free_returns_it():
    m = hybrid()
    m.allocate(0, 0, 6)
    assert m.states.slot(0) == 0 and m.states.num_free == 3
    assert m.take_state_moves() == [StateMove("zero", -1, 0)]
    assert m.take_state_moves() == []  # taken once
    m.free_seq(0)
    assert m.states.num_free == 4 and not m.states.holds(0)
    m.check_invariants()


def test_no_free_slot_refuses_admission_with_nothing_changed():
    m = hybrid(slots=1)
    m.allocate(0, 0, 4)
    m.take_state_moves()
    before = state(m)
    # Plenty of blocks, no slot: try_admit answers None, admit raises, both change nothing.
    assert m.try_admit(1, [SeqSpec(1, 4)], 4) is None
    assert not m.can_allocate(4)
    with pytest.raises(NoFreeStateSlotsError, match="state slot.*num_state_slots"):
        m.admit(1, [SeqSpec(1, 4)], 4)
    with pytest.raises(NoFreeBlocksError):  # callers that handle a full pool handle this
        m.allocate(2, 2, 4)
    assert state(m) == before
    m.check_invariants()


def test_a_group_of_several_sequences_recomputes_the_shared_prompt_without_writing_it():
    """A group recomputed after preemption: each sequence builds its linear-attention state
    from its first token, so each computes every token from an empty slot; the prompt's full
    blocks stay shared, written by the first sequence only (the others' slots there: -1)."""
    m = hybrid(blocks=8, slots=4, enable_prefix_caching=True)
    seqs = [SeqSpec(s, 11, block_hashes(list(range(9)) + [s, s], 4)) for s in range(2)]
    assert hybrid(blocks=8, slots=1).try_admit(0, seqs, 9) is None  # two slots needed
    placed = m.try_admit(0, seqs, 9)
    assert [p.num_tokens for p in placed] == [11, 11]
    first, second = (m.tables[s][0] for s in range(2))
    assert placed[0].slots[0] == first.slots(0, 11)
    assert placed[1].slots[0] == [-1] * 8 + second.slots(8, 11)
    assert first.blocks[:2] == second.blocks[:2] and first.blocks[2] != second.blocks[2]
    assert m.take_state_moves() == [StateMove("zero", -1, m.states.slot(0)),
                                    StateMove("copy", m.states.slot(0), m.states.slot(1))]
    m.check_invariants()


def test_fork_copies_the_state_once_per_child_and_shares_the_prompt_blocks():
    m = hybrid(blocks=16, slots=9)
    m.allocate(0, 0, 12)  # three full prompt blocks
    m.take_state_moves()
    used = m.num_used_device_blocks
    for child in range(1, 9):  # n = 8 samples: the parent and seven forks... and one more
        m.fork(0, child)
    moves = m.take_state_moves()
    assert moves == [StateMove("copy", 0, m.states.slot(c)) for c in range(1, 9)]
    assert len({mv.target for mv in moves}) == 8
    assert m.num_used_device_blocks == used  # no K/V block copied
    assert all(m.block_ids(c, 0) == m.block_ids(0, 0) for c in range(1, 9))
    m.check_invariants()


def test_fork_without_a_free_slot_changes_nothing():
    m = hybrid(slots=1)
    m.allocate(0, 0, 4)
    before = state(m)
    with pytest.raises(NoFreeStateSlotsError, match="a fork of sequence 0"):
        m.fork(0, 1)
    assert state(m) == before and not m.has_seq(1)
    m.check_invariants()


def test_swap_moves_states_with_blocks_all_or_nothing():
    m = hybrid(slots=3, host_slots=2)
    m.allocate(0, 0, 6)
    m.fork(0, 1)
    m.take_state_moves()
    slots = [m.states.slot(0), m.states.slot(1)]
    pairs = m.swap_out(0)
    assert pairs and m.is_swapped_out(0)
    moves = m.take_state_moves()
    assert [mv.kind for mv in moves] == ["swap_out", "swap_out"]
    assert [mv.source for mv in moves] == slots and m.states.num_free == 3
    m.check_invariants()
    # The device's slots are taken by another group: the swap-in does not fit, nothing moves.
    m.allocate(1, 2, 4)
    m.fork(2, 3)
    m.take_state_moves()
    before = state(m)
    assert m.try_swap_in(0) is None
    with pytest.raises(NoFreeStateSlotsError):
        m.swap_in(0)
    assert state(m) == before and m.is_swapped_out(0)
    m.free_group(1)
    assert m.try_swap_in(0) is not None
    assert [mv.kind for mv in m.take_state_moves()] == ["swap_in", "swap_in"]
    m.check_invariants()


def test_swap_out_needs_host_slots():
    m = hybrid(slots=3, host_slots=1)
    m.allocate(0, 0, 5)
    m.fork(0, 1)
    assert not m.can_swap_out(0)
    before = state(m)
    with pytest.raises(NoFreeStateSlotsError, match="host state slots"):
        m.swap_out(0)
    assert state(m) == before
    m.check_invariants()


def test_freeing_a_swapped_out_sequence_frees_its_host_slot():
    m = hybrid()
    m.allocate(0, 0, 4)
    m.swap_out(0)
    assert m.states.num_free_host == 3
    m.free_group(0)
    assert m.states.num_free_host == 4 and m.states.num_free == 4
    m.check_invariants()


def test_rollback_restores_slots_and_pending_moves():
    m = hybrid()
    m.allocate(0, 0, 4)
    checkpoint = m.checkpoint()
    m.fork(0, 1)
    m.allocate(2, 2, 4)
    m.rollback(checkpoint)
    assert m.states.pending_moves() == [StateMove("zero", -1, 0)]
    assert m.states.num_free == 3 and not m.has_seq(1)
    m.check_invariants()


@pytest.mark.parametrize("slots", [None, 4])
def test_prefix_hits_only_where_every_prompt_token_is_computed(slots):
    """A hit skips the prompt's computation in try_admit (the engine): with state slots the
    linear layers' state after the hit is nowhere kept, so there is none. A caller that
    computes every prompt token (queries_from_start: a transformers forward) still shares
    the K/V blocks."""
    m = BlockSpaceManager(32, 0, 4, enable_prefix_caching=True, num_state_slots=slots)
    prompt = list(range(13))
    m.allocate(0, 0, prompt)
    assert len(m.named_blocks()) == 3
    [placed] = m.try_admit(1, [SeqSpec(1, 13, block_hashes(prompt, 4))], 13)
    hits = 13 - len(placed.slots[0])
    assert hits == (12 if slots is None else 0)
    _, cached = m.allocate(2, 2, prompt, queries_from_start=True)
    assert cached == 12
    assert m.block_ids(2, 0)[:3] == m.block_ids(0, 0)[:3]
    m.check_invariants()


def test_usage_and_manager_without_slots():
    m = hybrid(slots=2)
    m.allocate(0, 0, 4)
    assert m.usage()["state_slots_used"] == 1 and m.usage()["state_slots_total"] == 2
    plain = BlockSpaceManager(8, 0, 4)
    plain.allocate(0, 0, 4)
    plain.fork(0, 1)
    assert plain.take_state_moves() == [] and "state_slots_used" not in plain.usage()


def test_bad_slot_counts_are_refused():
    with pytest.raises(ValueError, match="num_slots must be an int >= 0"):
        StateSlots(-1)
    with pytest.raises(ValueError, match="num_host_slots"):
        StateSlots(1, 1.5)


# ---- the tensors -----------------------------------------------------------------------

def test_pools_follow_the_moves():
    pools = StatePools(4, 2)
    conv = pools.pool((0, "conv"), (3, 2), torch.float32, torch.device("cpu"))
    rec = pools.pool((0, "recurrent"), (2, 2), torch.float32, torch.device("cpu"))
    assert pools.slot_bytes == state_bytes([(3, 2), (2, 2)], torch.float32) == 40
    for t in (conv, rec):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
    expected = {k: t.clone() for k, t in pools.device.items()}
    moves = [StateMove("copy", 0, 1), StateMove("copy", 1, 2),  # a chain: read after write
             StateMove("swap_out", 2, 1), StateMove("zero", -1, 2), StateMove("swap_in", 1, 3)]
    pools.apply(moves)
    for key, t in expected.items():
        t[1] = t[0]
        t[2] = t[1]
        host_row = t[2].clone()
        t[2] = 0
        t[3] = host_row
        assert torch.equal(pools.device[key], t)
        assert torch.equal(pools.host[key][1], host_row)


def test_pool_shape_is_fixed_and_bad_moves_raise():
    pools = StatePools(2)
    pools.pool("s", (3,), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="a state's shape is fixed"):
        pools.pool("s", (4,), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown state move"):
        pools.apply([StateMove("move", 0, 1)])
