"""Gemma-4 through PagedCache: layers of different K/V shapes, K=V layers, KV-shared layers.

Three tiny random text models of transformers' Gemma-4 classes (fp32, eager twin with the
same weights), each token-identical to eager ``generate`` (greedy, beams, sampling) over a
left-padded batch that decodes past the sliding window:

* ``dense``: sliding layers of head 16 (real: 256) beside full layers of ``global_head_dim``
  32 (real: 512), as Gemma-4 26B/31B;
* ``k_eq_v``: the same with ``attention_k_eq_v`` and one global KV head (31B-like). Its
  full layers project one tensor for both, but transformers stores K after ``k_norm`` and
  RoPE and V after ``v_norm``, so the cache holds two different tensors;
* ``kv_shared``: the last three layers reuse the K/V of the last earlier layer of their
  type (``num_kv_shared_layers``, E2B/E4B-like) and call no ``update``.

Also: the image-text model with text prompts, Gemma-4's own head sizes (256 and 512),
compile mode, prefix caching and a fixed pool. The engine's tests are in
``tests/test_engine_gemma4.py``.
"""

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from paged_attention_ext.hf import ATTN_IMPLEMENTATION, CompiledPagedCache, PagedCache, support
from paged_attention_ext.hf import cache as cache_module, handoff
from paged_attention_ext.testing import random_pair

from hf_prompts import left_padded

BLOCK_SIZE = 4
WINDOW = 6
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
              initializer_range=0.02, sliding_window=WINDOW, head_dim=16, global_head_dim=32)
SHARED_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
CONFIGS = {
    "dense": lambda: transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=6, num_key_value_heads=2,
                                                   hidden_size_per_layer_input=0),
    "k_eq_v": lambda: transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=6, num_key_value_heads=2,
                                                    num_global_key_value_heads=1, attention_k_eq_v=True,
                                                    hidden_size_per_layer_input=0),
    "kv_shared": lambda: transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=8,
                                                       layer_types=SHARED_TYPES, num_key_value_heads=1,
                                                       num_kv_shared_layers=3,
                                                       hidden_size_per_layer_input=8,
                                                       vocab_size_per_layer_input=128),
}
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, num_return_sequences=3),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    paged, reference = random_pair(CONFIGS[request.param](), reference_attention="eager")
    return request.param, reference, paged


def generate(model, ids, mask, cache=None, seed=5, **kwargs):
    torch.manual_seed(seed)
    extra = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs, **extra)


@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_equal_to_eager(pair, decoding):
    name, reference, paged = pair
    ids, mask = left_padded([11, 7], vocab_size=COMMON["vocab_size"])
    want = generate(reference, ids, mask, max_new_tokens=16, **DECODING[decoding])
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    got = generate(paged, ids, mask, cache, max_new_tokens=16, **DECODING[decoding])
    assert torch.equal(got, want), name
    assert len(set(want[0, ids.shape[1]:].tolist())) > 4  # not a repeated token
    cache.manager.check_invariants()


def test_pools_per_shape(pair):
    """Each group holds layers of one shape; a group's layers are views of its pages."""
    name, _, paged = pair
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    generate(paged, *left_padded([9, 5], vocab_size=COMMON["vocab_size"]), cache, max_new_tokens=3)
    global_heads = 1 if name == "k_eq_v" else (1 if name == "kv_shared" else 2)
    sliding_heads = 1 if name == "kv_shared" else 2
    for layer, kind in enumerate(paged.config.layer_types):
        key_pool, value_pool = cache.kv.layer(layer)
        want = (global_heads, BLOCK_SIZE, 32) if kind == "full_attention" else (sliding_heads, BLOCK_SIZE, 16)
        assert key_pool.shape[1:] == want and value_pool.shape[1:] == want, (layer, key_pool.shape)
        assert key_pool.data_ptr() != value_pool.data_ptr()  # K=V layers still store both
    if name == "k_eq_v":
        # What transformers stores as the full layers' keys (k_norm, RoPE) and values (v_norm)
        # differ, although one projection makes both: a value view of the keys would be wrong.
        block = cache.manager.tables[cache.rows[0]][cache.kv.kv_group(5)].blocks[0]
        key_pool, value_pool = cache.kv.layer(5)
        assert value_pool[block].abs().sum() > 0 and not torch.allclose(key_pool[block], value_pool[block])
    assert len(cache.kv.key_caches) == 1  # one page buffer for keys, one for values
    # A page (fp32) is as large as the largest group's.
    elements = [cache.kv_groups.page_elements(g, BLOCK_SIZE) for g in range(len(cache.kv_groups.groups))]
    assert max(elements) * 4 == cache.kv.block_bytes


