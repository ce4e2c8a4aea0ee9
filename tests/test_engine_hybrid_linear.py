"""The engine on hybrid models with linear-attention layers (gated DeltaNet, KDA).

Qwen3-Next-, Qwen3.5-, Qwen3.5-MoE-, OLMo-hybrid- and Kimi-Linear-shaped tiny random fp32
models (the configs of tests/test_hf_hybrid_linear.py): the full layers' K/V in paged
blocks, each sequence's linear-layer states in its state slot. The engine's tokens equal
eager ``generate`` (greedy, sampled n=3, beam search) with prefix caching on, in a roomy pool
and in small pools that force swap and recompute preemption; forks copy states, not blocks;
state slots bound admission; a failed step leaves every state as it was; and the engine's
real scheduler admits as many 8k-token Qwen3-Next-80B requests as the bytes allow.
"""

import copy
from unittest import mock

import pytest
import torch

from paged_attention_ext.engine import (EngineConfig, LLMEngine, Request, SamplingParams,
                                        generate_reference)
from paged_attention_ext.engine import engine as engine_module
from paged_attention_ext.engine.scheduler import Scheduler
from paged_attention_ext.engine.sequence import Sequence, SequenceGroup
from paged_attention_ext.hf import PagedCache
from paged_attention_ext.kv_groups import KVGroupLayout
from paged_attention_ext.state_slots import COPY
from paged_attention_ext.testing import random_pair, tiny_config
from paged_attention_ext.tools.memory import GIB, PRESETS, kv_report

from engine_loop import serve_to_completion
from test_hf_hybrid_linear import MODELS

pytestmark = pytest.mark.usefixtures("one_thread")

REQUESTS = [
    Request("greedy", [5, 17, 99, 3, 41, 8, 60], SamplingParams(max_new_tokens=10)),
    # The same first block as "greedy": a prefix hit for a model without linear layers.
    Request("greedy-shared", [5, 17, 99, 3, 41, 8, 60, 9, 9, 1, 2], SamplingParams(max_new_tokens=10)),
    Request("sampled", [7, 7, 12, 90, 33], SamplingParams(max_new_tokens=8, temperature=0.8,
                                                          top_k=30, n=3, seed=3)),
    Request("beam", [2, 64, 31, 18, 5, 77, 9, 100, 4], SamplingParams(max_new_tokens=6, num_beams=3,
                                                                      num_return_sequences=2)),
]
# (preemption mode, device blocks of 4 tokens): roomy, then small enough that the later
# groups are preempted (the sampled and beam groups, several sequences each).
POOLS = {"roomy": ("swap", 64), "swap": ("swap", 9), "recompute": ("recompute", 9)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    """(name, paged model, eager twin)."""
    try:
        config = MODELS[request.param]()
    except AttributeError as missing:  # a family this transformers release does not have
        pytest.skip(f"{request.param}: {missing}")
    paged, reference = random_pair(config, reference_attention="eager")
    return request.param, paged, reference


@pytest.fixture(scope="module")
def expected(pair):
    _, _, reference = pair
    return {r.request_id: generate_reference(reference, r) for r in REQUESTS}


def engine_for(paged, **overrides) -> LLMEngine:
    config = dict(block_size=4, num_device_blocks=64, num_host_blocks=64, num_state_slots=8,
                  record_block_contents=True)
    return LLMEngine(paged, EngineConfig(**{**config, **overrides}))


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_engine_equals_eager(pair, expected, pool):
    name, paged, _ = pair
    mode, blocks = POOLS[pool]
    engine = engine_for(paged, preemption_mode=mode, num_device_blocks=blocks)
    got = engine.generate(copy.deepcopy(REQUESTS))
    assert got == expected, name
    engine.check_invariants(deep=True)
    report = engine.report()
    assert report["preemptions"][mode] == (0 if pool == "roomy" else 2)
    # Prefix caching is on, but no hit reuses K/V blocks the linear layers would not recompute.
    assert report["prefix_cache_hit_rate"] == 0
    assert engine.scheduler.manager.states.num_used == 0


def test_pools_hold_the_full_layers_kv_and_one_state_per_linear_layer(pair):
    _, paged, _ = pair
    engine = engine_for(paged)
    linear = engine.runner.spec.linear_layers
    layout = engine.kv_cache.kv_groups
    assert linear and layout.without_kv == linear
    assert sorted(layer for group in layout.groups for layer in group.layers) == [
        layer for layer in range(layout.num_layers) if layer not in linear]
    assert {key[0] for key in engine.states.device} == set(linear)
    assert {key[1] for key in engine.states.device} == {"conv", "recurrent"}
    assert all(t.shape[0] == 8 for t in engine.states.device.values())
    assert all(t.shape[0] == 8 for t in engine.states.host.values())


def test_fork_of_eight_samples_copies_each_state_once_and_no_prompt_block():
    paged, reference = random_pair(MODELS["qwen3_next"](), reference_attention="eager")
    engine = engine_for(paged, num_state_slots=8)
    request = Request("n8", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=4, temperature=1.0,
                                                                     n=8, seed=7))
    moves, copies = [], []
    apply_moves, apply_copies = engine.states.apply, engine.kv_cache.apply_copies
    with mock.patch.object(engine.states, "apply", lambda m: (moves.append(list(m)), apply_moves(m))), \
            mock.patch.object(engine.kv_cache, "apply_copies",
                              lambda c: (copies.extend(c), apply_copies(c))):
        got = engine.generate([copy.deepcopy(request)])
    assert got["n8"] == generate_reference(reference, request)
    forks = [m for step in moves for m in step if m.kind == COPY]
    assert len(forks) == 7 and len({m.target for m in forks}) == 7  # one per new sample
    assert len({m.source for m in forks}) == 1                       # all from the prompt's state
    assert copies == []  # the prompt's two full blocks are shared, never copied


