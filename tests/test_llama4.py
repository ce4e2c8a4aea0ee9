"""Llama-4 (text): chunked local attention layers beside NoPE full-attention layers, through
``PagedCache`` and the engine, token-equal to transformers' eager ``generate`` (greedy,
sampled n > 1, beams) over contexts several chunks long, eagerly and compiled (one graph for
every decode step); what is not served (transformers' continuous batching, the multimodal
wrapper) is refused clearly."""

import copy
import inspect

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import (ContinuousBatchingConfig, GenerationConfig, StaticCache,
                          masking_utils)
from transformers.masking_utils import chunked_causal_mask_function

from paged_attention_ext.block_table import NULL_BLOCK
from paged_attention_ext.engine import (EngineConfig, LLMEngine, Request, SamplingParams,
                                        generate_reference)
from paged_attention_ext.hf import CB_ATTN_IMPLEMENTATION, CompiledPagedCache, PagedCache
from paged_attention_ext.hf.hooks import llama4_positions
from paged_attention_ext.hf.masks import is_paged_mask
from paged_attention_ext.hf.support import check_config
from paged_attention_ext.kv_groups import Chunked
from paged_attention_ext.testing import random_pair

import hf_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK, BLOCK_SIZE = 8, 4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
              initializer_range=0.2, attention_chunk_size=CHUNK, num_local_experts=2,
              num_experts_per_tok=1, interleave_moe_layer_step=2)


def llama4(**overrides) -> transformers.Llama4TextConfig:
    """Layers 0-2 chunked, layer 3 NoPE full attention (every 4th layer, as Scout)."""
    return transformers.Llama4TextConfig(**{**COMMON, **overrides})


@pytest.fixture(scope="module")
def models():
    # floor_scale=4: the NoPE layer's attention temperature changes from position 3 on, so
    # positions read through the cache must be exact (eager is the reference: soft maxima
    # differ slightly between sdpa and eager, enough to flip a tie of random weights).
    paged, reference = random_pair(llama4(floor_scale=4, attn_scale=0.5), reference_attention="eager")
    return reference, paged


def generate_both(models, ids, mask, seed=None, **kwargs):
    reference, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    outputs = []
    for model, extra in ((reference, {}), (paged, {"past_key_values": cache})):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, pad_token_id=0,
                                          return_dict_in_generate=True, output_logits=True,
                                          **kwargs, **extra))
    return outputs[0], outputs[1], cache


def test_chunked_layers_get_kv_groups_of_their_own(models):
    _, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert paged.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert cache.kv_groups.windows == (None, Chunked(CHUNK), Chunked(CHUNK), Chunked(CHUNK))


def test_greedy_left_padded_batch_over_many_chunks(models):
    ids, mask = hf_prompts.left_padded([13, 7, 10], 0, vocab_size=128)
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(got.sequences, expected.sequences)
    for want, have in zip(expected.logits, got.logits):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
    # 43 positions: each chunked table holds its chunk's blocks, the chunks before are freed.
    manager = cache.manager
    manager.check_invariants()
    for seq_id, tables in manager.tables.items():
        for table in tables:
            live = len(table.live_blocks)
            if isinstance(table.sliding_window, Chunked):
                assert live <= CHUNK // BLOCK_SIZE and table.blocks[0] == NULL_BLOCK
            else:
                assert NULL_BLOCK not in table.blocks


def test_chunking_changes_the_tokens(models):
    """The check above can fail: without chunks (one chunk longer than every sequence) the
    same weights generate other tokens."""
    reference, _ = models
    ids, mask = hf_prompts.left_padded([13, 7, 10], 0, vocab_size=128)
    unchunked = copy.deepcopy(reference)
    unchunked.config.attention_chunk_size = 256
    with torch.no_grad():
        chunked_out = reference.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
        plain_out = unchunked.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert not torch.equal(chunked_out, plain_out)


def test_sampled_rows_share_prompt_blocks(models):
    ids, mask = hf_prompts.left_padded([11, 9], 1, vocab_size=128)
    expected, got, cache = generate_both(models, ids, mask, seed=7, max_new_tokens=20,
                                         do_sample=True, num_return_sequences=3)
    assert torch.equal(got.sequences, expected.sequences)
    assert cache.manager.device.cache_hits > 0
    cache.manager.check_invariants()


