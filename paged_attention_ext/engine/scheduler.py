"""Which sequence groups run each step, and the block moves that makes possible.

First come, first served over three queues kept in arrival order:

* running groups decode one token per live sequence; when the pool cannot hold the
  next token of a group, the latest-arrived running groups are preempted, whole,
  until it can (possibly the group itself);
* swapped groups come back (swap-in) when their blocks fit, oldest first;
* waiting groups (new, or preempted for recomputation) are prefilled when their blocks
  fit and the step's token budget allows, only once nothing is swapped out.

The scheduler is the block manager's only client in the engine: it places and preempts
groups, forks and releases the sequences the engine's sampling and beam search create
and drop (:meth:`Scheduler.fork`, :meth:`Scheduler.release`), hands the runner each
step's slots and block tables (:class:`SchedulerOutput`), and undoes a failed step
(:meth:`Scheduler.transaction`).

A step has two parts, so that a failure in the second never loses a group's blocks:
:meth:`Scheduler.preempt` first decides and applies the preemptions (the engine then
copies the swapped-out blocks to the host), and only then :meth:`Scheduler.schedule`
places this step's tokens, which may reuse the freed blocks. A step that preempts
admits nothing, so freed blocks are not handed straight back. Prompts are prefilled in
one step (no chunked prefill).
"""

import bisect
import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import (Deque, Dict, Iterator, List, MutableSequence, Optional, Sequence as TypingSequence,
                    Tuple)

from ..block_manager import BlockSpaceManager, SeqSpec
from ..block_table import BlockPair
from ..state_slots import StateMove
from .config import EngineConfig
from .sequence import GroupStatus, Sequence, SequenceGroup

PREEMPTION_MODES = ("swap", "recompute")


@dataclass
class Preemption:
    swap_out: List[BlockPair] = field(default_factory=list)  # (device, host) rows to copy before any write
    # state slot moves (a hybrid model's: earlier forks' copies, then the swap-outs), in order
    state_moves: List[StateMove] = field(default_factory=list)
    counts: Dict[str, int] = field(default_factory=lambda: {m: 0 for m in PREEMPTION_MODES})

    @property
    def any(self) -> bool:
        return any(self.counts.values())


@dataclass
class SchedulerOutput:
    groups: List[SequenceGroup] = field(default_factory=list)  # run: every uncomputed token
    # per sequence and KV group, its uncomputed tokens' slots
    slots: Dict[int, List[List[int]]] = field(default_factory=dict)
    # per sequence and KV group, its block table once the step's tokens are placed
    tables: Dict[int, List[List[int]]] = field(default_factory=dict)
    swap_in: List[BlockPair] = field(default_factory=list)
    copies: List[BlockPair] = field(default_factory=list)  # copy-on-write, after the swap-ins
    # A hybrid model's: per sequence its state slot, and the slot moves (zero, copy, swap-in)
    # to apply, in order, before the forward.
    state_slots: Dict[int, int] = field(default_factory=dict)
    state_moves: List[StateMove] = field(default_factory=list)


