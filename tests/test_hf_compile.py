"""Compiled decoding with a CompiledPagedCache (``max_cache_len``): every step runs in
one graph (no graph breaks, no recompiles after warm-up) across steps, rows finishing, beam
reorders and block-table growth, and generates what eager attention generates.

Counter tests use the ``eager`` backend (dynamo's tracing is the point, not inductor's
code); one test (marked integration: make test-integration) runs inductor. Graphs are
counted by a backend function (generate's CompileConfig deep-copies its backend argument,
which keeps a function but not a counter object) and graph breaks by dynamo's counters.
"""

import copy

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig

from paged_attention_ext.block_table import NULL_BLOCK
from paged_attention_ext.hf import CompiledPagedCache, PagedCache
from paged_attention_ext.testing import TINY, random_pair

from hf_prompts import greedy_compiled_loop, left_padded

BLOCK_SIZE = 4  # small: tables grow by a block every 4 decode steps
MAX_CACHE_LEN = 48

pytestmark = pytest.mark.usefixtures("one_thread")

GRAPHS = []  # (input shapes) of every graph dynamo handed to the backend


def counting_backend(gm: torch.fx.GraphModule, example_inputs):
    GRAPHS.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
    return gm.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    GRAPHS.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def models():
    """(reference sdpa model, paged model) with the same weights."""
    paged, reference = random_pair(transformers.LlamaConfig(**TINY))
    return reference, paged


def generate(model, ids, mask, cache=None, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    extra = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs, **extra)


def compile_config(backend=counting_backend) -> CompileConfig:
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # generate compiles only on accelerators otherwise
    return config


