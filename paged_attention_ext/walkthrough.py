"""A guided run of every op on a small paged KV cache, checked against the reference.

Four sequences share one pool of blocks placed in random physical order. The
walkthrough prefills them with ``write_kv`` and multi-token attention, decodes a
step, forks a sequence and copies its partly filled last block on write with
``copy_blocks``, swaps blocks out to a host pool and back with ``swap_blocks``,
and compares every result with :mod:`paged_attention_ext.reference`.
"""

import argparse
import time
from typing import Dict, List

import torch

from . import ops, reference

NUM_BLOCKS, NUM_KV_HEADS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE = 64, 2, 8, 16, 64
SCALE = HEAD_SIZE ** -0.5


class Walkthrough:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
        self.key_cache = torch.zeros(shape)
        self.value_cache = torch.zeros(shape)
        self.free_blocks: List[int] = torch.randperm(NUM_BLOCKS, generator=self.gen).tolist()
        self.tables: List[List[int]] = []
        self.lens: List[int] = []
        self.checks: Dict[str, float] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def append_slots(self, seq: int, count: int) -> torch.Tensor:
        """Slots for `count` new tokens of sequence `seq`, allocating blocks on demand."""
        slots = []
        for _ in range(count):
            position = self.lens[seq]
            if position % BLOCK_SIZE == 0:
                self.tables[seq].append(self.free_blocks.pop())
            slots.append(self.tables[seq][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            self.lens[seq] += 1
        return torch.tensor(slots, dtype=torch.int64)

    def metadata(self):
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        return tables, torch.tensor(self.lens, dtype=torch.int32)

    def attend_and_check(self, name: str, query: torch.Tensor, query_start_loc=None) -> None:
        tables, lens = self.metadata()
        args = (query, self.key_cache, self.value_cache, tables, lens, SCALE, query_start_loc)
        got = ops.attention(*args)
        want = reference.attention(*args)
        self.checks[name] = float((got - want).abs().max())

    def prefill(self, prompt_lens: List[int]) -> None:
        for n in prompt_lens:
            self.tables.append([])
            self.lens.append(0)
        slots = torch.cat([self.append_slots(i, n) for i, n in enumerate(prompt_lens)])
        total = sum(prompt_lens)
        ops.write_kv(self.randn(total, NUM_KV_HEADS, HEAD_SIZE), self.randn(total, NUM_KV_HEADS, HEAD_SIZE),
                     self.key_cache, self.value_cache, slots)
        starts = torch.tensor([0] + prompt_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.attend_and_check("prefill (multi-token)", self.randn(total, NUM_HEADS, HEAD_SIZE), starts)

    def decode(self, name: str) -> None:
        n = len(self.lens)
        slots = torch.cat([self.append_slots(i, 1) for i in range(n)])
        ops.write_kv(self.randn(n, NUM_KV_HEADS, HEAD_SIZE), self.randn(n, NUM_KV_HEADS, HEAD_SIZE),
                     self.key_cache, self.value_cache, slots)
        self.attend_and_check(name, self.randn(n, NUM_HEADS, HEAD_SIZE))

    def fork_with_copy_on_write(self, parent: int) -> None:
        """A child shares the parent's full blocks and gets a copy of its partly filled last one."""
        shared, last = self.tables[parent][:-1], self.tables[parent][-1]
        copy = self.free_blocks.pop()
        ops.copy_blocks([self.key_cache], [self.value_cache], torch.tensor([[last, copy]]))
        self.tables.append(shared + [copy])
        self.lens.append(self.lens[parent])
        self.checks["copy_blocks (copy-on-write)"] = float(
            (self.key_cache[copy] - self.key_cache[last]).abs().max())

    def swap_round_trip(self, seq: int) -> None:
        host = torch.zeros((len(self.tables[seq]),) + self.key_cache.shape[1:])
        before = self.key_cache.clone()
        out_map = torch.tensor([[b, i] for i, b in enumerate(self.tables[seq])])
        ops.swap_blocks(self.key_cache, host, out_map)
        self.key_cache[out_map[:, 0]] = float("nan")  # the device blocks are reused meanwhile
        ops.swap_blocks(host, self.key_cache, out_map.flip(1))
        self.checks["swap_blocks (out and back)"] = float((self.key_cache - before).abs().max())


def run(args: argparse.Namespace) -> Dict:
    start = time.perf_counter()
    walk = Walkthrough(args.seed)
    print(f"paged-attention walkthrough: {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens, "
          f"{NUM_HEADS} query / {NUM_KV_HEADS} KV heads, head size {HEAD_SIZE}, "
          f"CPU kernel: {ops.cpu_isa()}")
    walk.prefill([5, 16, 17, 40])
    walk.decode("decode step")
    walk.fork_with_copy_on_write(parent=2)
    walk.decode("decode after fork")
    walk.swap_round_trip(seq=3)
    walk.decode("decode after swap-in")

    used = len({block for table in walk.tables for block in table})  # shared blocks count once
    tokens = sum(walk.lens)
    print(f"sequences: {len(walk.lens)}, tokens: {tokens}, blocks used: {used} "
          f"({tokens / (used * BLOCK_SIZE):.0%} of their slots hold tokens)")
    ok = True
    for name, error in walk.checks.items():
        good = error < 1e-4
        ok &= good
        print(f"  {name:<30} max |op - reference| = {error:.2e}  {'ok' if good else 'MISMATCH'}")
    seconds = time.perf_counter() - start
    print(f"{'all ops match the reference' if ok else 'MISMATCH against the reference'} "
          f"({seconds:.2f} s)")
    return {"ok": ok, "checks": walk.checks, "sequences": len(walk.lens), "tokens": tokens,
            "blocks_used": used, "cpu_isa": ops.cpu_isa(), "seconds": seconds}
