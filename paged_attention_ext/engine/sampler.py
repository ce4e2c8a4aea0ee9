"""Next-token choice for greedy and sampled requests, matching transformers' ``generate``.

transformers applies its logits warpers in a fixed order (temperature, top-k, top-p),
takes a softmax and draws all rows of a request with one ``torch.multinomial`` call.
Doing the same with the same row count and a generator seeded like
``torch.manual_seed(seed)`` reproduces its samples: the CPU multinomial draws
``rows x vocab`` exponentials per call whatever the probabilities, so finished rows are
kept as placeholders to keep the random stream aligned.
"""

from typing import Dict, List, Sequence, Tuple

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


def _rows(logits: torch.Tensor, live: List[bool]) -> torch.Tensor:
    """One row of logits per row of the request (see :func:`next_tokens`)."""
    if logits.shape[0] == 1:
        return logits.expand(len(live), -1)
    # Finished rows get a uniform placeholder distribution.
    full = logits.new_zeros(len(live), logits.shape[1])
    full[torch.tensor(live)] = logits
    return full


def next_tokens(logits: torch.Tensor, live: List[bool], params: SamplingParams,
                generator: "torch.Generator | None") -> List[int]:
    """One token per row of the request, in row order.

    Args:
        logits: fp32 ``[num_live, vocab]``, the rows marked in ``live`` in order; or a
            single row (the prompt's, on the first step) that stands for every row.
        live: one flag per row; a finished sample's token is drawn (to keep the random
            stream aligned) and ignored.
    """
    return sample_many([(logits, live, params, generator)])[0]


def sample_many(requests: Sequence[Tuple[torch.Tensor, List[bool], SamplingParams,
                                         "torch.Generator | None"]]) -> List[List[int]]:
    """:func:`next_tokens` for several requests at once (its arguments per request).

    Greedy rows take one argmax for all; sampled rows with the same temperature, top-k
    and top-p are warped and softmaxed together (each op is row by row, so a row's
    probabilities are the bits it gets alone); each request then draws from its own
    rows with its own generator.
    """
    full = [_rows(logits, live) for logits, live, _, _ in requests]
    out: List[List[int]] = [[] for _ in requests]
    batches: Dict[object, List[int]] = {}
    for i, (_, _, params, _) in enumerate(requests):
        key = (params.temperature, params.top_k, params.top_p) if params.do_sample else "greedy"
        batches.setdefault(key, []).append(i)
    for key, members in batches.items():
        rows = torch.cat([full[i] for i in members]) if len(members) > 1 else full[members[0]]
        sizes = [full[i].shape[0] for i in members]
        if key == "greedy":
            tokens = rows.argmax(dim=-1).tolist()
            for i, part in zip(members, _split(tokens, sizes)):
                out[i] = part
            continue
        probs = torch.softmax(warp(rows, requests[members[0]][2]), dim=-1)
        for i, part in zip(members, probs.split(sizes)):
            out[i] = torch.multinomial(part, num_samples=1,
                                       generator=requests[i][3]).squeeze(1).tolist()
    return out


def _split(values: List[int], sizes: List[int]) -> List[List[int]]:
    parts, start = [], 0
    for size in sizes:
        parts.append(values[start:start + size])
        start += size
    return parts