def test_shared_layers_read_their_source():
    """KV-shared layers store nothing: their pools are their source layer's, and update()
    for them is refused."""
    paged, _ = random_pair(CONFIGS["kv_shared"](), reference_attention="eager")
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert dict(cache.kv_groups.readers) == {5: 3, 6: 3, 7: 4}
    ids, mask = left_padded([9, 5], vocab_size=COMMON["vocab_size"])
    generate(paged, ids, mask, cache, max_new_tokens=3)
    for reader, source in cache.kv_groups.readers:
        assert [t.data_ptr() for t in cache.kv.layer(reader)] == [t.data_ptr() for t in cache.kv.layer(source)]
    assert cache.kv_groups.stored_layers == 5
    with pytest.raises(RuntimeError, match="layer 5 reads layer 3's K/V"):
        cache.update(torch.zeros(2, 1, 1, 16), torch.zeros(2, 1, 1, 16), 5)


def test_reader_of_another_layer_raises(monkeypatch):
    """A reader that gets K/V of another layer than the one the cache reads for it raises
    (the layer would attend over the wrong blocks), instead of generating."""
    paged, _ = random_pair(CONFIGS["kv_shared"](), reference_attention="eager")
    monkeypatch.setattr(cache_module, "kv_readers", lambda *args: {5: 1, 6: 1, 7: 4})
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    ids, mask = left_padded([9, 5], vocab_size=COMMON["vocab_size"])
    with pytest.raises(ValueError, match="has neither"):
        generate(paged, ids, mask, cache, max_new_tokens=3)
    monkeypatch.setattr(cache_module, "kv_readers", lambda *args: {5: 4, 6: 3, 7: 4})
    with pytest.raises(ValueError, match="layer 5 reads layer 4, whose window or shape differs"):
        PagedCache(paged.config, block_size=BLOCK_SIZE)


def test_prefix_caching_and_fixed_pool(pair):
    """Two rows of one prompt share its full blocks in every group; a fixed pool of as many
    pages as the rows need runs, one page fewer refuses before anything changes."""
    name, reference, paged = pair
    ids, mask = left_padded([13], vocab_size=COMMON["vocab_size"])
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    want = generate(reference, ids, mask, max_new_tokens=10, do_sample=False)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert torch.equal(generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False), want)
    usage = cache.memory_usage()
    assert usage["block_references"] > usage["blocks_used"], usage
    fixed = PagedCache(paged.config, block_size=BLOCK_SIZE, num_blocks=usage["blocks_used"] + 2,
                       enable_prefix_caching=True)
    assert torch.equal(generate(paged, ids, mask, fixed, max_new_tokens=10, do_sample=False), want)
    fixed.manager.check_invariants()


def test_multimodal_wrapper_with_text_prompts():
    """Gemma4ForConditionalGeneration (the image-text model, a one-layer vision tower) with
    text prompts: its text model's layers, token-identical to eager."""
    text = dict(COMMON, num_hidden_layers=6, num_key_value_heads=2, num_global_key_value_heads=1,
                attention_k_eq_v=True, hidden_size_per_layer_input=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    special = dict(boi_token_id=120, eoi_token_id=121, image_token_id=122, video_token_id=123,
                   boa_token_id=124, eoa_token_index=125, audio_token_id=126)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       **special)
    torch.manual_seed(0)
    build = transformers.Gemma4ForConditionalGeneration._from_config
    reference = build(copy.deepcopy(config), attn_implementation="eager").eval()
    paged = build(copy.deepcopy(config), attn_implementation=ATTN_IMPLEMENTATION).eval()
    paged.load_state_dict(reference.state_dict())
    ids, mask = left_padded([11, 7], vocab_size=special["boi_token_id"])  # text tokens only
    want = generate(reference, ids, mask, max_new_tokens=10, do_sample=False)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert torch.equal(generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False), want)
    assert {g.shape for g in cache.kv_groups.groups} == {(2, 16, 16), (1, 32, 32)}


