"""The engine's compiled decode: token-identical to the eager engine (greedy, seeded samples,
beams, through swap and recompute preemption, padded batch sizes), compiled once at engine
creation and never again, larger batches falling back to the eager forward."""

import random

import pytest
import torch
from torch._dynamo.utils import counters

from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams
from paged_attention_ext.testing import random_pair, tiny_config

from engine_loop import serve_to_completion

VOCAB = 96
BLOCK = 4


@pytest.fixture(scope="module")
def model():
    return random_pair(tiny_config(vocab_size=VOCAB), seed=0)[0]


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    # torch keeps at most recompile_limit (8) graphs per function; each engine adds its own.
    torch._dynamo.reset()
    counters.clear()


def make_requests(count=9, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(2 * BLOCK + 1)]
    reqs = []
    for i in range(count):
        prompt = (system if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 9))]
        kind = i % 3
        params = (SamplingParams(max_new_tokens=rng.randint(6, 14), eos_token_ids=(7,)) if kind == 0
                  else SamplingParams(max_new_tokens=rng.randint(6, 14), temperature=0.9, top_k=20,
                                      top_p=0.9, n=1 + i % 3, seed=i) if kind == 1
                  else SamplingParams(max_new_tokens=rng.randint(4, 8), num_beams=2 + i % 2,
                                      num_return_sequences=2))
        reqs.append(Request(f"r{i}", prompt, params))
    return reqs


def serve(model, requests, **config):
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK, record_block_contents=True, **config))
    graphs = counters["stats"]["unique_graphs"]
    for request in requests:
        engine.add_request(request)
    outputs = serve_to_completion(engine)
    return engine, outputs, counters["stats"]["unique_graphs"] - graphs


@pytest.mark.parametrize("pool,mode", [(256, "swap"), (20, "swap"), (20, "recompute")])
def test_compiled_decode_equals_eager(model, pool, mode):
    requests = make_requests()
    eager, expected, _ = serve(model, requests, num_device_blocks=pool, preemption_mode=mode)
    # Padded sizes: batches run in the next size up, with padding rows.
    compiled, outputs, new_graphs = serve(model, requests, num_device_blocks=pool,
                                          preemption_mode=mode, compile_decode=True,
                                          compile_backend="eager", decode_batch_sizes=(3, 8, 64))
    assert outputs == expected
    report = compiled.report()
    assert report["compiled_decode"]["steps"] > 0.5 * report["steps"]
    assert eager.report()["compiled_decode"] is None
    assert new_graphs == 0 and not counters["graph_break"] and not counters["recompiles"]
    if pool == 20:
        assert sum(compiled.report()["preemptions"].values()) > 0
        assert compiled.report()["preemptions"] == eager.report()["preemptions"]


def test_no_recompiles_across_batch_sizes_and_table_growth(model):
    # Unpadded (every batch size), long enough that tables grow by many blocks.
    requests = [Request(f"g{i}", [1 + i] * (3 + 5 * i), SamplingParams(max_new_tokens=20 + 7 * i))
                for i in range(6)]
    _, expected, _ = serve(model, requests, num_device_blocks=128)
    engine, outputs, new_graphs = serve(model, requests, num_device_blocks=128, compile_decode=True,
                                        compile_backend="eager")
    assert outputs == expected
    assert engine.runner.decode.calls >= 40
    assert new_graphs == 0 and not counters["recompiles"] and not counters["graph_break"]


def test_batches_beyond_the_largest_size_run_eager(model):
    requests = [Request(f"b{i}", [3, 4, 5 + i], SamplingParams(max_new_tokens=5)) for i in range(5)]
    _, expected, _ = serve(model, requests, num_device_blocks=64)
    engine, outputs, _ = serve(model, requests, num_device_blocks=64, compile_decode=True,
                               compile_backend="eager", max_decode_batch=2)
    assert outputs == expected
    assert engine.runner.decode.calls == 0  # five sequences decode together: never fits


@pytest.mark.parametrize("sizes", [(0, 4), (2, "8")])
def test_bad_decode_batch_sizes_raise(model, sizes):
    with pytest.raises(ValueError, match="decode batch sizes"):
        LLMEngine(model, EngineConfig(compile_decode=True, compile_backend="eager",
                                      decode_batch_sizes=sizes))


