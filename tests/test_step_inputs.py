"""One step's inputs: persistent buffers filled in place give the same tensors as a step
built fresh, step after step, whatever the rows held before; and the engine's eager steps
read them through buffers that grow to the step that does not fit."""

import random

import pytest
import torch

from paged_attention_ext.block_table import NULL_BLOCK
from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams, generate_reference
from paged_attention_ext.kv_cache import PagedKVCache
from paged_attention_ext.kv_groups import Chunked, KVGroupLayout
from paged_attention_ext.step_buffers import StepBuffers
from paged_attention_ext.step_inputs import StepInputs, StepPlan, plan_cascades
from paged_attention_ext.testing import random_pair, tiny_config

BLOCK = 4


def _kv_cache() -> PagedKVCache:
    # A full group and a sliding one, whose tables start with freed entries.
    return PagedKVCache(2, 1, 8, BLOCK, torch.float32, "cpu", num_blocks=64,
                        kv_groups=KVGroupLayout.from_windows([None, 6]))


def _random_plan(rng: random.Random) -> StepPlan:
    num_seqs = rng.randint(1, 6)
    seq_lens = [rng.randint(1, 40) for _ in range(num_seqs)]
    query_lens = [rng.randint(1, n) for n in seq_lens]
    full = [[rng.randrange(64) for _ in range(-(-n // BLOCK))] for n in seq_lens]
    sliding = [[NULL_BLOCK if b < len(t) - 3 else blk for b, blk in enumerate(t)] for t in full]
    slots = [[rng.randrange(-1, 256) for _ in range(sum(query_lens))] for _ in range(2)]
    return StepPlan([full, sliding], slots, seq_lens, query_lens)


def _assert_same(got: StepInputs, want: StepInputs) -> None:
    for a, b in [*zip(got.slot_mappings, want.slot_mappings), *zip(got.block_tables, want.block_tables),
                 (got.seq_lens, want.seq_lens), (got.query_start_loc, want.query_start_loc)]:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert len(got.cascades) == len(want.cascades)
    assert len(got.attention) == len(want.attention) == 2


def test_filled_buffers_equal_fresh_inputs_step_after_step():
    kv_cache, rng = _kv_cache(), random.Random(0)
    buffers = StepBuffers(kv_cache, 6, 6 * 40, 10)
    for _ in range(200):  # rows change holder, tables shrink and grow
        plan = _random_plan(rng)
        _assert_same(buffers.fill_sized(plan), StepInputs.from_plan(plan, kv_cache))


def test_filled_buffers_carry_the_planned_cascade():
    kv_cache = _kv_cache()
    shared = list(range(8))  # 32 shared tokens
    plan = StepPlan([[shared + [20], shared + [21], shared + [22]]] * 2, [[1, 2, 3]] * 2,
                    [34, 35, 36], [1, 1, 1])
    cascades = plan_cascades(plan, kv_cache, 1)
    assert cascades and cascades[0] is not None and cascades[1] is None  # windows attend plainly
    inputs = StepBuffers(kv_cache, 4, 4, 9).fill_sized(plan, cascades)
    assert inputs.cascades is cascades and inputs.attention[0].cascade is cascades[0]
    _assert_same(inputs, StepInputs.from_plan(plan, kv_cache, 1))


def test_a_step_past_the_buffers_raises_before_writing():
    kv_cache = _kv_cache()
    buffers = StepBuffers(kv_cache, 2, 4, 2)
    before = [t.clone() for t in buffers.tensors()]
    too_wide = StepPlan([[[1, 2, 3]]] * 2, [[5]] * 2, [9], [1])
    too_many = StepPlan([[[1]] * 3] * 2, [[5, 6, 7]] * 2, [1, 1, 1], [1, 1, 1])
    for plan in (too_wide, too_many):
        assert not buffers.fits(plan)
        with pytest.raises(ValueError, match="exceeds the buffers"):
            buffers.fill_sized(plan)
    assert all(torch.equal(a, b) for a, b in zip(before, buffers.tensors()))


def test_engine_eager_buffers_grow_to_a_prompt_past_the_step_budget():
    """A prompt longer than max_num_batched_tokens runs alone; the buffers grow to it and
    the tokens still equal transformers' generate."""
    paged, reference = random_pair(tiny_config(), reference_attention="eager")
    g = torch.Generator().manual_seed(1)
    requests = [Request(f"r{n}", torch.randint(3, 100, (n,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=4)) for n in (3, 9, 40)]
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK, num_device_blocks=64,
                                           num_host_blocks=0, max_num_batched_tokens=16))
    got = engine.generate(requests)
    buffers = engine.runner._buffers
    assert buffers.max_tokens >= 40 and buffers.width >= 11
    engine.generate([Request("again", requests[1].prompt, SamplingParams(max_new_tokens=4))])
    assert engine.runner._buffers is buffers  # kept across steps, not rebuilt
    for request in requests:
        assert got[request.request_id] == generate_reference(reference, request)


def test_engine_steps_inside_and_outside_inference_mode():
    """Buffers first allocated under inference_mode stay writable by later steps outside it."""
    paged, reference = random_pair(tiny_config(), reference_attention="eager")
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK, num_device_blocks=64, num_host_blocks=0))
    first = Request("first", [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=3))
    second = Request("second", [5, 6, 7], SamplingParams(max_new_tokens=3))  # fits: no growth
    with torch.inference_mode():
        got = engine.generate([first])
    got.update(engine.generate([second]))
    for request in (first, second):
        assert got[request.request_id] == generate_reference(reference, request)


@pytest.mark.parametrize("decode", [False, True])
def test_fixed_chunk_local_buffers_attend_as_chunk_local(decode):
    """A chunked group's chunk-local metadata in fixed buffers (pieces padded to a count fixed
    per step shape, rows rewritten only when they change) attends as chunk_local's fresh
    rewrite, step after step; a step of one shape reads the same tensors every time."""
    chunk = 8
    kv_cache = PagedKVCache(2, 1, 8, BLOCK, torch.float32, "cpu", num_blocks=64,
                            kv_groups=KVGroupLayout.from_windows([None, Chunked(chunk)]))
    keys, values = torch.randn(64, 1, BLOCK, 8), torch.randn(64, 1, BLOCK, 8)
    buffers, rng = StepBuffers(kv_cache, 6, 6 if decode else 6 * 40, 10, decode=decode), random.Random(1)
    seen = {}
    for _ in range(150):
        plan = _random_plan(rng)  # the chunked group: whole tables (no freed chunks)
        query_lens = [1] * len(plan.seq_lens) if decode else plan.query_lens
        plan = StepPlan([plan.tables[0]] * 2, [s[:sum(query_lens)] for s in plan.slots],
                        plan.seq_lens, query_lens)
        got, want = buffers.fill(plan), StepInputs.from_plan(plan, kv_cache)
        meta = got.attention[1]
        assert seen.setdefault(len(plan.seq_lens), meta.block_tables.data_ptr()) == \
            meta.block_tables.data_ptr()
        query = torch.randn(plan.num_tokens, 2, 8)
        torch.testing.assert_close(meta.run(query, keys, values, 0.3),
                                   want.attention[1].run(query, keys, values, 0.3))