def test_wrong_layer_shape_raises():
    """A layer whose K/V do not have its config's shape is refused, naming both."""
    cache = PagedCache(CONFIGS["dense"](), block_size=BLOCK_SIZE)
    keys, _ = cache.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), 0)
    handoff.take_batch(SimpleNamespace(layer_idx=0), keys)  # layer 0's attention
    with pytest.raises(ValueError, match=r"layer 1 stores keys \(1, 2, 3, 32\) .* the pools hold 2 "
                                         "KV heads of key size 16"):
        cache.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32), 1)


# transformers >= 5.25 runs the KV-shared layers of a multi-token forward on the positions
# whose logits it keeps.
SLICES_READERS = hasattr(transformers.models.gemma4.modeling_gemma4.Gemma4TextModel,
                         "_maybe_slice_kv_shared_inputs")
GRAPHS = []  # input shapes of every graph dynamo hands to the backend


def counting_backend(gm: torch.fx.GraphModule, example_inputs):
    GRAPHS.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
    return gm.forward


@pytest.mark.parametrize("mode", ["greedy", "sample", "beams"])
def test_compile_mode_kv_shared_layers(mode):
    """CompiledPagedCache of an E4B-like model: a traced source layer publishes its call in
    the trace, its readers take the batch with the key tensor it returned; generate's
    compile_config path (eager prefill, readers narrowed to the kept positions on 5.25)
    runs every decode step in one graph, token-equal to eager. Beam search runs no compiled
    forward of transformers': its beams compile the model's forward (prefill included, so
    not where transformers runs readers on the kept positions alone)."""
    if mode == "beams" and SLICES_READERS:
        pytest.skip("a compiled prefill of readers on the kept positions is refused (below)")
    paged, reference = random_pair(CONFIGS["kv_shared"](), reference_attention="eager")
    ids, mask = left_padded([11, 6], seed=1, vocab_size=COMMON["vocab_size"])
    kwargs = {"greedy": dict(do_sample=False),
              "sample": dict(do_sample=True, num_return_sequences=3),
              "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2)}[mode]
    want = generate(reference, ids, mask, max_new_tokens=14, **kwargs)
    config = transformers.CompileConfig(fullgraph=True, backend=counting_backend, mode=None)
    config._compile_all_devices = True  # generate compiles only on accelerators otherwise
    torch._dynamo.reset()
    GRAPHS.clear()
    counters.clear()
    forward = paged.forward
    if mode == "beams":
        paged.forward = torch.compile(forward, fullgraph=True, backend=counting_backend)
    else:
        kwargs["compile_config"] = config
    try:
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=48)
        got = generate(paged, ids, mask, cache, max_new_tokens=14, **kwargs)
    finally:
        paged.forward = forward
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert len(GRAPHS) == (2 if mode == "beams" else 1), GRAPHS  # (prefill and) decode
    assert not counters["graph_break"], dict(counters["graph_break"])
    cache.manager.check_invariants()


@contextlib.contextmanager
def compiled_forward(model):
    """``model.forward`` compiled (fullgraph, eager backend) inside, restored after."""
    forward = model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(forward, fullgraph=True, backend="eager")
    try:
        yield
    finally:
        model.forward = forward
        torch._dynamo.reset()


def test_compiled_prefill_of_kv_shared_layers():
    """A compiled multi-token forward: on 5.18 the readers run on every position and the
    prefill compiles too; on 5.25 they run on the kept positions alone, which a compiled
    forward does not narrow: refused naming the layer, before any wrong token."""
    paged, reference = random_pair(CONFIGS["kv_shared"](), reference_attention="eager")
    ids, mask = left_padded([11, 6], seed=1, vocab_size=COMMON["vocab_size"])
    want = generate(reference, ids, mask, max_new_tokens=10, do_sample=False)
    with compiled_forward(paged):
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=48)
        if SLICES_READERS:
            with pytest.raises(Exception, match="layer 5 reuses another layer's K/V on the last 1 "
                                                "of the forward's 11 positions"):
                generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False)
            return
        got = generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)