def test_beam_search(models):
    ids, mask = hf_prompts.left_padded([10, 6], 2, vocab_size=128)
    expected, got, cache = generate_both(models, ids, mask, max_new_tokens=20, do_sample=False,
                                         num_beams=3, num_return_sequences=2)
    assert torch.equal(got.sequences, expected.sequences)
    usage = cache.memory_usage()
    assert usage["blocks_used"] < usage["block_references"]  # beams share forked blocks


@pytest.mark.parametrize("q_offset,q_length", [(29, 1), (0, 30), (20, 10)])
def test_the_chunked_mask_is_recognised_with_left_padding(q_offset, q_length):
    """transformers counts chunks from each row's first real token; so do the ops (padding
    is never stored). Another chunk size or padding, or a model without chunks, is refused."""
    pad = torch.tensor([0, 3])
    mask_function = chunked_causal_mask_function(CHUNK, pad)
    grid = dict(batch_size=2, q_length=q_length, kv_length=30, q_offset=q_offset, kv_offset=0,
                packed=False, sliding_windows=(None,))
    assert is_paged_mask(mask_function, **grid, chunk_size=CHUNK, left_padding=pad)
    assert not is_paged_mask(mask_function, **grid, chunk_size=CHUNK, left_padding=torch.tensor([0, 2]))
    assert not is_paged_mask(mask_function, **grid, chunk_size=CHUNK // 2, left_padding=pad)
    assert not is_paged_mask(mask_function, **grid)


def test_prompt_lookup_decoding_crops_within_the_kept_chunks(models, monkeypatch):
    """Verification forwards append the last accepted token and the candidates; rejected
    candidates are cropped, never back before that token, so the chunk a chunked table keeps
    (the first appended token's) is always enough."""
    reference, paged = models
    crops = []
    monkeypatch.setattr(PagedCache, "crop", lambda self, n, _crop=PagedCache.crop: (
        crops.append(self._tokens_to_crop(n)), _crop(self, n))[1])
    ids = torch.tensor([[5, 6, 7, 8] * 3 + [5, 6]])
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=3)
        got = paged.generate(ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=3,
                             past_key_values=cache)
    assert torch.equal(got, want) and max(crops) > 0  # candidates were rejected
    cache.manager.check_invariants()


def test_a_chunk_must_be_whole_blocks(models):
    _, paged = models
    with pytest.raises(ValueError, match="attention_chunk_size=8 is not a multiple of block_size=3"):
        PagedCache(paged.config, block_size=3)


GRAPHS = []  # input shapes of every graph dynamo hands to the backend


def counting_backend(gm: torch.fx.GraphModule, example_inputs):
    GRAPHS.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
    return gm.forward


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    GRAPHS.clear()
    yield
    torch._dynamo.reset()


# transformers 5.18's generate cannot build Llama-4's masks for any compileable cache (it
# passes create_chunked_causal_mask an argument it does not take); later releases can.
GENERATE_BUILDS_CHUNKED_MASKS = "block_sequence_ids" in inspect.signature(
    masking_utils.create_chunked_causal_mask).parameters


def compiled_generate(models, ids, mask, kwargs):
    """(eager reference, CompiledPagedCache) outputs with logits, the paged model's whole
    forward compiled (prefill and decode graphs). generate(compile_config=...) does not
    compile Llama-4 (transformers' get_compiled_call skips it)."""
    reference, paged = models
    forward = paged.forward
    paged.forward = torch.compile(forward, fullgraph=True, backend=counting_backend)
    try:
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=48)
        outputs = []
        for model, extra in ((reference, {}), (paged, {"past_key_values": cache})):
            torch.manual_seed(5)
            with torch.no_grad():
                outputs.append(model.generate(ids, attention_mask=mask, pad_token_id=0,
                                              return_dict_in_generate=True, output_logits=True,
                                              **kwargs, **extra))
    finally:
        paged.forward = forward
    assert not counters["graph_break"], dict(counters["graph_break"])
    cache.manager.check_invariants()
    return outputs


