"""Next-token choice for greedy and sampled requests, matching transformers' ``generate``.

transformers applies its logits warpers in a fixed order (temperature, top-k, top-p),
takes a softmax and draws all rows of a request with one ``torch.multinomial`` call.
Doing the same with the same row count and a generator seeded like
``torch.manual_seed(seed)`` reproduces its samples: the CPU multinomial draws
``rows x vocab`` exponentials per call whatever the probabilities, so finished rows are
kept as placeholders to keep the random stream aligned.
"""

from typing import List

import torch

from .params import SamplingParams


def warp(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p, as TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper."""
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k != 0:
        k = min(params.top_k, scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - params.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores


def next_tokens(logits: torch.Tensor, live: List[bool], params: SamplingParams,
                generator: "torch.Generator | None") -> List[int]:
    """One token per row of the request, in row order.

    Args:
        logits: fp32 ``[num_live, vocab]``, the rows marked in ``live`` in order; or a
            single row (the prompt's, on the first step) that stands for every row.
        live: one flag per row; a finished sample's token is drawn (to keep the random
            stream aligned) and ignored.
    """
    rows = len(live)
    if logits.shape[0] == 1:
        full = logits.expand(rows, -1)
    else:
        # Finished rows get a uniform placeholder distribution.
        full = logits.new_zeros(rows, logits.shape[1])
        full[torch.tensor(live)] = logits
    if not params.do_sample:
        return torch.argmax(full, dim=-1).tolist()
    probs = torch.softmax(warp(full, params), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1).tolist()
