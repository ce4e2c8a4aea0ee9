"""What a request asks for: its prompt and how to decode it."""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..kv_cache import check_int


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings, named and defaulted like transformers' ``generate``.

    ``temperature == 0`` is greedy decoding; ``num_beams > 1`` is beam search (greedy
    beams, as ``generate(num_beams=..., do_sample=False)``); otherwise multinomial
    sampling after temperature, top-k and top-p, ``n`` samples from one seed.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1.0: off
    seed: int = 0
    n: int = 1              # parallel samples (sampling only)
    num_beams: int = 1
    num_return_sequences: Optional[int] = None  # beams returned; default num_beams
    length_penalty: float = 1.0
    early_stopping: "bool | str" = False
    eos_token_ids: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Every bad setting raises ValueError, a value that is no int too.
        for name, minimum in (("max_new_tokens", 1), ("top_k", 0), ("seed", None), ("n", 1),
                              ("num_beams", 1)):
            check_int(name, getattr(self, name), minimum, type_error=ValueError)
        check_int("num_return_sequences", self.num_return_sequences, 1, optional=True,
                  type_error=ValueError)
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not isinstance(self.eos_token_ids, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a tuple of token ids >= 0, got {self.eos_token_ids!r}")
        if self.n > 1 and not self.do_sample:
            raise ValueError("n > 1 needs sampling (temperature > 0); greedy samples are identical")
        if self.num_beams > 1 and (self.do_sample or self.n > 1):
            raise ValueError("beam search is greedy and returns num_return_sequences, not n")
        if not self.beams_returned <= self.num_beams:
            raise ValueError(f"num_return_sequences must be in [1, num_beams={self.num_beams}], "
                             f"got {self.num_return_sequences}")

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    @property
    def is_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def beams_returned(self) -> int:
        return self.num_return_sequences or self.num_beams

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs once its first token is chosen."""
        return self.num_beams if self.is_beam_search else self.n


@dataclass
class Request:
    request_id: str
    prompt: List[int]
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: empty prompt")
        for position, token in enumerate(self.prompt):
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"request {self.request_id}: prompt[{position}] = {token!r} "
                                 "is not a token id (an integer >= 0)")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
