"""The engine on Gemma-4 text models: KV groups per layer shape (sliding layers of one head
size beside full layers of another, K=V full layers with one KV head) and KV-shared layers
(they store nothing and attend over their source layer's blocks). Tokens equal transformers'
``generate`` (greedy, sampled n > 1, beams) under swap and recompute preemption, with prefix
caching, in the compiled decode and with one table per shape (``hybrid_kv_groups=False``)."""

import copy

import pytest

from paged_attention_ext.engine import EngineConfig, LLMEngine, generate_reference
from paged_attention_ext.testing import random_pair

from test_engine_hybrid import BLOCK_SIZE, REQUESTS
from test_hf_gemma4 import CONFIGS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    paged, reference = random_pair(CONFIGS[request.param](), reference_attention="eager")
    expected = {r.request_id: generate_reference(reference, r) for r in REQUESTS}
    return request.param, paged, expected


def serve(paged, **overrides):
    engine = LLMEngine(paged, EngineConfig(**{**dict(block_size=BLOCK_SIZE, num_device_blocks=256,
                                                     num_host_blocks=256), **overrides}))
    got = engine.generate(copy.deepcopy(REQUESTS), on_output=lambda _: engine.check_invariants())
    return engine, got


def test_groups_per_shape(model):
    name, paged, _ = model
    layout = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=64,
                                           num_host_blocks=0)).kv_cache.kv_groups
    assert {(g.sliding_window, g.shape) for g in layout.groups} == {
        "dense": {(None, (2, 32, 32)), (6, (2, 16, 16))},
        "k_eq_v": {(None, (1, 32, 32)), (6, (2, 16, 16))},
        "kv_shared": {(None, (1, 32, 32)), (6, (1, 16, 16))}}[name]
    assert dict(layout.readers) == ({5: 3, 6: 3, 7: 4} if name == "kv_shared" else {})


@pytest.mark.parametrize("pool,mode", [("large", "swap"), ("small", "swap"), ("small", "recompute")])
def test_tokens_equal_generate(model, pool, mode):
    name, paged, expected = model
    # Small: requests are preempted and come back (fewer groups need fewer blocks).
    small = {"kv_shared": 30}.get(name, 60)
    engine, got = serve(paged, num_device_blocks=256 if pool == "large" else small, preemption_mode=mode)
    assert got == expected
    if pool == "small":
        assert sum(engine.report()["preemptions"].values()) > 0
    assert engine.report()["prefix_cache_hit_rate"] > 0


def test_compiled_decode_equals_generate(model):
    _, paged, expected = model
    _, got = serve(paged, compile_decode=True, compile_backend="eager")
    assert got == expected


def test_one_table_per_shape(model):
    """hybrid_kv_groups=False: no sliding groups, still a group per shape."""
    _, paged, expected = model
    engine, got = serve(paged, hybrid_kv_groups=False)
    assert got == expected
    assert set(engine.kv_cache.kv_groups.windows) == {None}