def test_state_slots_bound_the_running_sequences_forks_included():
    """Three slots: a group of n=3 samples holds all three once it forks, so the next one
    waits (it is not admitted only to fail at its fork); both equal eager."""
    paged, reference = random_pair(MODELS["qwen3_next"](), reference_attention="eager")
    engine = engine_for(paged, num_state_slots=3, num_host_state_slots=0)
    requests = [Request(f"s{i}", [7, 7, 12, 90, 33 + i], SamplingParams(
        max_new_tokens=5, temperature=0.8, n=3, seed=i)) for i in range(2)]
    for request in copy.deepcopy(requests):
        engine.add_request(request)
    engine.step()
    assert [g.request.request_id for g in engine.scheduler.running] == ["s0"]
    assert len(engine.scheduler.waiting) == 1

    def at_most_three_slots(engine):
        assert engine.scheduler.manager.states.num_used <= 3
    got = serve_to_completion(engine, check_deep=False, after_step=at_most_three_slots)
    assert got == {r.request_id: generate_reference(reference, r) for r in requests}


def test_a_failed_step_leaves_every_state_as_it_was():
    paged, reference = random_pair(MODELS["qwen3_next"](), reference_attention="eager")
    engine = engine_for(paged)
    request = Request("r", [5, 17, 99, 3, 41], SamplingParams(max_new_tokens=6))
    engine.add_request(copy.deepcopy(request))
    outputs = [engine.step(), engine.step()]  # the prompt, then one decode step
    before = {key: t.clone() for key, t in engine.states.device.items()}
    with mock.patch.object(engine_module, "sample_many", side_effect=RuntimeError("injected")):
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()  # the forward ran; sampling failed
    assert all(torch.equal(before[key], t) for key, t in engine.states.device.items())
    while engine.has_unfinished():
        outputs.append(engine.step())
    tokens = [o.new_tokens[0][0] for step in outputs for o in step]
    assert [tokens] == generate_reference(reference, request)


@pytest.mark.parametrize("point", ["forward", "sampler"])
def test_a_step_that_fails_after_a_fork_runs_again_to_the_same_tokens(point):
    """The step after n = 3 samples forked applies the forks' state copies, then fails in the
    forward or the sampler; it is rolled back (the copies stay pending) and runs again."""
    paged, reference = random_pair(MODELS["qwen3_next"](), reference_attention="eager")
    engine = engine_for(paged)
    request = Request("r", [7, 7, 12, 90, 33], SamplingParams(max_new_tokens=5, temperature=0.8,
                                                              n=3, seed=3))
    engine.add_request(copy.deepcopy(request))
    engine.step()  # the prompt; its first tokens fork the samples
    assert len(engine.scheduler.manager.states.pending_moves()) == 2
    target = (mock.patch.object(paged, "forward", side_effect=RuntimeError("injected"))
              if point == "forward" else
              mock.patch.object(engine_module, "sample_many", side_effect=RuntimeError("injected")))
    with target, pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert len(engine.scheduler.manager.states.pending_moves()) == 2
    got = engine.generate([])
    assert got == {"r": generate_reference(reference, request)}


