"""Engine parts on their own: sampling parameters, the sampler against transformers' warpers,
and the scheduler's choice of victims."""

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.testing import random_pair, tiny_config
from paged_attention_ext.engine.sampler import next_tokens, sample_many, warp
from paged_attention_ext.engine.sequence import GroupStatus


@pytest.mark.parametrize("bad,field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"), (dict(seed=1.0), "seed"), (dict(n=0), "n"),
    (dict(n=2), "n > 1"), (dict(num_beams=0), "num_beams"),
    (dict(num_beams=2, temperature=1.0), "beam search"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
    (dict(num_beams=2, num_return_sequences=0), "num_return_sequences"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(num_beams=2, early_stopping="soon"), "early_stopping"),
    (dict(eos_token_ids=(-1,)), "eos_token_ids"), (dict(eos_token_ids=2), "eos_token_ids")])
def test_invalid_sampling_params_raise_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field.replace(">", ".")):
        SamplingParams(**bad)


@pytest.mark.parametrize("prompt", [[], [1, -2], [1, 2.0], [True]])
def test_invalid_prompts_raise_naming_the_request(prompt):
    with pytest.raises(ValueError, match="request r7"):
        Request("r7", prompt)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 20, 0.9), (1.0, 200, 0.5)])
def test_warp_matches_transformers_warpers(temperature, top_k, top_p):
    scores = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(warp(scores, params), processors(None, scores))


def test_requests_sampled_together_equal_each_alone():
    g = torch.Generator().manual_seed(3)
    hot = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, n=3)
    cases = [(torch.randn(1, 500, generator=g), [True] * 3, hot, 5),        # first token
             (torch.randn(2, 500, generator=g), [True, False, True], hot, 6),
             (torch.randn(1, 500, generator=g), [True], SamplingParams(), None),
             (torch.randn(1, 500, generator=g), [True], SamplingParams(temperature=1.3), 7),
             (torch.randn(1, 500, generator=g), [True], SamplingParams(), None)]

    def generator(seed):
        return None if seed is None else torch.Generator().manual_seed(seed)

    alone = [next_tokens(logits, live, params, generator(seed)) for logits, live, params, seed in cases]
    together = sample_many([(logits, live, params, generator(seed))
                            for logits, live, params, seed in cases])
    assert together == alone


def test_finished_rows_keep_the_random_stream_aligned():
    params = SamplingParams(temperature=1.0, n=4)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    all_rows = next_tokens(logits, [True] * 4, params, torch.Generator().manual_seed(7))
    some_rows = next_tokens(logits[[0, 2]], [True, False, True, False], params,
                            torch.Generator().manual_seed(7))
    assert [some_rows[0], some_rows[2]] == [all_rows[0], all_rows[2]]


def test_latest_arrived_group_is_preempted_first():
    paged, _ = random_pair(tiny_config(vocab_size=64), seed=0)
    engine = LLMEngine(paged, EngineConfig(block_size=4, num_device_blocks=9, num_host_blocks=32))
    for i in range(3):
        engine.add_request(Request(f"r{i}", [i + 1] * 7, SamplingParams(max_new_tokens=12)))
    while engine.has_unfinished():
        engine.step()
        swapped = [f"r{i}" for i in range(3) if engine.status(f"r{i}") is GroupStatus.SWAPPED]
        if swapped:
            assert swapped == ["r2"]
            assert engine.status("r0") is engine.status("r1") is GroupStatus.RUNNING
            return
    pytest.fail("the pool was meant to force a preemption")
