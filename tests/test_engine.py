"""The engine end to end: token-identical to transformers generate, through preemption, with
and without prefix caching, and no block leaks after finishing or aborting."""

import collections
import random

import pytest

from paged_attention_ext.engine import (EngineConfig, LLMEngine, Request, SamplingParams,
                                        generate_reference)
from paged_attention_ext.testing import random_pair, tiny_config
from paged_attention_ext.engine.sequence import GroupStatus

from engine_loop import serve_to_completion

VOCAB = 96
BLOCK = 4


@pytest.fixture(scope="module")
def models():
    return random_pair(tiny_config(vocab_size=VOCAB), seed=0)


@pytest.fixture(scope="module")
def requests(models):
    """Greedy, sampled (n > 1, top-k/top-p) and beam requests; half share a system prompt.

    The end-of-sequence token is one the model emits often, so samples and beams end early.
    """
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(2 * BLOCK + 1)]
    probe = generate_reference(models[1], Request("probe", system, SamplingParams(max_new_tokens=30)))
    eos = (collections.Counter(probe[0]).most_common(1)[0][0],)
    beam_settings = [dict(length_penalty=1.0, early_stopping=False),
                     dict(length_penalty=0.5, early_stopping=True),
                     dict(length_penalty=2.0, early_stopping="never")]
    reqs = []
    for i in range(12):
        prompt = (system if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        if i % 3 == 0:
            params = SamplingParams(max_new_tokens=rng.randint(6, 12), eos_token_ids=eos)
        elif i % 3 == 1:
            params = SamplingParams(max_new_tokens=rng.randint(6, 12), temperature=0.9, top_k=20,
                                    top_p=0.9, n=1 + i % 4, seed=i, eos_token_ids=eos)
        else:
            params = SamplingParams(max_new_tokens=rng.randint(6, 10), num_beams=2 + i % 3,
                                    num_return_sequences=2, eos_token_ids=eos, **beam_settings[i % 3])
        reqs.append(Request(f"r{i}", prompt, params))
    return reqs


@pytest.fixture(scope="module")
def expected(models, requests):
    return {r.request_id: generate_reference(models[1], r) for r in requests}


def serve(model, requests, **config):
    """Run to completion, checking the engine deeply after every step.

    Also returns the requests that were preempted (swapped out, or sent back to wait).
    """
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK, record_block_contents=True, **config))
    for request in requests:
        engine.add_request(request)
    started, preempted = set(), set()

    def note_preempted(engine):
        for request in requests:
            status = engine.status(request.request_id)
            if status is GroupStatus.RUNNING:
                started.add(request.request_id)
            elif status is GroupStatus.SWAPPED or (status is GroupStatus.WAITING
                                                   and request.request_id in started):
                preempted.add(request.request_id)
    outputs = serve_to_completion(engine, after_step=note_preempted)
    return engine, outputs, preempted


def assert_all_blocks_released(engine):
    usage = engine.scheduler.manager.usage()
    assert usage["device_blocks_used"] == 0 and usage["host_blocks_used"] == 0
    assert engine.scheduler.manager.device.num_free_blocks == engine.scheduler.manager.device.num_blocks
    assert not engine.scheduler.manager.tables and not engine.scheduler.manager.groups


