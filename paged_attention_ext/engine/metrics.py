"""What the engine reports: speed, latency, KV memory, sharing, preemptions, prefix hits."""

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..block_table import blocks_needed
from .scheduler import PREEMPTION_MODES, Scheduler


USAGE_EVERY = 8  # steps between samples of the block tables' sharing and fill


@dataclass
class _RequestTimes:
    arrival: float
    token_times: List[float] = field(default_factory=list)  # one per step that produced tokens


class EngineMetrics:
    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.start: Optional[float] = None
        self.end: Optional[float] = None  # the last token or finish
        self.requests: Dict[str, _RequestTimes] = {}
        self.generated_tokens = 0
        self.steps = 0
        self.preemptions = {m: 0 for m in PREEMPTION_MODES}
        self.blocks_used: List[int] = []
        self.contiguous_blocks: List[int] = []
        self.filled_fraction: List[float] = []
        self.block_references = 0
        self.blocks_saved = 0

    # ---- events ---------------------------------------------------------------------
    def on_arrival(self, request_id: str) -> None:
        now = self.clock()
        self.start = now if self.start is None else self.start
        self.requests[request_id] = _RequestTimes(arrival=now)

    def on_tokens(self, request_id: str, count: int) -> None:
        """`count` sequences of the request got a token this step (samples, beams)."""
        self.generated_tokens += count
        self.end = self.clock()
        self.requests[request_id].token_times.append(self.end)

    def on_finish(self) -> None:
        """A request finished or was aborted."""
        self.end = self.clock()

    def on_preempt(self, preempted: Dict[str, int]) -> None:
        for mode, count in preempted.items():
            self.preemptions[mode] += count

    def on_step(self, scheduler: Scheduler) -> None:
        """A step ran: sample the pool (read through the scheduler) as its forward saw it.

        Blocks in use are counted every step (the peak is exact); the sharing and fill
        statistics walk every block table, so they are sampled every USAGE_EVERY steps
        (the first included), keeping that walk out of most steps.
        """
        manager = scheduler.manager
        self.steps += 1
        self.blocks_used.append(manager.num_used_device_blocks)
        if self.steps % USAGE_EVERY == 1 % USAGE_EVERY:
            usage = manager.usage()
            self.block_references += int(usage["block_references"])
            self.blocks_saved += int(usage["sharing_saved_blocks"])
            if usage["device_slots_in_use"]:
                self.filled_fraction.append(usage["device_slots_filled"] / usage["device_slots_in_use"])
        # A contiguous cache reserves max length for every sequence up front.
        bs = manager.block_size
        self.contiguous_blocks.append(sum(
            g.request.params.num_seqs
            * blocks_needed(len(g.request.prompt) + g.request.params.max_new_tokens, bs)
            for g in scheduler.running))

    # ---- report ---------------------------------------------------------------------
    def report(self, scheduler: Scheduler) -> Dict:
        elapsed = max((self.end or 0.0) - (self.start or 0.0), 1e-9)
        ttft = [r.token_times[0] - r.arrival for r in self.requests.values() if r.token_times]
        # Per-token latency: the gaps between a request's steps after its first token.
        gaps = [b - a for r in self.requests.values() for a, b in zip(r.token_times, r.token_times[1:])]
        peak = max(self.blocks_used, default=0)
        usage = scheduler.manager.usage()
        return {
            "requests": len(self.requests),
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": elapsed,
            "tokens_per_s": self.generated_tokens / elapsed,
            "ttft_s": _summary(ttft),
            "per_token_latency_s": _summary(gaps),
            "kv_blocks_total": usage["device_blocks_total"],
            "kv_blocks_peak": peak,
            "kv_blocks_mean": statistics.fmean(self.blocks_used) if self.blocks_used else 0.0,
            "contiguous_blocks_peak": max(self.contiguous_blocks, default=0),
            "contiguous_blocks_mean": (statistics.fmean(self.contiguous_blocks)
                                       if self.contiguous_blocks else 0.0),
            "kv_utilization": statistics.fmean(self.filled_fraction) if self.filled_fraction else 0.0,
            "sharing_saved_pct": (100.0 * self.blocks_saved / self.block_references
                                  if self.block_references else 0.0),
            "preemptions": dict(self.preemptions),
            "prefix_cache_hit_rate": usage["prefix_cache_hit_rate"],
        }


def _summary(values: List[float]) -> Dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "max": 0.0}
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "max": max(values)}
