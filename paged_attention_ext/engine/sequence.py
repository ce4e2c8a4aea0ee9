"""A request's sequences and its state inside the engine."""

import enum
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .beam_search import BeamSearch
from .params import Request


@dataclass
class Sequence:
    seq_id: int
    token_ids: List[int]        # prompt + generated; the last one may still lack KV
    prompt_len: int
    num_computed: int = 0       # leading tokens whose K/V is in the cache
    finished: bool = False      # a sample that hit EOS or its length limit
    block_hashes: List[bytes] = field(default_factory=list)  # names of token_ids' full blocks

    @property
    def output_ids(self) -> List[int]:
        return self.token_ids[self.prompt_len:]


class GroupStatus(enum.Enum):
    WAITING = "waiting"      # not admitted, or preempted for recomputation
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted to the host pool
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class SequenceGroup:
    """All sequences of one request; admitted, preempted and resumed as a whole.

    ``seqs`` is ordered: sample rows for the sampler, running beams for beam search,
    so both see the rows in the order transformers' ``generate`` keeps them.
    """

    group_id: int
    request: Request
    seqs: List[Sequence]
    arrival: int                                 # arrival order: earlier is served first
    status: GroupStatus = GroupStatus.WAITING
    generator: Optional[torch.Generator] = None  # the request's own sampling RNG
    beam: Optional[BeamSearch] = None
    results: List[List[int]] = field(default_factory=list)  # final outputs

    @property
    def live_seqs(self) -> List[Sequence]:
        return [s for s in self.seqs if not s.finished]