def test_matches_transformers_generate(models, requests, expected):
    engine, outputs, _ = serve(models[0], requests, num_device_blocks=256, num_host_blocks=0)
    assert outputs == expected
    report = engine.report()
    assert report["preemptions"] == {"swap": 0, "recompute": 0}
    assert report["sharing_saved_pct"] > 0 and report["prefix_cache_hit_rate"] > 0
    assert 0 < report["kv_utilization"] <= 1
    assert report["kv_blocks_peak"] < report["contiguous_blocks_peak"]
    assert_all_blocks_released(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_gives_identical_tokens(models, requests, expected, mode):
    # 24 blocks hold the largest request alone but not the batch.
    engine, outputs, preempted = serve(models[0], requests, num_device_blocks=24,
                                       num_host_blocks=64, preemption_mode=mode)
    preemptions = engine.report()["preemptions"]
    assert preemptions[mode] > 0 and sum(preemptions.values()) == preemptions[mode]
    kinds = {("beam" if r.params.is_beam_search else "samples" if r.params.n > 1 else "one")
             for r in requests if r.request_id in preempted}
    assert kinds == {"beam", "samples", "one"}
    assert outputs == expected
    assert_all_blocks_released(engine)


def test_swap_without_host_space_recomputes(models, requests, expected):
    engine, outputs, _ = serve(models[0], requests, num_device_blocks=24, num_host_blocks=0,
                               preemption_mode="swap")
    assert engine.report()["preemptions"]["recompute"] > 0
    assert outputs == expected


def test_prefix_caching_does_not_change_output(models, requests, expected):
    on, with_cache, _ = serve(models[0], requests, num_device_blocks=28, enable_prefix_caching=True)
    off, without, _ = serve(models[0], requests, num_device_blocks=28, enable_prefix_caching=False)
    assert with_cache == without == expected
    assert on.report()["prefix_cache_hit_rate"] > 0 == off.report()["prefix_cache_hit_rate"]


def test_abort_releases_blocks_in_every_state(models, requests):
    engine = LLMEngine(models[0], EngineConfig(block_size=BLOCK, num_device_blocks=24,
                                               num_host_blocks=64, record_block_contents=True))
    for request in requests:
        engine.add_request(request)
    aborted = {}  # status -> request aborted in it
    while engine.has_unfinished() and len(aborted) < 3:
        for request in requests:
            status = engine.status(request.request_id)
            if status in (GroupStatus.WAITING, GroupStatus.RUNNING, GroupStatus.SWAPPED) \
                    and status not in aborted:
                engine.abort(request.request_id)
                aborted[status] = request.request_id
                engine.check_invariants(deep=True)
        engine.step()
    assert len(aborted) == 3
    finished = serve_to_completion(engine)
    assert finished.keys().isdisjoint(aborted.values())
    assert_all_blocks_released(engine)


def test_streamed_tokens_add_up_to_outputs(models, requests, expected):
    engine = LLMEngine(models[0], EngineConfig(block_size=BLOCK, num_device_blocks=256))
    streamed = collections.defaultdict(lambda: collections.defaultdict(list))
    finals = {}

    def collect(out):
        for row, tokens in enumerate(out.new_tokens):
            streamed[out.request_id][row] += tokens
        if out.finished:
            finals[out.request_id] = out.outputs

    engine.generate(requests, on_output=collect)
    assert finals == expected
    for request in requests:
        rows = streamed[request.request_id]
        if request.params.is_beam_search:
            assert not any(rows.values())  # beams are only final at the end
        else:
            assert [rows[i] for i in range(request.params.n)] == finals[request.request_id]
    report = engine.report()
    assert report["ttft_s"]["max"] > 0 and report["tokens_per_s"] > 0


def test_request_larger_than_pool_raises(models):
    engine = LLMEngine(models[0], EngineConfig(block_size=BLOCK, num_device_blocks=2))
    engine.add_request(Request("big", list(range(20)), SamplingParams(max_new_tokens=4)))
    with pytest.raises(RuntimeError, match="cannot fit"):
        serve_to_completion(engine, check_deep=False)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_cascade_attention_gives_identical_tokens(models, requests, expected, prefix_caching):
    # Every sharing run takes the cascade split (samples, beams, prompts on cached blocks).
    engine, outputs, _ = serve(models[0], requests, num_device_blocks=256,
                               enable_prefix_caching=prefix_caching, cascade_min_saved_tokens=1)
    assert outputs == expected
    cascade = engine.report()["cascade"]
    assert cascade["steps"] > 0 and cascade["saved_key_reads"] > 0
    # The default threshold leaves these short prompts on the plain path.
    default, _, _ = serve(models[0], requests[:4], num_device_blocks=256)
    assert default.report()["cascade"] == {"steps": 0, "saved_key_reads": 0}
