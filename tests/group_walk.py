"""A random walk over a block manager's sequence groups, shared by the KV-group tests."""

import random
from typing import Callable, List, Optional

from paged_attention_ext.block_manager import BlockSpaceManager, NoFreeBlocksError


def random_group_walk(mgr: BlockSpaceManager, rng: random.Random, steps: int,
                      admit: Callable[[int], List[int]],
                      append_count: Callable[[], int] = lambda: 1,
                      after_append: Optional[Callable[[int], None]] = None) -> None:
    """``steps`` random admits (``admit(group_id)`` admits a group, returns its sequence
    ids), appends (``append_count()`` tokens per sequence; ``after_append(seq)`` checks each),
    forks, swaps and frees, invariants checked after every operation; at the end every
    group is freed."""
    live, swapped, next_id = {}, set(), 100
    for _ in range(steps):
        op = rng.random()
        try:
            if op < 0.2 and len(live) < 6:
                live[next_id] = admit(next_id)
                next_id += len(live[next_id])
            elif op < 0.6 and live:
                group = rng.choice([g for g in live if g not in swapped] or [None])
                if group is not None:
                    mgr.append_group(group, {s: append_count() for s in live[group]})
                    for s in live[group] if after_append is not None else ():
                        after_append(s)
            elif op < 0.7 and live:
                group = rng.choice([g for g in live if g not in swapped] or [None])
                if group is not None:
                    mgr.fork(live[group][0], next_id)
                    live[group].append(next_id)
                    next_id += 1
            elif op < 0.8 and live:
                group = rng.choice(list(live))
                if group in swapped:
                    mgr.swap_in(group)
                    swapped.discard(group)
                else:
                    mgr.swap_out(group)
                    swapped.add(group)
            elif live:
                group = rng.choice(list(live))
                mgr.free_group(group)
                del live[group]
                swapped.discard(group)
        except NoFreeBlocksError:
            pass
        mgr.check_invariants()
    for group in list(live):
        mgr.free_group(group)
