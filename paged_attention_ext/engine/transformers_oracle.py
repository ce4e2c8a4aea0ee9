"""The same requests through transformers' own ``generate``: the engine's oracle."""

from typing import List

import torch

from .params import Request


def generate_reference(model: torch.nn.Module, request: Request) -> List[List[int]]:
    """Generated tokens per returned sequence, EOS included, as the engine reports them.

    ``model`` is a twin of the engine's model with a stock attention implementation
    (e.g. sdpa). Sampled requests reseed the global RNG with the request's seed, which
    is what the engine's per-request generator reproduces.
    """
    p = request.params
    eos = list(p.eos_token_ids)
    kwargs = dict(max_new_tokens=p.max_new_tokens, num_beams=p.num_beams,
                  do_sample=p.do_sample, eos_token_id=eos or None,
                  pad_token_id=eos[0] if eos else 0, return_dict_in_generate=True,
                  num_return_sequences=p.beams_returned if p.is_beam_search else p.n)
    if p.do_sample:
        kwargs.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        torch.manual_seed(p.seed)
    if p.is_beam_search:
        kwargs.update(length_penalty=p.length_penalty, early_stopping=p.early_stopping)
    prompt = torch.tensor([request.prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    rows = out.sequences[:, prompt.shape[1]:].tolist()
    if p.is_beam_search:
        # Shorter beams are padded; beam_indices marks the real tokens.
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        return [row[:n] for row, n in zip(rows, lengths)]
    return [_cut_after_eos(row, eos) for row in rows]


def _cut_after_eos(tokens: List[int], eos: List[int]) -> List[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1]
    return tokens
