"""Random add / append / fork / free / swap / preempt sequences over a small pool.

Besides the allocator invariants, the machine keeps a real one-layer KV cache: every
token's key holds its token id, written through the slots the manager returns, with
copy-on-write copies and swaps applied by the ops. After each step, reading every
sequence back through its block table must give exactly its tokens, which checks
copy-on-write, swapping and prefix-cache hits end to end.
"""

from typing import Dict, List

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_attention_ext.block_allocator import NoFreeBlocksError
from paged_attention_ext.block_manager import BlockSpaceManager
from paged_attention_ext.block_table import block_hashes
from paged_attention_ext.kv_cache import PagedKVCache
from paged_attention_ext import ops

BLOCK_SIZE = 4
DEVICE_BLOCKS = 12
HOST_BLOCKS = 8
# A tiny vocabulary makes equal prefixes (prefix-cache hits) common.
TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockSpaceManager(DEVICE_BLOCKS, HOST_BLOCKS, BLOCK_SIZE,
                                     enable_prefix_caching=True, watermark=0.0)
        self.cache = PagedKVCache(1, 1, 8, BLOCK_SIZE, torch.float32, num_blocks=DEVICE_BLOCKS,
                                  num_host_blocks=HOST_BLOCKS)
        self.tokens: Dict[int, List[int]] = {}  # the truth: every sequence's tokens
        self.next_id = 0

    def write(self, slots: List[int], tokens: List[int]) -> None:
        values = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1).expand(-1, 1, 8)
        ops.write_kv(values.contiguous(), values.contiguous(), *self.cache.layer(0),
                     torch.tensor(slots, dtype=torch.int64))

    @staticmethod
    def names(tokens: List[int]) -> List[bytes]:
        return block_hashes(tokens, BLOCK_SIZE)

    def device_groups(self) -> List[int]:
        return [g for g in self.mgr.groups if not self.mgr.is_swapped_out(g)]

    def swapped_groups(self) -> List[int]:
        return [g for g in self.mgr.groups if self.mgr.is_swapped_out(g)]

    @rule(prompt=TOKENS)
    def add_group(self, prompt):
        group = seq = self.next_id
        self.next_id += 1
        if not self.mgr.can_allocate(prompt):
            return
        result, cached = self.mgr.allocate(group, seq, prompt)
        self.write(result.slots[0], prompt[cached:])
        self.tokens[seq] = list(prompt)

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def append_group(self, data):
        group = data.draw(st.sampled_from(self.device_groups()))
        seqs = self.mgr.groups[group]
        new = {s: [data.draw(st.integers(1, 3))] for s in seqs}
        counts = {s: 1 for s in seqs}
        names = {s: self.names(self.tokens[s] + new[s]) for s in seqs}
        fits = self.mgr.append_cost(group) <= self.mgr.num_free_device_blocks
        try:
            step = self.mgr.append_group(group, counts, names)
        except NoFreeBlocksError:
            assert not fits, "append_cost said it fits but the append failed"
            return
        assert fits, "append_cost said no but the append succeeded"
        self.cache.apply_copies([c for s in seqs for c in step[s].copies])
        self.write([slot for s in seqs for slot in step[s].slots[0]], [new[s][0] for s in seqs])
        for s in seqs:
            self.tokens[s] += new[s]

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data(), diverge=st.booleans())
    def fork(self, data, diverge):
        group = data.draw(st.sampled_from(self.device_groups()))
        parent = data.draw(st.sampled_from(self.mgr.groups[group]))
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        if diverge and self.mgr.tables[child][0].blocks_needed(1) <= self.mgr.device.num_free_blocks:
            # A beam that takes a different token at once: copy-on-write of a partial block.
            token = data.draw(st.integers(1, 3))
            step = self.mgr.append(child, 1, self.names(self.tokens[child] + [token]))
            self.cache.apply_copies(step.copies)
            self.write(step.slots[0], [token])
            self.tokens[child].append(token)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_sequence(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free_seq(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self.device_groups()))
        if not self.mgr.can_swap_out(group):
            return
        self.cache.swap_out(self.mgr.swap_out(group))

    @precondition(lambda self: self.swapped_groups())
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.swapped_groups()))
        mapping = self.mgr.try_swap_in(group)
        if mapping is None:
            return
        self.cache.swap_in(mapping)

    @precondition(lambda self: self.device_groups())
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        group = data.draw(st.sampled_from(self.device_groups()))
        for seq in list(self.mgr.groups[group]):
            del self.tokens[seq]
        self.mgr.free_group(group)

    @invariant()
    def allocator_invariants(self):
        self.mgr.check_invariants()

    @invariant()
    def free_blocks_are_garbage(self):
        # Whatever sits in a free block must never be read again: poison it.
        for pool, allocator in ((self.cache.key_caches[0], self.mgr.device),
                                (self.cache.host_key_caches[0], self.mgr.host)):
            pool[allocator.free_block_ids()] = float("nan")

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq, tokens in self.tokens.items():
            table = self.mgr.tables[seq][0]
            pool = (self.cache.host_key_caches if table.allocator is self.mgr.host
                    else self.cache.key_caches)[0]
            read = [float(pool[table.blocks[p // BLOCK_SIZE], 0, p % BLOCK_SIZE, 0])
                    for p in range(len(tokens))]
            assert read == [float(t) for t in tokens], f"sequence {seq}"


BlockManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
