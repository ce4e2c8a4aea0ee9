"""Builders of adversarial paged-KV test cases shared by the test modules."""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

# Tolerances against the fp32 reference. Kernel and reference both compute in fp32
# from identical inputs, so they differ by fp32 summation order (~1e-6 relative)
# plus, for 16-bit outputs, one final rounding: bf16 keeps 8 mantissa bits (an ulp
# is 2^-7 = 0.0078 at magnitude 1), fp16 keeps 11 (an ulp is 2^-10 at 1).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Table entries past a sequence's last block: never valid ids, must never be read.
UNUSED_TABLE_ENTRY = 1 << 30


@dataclass
class PagedCase:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    used_slots: torch.Tensor  # bool [num_blocks, block_size]: slots that hold tokens

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[2]

    def poison_unused(self, value: float) -> None:
        """Write `value` into every slot no sequence uses (tails of last blocks, free blocks)."""
        unused = ~self.used_slots
        for cache in (self.key_cache, self.value_cache):
            cache.permute(0, 2, 1, 3)[unused] = value


def make_case(
    seq_lens: Sequence[int],
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
    seed: int = 0,
    poison: Optional[float] = float("nan"),
    head_size_v: Optional[int] = None,
) -> PagedCase:
    """Random caches whose blocks are scattered in a random physical order.

    The value cache's head size is ``head_size_v`` (default: ``head_size``).

    Every slot not holding a token is set to `poison` (NaN by default), and block
    table entries past each sequence's blocks hold an invalid id, so a kernel that
    reads anything it should not gives a visibly wrong answer.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max([1] + blocks_per_seq) + 1
    shape = (num_blocks, num_kv_heads, block_size)
    key_cache = torch.randn(shape + (head_size,), generator=gen).to(dtype)
    value_cache = torch.randn(shape + (head_size_v or head_size,), generator=gen).to(dtype)

    physical = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), UNUSED_TABLE_ENTRY, dtype=torch.int32)
    used_slots = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    next_block = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = physical[next_block:next_block + nb]
        next_block += nb
        block_tables[i, :nb] = ids.int()
        for b, block in enumerate(ids.tolist()):
            used_slots[block, : min(block_size, n - b * block_size)] = True
    case = PagedCase(key_cache, value_cache, block_tables,
                     torch.tensor(list(seq_lens), dtype=torch.int32), used_slots)
    if poison is not None:
        case.poison_unused(poison)
    return case


def query_start_loc(q_lens: List[int]) -> torch.Tensor:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32)


def random_query(num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype,
                 seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)


def free_out_of_window(case: PagedCase, window: int, q_lens: Optional[Sequence[int]] = None,
                       poison: float = float("nan")) -> PagedCase:
    """``case`` as a block manager leaves a sliding-window layer: every block wholly before
    the window of its row's first query is freed, its table entry set to -1 or an id outside
    the pool (alternately) and its slots filled with ``poison``. Returns how many were freed
    in ``case.freed`` (tests assert the case is adversarial)."""
    tables = case.block_tables.clone()
    used = case.used_slots.clone()
    freed = 0
    bs = case.block_size
    for i, kv_len in enumerate(case.seq_lens.tolist()):
        q_len = 1 if q_lens is None else q_lens[i]
        first_key = max(0, kv_len - q_len - window + 1)
        for b in range(first_key // bs):
            used[int(tables[i, b])] = False
            tables[i, b] = -1 if freed % 2 == 0 else UNUSED_TABLE_ENTRY
            freed += 1
    out = PagedCase(case.key_cache.clone(), case.value_cache.clone(), tables, case.seq_lens, used)
    out.poison_unused(poison)
    out.freed = freed
    return out