def assert_no_graph_breaks():
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_generate_compile_config_one_graph_for_every_decode_step(models):
    """transformers' own path: eager prefill, every decode step through one compiled graph.
    Row 0 finishes early (its EOS), the others go on; tables grow every 4 tokens."""
    reference, paged = models
    ids, mask = left_padded([13, 7, 10])
    free_run = generate(reference, ids, mask, max_new_tokens=16, do_sample=False)
    eos = int(free_run[0, ids.shape[1] + 2])  # row 0 stops after 3 tokens
    want = generate(reference, ids, mask, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    for attempt in range(2):  # a second generate with a new cache reuses the graph
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
        got = generate(paged, ids, mask, cache, max_new_tokens=16, do_sample=False,
                       eos_token_id=eos, compile_config=compile_config())
        assert torch.equal(got, want)
        assert (got[0, ids.shape[1] + 3:] == 0).all() and (got[1:, -1] != 0).all()
        assert len(GRAPHS) == 1, GRAPHS  # one decode graph, no recompiles
        assert_no_graph_breaks()
    cache.manager.check_invariants()


@pytest.mark.parametrize("mode", ["greedy", "sample", "beams"])
def test_compiled_forward_fullgraph(models, mode):
    """``model.forward = torch.compile(model.forward, fullgraph=True)``: the prefill is
    compiled too (one graph for its shape, one for decode steps), beam search reorders
    (forks) rows between compiled steps."""
    reference, paged = models
    ids, mask = left_padded([11, 6], seed=1)
    kwargs = {"greedy": dict(do_sample=False),
              "sample": dict(do_sample=True, num_return_sequences=3, seed=5),
              "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2)}[mode]
    want = generate(reference, ids, mask, max_new_tokens=14, **kwargs)
    forward = paged.forward
    paged.forward = torch.compile(forward, fullgraph=True, backend=counting_backend)
    try:
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
        got = generate(paged, ids, mask, cache, max_new_tokens=14, **kwargs)
    finally:
        paged.forward = forward
    assert torch.equal(got, want)
    assert len(GRAPHS) == 2, GRAPHS  # prefill and decode
    assert_no_graph_breaks()
    cache.manager.check_invariants()
    if mode == "beams":
        usage = cache.memory_usage()
        assert usage["blocks_used"] < usage["block_references"]  # beams share forked blocks


def test_eager_prefill_shares_prompt_blocks(models):
    """With transformers' compile path the prefill runs eagerly, which fingerprints the
    prompt rows: repeated prompts (num_return_sequences) share their full blocks."""
    reference, paged = models
    ids, mask = left_padded([13], seed=2)
    want = generate(reference, ids, mask, seed=3, max_new_tokens=8, do_sample=True,
                    num_return_sequences=4)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
    got = generate(paged, ids, mask, cache, seed=3, max_new_tokens=8, do_sample=True,
                   num_return_sequences=4, compile_config=compile_config())
    assert torch.equal(got, want)
    tables = [cache.manager.block_ids(s, 0) for s in cache.rows]
    assert all(t[:3] == tables[0][:3] for t in tables)  # 12 of 13 prompt tokens shared
    assert_no_graph_breaks()


def test_own_loop_with_prepare(models):
    """A decode loop of one's own around a compiled forward calls prepare() before each step."""
    reference, paged = models
    ids, mask = left_padded([9, 5], seed=4)
    want = generate(reference, ids, mask, max_new_tokens=10, do_sample=False)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
    step = torch.compile(paged.forward, fullgraph=True, backend=counting_backend)
    tokens = greedy_compiled_loop(paged, cache, step, ids, mask, 10)
    assert torch.equal(tokens[:, :-1], want[:, :-1])
    assert len(GRAPHS) == 1
    assert_no_graph_breaks()
    with pytest.raises(RuntimeError, match="without cache.prepare"), torch.no_grad():
        # The last token again, one position on: no prepare() since the loop's last step.
        step(tokens[:, -1:], position_ids=mask.sum(-1, keepdim=True) + 10, past_key_values=cache)


@pytest.mark.integration  # inductor's C++ compile takes a minute on a shared machine
def test_inductor(models):
    reference, paged = models
    ids, mask = left_padded([8, 5], seed=6)
    want = generate(reference, ids, mask, max_new_tokens=8, do_sample=False)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
    got = generate(paged, ids, mask, cache, max_new_tokens=8, do_sample=False,
                   compile_config=compile_config("inductor"))
    assert torch.equal(got, want)
    assert_no_graph_breaks()


def test_prompt_lookup_crops_in_compile_mode(models):
    """Candidate verification (multi-token forwards) and crop keep working in compile mode."""
    reference, paged = models
    ids = torch.randint(1, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([ids, ids[:, :5], ids], dim=1)  # repeated n-grams: candidates to propose
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3)
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
        got = paged.generate(ids, max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3,
                             past_key_values=cache)
    assert torch.equal(got, want)
    held = cache.manager.num_tokens(cache.rows[0])
    assert len(cache.manager.block_ids(cache.rows[0], 0)) == -(-held // BLOCK_SIZE)
    cache.manager.check_invariants()


def test_compile_mode_limits_and_arguments(models):
    _, paged = models
    config = paged.config
    # The caller picks the class, as transformers' DynamicCache / StaticCache.
    for compile_mode in (dict(max_cache_len=16), dict(max_batch_size=2)):
        with pytest.raises(TypeError, match=r"use CompiledPagedCache\(config, max_cache_len=\.\.\.\)"):
            PagedCache(config, **compile_mode)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_len'"):
        PagedCache(config, max_len=16)
    with pytest.raises(TypeError, match="max_seq_len"):
        CompiledPagedCache(config, max_cache_len=16, max_seq_len=16)
    with pytest.raises(ValueError, match="max_cache_len"):
        CompiledPagedCache(config, max_cache_len=0)
    assert not PagedCache(config).is_compileable
    assert CompiledPagedCache(config, max_cache_len=16).is_compileable
    assert type(PagedCache(config)) is PagedCache
    assert CompiledPagedCache(config, max_cache_len=16).get_max_length() == 16
    assert CompiledPagedCache(config, 16, 2).get_max_length() == 16  # as StaticCache(config, max_cache_len)
    with pytest.raises(TypeError, match="pass max_cache_len"):
        CompiledPagedCache(config)
    for cache in (PagedCache(config), CompiledPagedCache(config, max_cache_len=16)):
        for duplicate in (copy.copy(cache), copy.deepcopy(cache)):
            assert type(duplicate) is type(cache) and duplicate.is_compileable == cache.is_compileable
    with torch.no_grad():
        cache = CompiledPagedCache(config, block_size=BLOCK_SIZE, max_cache_len=12, max_batch_size=2)
        with pytest.raises(ValueError, match="more than max_batch_size=2"):
            paged(torch.ones(3, 4, dtype=torch.long), past_key_values=cache)
        paged(torch.ones(2, 10, dtype=torch.long), past_key_values=cache)
        with pytest.raises(ValueError, match="13 tokens, more than max_cache_len=12"):
            paged(torch.ones(2, 3, dtype=torch.long), past_key_values=cache)
        assert cache.get_seq_length() == 10  # refused before anything changed
        paged(torch.ones(2, 2, dtype=torch.long), past_key_values=cache)
        usage = cache.memory_usage()  # identical rows: 2 shared prompt blocks + 1 own each
        assert (usage["blocks_used"], usage["block_references"]) == (4, 6)
    assert not hasattr(PagedCache(config), "prepare")  # an eager forward places its own tokens
    with pytest.raises(ValueError, match="pass the model's dtype and device"):
        CompiledPagedCache(config, max_cache_len=16).prepare(1, 1)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_sliding_window_and_soft_cap_architectures(arch):
    """Hybrid full/sliding layers (generate builds two masks per step, the cache is prepared
    once) and Gemma2's soft caps, through generate's compile path."""
    from test_hf_generate import build_pair
    from test_hf_generate import left_padded as padded_160
    reference, paged = build_pair(arch)
    ids, mask = padded_160([12, 7], seed=8)
    want = generate(reference, ids, mask, max_new_tokens=10, do_sample=False)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
    got = generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False,
                   compile_config=compile_config())
    assert torch.equal(got, want)
    assert len(GRAPHS) == 1, GRAPHS
    assert_no_graph_breaks()
    # The sliding layers' KV group freed what left its window (tables of one group each).
    windows = cache.kv_groups.windows
    assert windows == (None, 6)
    for seq_id in cache.rows:
        full, sliding = cache.manager.tables[seq_id]
        assert NULL_BLOCK not in full.blocks and NULL_BLOCK in sliding.blocks
    cache.manager.check_invariants()


def test_chunked_prefill_compiled(models):
    """generate compiles the prefill chunks too (prefill_chunk_size): each chunk is prepared
    before its compiled forward; rows that are all padding in a chunk place nothing."""
    reference, paged = models
    ids, mask = left_padded([12, 3, 9], seed=5)
    want = generate(reference, ids, mask, max_new_tokens=6, do_sample=False)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
    got = generate(paged, ids, mask, cache, max_new_tokens=6, do_sample=False,
                   prefill_chunk_size=4, compile_config=compile_config())
    assert torch.equal(got, want)
    assert len(GRAPHS) == 2, GRAPHS  # chunks of 4, decode steps
    assert_no_graph_breaks()
    cache.manager.check_invariants()


@pytest.mark.parametrize("scales", ["calibrated", "fixed"])
def test_fp8_cache_compiles(models, scales):
    """An fp8 pool (docs/fp8.md) in compile mode: the compiled decode steps generate what the
    same cache generates eagerly (calibration happens in the eager prefill)."""
    _, paged = models
    ids, mask = left_padded([13, 6], seed=2)
    options = dict(kv_cache_dtype="fp8_e4m3")
    if scales == "fixed":
        options.update(k_scale=0.05, v_scale=0.05)
    outputs = []
    for config in (None, compile_config()):
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN,
                                   **options)
        extra = {} if config is None else {"compile_config": config}
        outputs.append(generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False, **extra))
    assert torch.equal(outputs[1], outputs[0])
    assert len(GRAPHS) == 1, GRAPHS
    assert_no_graph_breaks()


