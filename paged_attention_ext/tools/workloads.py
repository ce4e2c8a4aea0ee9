"""Request traces for the memory simulator: synthetic ShareGPT/Alpaca-like lengths and trace files.

A request is a prompt length and an output length in tokens. The synthetic workloads
draw both from clipped log-normal distributions whose means match the dataset
statistics reported in the vLLM paper (Kwon et al., SOSP 2023, Sec. 6.1 / Fig. 11).
The paper gives means and histograms only, so the spreads (``sigma``) are our choice:
long-tailed, like the histograms. See docs/memory.md.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Union

import numpy as np


class Request(NamedTuple):
    prompt_len: int
    output_len: int


Trace = List[Request]


@dataclass(frozen=True)
class LengthModel:
    """Prompt and output lengths: log-normal with these target means (after clipping) and sigmas."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float


WORKLOADS: Dict[str, LengthModel] = {
    # vLLM paper: ShareGPT input mean 161.31, output mean 337.99 tokens.
    "sharegpt": LengthModel(prompt_mean=161.31, prompt_sigma=1.2, output_mean=337.99, output_sigma=1.0),
    # vLLM paper: Alpaca input mean 19.31, output mean 58.45 tokens.
    "alpaca": LengthModel(prompt_mean=19.31, prompt_sigma=0.6, output_mean=58.45, output_sigma=0.9),
}


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[min(max(X, low), high)] for X = exp(N(mu, sigma^2))."""
    a, b = math.log(low), math.log(high)
    inside = math.exp(mu + sigma ** 2 / 2) * (_normal_cdf((b - mu - sigma ** 2) / sigma)
                                              - _normal_cdf((a - mu - sigma ** 2) / sigma))
    return (low * _normal_cdf((a - mu) / sigma) + inside
            + high * (1.0 - _normal_cdf((b - mu) / sigma)))


def fit_lognormal_mu(mean: float, sigma: float, low: float, high: float) -> float:
    """The mu whose log-normal, clipped to [low, high], has this mean (bisection: it is monotone in mu)."""
    if not low < mean < high:
        raise ValueError(f"mean {mean} must lie strictly inside [{low}, {high}]")
    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_lognormal_mean(mid, sigma, low, high) < mean else (lo, mid)
    return (lo + hi) / 2


def synthetic_trace(workload: str, num_requests: int, seed: int = 0, max_len: int = 2048) -> Trace:
    """`num_requests` requests of a built-in workload; prompt + output never exceeds max_len."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")
    model = WORKLOADS[workload]
    rng = np.random.default_rng(seed)

    def draw(mean: float, sigma: float) -> np.ndarray:
        mu = fit_lognormal_mu(mean, sigma, 1, max_len)
        return np.clip(np.rint(rng.lognormal(mu, sigma, num_requests)), 1, max_len).astype(int)

    prompts = np.minimum(draw(model.prompt_mean, model.prompt_sigma), max_len - 1)
    # Like a server's length limit: the output stops when the sequence reaches max_len.
    outputs = np.minimum(draw(model.output_mean, model.output_sigma), max_len - prompts)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs)]


def save_trace(trace: Trace, path: Union[str, Path]) -> None:
    """JSON lines, one {"prompt_len": int, "output_len": int} per request."""
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps({"prompt_len": r.prompt_len, "output_len": r.output_len}) + "\n")


def load_trace(path: Union[str, Path]) -> Trace:
    trace = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt, output = row.get("prompt_len"), row.get("output_len")
            if not (isinstance(prompt, int) and isinstance(output, int) and prompt >= 1 and output >= 1):
                raise ValueError(f"{path}:{number}: need integer prompt_len >= 1 and output_len >= 1, "
                                 f"got {line.strip()}")
            trace.append(Request(prompt, output))
    if not trace:
        raise ValueError(f"{path}: no requests")
    return trace