def test_settings_are_checked_by_name():
    paged, _ = random_pair(MODELS["qwen3_next"](), reference_attention="eager")
    with pytest.raises(ValueError, match="set EngineConfig.num_state_slots"):
        LLMEngine(paged, EngineConfig(block_size=4, num_device_blocks=16, num_host_blocks=16))
    with pytest.raises(NotImplementedError, match="compile_decode=True.*linear-attention"):
        engine_for(paged, compile_decode=True)
    with pytest.raises(ValueError, match="num_host_state_slots must be an int"):
        engine_for(paged, num_host_state_slots=-1)
    with pytest.raises(ValueError, match="4 sequences need a state slot each.*num_state_slots=3"):
        engine_for(paged, num_state_slots=3).add_request(
            Request("wide", [1, 2], SamplingParams(num_beams=4)))
    plain, _ = random_pair(tiny_config(vocab_size=64))
    with pytest.raises(ValueError, match="which this model does not have"):
        LLMEngine(plain, EngineConfig(num_device_blocks=16, num_host_blocks=16, num_state_slots=4))


@pytest.mark.parametrize("kv_every_layer", [False, True])
def test_80_gib_admit_as_many_8k_qwen3_next_requests_as_bytes_allow(kv_every_layer):
    """Qwen3-Next-80B-A3B in bf16: per 8192-token sequence 192 MiB of K/V (12 full layers) and
    38.25 MiB of state (36 gated-DeltaNet layers). The engine's scheduler over 80 GiB, split
    into blocks and state slots for such sequences, admits 355 at once; the same bytes as K/V
    blocks of all 48 layers (no state slots) admit 106."""
    shape, length, block_size = PRESETS["qwen3-next-80b-a3b"], 8192, 16
    report = kv_report(shape, "bfloat16", length, block_size, memory_gib=80)
    memory, linear = 80 * GIB, report["linear_state"]
    if kv_every_layer:
        block_bytes = report["bytes_per_block"] * (shape.layers + shape.linear_layers) // shape.layers
        slots, blocks = None, memory // block_bytes
    else:
        slots = linear["sequences_fit"]
        blocks = (memory - slots * linear["state_bytes_per_sequence"]) // report["bytes_per_block"]
    config = EngineConfig(block_size=block_size, num_device_blocks=blocks, num_host_blocks=0,
                          num_state_slots=slots, watermark=0.0, enable_prefix_caching=False,
                          max_num_batched_tokens=1 << 30)
    scheduler = Scheduler(config, KVGroupLayout.from_windows([None]).windows)
    for i in range(400):
        group = SequenceGroup(group_id=i, request=Request(str(i), [1], SamplingParams()),
                              seqs=[Sequence(1000 + i, [1] * length, length)], arrival=i)
        scheduler.add(group)
    scheduler.schedule()
    admitted = len(scheduler.running)
    assert admitted == (linear["sequences_fit_kv_every_layer"] if kv_every_layer
                        else linear["sequences_fit"])
    assert admitted == (106 if kv_every_layer else 355)


def test_the_hooked_model_still_generates_with_a_paged_cache():
    """The hook changes only the engine's packed forwards: after an engine was built on the
    model, generate with a PagedCache still gives the eager twin's tokens."""
    paged, reference = random_pair(MODELS["qwen3_next"](), reference_attention="eager")
    engine_for(paged)  # installs the hook
    ids = torch.tensor([[5, 17, 99, 3, 41, 8]])
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=6, do_sample=False)
        got = paged.generate(ids, max_new_tokens=6, do_sample=False,
                             past_key_values=PagedCache(paged.config, block_size=4))
    assert torch.equal(want, got)