def test_fp8_cache_compiles_after_calibration(model):
    # The scales are calibrated by the first prefill; compiling before would have traced the
    # calibration on padding rows.
    requests = make_requests(6, seed=2)
    eager, expected, _ = serve(model, requests, num_device_blocks=64, kv_cache_dtype="fp8_e4m3")
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK, num_device_blocks=64,
                                           kv_cache_dtype="fp8_e4m3", compile_decode=True,
                                           compile_backend="eager"))
    assert engine.report()["compiled_decode"]["compile_and_warmup_s"] is None  # not yet
    outputs = engine.generate(requests)
    assert outputs == expected and engine.runner.decode.calls > 0
    for mine, theirs in ((engine.kv_cache.k_scales, eager.kv_cache.k_scales),
                         (engine.kv_cache.v_scales, eager.kv_cache.v_scales)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("fmt", ["int8_per_token_head", "int4_per_token_head"])
def test_per_token_cache_compiles_at_creation(model, fmt):
    """Per-token scales need no calibration: the decode compiles with the engine, write_kv
    storing each row's scales inside the compiled step, through swap preemption."""
    requests = make_requests(6, seed=2)
    _, expected, _ = serve(model, requests, num_device_blocks=20, num_host_blocks=64,
                           kv_cache_dtype=fmt)
    engine, outputs, _ = serve(model, requests, num_device_blocks=20, num_host_blocks=64,
                               kv_cache_dtype=fmt, compile_decode=True, compile_backend="eager")
    assert outputs == expected and engine.runner.decode.calls > 0
    report = engine.report()
    assert report["compiled_decode"]["compile_and_warmup_s"] is not None
    assert report["preemptions"]["swap"] > 0


def test_bad_max_decode_batch_raises(model):
    with pytest.raises(ValueError, match="max_decode_batch"):
        LLMEngine(model, EngineConfig(compile_decode=True, compile_backend="eager", max_decode_batch=0))


def test_unknown_backend_raises(model):
    with pytest.raises(ValueError, match="compile_backend 'nope'"):
        LLMEngine(model, EngineConfig(compile_decode=True, compile_backend="nope"))


@pytest.mark.parametrize("options,match", [({"nope": 1}, "not inductor options"),
                                           ({"freezing": True}, "compile_backend is 'eager'")])
def test_bad_compile_options_raise(model, options, match):
    backend = "inductor" if "nope" in options else "eager"
    with pytest.raises(ValueError, match=match):
        LLMEngine(model, EngineConfig(compile_decode=True, compile_backend=backend,
                                      compile_options=options))


def test_compile_options_without_compile_decode_raise(model):
    with pytest.raises(ValueError, match="set compile_decode=True"):
        LLMEngine(model, EngineConfig(compile_options={"freezing": True}))


@pytest.mark.integration
@pytest.mark.parametrize("options", [None, {"freezing": True}])
def test_inductor_decode_equals_eager(model, options):
    requests = make_requests(6, seed=1)
    _, expected, _ = serve(model, requests, num_device_blocks=64)
    engine, outputs, new_graphs = serve(model, requests, num_device_blocks=64, compile_decode=True,
                                        compile_options=options)
    assert outputs == expected and engine.runner.decode.calls > 0
    assert new_graphs == 0 and not counters["recompiles"]
    if options:
        # Frozen weights are constants of the graph, prepacked: MKL (fp32) linear, not aten.mm.
        engine.add_request(Request("packed", [1, 2, 3], SamplingParams(max_new_tokens=3)))
        with torch.profiler.profile() as profile:
            serve_to_completion(engine, check_deep=False)
        ops = {event.key for event in profile.key_averages()}
        assert any("_mkl_linear" in op or "_linear_pointwise" in op for op in ops), sorted(ops)
        # A weight changed in place after freezing must not be silently ignored.
        weight = model.lm_head.weight
        saved = weight.detach().clone()
        try:
            with torch.no_grad():
                weight.copy_(weight.roll(1, dims=0))  # every token id shifts by one
            engine.add_request(Request("after", [1, 2, 3], SamplingParams(max_new_tokens=3)))
            with pytest.raises(RuntimeError, match="weights changed"):
                serve_to_completion(engine, check_deep=False)
            # A new engine compiles for the new weights; so does one without freezing (neither
            # may reuse the graph that holds the old weights as constants).
            _, changed, _ = serve(model, requests, num_device_blocks=64)
            assert changed != expected
            for again in (options, None):
                _, outputs, _ = serve(model, requests, num_device_blocks=64, compile_decode=True,
                                      compile_options=again)
                assert outputs == changed
        finally:
            with torch.no_grad():
                weight.copy_(saved)


def test_recompile_limit_raises_clearly(model):
    # Engines over one model share its graphs; once torch's per-function limit is full, a
    # new shape is refused at engine creation, and the eager engine still serves. An engine
    # compiles three graphs on the CPU: batch size 1, every size >= 2, and the cascade one.
    with torch._dynamo.config.patch(recompile_limit=3):
        LLMEngine(model, EngineConfig(block_size=BLOCK, compile_decode=True, compile_backend="eager"))
        with pytest.raises(RuntimeError, match="recompile_limit"):
            LLMEngine(model, EngineConfig(block_size=2 * BLOCK, compile_decode=True,
                                          compile_backend="eager"))
    requests = make_requests(3, seed=3)
    _, expected, _ = serve(model, requests, num_device_blocks=64)
    assert expected and all(expected.values())


@pytest.mark.parametrize("sizes", [None, (3, 8, 64)])
def test_cascade_decode_graph_equals_eager_without_recompiles(model, sizes):
    # Every sharing run takes the cascade split; its graph is compiled at warm-up (with
    # padded sizes too, whose padding rows form empty groups) and never recompiles. Two
    # long requests that share nothing decode on their own at the end (the plain graph).
    requests = make_requests() + [Request(f"solo{i}", [11 + i, 12, 13], SamplingParams(max_new_tokens=40))
                                  for i in range(2)]
    _, expected, _ = serve(model, requests, num_device_blocks=256, cascade_min_saved_tokens=None)
    engine, outputs, new_graphs = serve(model, requests, num_device_blocks=256, compile_decode=True,
                                        compile_backend="eager", decode_batch_sizes=sizes,
                                        cascade_min_saved_tokens=1)
    assert outputs == expected
    decode = engine.runner.decode
    assert 0 < decode.cascade_calls < decode.calls, "both graphs ran"
    assert engine.report()["cascade"]["steps"] >= decode.cascade_calls
    assert new_graphs == 0 and not counters["graph_break"] and not counters["recompiles"]
