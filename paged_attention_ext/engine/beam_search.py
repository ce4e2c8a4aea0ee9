"""Beam search for one request, step by step, as transformers 5.18's ``generate`` does it.

``_beam_search`` in transformers keeps static tensors per batch; this class keeps the
same tensors for a batch of one and applies the same operations in the same order
(top-k over all beams' continuations, ``-1e9`` masks, length penalty, early-stopping
heuristic), so the engine returns the same beams, ties included. The engine owns the
sequences: each step returns which running beam each new beam continues and with
which token, and the engine forks/frees block tables to match.

``step`` never changes a tensor or list in place, only rebinds attributes, so a shallow
copy (``copy.copy``) can take a step while the original stays as it was: the engine
adopts the copy only when its whole step succeeded.
"""

from typing import List, Sequence, Tuple

import torch

from .params import SamplingParams

_MASK = -1.0e9  # transformers' score for "not a candidate"


class BeamSearch:
    def __init__(self, prompt_len: int, params: SamplingParams) -> None:
        beams = params.num_beams
        self.params = params
        self.prompt_len = prompt_len
        self.cur_len = prompt_len
        self.max_length = prompt_len + params.max_new_tokens
        self.eos = torch.tensor(params.eos_token_ids, dtype=torch.int64)
        # Keep enough candidates that num_beams survive even if the best ones end in EOS.
        self.beams_to_keep = max(2, 1 + len(params.eos_token_ids)) * beams
        self.top_num_beam_mask = torch.arange(self.beams_to_keep) < beams
        # Only the first beam is live at the start, so the first step does not pick
        # the same token from identical beams.
        self.running_scores = torch.zeros((1, beams))
        self.running_scores[:, 1:] = _MASK
        self.finished_scores = torch.full((1, beams), _MASK)
        self.is_finished = torch.zeros((1, beams), dtype=torch.bool)
        self.finished_tokens: List[List[int]] = [[] for _ in range(beams)]
        self.improvable = torch.ones((1, 1), dtype=torch.bool)
        self.done = False

    def step(self, logits: torch.Tensor, running: Sequence[Sequence[int]]) -> List[Tuple[int, int]]:
        """Advance by one token.

        Args:
            logits: fp32 ``[rows, vocab]``, the last-position logits of each running beam
                (one row on the first step: the prompt's).
            running: the generated tokens of each running beam, in row order.

        Returns:
            The new running beams in order, as ``(row of the beam it continues, token)``.
            After the last step (``done``) ``results()`` holds the output.
        """
        beams, rows, vocab = self.params.num_beams, logits.shape[0], logits.shape[1]
        log_probs = torch.log_softmax(logits.expand(beams, vocab), dim=-1)
        scores = (log_probs[None] + self.running_scores[:, :, None]).reshape(1, -1)
        topk_log_probs, topk_indices = torch.topk(scores, k=self.beams_to_keep)
        parents = (topk_indices // vocab)[0].tolist()
        tokens = topk_indices % vocab
        candidates = [list(running[p if rows > 1 else 0]) + [t]
                      for p, t in zip(parents, tokens[0].tolist())]
        hits = torch.isin(tokens, self.eos) | (self.cur_len + 1 >= self.max_length)

        # Next running beams: the best candidates that did not just finish.
        running_log_probs = topk_log_probs + hits.to(torch.float32) * _MASK
        keep = torch.topk(running_log_probs, k=beams)[1]
        self.running_scores = torch.gather(running_log_probs, 1, keep)

        self._update_finished(topk_log_probs, hits, candidates)
        self.cur_len += 1
        self._update_improvable()
        self.done = not (bool(self.improvable.any())
                         and not (bool(self.is_finished.all()) and self.params.early_stopping is True)
                         and not bool(hits.all()))
        return [(parents[c] if rows > 1 else 0, candidates[c][-1]) for c in keep[0].tolist()]

    def results(self) -> List[List[int]]:
        """Generated tokens of the best finished beams, best first (EOS included)."""
        return [list(t) for t in self.finished_tokens[:self.params.beams_returned]]

    def _update_finished(self, topk_log_probs: torch.Tensor, hits: torch.Tensor,
                         candidates: List[List[int]]) -> None:
        # Only the top num_beams candidates may finish; the rest are spares.
        just_finished = hits & self.top_num_beam_mask[None, :]
        scores = topk_log_probs / ((self.cur_len + 1 - self.prompt_len) ** self.params.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.params.early_stopping is True)
        scores += full.to(torch.float32) * _MASK
        scores += (~self.improvable).to(torch.float32) * _MASK
        scores += (~just_finished) * _MASK
        merged_scores = torch.cat((self.finished_scores, scores), dim=1)
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        merged_tokens = self.finished_tokens + candidates
        best = torch.topk(merged_scores, k=self.params.num_beams)[1]
        self.finished_scores = torch.gather(merged_scores, 1, best)
        self.is_finished = torch.gather(merged_finished, 1, best)
        self.finished_tokens = [merged_tokens[i] for i in best[0].tolist()]

    def _update_improvable(self) -> None:
        """Whether a running beam may still beat the worst finished one (transformers' heuristic)."""
        penalty = self.params.length_penalty
        if self.params.early_stopping == "never" and penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = self.cur_len - self.prompt_len
        best_running = self.running_scores[:, :1] / (best_length ** penalty)
        worst_finished = torch.where(self.is_finished,
                                     torch.min(self.finished_scores, dim=1, keepdim=True)[0], _MASK)
        self.improvable = self.improvable & torch.any(best_running > worst_finished, dim=-1,
                                                      keepdim=True)