def test_forward_stopped_between_layers_is_refused(models, monkeypatch):
    """An eager forward that an exception stops after layer 0 stored its K/V: the next
    preparation refuses (the history is partly stored) until reset()."""
    from paged_attention_ext import ops  # the module the attention function's metadata calls
    reference, paged = models
    ids, mask = left_padded([9, 6], seed=9)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        paged(ids, attention_mask=mask, past_key_values=cache)
        calls = []
        real = ops.attention

        def fail_in_layer_0(*args, **kwargs):  # after layer 0 stored, before layer 1
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt("stopped")
            return real(*args, **kwargs)
        monkeypatch.setattr(ops, "attention", fail_in_layer_0)
        step = torch.ones(2, 1, dtype=torch.long)
        grown = torch.cat([mask, torch.ones_like(step)], dim=1)
        with pytest.raises(KeyboardInterrupt):
            paged(step, attention_mask=grown, past_key_values=cache)
        monkeypatch.setattr(ops, "attention", real)
        with pytest.raises(RuntimeError, match="stopped after 1 of 2 layers"):
            cache.prepare(2, 1, torch.cat([grown, torch.ones_like(step)], dim=1),
                          dtype=paged.dtype, device=paged.device)
    cache.reset()
    want = generate(reference, ids, mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generate(paged, ids, mask, cache, max_new_tokens=6, do_sample=False), want)


@pytest.mark.parametrize("search", ["samples", "beams"])
def test_cascade_decode_graph(models, search):
    """num_return_sequences (generate's compile_config) and beams (a compiled forward, beams
    forking between steps) with the cascade split on every decode step, from compile mode's
    fixed cascade buffers: the same tokens, one decode graph, no graph breaks."""
    reference, paged = models
    ids, mask = left_padded([13, 9], seed=4)
    kwargs = (dict(do_sample=True, num_return_sequences=3) if search == "samples"
              else dict(do_sample=False, num_beams=3, num_return_sequences=2))
    want = generate(reference, ids, mask, seed=6, max_new_tokens=12, **kwargs)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=MAX_CACHE_LEN,
                               cascade_min_saved_tokens=1)
    forward = paged.forward
    if search == "beams":
        paged.forward = torch.compile(forward, fullgraph=True, backend=counting_backend)
    try:
        got = generate(paged, ids, mask, cache, seed=6, max_new_tokens=12, **kwargs,
                       **({"compile_config": compile_config()} if search == "samples" else {}))
    finally:
        paged.forward = forward
    assert torch.equal(got, want)
    assert cache.cascade_forwards >= 11  # every decode step
    assert len(GRAPHS) == (1 if search == "samples" else 2), GRAPHS  # (prefill and) decode
    assert_no_graph_breaks()
    cache.manager.check_invariants()
