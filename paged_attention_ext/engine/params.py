"""What a request asks for: its prompt and how to decode it."""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


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
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
        if self.n < 1 or self.num_beams < 1:
            raise ValueError("n and num_beams must be >= 1")
        if self.n > 1 and not self.do_sample:
            raise ValueError("n > 1 needs sampling (temperature > 0); greedy samples are identical")
        if self.num_beams > 1 and (self.do_sample or self.n > 1):
            raise ValueError("beam search is greedy and returns num_return_sequences, not n")
        if not 1 <= self.beams_returned <= self.num_beams:
            raise ValueError("num_return_sequences must be in [1, num_beams]")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError("early_stopping is True, False or 'never'")

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