def assert_same(want, got):
    assert torch.equal(got.sequences, want.sequences)
    for expected, have in zip(want.logits, got.logits):
        torch.testing.assert_close(have, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not GENERATE_BUILDS_CHUNKED_MASKS, reason="transformers' generate fails first")
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("mode", ["greedy", "sample", "beams"])
def test_compiled_forward_over_many_chunks(models, mode):
    """``torch.compile(model.forward, fullgraph=True)`` over a CompiledPagedCache: the chunked
    groups' chunk-local tables live in fixed buffers rewritten before each forward, so one
    graph serves every decode step across chunk boundaries (the prefill has its own). The
    NoPE layer's temperature reads the columns before the forward (get_seq_length)."""
    ids, mask = hf_prompts.left_padded([13, 7, 10] if mode == "greedy" else [11, 6], 1,
                                       vocab_size=128)
    kwargs = {"greedy": dict(do_sample=False),
              "sample": dict(do_sample=True, num_return_sequences=3),
              "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2)}[mode]
    want, got = compiled_generate(models, ids, mask, dict(max_new_tokens=24, **kwargs))
    assert ids.shape[1] + 24 > 4 * CHUNK  # several chunk boundaries crossed while decoding
    assert_same(want, got)
    assert len(GRAPHS) == 2, GRAPHS  # prefill and decode: no recompile per step


@pytest.mark.skipif(GENERATE_BUILDS_CHUNKED_MASKS, reason="transformers builds the masks")
def test_generate_with_a_compileable_cache_fails_in_transformers(models):
    """transformers 5.18's generate fails building Llama-4's masks for its own StaticCache as
    for a CompiledPagedCache, before any forward: that release serves compiled steps only
    through a loop of one's own (test_own_compiled_loop)."""
    _, paged = models
    ids = torch.tensor([[5, 6, 7]])
    for cache in (StaticCache(paged.config, max_cache_len=16),
                  CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=16)):
        with pytest.raises(TypeError, match="block_sequence_ids"), torch.no_grad():
            paged.generate(ids, max_new_tokens=2, past_key_values=cache)


@pytest.mark.usefixtures("fresh_dynamo")
def test_own_compiled_loop(models):
    """A loop of one's own around a compiled forward (prepare() before each step), greedy
    across chunk boundaries, one decode graph, token-equal to eager generate."""
    reference, paged = models
    ids, mask = hf_prompts.left_padded([9, 5], 4, vocab_size=128)
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=20,
                                  do_sample=False)
    cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=48)
    step = torch.compile(paged.forward, fullgraph=True, backend=counting_backend)

    def prepared(tokens):
        assert cache.get_seq_length() == tokens.shape[1] - 1  # prepared, not run yet

    def stepped(tokens):
        assert cache.get_seq_length() == tokens.shape[1]  # the compiled step ran
    tokens = hf_prompts.greedy_compiled_loop(paged, cache, step, ids, mask, 20, prepared, stepped)
    assert torch.equal(tokens, want)
    assert len(GRAPHS) == 1, GRAPHS
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_continuous_batching_is_refused_by_transformers(models):
    """transformers' continuous batching has no cache for chunked layers: it raises before any
    attention runs (the paged ops are never asked for a chunked layer there)."""
    _, paged = models
    model = copy.deepcopy(paged)
    model.set_attn_implementation(CB_ATTN_IMPLEMENTATION)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(ValueError, match="chunked_attention"):
        model.generate_batch([list(range(1, 20))], generation_config=config,
                             continuous_batching_config=ContinuousBatchingConfig(
                                 page_size=8, num_blocks=32, max_batch_tokens=32))


def test_the_multimodal_wrapper_is_refused_naming_the_text_model():
    config = transformers.Llama4Config(text_config=COMMON)
    with pytest.raises(NotImplementedError, match="Llama4ForCausalLM\\(config.text_config\\)"):
        check_config(config, config.get_text_config(decoder=True))


# ---- the engine ------------------------------------------------------------------------

SHARED = [9, 4, 33, 21, 8, 70, 3, 3, 15, 60, 2, 44, 5, 91, 12, 30]  # 4 blocks: a prefix-cache hit
REQUESTS = [
    Request("greedy", SHARED + [5, 17, 99, 3, 41, 8], SamplingParams(max_new_tokens=20)),
    Request("shared", SHARED + [7, 1], SamplingParams(max_new_tokens=14)),
    Request("sampled", [7, 7, 12, 90, 33, 2, 61, 18, 40], SamplingParams(
        max_new_tokens=18, temperature=0.8, top_k=30, n=3, seed=3)),
    Request("beam", [2, 64, 31, 18, 5, 77, 9, 100, 4, 16, 30], SamplingParams(
        max_new_tokens=14, num_beams=3, num_return_sequences=2)),
]