def test_compile_mode():
    """CompiledPagedCache: layers of several shapes compile."""
    paged, reference = random_pair(CONFIGS["k_eq_v"](), reference_attention="eager")
    ids, mask = left_padded([11, 6], seed=1, vocab_size=COMMON["vocab_size"])
    want = generate(reference, ids, mask, max_new_tokens=12, do_sample=False)
    with compiled_forward(paged):
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=48)
        got = generate(paged, ids, mask, cache, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_layer_shapes_through_the_per_layer_config():
    """Per-layer attributes come from transformers' per-layer config (the global attribute
    raises there); tensor parallelism divides each layer's KV heads."""
    config = transformers.Gemma4TextConfig(**dict(COMMON, head_dim=256, global_head_dim=512),
                                           num_hidden_layers=12, num_key_value_heads=4,
                                           num_global_key_value_heads=2, attention_k_eq_v=True)
    shapes = support.layer_shapes(config, tp_size=2)
    assert [tuple(s) for s in shapes] == [(2, 256, 256)] * 5 + [(1, 512, 512)] + [(2, 256, 256)] * 5 + [(1, 512, 512)]
    with pytest.raises(ValueError, match="tp_size=4 does not divide the 2 KV heads of layer 5"):
        support.layer_shapes(config, tp_size=4)
    assert support.layer_shapes(transformers.LlamaConfig(num_hidden_layers=2)) is None


def test_real_head_sizes():
    """Gemma-4's own head sizes: sliding layers of 256, full layers of 512 (the ops' largest)."""
    config = transformers.Gemma4TextConfig(**dict(COMMON, head_dim=256, global_head_dim=512,
                                                  num_attention_heads=2),
                                           num_hidden_layers=6, num_key_value_heads=1,
                                           num_global_key_value_heads=1, attention_k_eq_v=True,
                                           hidden_size_per_layer_input=0)
    paged, reference = random_pair(config, reference_attention="eager")
    ids, mask = left_padded([11, 7], vocab_size=COMMON["vocab_size"])
    want = generate(reference, ids, mask, max_new_tokens=10, do_sample=False)
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
    assert torch.equal(generate(paged, ids, mask, cache, max_new_tokens=10, do_sample=False), want)
    assert {tuple(cache.kv.layer(i)[0].shape[1:]) for i in range(6)} == {(1, 4, 256), (1, 4, 512)}


def test_transformers_continuous_batching_does_not_serve_gemma4():
    """transformers' continuous-batching cache reads the global head_dim, which Gemma-4
    declares per layer: its own paged|sdpa fails before any attention runs. When this test
    fails, transformers serves the family and the continuous-batching path needs its test."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.integrations.heterogeneity.configuration_utils import (
        AmbiguousGlobalPerLayerAttributeError)
    model = transformers.Gemma4ForCausalLM(CONFIGS["dense"]()).eval()
    model.set_attn_implementation("paged|sdpa")
    with pytest.raises(AmbiguousGlobalPerLayerAttributeError, match="head_dim"):
        model.generate_batch([[1, 2, 3]], generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0),
            continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=16))


def test_fp8_scales_follow_each_layer_heads():
    """An fp8 cache calibrates per KV head of each layer's own shape; readers use their
    source's scales and calibrate none."""
    paged, _ = random_pair(CONFIGS["kv_shared"](), reference_attention="eager")
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype="fp8",
                       kv_scale_calibration="per_head")
    generate(paged, *left_padded([9, 5], vocab_size=COMMON["vocab_size"]), cache, max_new_tokens=3)
    assert [s.numel() if s is not None else None for s in cache.kv.k_scales] == [1] * 5 + [None] * 3
    assert cache.kv.scales(7)["k_scale"] is cache.kv.scales(4)["k_scale"]
    paged, _ = random_pair(CONFIGS["k_eq_v"](), reference_attention="eager")
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype="fp8",
                       kv_scale_calibration="per_head")
    generate(paged, *left_padded([9, 5], vocab_size=COMMON["vocab_size"]), cache, max_new_tokens=3)
    assert [s.numel() for s in cache.kv.k_scales] == [2] * 5 + [1]  # one global KV head


def test_mixture_of_experts_26b_like():
    """Gemma-4 26B-A4B-like: MoE blocks beside K=V full layers of one global KV head."""
    config = transformers.Gemma4TextConfig(**COMMON, num_hidden_layers=6, num_key_value_heads=2,
                                           num_global_key_value_heads=1, attention_k_eq_v=True,
                                           hidden_size_per_layer_input=0, enable_moe_block=True,
                                           num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    paged, reference = random_pair(config, reference_attention="eager")
    ids, mask = left_padded([11, 7], vocab_size=COMMON["vocab_size"])
    for decoding in ("greedy", "beam"):
        want = generate(reference, ids, mask, max_new_tokens=12, **DECODING[decoding])
        cache = PagedCache(paged.config, block_size=BLOCK_SIZE)
        assert torch.equal(generate(paged, ids, mask, cache, max_new_tokens=12, **DECODING[decoding]),
                           want), decoding