class Scheduler:
    """Owns the engine's block manager (built here from ``config``'s pool sizes and the
    model's KV groups): nothing else changes it."""

    def __init__(self, config: EngineConfig, kv_group_windows: TypingSequence[Optional[int]]) -> None:
        self._manager = BlockSpaceManager(
            config.num_device_blocks, config.num_host_blocks, config.block_size,
            config.enable_prefix_caching, config.watermark, kv_group_windows,
            device_setting="EngineConfig.num_device_blocks",
            host_setting="EngineConfig.num_host_blocks", num_state_slots=config.num_state_slots,
            num_host_state_slots=config.host_state_slots,
            state_setting="EngineConfig.num_state_slots",
            host_state_setting="EngineConfig.num_host_state_slots")
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        self.preemption_mode = config.preemption_mode
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # Queues served from the front (deques); the running groups are a list, visited in
        # order and rebuilt by each preemption.
        self.waiting: Deque[SequenceGroup] = deque()
        self.running: List[SequenceGroup] = []
        self.swapped: Deque[SequenceGroup] = deque()

    @property
    def manager(self) -> BlockSpaceManager:
        """The block manager, for reading (metrics, checks, tests); only the scheduler changes it."""
        return self._manager

    def add(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.WAITING
        _insert(self.waiting, group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def remove(self, group: SequenceGroup) -> None:
        """Drop a finished or aborted group and release whatever blocks it still holds."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        if self._manager.holds(group.group_id):
            self._manager.free_group(group.group_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A new sample or beam of the parent's group, sharing all its blocks (copied on write)."""
        self._manager.fork(parent.seq_id, child.seq_id)

    def release(self, seq: Sequence) -> None:
        """Return the blocks of a finished sample or a dropped beam."""
        self._manager.free_seq(seq.seq_id)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Undo every change to the blocks, the queues and the queued groups' statuses and
        computed tokens if the body of the ``with`` raises (see ``LLMEngine.step``)."""
        manager = self._manager.checkpoint()
        queues = [q.copy() for q in (self.waiting, self.running, self.swapped)]
        groups = [(g, g.status, [(s, s.num_computed) for s in g.seqs]) for q in queues for g in q]
        try:
            yield
        except BaseException:
            self._manager.rollback(manager)
            self.waiting, self.running, self.swapped = queues
            for group, status, seqs in groups:
                group.status = status
                for seq, num_computed in seqs:
                    seq.num_computed = num_computed
            raise

    def must_preempt(self) -> bool:
        """Whether :meth:`preempt` would preempt: the running groups' next tokens, placed in
        order, do not all fit (a sliding window's group may return blocks, so a cost can be
        negative and every prefix of the order is checked).

        A sequence's next token takes at most one block per KV group (a new one, or a copy
        of a shared last block), so the common case is answered without asking the manager
        per group.
        """
        free = self._manager.num_free_device_blocks
        if sum(len(g.live_seqs) for g in self.running) * self._manager.num_kv_groups <= free:
            return False
        needed = 0
        for group in self.running:
            needed += self._manager.append_cost(group.group_id)
            if needed > free:
                return True
        return False

    def preempt(self) -> Preemption:
        """Preempt the latest-arrived running groups until every other one's next token fits.

        Writes nothing: the blocks the running groups will take are only counted.
        """
        out = Preemption()
        queue, self.running, reserved = deque(self.running), [], 0
        while queue:
            group = queue.popleft()
            while group.status is GroupStatus.RUNNING:
                # Counted again after each preemption: freed shared blocks change the cost.
                cost = self._manager.append_cost(group.group_id)
                if reserved + cost <= self._manager.num_free_device_blocks:
                    reserved += cost
                    self.running.append(group)
                    break
                self._preempt(queue.pop() if queue else group, out)
        out.state_moves = self._manager.take_state_moves()
        return out

    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """Place the running groups' next tokens, then (if `admit`) swap in and prefill."""
        out = SchedulerOutput()
        for group in self.running:
            self._append_pending(group, out)
        if admit:
            self._schedule_swapped(out)
            if not self.swapped:
                self._schedule_waiting(out)
            if not out.groups and self.has_unfinished():
                group = (self.swapped or self.waiting)[0]
                raise RuntimeError(f"request {group.request.request_id} cannot fit in the KV pool "
                                   f"({self._manager.num_device_blocks} blocks) even alone")
        kv_groups = range(self._manager.num_kv_groups)
        states = self._manager.states
        for group in out.groups:
            for seq in group.live_seqs:
                out.tables[seq.seq_id] = [self._manager.block_ids(seq.seq_id, g) for g in kv_groups]
                if states is not None:
                    out.state_slots[seq.seq_id] = states.slot(seq.seq_id)
        out.state_moves = self._manager.take_state_moves()
        return out

    # ---- the queues that wait --------------------------------------------------------
    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        while self.swapped:
            if not self._state_slots_fit(self.swapped[0]):
                return
            mapping = self._manager.try_swap_in(self.swapped[0].group_id)
            if mapping is None:
                return
            group = self.swapped.popleft()
            out.swap_in += mapping
            self._append_pending(group, out)
            self._start(group)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens - sum(len(g.live_seqs) for g in out.groups)
        while self.waiting:
            group = self.waiting[0]
            tokens = sum(len(s.token_ids) for s in group.live_seqs)
            if ((out.groups and tokens > budget) or not self._state_slots_fit(group)
                    or not self._admit(group, out)):
                return
            self.waiting.popleft()
            self._start(group)
            budget -= tokens
            out.groups.append(group)

    # ---- helpers ---------------------------------------------------------------------
    def _start(self, group: SequenceGroup) -> None:
        group.status = GroupStatus.RUNNING
        _insert(self.running, group)

    def _state_slots_fit(self, group: SequenceGroup) -> bool:
        """Whether the device's state slots hold the group's live sequences and every fork
        it and the running groups are still to make (forks happen after the forward, where
        they must not fail): always, for a model without linear-attention layers."""
        states = self._manager.states
        if states is None:
            return True
        promised = sum(_forks_ahead(g) for g in self.running)
        return len(group.live_seqs) + _forks_ahead(group) <= states.num_free - promised

    def _append_pending(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Room for the token each live sequence sampled last step."""
        live = group.live_seqs
        placed = self._manager.append_group(group.group_id, {s.seq_id: 1 for s in live},
                                            {s.seq_id: s.block_hashes for s in live})
        for seq in live:
            out.copies += placed[seq.seq_id].copies
            out.slots[seq.seq_id] = placed[seq.seq_id].slots
        out.groups.append(group)

    def _preempt(self, group: SequenceGroup, out: Preemption) -> None:
        """Swap the group to host blocks, or free it to be recomputed (also when the host is full)."""
        if self.preemption_mode == "swap" and self._manager.can_swap_out(group.group_id):
            out.swap_out += self._manager.swap_out(group.group_id)
            group.status = GroupStatus.SWAPPED
            _insert(self.swapped, group)
            out.counts["swap"] += 1
            return
        self._manager.free_group(group.group_id)
        for seq in group.live_seqs:
            seq.num_computed = 0
        self.add(group)
        out.counts["recompute"] += 1

    def _admit(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Place a prefill (new request) or a re-prefill after recompute preemption, if it
        fits above the watermark; False (nothing changed) if it does not."""
        placements = self._manager.try_admit(group.group_id, *_admission(group))
        if placements is None:
            return False
        for seq, placed in zip(group.live_seqs, placements):
            seq.num_computed = len(seq.token_ids) - placed.num_tokens
            out.slots[seq.seq_id] = placed.slots
        return True


def _admission(group: SequenceGroup) -> Tuple[List[SeqSpec], int]:
    """The group's sequences as the manager places them, and how many tokens they share.

    One sequence is placed whole (prefix-cache hits may cover generated tokens too);
    the samples or beams of a recomputed group share their prompt.
    """
    live = group.live_seqs
    seqs = [SeqSpec(s.seq_id, len(s.token_ids), s.block_hashes) for s in live]
    return seqs, (len(live[0].token_ids) if len(live) == 1 else live[0].prompt_len)


def _forks_ahead(group: SequenceGroup) -> int:
    """Sequences the group has yet to fork: samples at their first token, beams up to
    ``num_beams`` (a beam step frees the dropped beams before it forks the others)."""
    params = group.request.params
    return (params.num_beams if params.is_beam_search else params.n) - len(group.seqs)


def _insert(queue: MutableSequence[SequenceGroup], group: SequenceGroup) -> None:
    """Keep a queue in arrival order (earliest first)."""
    bisect.insort(queue, group, key=lambda g: g.arrival)