# The NoPE layer's attention temperature steps every FLOOR positions: each request crosses
# several steps, and a packed row puts most tokens at an index other than their position.
FLOOR = 6


@pytest.fixture(scope="module")
def engine_models():
    paged, reference = random_pair(llama4(floor_scale=FLOOR, attn_scale=0.5),
                                   reference_attention="eager")
    return paged, {r.request_id: generate_reference(reference, r) for r in REQUESTS}


def serve(paged, **overrides):
    engine = LLMEngine(paged, EngineConfig(**{**dict(
        block_size=BLOCK_SIZE, num_device_blocks=256, num_host_blocks=256,
        max_num_batched_tokens=255, enable_prefix_caching=True), **overrides}))
    most_held = []  # per step: the most blocks a sequence's chunked group holds

    def check(_output):
        engine.check_invariants()
        manager = engine.scheduler.manager
        most_held.extend(len(t.live_blocks) for ts in manager.tables.values() for t in ts
                         if isinstance(t.sliding_window, Chunked) and t.allocator is manager.device)
    return engine, engine.generate(copy.deepcopy(REQUESTS), on_output=check), most_held


@pytest.mark.parametrize("pool,mode", [("large", "swap"), ("small", "swap"), ("small", "recompute")])
def test_engine_tokens_equal_generate(engine_models, pool, mode):
    paged, expected = engine_models
    engine, got, most_held = serve(paged, num_device_blocks=256 if pool == "large" else 60,
                                   preemption_mode=mode)
    assert got == expected
    assert engine.kv_cache.kv_groups.windows == (None,) + (Chunked(CHUNK),) * 3
    # A prompt is held whole until computed (6 blocks); after that, its chunk.
    assert max(most_held) <= -(-len(REQUESTS[0].prompt) // BLOCK_SIZE)
    assert sorted(most_held)[len(most_held) // 2] <= CHUNK // BLOCK_SIZE
    if pool == "small":
        assert sum(engine.report()["preemptions"].values()) > 0
    assert engine.report()["prefix_cache_hit_rate"] > 0


def test_engine_compiled_decode_equals_generate(engine_models):
    """compile_decode: the chunked groups' chunk-local tables are staged in the decode
    buffers with the step, so every decode step runs in the compiled graphs."""
    paged, expected = engine_models
    engine, got, _ = serve(paged, compile_decode=True, compile_backend="eager")
    assert got == expected
    assert engine.runner.decode.calls >= 15  # decode steps over several chunk boundaries


def test_engine_refuses_what_it_cannot_compute(engine_models):
    paged, _ = engine_models
    base = dict(block_size=BLOCK_SIZE, num_device_blocks=64, num_host_blocks=0,
                max_num_batched_tokens=255)
    with pytest.raises(NotImplementedError, match="set hybrid_kv_groups=True"):
        LLMEngine(paged, EngineConfig(**base, hybrid_kv_groups=False))


def test_without_real_positions_the_engine_differs(engine_models, monkeypatch):
    """The equality above can fail: with the temperature read from each token's index in the
    packed row (transformers' default without the hook), the engine's tokens differ."""
    paged, expected = engine_models
    monkeypatch.setattr(llama4_positions.RealPositions, "feed", lambda self, position_ids: None)
    _, got, _ = serve(paged)
    assert got != expected
    torch._dynamo.reset()  # the graphs traced by earlier tests inlined the real feed
    _, got, _ = serve(paged, compile_decode=True, compile_backend="eager")
    assert got != expected


def test_compiled_decode_tempers_a_config_without_chunks():
    """A Llama-4 config whose layers are all full attention: its compiled decode steps, rows
    packed in one, temper each query at its own position (the hook fed in the graph)."""
    paged, reference = random_pair(llama4(layer_types=["full_attention"] * 4, floor_scale=FLOOR,
                                          attn_scale=0.5), reference_attention="eager")
    requests = REQUESTS[:1] + REQUESTS[2:3]
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=64,
                                           num_host_blocks=0, compile_decode=True,
                                           compile_backend="eager"))
    got = engine.generate(copy.deepcopy(requests))
    assert got == {r.request_id: generate_reference(reference, r) for r in requests}
    assert engine.runner.decode.calls >= 10
