"""Wall-clock timing helpers for CPU benchmarks.

Candidates are timed interleaved: every repetition calls each candidate once, in a
random order per repetition, so machine noise (other tenants, frequency changes)
falls on all of them alike. Each call is timed on its own; the median is the headline
figure and the minimum the best case.
"""

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping

Candidate = Callable[[], object]


@dataclass(frozen=True)
class Timing:
    """Per-call wall times of one candidate, in seconds."""

    median_s: float
    min_s: float
    reps: int

    def summary(self, nbytes: int) -> Dict[str, float]:
        """Times plus the bandwidth ``nbytes`` per call implies, in GB/s (1e9 bytes)."""
        return {
            "median_s": self.median_s,
            "min_s": self.min_s,
            "reps": self.reps,
            "gbps_median": nbytes / self.median_s / 1e9,
            "gbps_best": nbytes / self.min_s / 1e9,
        }


def time_call(fn: Candidate) -> float:
    """Wall time of one call of ``fn`` (CPU ops are synchronous)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_interleaved_samples(candidates: Mapping[str, Candidate], warmup: int,
                             reps: int) -> Dict[str, List[float]]:
    """Warm every candidate up, then time ``reps`` round-robin repetitions of all of them.

    Returns every candidate's per-call times in repetition order, so ``samples[a][r]`` and
    ``samples[b][r]`` were taken within one round (for paired ratios).
    """
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    samples: Dict[str, List[float]] = {name: [] for name in names}
    # A fresh random order every round. A rotated order would always run the same
    # candidate right after a given one (e.g. after the 1 GiB read that flushes the caches).
    order = random.Random(0)
    for _ in range(reps):
        round_names = list(names)
        order.shuffle(round_names)
        for name in round_names:
            samples[name].append(time_call(candidates[name]))
    return samples


def summarize(samples: List[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), len(samples))


def time_interleaved(candidates: Mapping[str, Candidate], warmup: int, reps: int) -> Dict[str, Timing]:
    """Warm every candidate up, then time ``reps`` round-robin repetitions of all of them."""
    samples = time_interleaved_samples(candidates, warmup, reps)
    return {name: summarize(s) for name, s in samples.items()}
