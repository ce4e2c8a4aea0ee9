"""A guided run of every op on a small paged KV cache, checked against the reference.

Four sequences get their blocks from the package's block manager. The walkthrough
prefills them with ``write_kv`` and multi-token attention, decodes a step, forks a
sequence (the next step copies its shared, partly filled last block on write with
``copy_blocks``), swaps a sequence out to the host pool and back with
``swap_blocks``, and compares every result with :mod:`paged_attention_ext.reference`.
"""

import argparse
import time
from typing import Dict, List

import torch

from .. import ops, reference
from ..block_manager import BlockSpaceManager
from ..kv_cache import PagedKVCache

NUM_BLOCKS, NUM_HOST_BLOCKS, NUM_KV_HEADS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE = 64, 16, 2, 8, 16, 64
SCALE = HEAD_SIZE ** -0.5


class Walkthrough:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.manager = BlockSpaceManager(NUM_BLOCKS, NUM_HOST_BLOCKS, BLOCK_SIZE, watermark=0.0)
        self.cache = PagedKVCache(1, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32,
                                  num_blocks=NUM_BLOCKS, num_host_blocks=NUM_HOST_BLOCKS)
        self.seqs: List[int] = []
        self.checks: Dict[str, float] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def write(self, slots: List[int]) -> None:
        n = len(slots)
        ops.write_kv(self.randn(n, NUM_KV_HEADS, HEAD_SIZE), self.randn(n, NUM_KV_HEADS, HEAD_SIZE),
                     *self.cache.layer(0), torch.tensor(slots, dtype=torch.int64))

    def metadata(self):
        tables = [self.manager.block_ids(s, 0) for s in self.seqs]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = [self.manager.num_tokens(s) for s in self.seqs]
        return block_tables, torch.tensor(lens, dtype=torch.int32)

    def attend_and_check(self, name: str, query: torch.Tensor, query_start_loc=None) -> None:
        args = (query, *self.cache.layer(0), *self.metadata(), SCALE, query_start_loc)
        self.checks[name] = float((ops.attention(*args) - reference.attention(*args)).abs().max())

    def prefill(self, prompt_lens: List[int]) -> None:
        slots: List[int] = []
        for n in prompt_lens:
            seq = len(self.seqs)
            placed, _ = self.manager.allocate(seq, seq, n)
            slots += placed.slots[0]
            self.seqs.append(seq)
        self.write(slots)
        starts = torch.tensor([0] + prompt_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.attend_and_check("prefill (multi-token)", self.randn(len(slots), NUM_HEADS, HEAD_SIZE),
                              starts)

    def decode(self, name: str) -> None:
        slots, copies = [], []
        for seq in self.seqs:
            placed = self.manager.append(seq, 1)
            slots += placed.slots[0]
            copies += placed.copies
        self.cache.apply_copies(copies)  # before this step's tokens are written
        if copies:
            key_cache = self.cache.key_caches[0]
            self.checks["copy_blocks (copy-on-write)"] = max(
                float((key_cache[dst] - key_cache[src]).abs().max()) for src, dst in copies)
        self.write(slots)
        self.attend_and_check(name, self.randn(len(self.seqs), NUM_HEADS, HEAD_SIZE))

    def fork(self, parent: int) -> None:
        """A child shares all of the parent's blocks; nothing is copied until it diverges."""
        child = len(self.seqs)
        self.manager.fork(parent, child)
        self.seqs.append(child)

    def swap_round_trip(self, seq: int) -> None:
        key_cache = self.cache.key_caches[0]
        before = key_cache[self.manager.block_ids(seq, 0)]
        out_map = self.manager.swap_out(self.manager.group_of_seq(seq))
        self.cache.swap_out(out_map)
        key_cache[[device for device, _ in out_map]] = float("nan")  # reused meanwhile
        self.cache.swap_in(self.manager.swap_in(self.manager.group_of_seq(seq)))
        after = key_cache[self.manager.block_ids(seq, 0)]
        self.checks["swap_blocks (out and back)"] = float((after - before).abs().max())


def run(args: argparse.Namespace) -> Dict:
    start = time.perf_counter()
    walk = Walkthrough(args.seed)
    print(f"paged-attention walkthrough: {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens, "
          f"{NUM_HEADS} query / {NUM_KV_HEADS} KV heads, head size {HEAD_SIZE}, "
          f"CPU kernel: {ops.cpu_isa()}")
    walk.prefill([5, 16, 17, 40])
    walk.decode("decode step")
    walk.fork(parent=2)
    walk.decode("decode after fork")
    walk.swap_round_trip(seq=3)
    walk.decode("decode after swap-in")
    walk.manager.check_invariants()

    used = walk.manager.num_used_device_blocks  # shared blocks count once
    tokens = sum(walk.manager.num_tokens(s) for s in walk.seqs)
    print(f"sequences: {len(walk.seqs)}, tokens: {tokens}, blocks used: {used} "
          f"({tokens / (used * BLOCK_SIZE):.0%} of their slots hold tokens)")
    ok = True
    for name, error in walk.checks.items():
        good = error < 1e-4
        ok &= good
        print(f"  {name:<30} max |op - reference| = {error:.2e}  {'ok' if good else 'MISMATCH'}")
    seconds = time.perf_counter() - start
    print(f"{'all ops match the reference' if ok else 'MISMATCH against the reference'} "
          f"({seconds:.2f} s)")
    return {"ok": ok, "checks": walk.checks, "sequences": len(walk.seqs), "tokens": tokens,
            "blocks_used": used, "cpu_isa": ops.cpu_isa(), "seconds": seconds}
