"""The machine's side: the K/V pools (huge-page and plain), the references every candidate
is timed with (the 1 GiB read sum; the copy's buffers), thread and ISA switches, and the
statistics that turn samples into rates and into % of a reference."""

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

import paged_attention_ext as pa
from paged_attention_ext.host_memory import zeros_huge_pages

from common.timing import Candidate, summarize

from .config import COPY_BYTES, DTYPES, MIB, PLAIN_POOL_BYTES, POOL_BYTES, READ_BYTES

# --- memory ---------------------------------------------------------------------------------


class Pool:
    """One allocation of ``nbytes``, viewed as caches of any dtype and shape."""

    def __init__(self, nbytes: int, huge: bool):
        self.nbytes = nbytes
        self.huge = huge
        self.raw = zeros_huge_pages((nbytes,), torch.uint8) if huge else torch.zeros(nbytes, dtype=torch.uint8)

    def tensor(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        count = math.prod(shape)
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"{tuple(shape)} {dtype} does not fit a {self.nbytes >> 20} MiB pool")
        return self.raw.view(dtype)[:count].view(tuple(shape))

    def fill(self, pattern: torch.Tensor) -> None:
        """Tile ``pattern`` (1-D, the dtype to store) over the whole pool."""
        flat = self.raw.view(pattern.dtype)
        period = pattern.numel()
        whole = flat.numel() // period
        flat[: whole * period].view(whole, period).copy_(pattern.expand(whole, period))
        flat[whole * period:].copy_(pattern[: flat.numel() - whole * period])


def random_pattern(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((1 << 20) + 3, generator=gen).to(dtype)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold ``tensor`` (from /proc/self/smaps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return -1
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@dataclass
class Memory:
    key: Pool
    value: Pool
    plain_key: Pool
    plain_value: Pool
    read: torch.Tensor  # fp32, READ_BYTES, huge pages
    read_plain: torch.Tensor  # fp32, READ_BYTES, plain torch.ones (4 KiB pages)
    copy_src: torch.Tensor  # fp32, COPY_BYTES, huge pages
    copy_dst: torch.Tensor
    filled: Optional[str] = None

    def fill(self, dtype_name: str, plain: bool = False) -> None:
        """Random values of ``dtype_name`` in the K/V pools (and the plain ones, same values)."""
        if self.filled == (dtype_name, plain) or self.filled == (dtype_name, True):
            return
        dtype = DTYPES[dtype_name]
        k, v = random_pattern(dtype, 1), random_pattern(dtype, 2)
        pools = [(self.key, k), (self.value, v)]
        if plain:
            pools += [(self.plain_key, k), (self.plain_value, v)]
        for pool, pattern in pools:
            pool.fill(pattern)
        self.filled = (dtype_name, plain)


def allocate() -> Memory:
    mem = Memory(Pool(POOL_BYTES, True), Pool(POOL_BYTES, True), Pool(PLAIN_POOL_BYTES, False),
                 Pool(PLAIN_POOL_BYTES, False), zeros_huge_pages((READ_BYTES // 4,), torch.float32),
                 torch.ones(READ_BYTES // 4),
                 zeros_huge_pages((COPY_BYTES // 4,), torch.float32),
                 zeros_huge_pages((COPY_BYTES // 4,), torch.float32))
    mem.read.fill_(1.0)
    mem.copy_src.copy_(random_pattern(torch.float32, 3).repeat(COPY_BYTES // 4 // ((1 << 20) + 3) + 1)[: COPY_BYTES // 4])
    return mem


def memory_info(mem: Memory) -> Dict[str, object]:
    def mib(t: torch.Tensor) -> float:
        return round(huge_page_bytes(t) / MIB, 1)
    return {
        "thp_enabled": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
        "huge_page_mib": {"key_pool": mib(mem.key.raw), "value_pool": mib(mem.value.raw),
                          "plain_key_pool": mib(mem.plain_key.raw),
                          "plain_value_pool": mib(mem.plain_value.raw), "read": mib(mem.read),
                          "read_plain": mib(mem.read_plain),
                          "copy_src": mib(mem.copy_src), "copy_dst": mib(mem.copy_dst)},
    }


# --- statistics -----------------------------------------------------------------------------


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def rate_summary(samples: List[float], amount: float) -> Dict[str, float]:
    """Times and ``amount`` per second (GB/s for bytes, GFLOP/s for FLOPs) of one candidate."""
    t = summarize(samples)
    return {"median_s": t.median_s, "min_s": t.min_s, "reps": t.reps,
            "rate_median": amount / t.median_s / 1e9, "rate_best": amount / t.min_s / 1e9}


def ratios(samples: List[float], amount: float, ref_samples: List[float],
           ref_amount: float) -> Dict[str, float]:
    """Candidate rate as % of the reference rate: paired per round, median/median, median/best."""
    per_round = [(amount / a) / (ref_amount / b) for a, b in zip(samples, ref_samples)]
    med, ref_med, ref_best = (statistics.median(samples), statistics.median(ref_samples),
                              min(ref_samples))
    return {"pct_paired": 100 * statistics.median(per_round),
            "pct_median": 100 * (amount / med) / (ref_amount / ref_med),
            "pct_best": 100 * (amount / med) / (ref_amount / ref_best)}


REGIME_GBPS = 60.0  # read bandwidth that splits the host's slow and fast states


def regimes(samples: List[float], amount: int, read_samples: List[float]) -> Dict[str, object]:
    """The candidate's GB/s and paired % in rounds whose read was below / above REGIME_GBPS."""
    out: Dict[str, object] = {}
    for name, keep in (("read_below", lambda g: g < REGIME_GBPS),
                       ("read_above", lambda g: g >= REGIME_GBPS)):
        rounds = [(a, b) for a, b in zip(samples, read_samples) if keep(gbps(READ_BYTES, b))]
        if rounds:
            out[name] = {"rounds": len(rounds),
                         "read_gbps_median": statistics.median(gbps(READ_BYTES, b) for _, b in rounds),
                         "rate_median": statistics.median(gbps(amount, a) for a, _ in rounds),
                         "pct_paired": 100 * statistics.median(
                             (amount / a) / (READ_BYTES / b) for a, b in rounds)}
        else:
            out[name] = {"rounds": 0}
    return {"threshold_gbps": REGIME_GBPS, **out}


def load() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def read_candidate(mem: Memory) -> Candidate:
    return mem.read.sum


def lower_isa() -> Optional[str]:
    """The kernel without bf16 dot products, when the best one has them (bf16 rows only)."""
    return "avx512" if pa.cpu_isa() in ("avx512_bf16", "amx") else None


def with_isa(isa: str, fn: Candidate) -> Candidate:
    """``fn`` with the kernel switched to ``isa`` for the call, then back to the default."""
    def call():
        pa.select_cpu_isa(isa)
        try:
            return fn()
        finally:
            pa.select_cpu_isa()
    return call


def with_threads(threads: int, fn: Candidate) -> Candidate:
    def call():
        torch.set_num_threads(threads)
        return fn()
    return call
