"""The engine's invariants: each request where its status says, and (deep) the cache's content."""

from typing import Mapping, Optional

from ..block_table import NULL_BLOCK
from .contents import BlockContents
from .scheduler import Scheduler
from .sequence import GroupStatus, SequenceGroup


def check_engine(scheduler: Scheduler, groups: Mapping[str, SequenceGroup],
                 contents: Optional[BlockContents]) -> None:
    """Raise AssertionError naming the first request found inconsistent.

    ``contents``: also check every named block and every sequence's computed tokens
    against the record of what was written (see :class:`BlockContents`).
    """
    manager = scheduler.manager
    manager.check_invariants()
    queues = {GroupStatus.WAITING: scheduler.waiting, GroupStatus.RUNNING: scheduler.running,
              GroupStatus.SWAPPED: scheduler.swapped}
    for status, queue in queues.items():
        for group in queue:
            assert group.status is status, f"request {group.request.request_id} in the wrong queue"
            assert groups.get(group.request.request_id) is group
    assert sum(map(len, queues.values())) == len(groups), "a request is in no queue"
    for group in groups.values():
        held = group.status is not GroupStatus.WAITING
        assert manager.holds(group.group_id) == held, (
            f"request {group.request.request_id} is {group.status.value} but holds blocks: "
            f"{manager.holds(group.group_id)}")
        if held:
            assert manager.is_swapped_out(group.group_id) == (group.status is GroupStatus.SWAPPED)
            for seq in group.live_seqs:
                # The last token, chosen by the previous step, is placed by the next.
                assert seq.num_computed == len(seq.token_ids) - 1 == \
                    manager.num_tokens(seq.seq_id), (
                        f"request {group.request.request_id}, sequence {seq.seq_id}: "
                        f"{len(seq.token_ids)} tokens, {seq.num_computed} computed")
    if contents is None:
        return
    contents.check_named(manager.named_blocks())
    for group in groups.values():
        if group.status is GroupStatus.WAITING:
            continue
        pool = contents.host if group.status is GroupStatus.SWAPPED else contents.device
        for seq in group.live_seqs:
            for kv_group in range(manager.num_kv_groups):
                blocks = manager.block_ids(seq.seq_id, kv_group)
                held = contents.tokens(pool, blocks, seq.num_computed)
                # A sliding window's freed blocks hold nothing the sequence reads.
                want = [None if blocks[p // contents.block_size] == NULL_BLOCK else token
                        for p, token in enumerate(seq.token_ids[:seq.num_computed])]
                assert held == want, (
                    f"request {group.request.request_id}, sequence {seq.seq_id}, KV group "
                    f"{kv_group}: the cache holds {held} for tokens {want}")
