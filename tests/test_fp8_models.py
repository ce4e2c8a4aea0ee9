"""fp8 KV caches in PagedCache and the engine, on tiny random models.

The exact oracle: with fixed scales an fp8 cache holds ``to_fp8(K / scale)`` and the
attention reads ``float(stored) * scale``, so a stock model whose attention function
quantizes and dequantizes K and V the same way (``FAKE_FP8`` below, around sdpa) must
generate the same tokens, through greedy, beam search (copy-on-write), sampling, left
padding, sliding windows, GQA, pool growth, and the engine's swap and recompute
preemption. Calibrated scales are checked against the keys' absolute maxima, and the
calibrated default's logits against the float-cache run (bounded relative to what a
bf16 cache costs).
"""

import random

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from paged_attention_ext import quantization as q
from paged_attention_ext.engine import EngineConfig, LLMEngine, Request, SamplingParams, generate_reference
from paged_attention_ext.hf import CompiledPagedCache, PagedCache
from paged_attention_ext.reference import quantize
from paged_attention_ext.testing import ARCHS, TINY, random_pair, tiny_config

from engine_loop import serve_to_completion

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sampling": dict(do_sample=True, num_return_sequences=3),
}
BLOCK_SIZE = 4
# Fixed scales, per layer and per KV head mixed; small enough that the largest keys saturate.
K_SCALE = [[0.012, 0.02], 0.015]
V_SCALE = [0.004, [0.005, 0.006]]

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeFp8:
    """sdpa over K/V quantized and dequantized as an fp8 cache with K_SCALE/V_SCALE stores them."""

    name = "fake_fp8_sdpa"
    dtype = torch.float8_e4m3fn
    seen = {}  # layer -> the (key, value) of its last call, as the layer computed them

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        self.seen[layer] = (key, value)
        return sdpa_attention_forward(module, query, self._round(key, K_SCALE[layer]),
                                      self._round(value, V_SCALE[layer]), attention_mask, **kwargs)

    def _round(self, states: torch.Tensor, scale) -> torch.Tensor:
        """``[batch, kv_heads, tokens, head_size]`` through the cache's fp8 and back."""
        scale = q.check_scale("scale", scale, states.shape[1], states.device)
        tokens = states.transpose(1, 2)
        stored = quantize(tokens, scale, self.dtype)
        return (stored.float() * scale.view(-1, 1)).transpose(1, 2).to(states.dtype)


FAKE_FP8 = FakeFp8()
AttentionInterface.register(FAKE_FP8.name, FAKE_FP8)
AttentionMaskInterface.register(FAKE_FP8.name, sdpa_mask)


@pytest.fixture
def fake_format(request):
    """Point the fake-fp8 reference at the format under test."""
    FAKE_FP8.dtype = FORMATS[request.param]
    yield request.param
    FAKE_FP8.dtype = torch.float8_e4m3fn


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request):
    """(paged model, fake-fp8 sdpa twin) with the same random weights."""
    return random_pair(ARCHS[request.param](), reference_attention=FAKE_FP8.name)


def left_padded_prompts():
    ids = torch.randint(1, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


@pytest.mark.parametrize("fake_format", sorted(FORMATS), indirect=True)
@pytest.mark.parametrize("decoding", sorted(DECODING))
def test_paged_cache_equals_fake_fp8_reference(pair, fake_format, decoding):
    paged, reference = pair
    ids, mask = left_padded_prompts()
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype=fake_format,
                       k_scale=K_SCALE, v_scale=V_SCALE)
    outputs = []
    for model, extra in ((reference, {}), (paged, {"past_key_values": cache})):
        torch.manual_seed(5)
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                                          **DECODING[decoding], **extra))
    assert torch.equal(outputs[0], outputs[1])
    assert cache.kv.dtype == FORMATS[fake_format] and cache.kv.key_caches[0].dtype == cache.kv.dtype
    assert cache.kv.scales(1)["k_scale"].tolist() == pytest.approx([0.015])
    cache.manager.check_invariants()


# ---- the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_pair():
    return random_pair(tiny_config(vocab_size=96), seed=0, reference_attention=FAKE_FP8.name)


def engine_requests():
    """Greedy, parallel-sampled and beam requests, half behind a shared prompt."""
    rng = random.Random(1)
    system = [rng.randrange(96) for _ in range(9)]
    requests = []
    for i in range(9):
        prompt = (system if i % 2 else []) + [rng.randrange(96) for _ in range(rng.randint(2, 9))]
        params = [SamplingParams(max_new_tokens=10),
                  SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, n=2, seed=i),
                  SamplingParams(max_new_tokens=8, num_beams=3, num_return_sequences=2)][i % 3]
        requests.append(Request(f"r{i}", prompt, params))
    return requests


@pytest.mark.parametrize("fake_format", sorted(FORMATS), indirect=True)
@pytest.mark.parametrize("blocks, mode", [(256, "swap"), (20, "swap"), (20, "recompute")])
def test_engine_equals_fake_fp8_reference(engine_pair, fake_format, blocks, mode):
    paged, reference = engine_pair
    requests = engine_requests()
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=blocks,
                                           num_host_blocks=64, preemption_mode=mode,
                                           kv_cache_dtype=fake_format, k_scale=K_SCALE,
                                           v_scale=V_SCALE, record_block_contents=True))
    for request in requests:
        engine.add_request(request)
    outputs = serve_to_completion(engine)
    assert outputs == {r.request_id: generate_reference(reference, r) for r in requests}
    assert engine.kv_cache.dtype == FORMATS[fake_format]
    preemptions = engine.report()["preemptions"]
    assert (preemptions[mode] > 0) == (blocks < 256)


# ---- calibration ----------------------------------------------------------------------------

def layer0_keys_values(reference, ids):
    """Layer 0's keys and values of a forward of ``ids`` by the fake-fp8 reference,
    ``[tokens, kv_heads, head_size]`` (they do not depend on any attention output)."""
    with torch.no_grad():
        reference(ids, use_cache=False)
    return [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in FAKE_FP8.seen[0]]


@pytest.mark.parametrize("calibration", ["per_layer", "per_head"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_paged_cache_calibrates_from_the_first_forward(pair, fmt, calibration):
    paged, reference = pair
    ids = torch.randint(1, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
    keys, values = layer0_keys_values(reference, ids)  # layer 0 sees no quantized attention yet
    cache = PagedCache(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype=fmt,
                       kv_scale_calibration=calibration)
    with torch.no_grad():
        paged.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, past_key_values=cache)
    per_head = calibration == "per_head"
    dtype = FORMATS[fmt]
    # Set by the prompt's forward, kept through the decode steps and the pool's growth.
    torch.testing.assert_close(cache.kv.k_scales[0], q.calibrate(keys, dtype, per_head))
    torch.testing.assert_close(cache.kv.v_scales[0], q.calibrate(values, dtype, per_head))
    heads = paged.config.num_key_value_heads if per_head else 1
    assert all(s.shape == (heads,) for s in cache.kv.k_scales + cache.kv.v_scales)
    fmax = q.fp8_max(dtype)
    assert cache.kv.key_caches[0].float().abs().max() == fmax  # the largest key hits the format's top


@pytest.mark.parametrize("cache_class,mode", [(PagedCache, {}), (CompiledPagedCache, {"max_cache_len": 32})],
                         ids=["eager", "fixed_pool"])
def test_reset_calibrates_anew(pair, cache_class, mode):
    """A reused cache (also compile mode's fixed pool) takes the next requests' scales, so
    keys 50x larger are not clamped to the first requests' range."""
    paged, _ = pair
    ids = torch.randint(1, TINY["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(5))
    cache = cache_class(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype="fp8_e4m3", **mode)
    k_proj = paged.model.layers[0].self_attn.k_proj.weight
    with torch.no_grad():
        paged(ids, past_key_values=cache)
        first = cache.kv.k_scales[0].clone()
        cache.reset()
        k_proj.mul_(50)
        try:
            paged(ids, past_key_values=cache)
        finally:
            k_proj.div_(50)
    torch.testing.assert_close(cache.kv.k_scales[0], first * 50, rtol=1e-3, atol=0)


def test_engine_calibrates_from_its_first_step(engine_pair):
    paged, reference = engine_pair
    prompt = list(range(5, 30))
    keys, values = layer0_keys_values(reference, torch.tensor([prompt]))
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=32,
                                           kv_cache_dtype="fp8_e5m2"))
    engine.generate([Request("one", prompt, SamplingParams(max_new_tokens=4))])
    torch.testing.assert_close(engine.kv_cache.k_scales[0], q.calibrate(keys, torch.float8_e5m2))
    torch.testing.assert_close(engine.kv_cache.v_scales[0], q.calibrate(values, torch.float8_e5m2))
    assert engine.kv_cache.calibrated


def test_bad_fp8_options_raise_at_construction(pair):
    config = pair[0].config
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'"):
        PagedCache(config, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="k_scale and v_scale apply to fp8 caches only"):
        PagedCache(config, k_scale=0.1, v_scale=0.1)
    with pytest.raises(ValueError, match="needs both k_scale and v_scale"):
        PagedCache(config, kv_cache_dtype="fp8_e4m3", k_scale=0.1)
    with pytest.raises(ValueError, match=r"k_scale\[0\] must have 1 element \(per layer\) or 2"):
        PagedCache(config, kv_cache_dtype="fp8_e4m3", k_scale=[[0.1, 0.2, 0.3], 0.1], v_scale=0.1)
    with pytest.raises(ValueError, match="calibration must be one of"):
        PagedCache(config, kv_cache_dtype="fp8_e4m3", kv_scale_calibration="per_token")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'e4m3'"):
        LLMEngine(pair[0], EngineConfig(num_device_blocks=4, kv_cache_dtype="e4m3"))
    with pytest.raises(ValueError, match=r"v_scale must be one scale for every layer or a sequence of "
                                         r"one per layer \(2\), got 3"):
        LLMEngine(pair[0], EngineConfig(num_device_blocks=4, kv_cache_dtype="fp8", k_scale=0.1,
                                        v_scale=[0.1, 0.1, 0.1]))


# ---- accuracy against the float cache -----------------------------------------------------------

def teacher_forced_logits(model, tokens, prompt_len, **cache_options):
    """Logits ``[rows, steps, vocab]`` of the prompt's last position and of each later token
    fed one at a time (the same tokens whatever the cache), through a PagedCache."""
    cache = PagedCache(model.config, block_size=BLOCK_SIZE, **cache_options)
    with torch.no_grad():
        logits = [model(tokens[:, :prompt_len], past_key_values=cache).logits[:, -1]]
        for i in range(prompt_len, tokens.shape[1] - 1):
            logits.append(model(tokens[:, i:i + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(logits, dim=1)


def test_fp8_stays_close_to_the_float_cache(pair):
    """Mean logit error over 24 teacher-forced steps, relative to the bf16 cache's: within 1.5x
    the unit roundoff ratio (e4m3 2^-4, e5m2 2^-3 vs bf16 2^-8), e4m3 closer than e5m2, and
    most greedy choices unchanged (random tiny models have small logit margins: measured
    0.88-0.90 for e4m3, 0.56-0.81 for e5m2)."""
    paged = pair[0]
    ids = torch.randint(1, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tokens = paged.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0,
                                past_key_values=PagedCache(paged.config, block_size=BLOCK_SIZE))
    exact = teacher_forced_logits(paged, tokens, 12)
    error = {}
    for dtype in ("fp8_e4m3", "fp8_e5m2", torch.bfloat16):
        logits = teacher_forced_logits(paged, tokens, 12, kv_cache_dtype=dtype)
        error[dtype] = (logits - exact).abs().mean().item()
        if dtype != torch.bfloat16:
            agreement = (logits.argmax(-1) == exact.argmax(-1)).float().mean().item()
            assert agreement >= {"fp8_e4m3": 0.8, "fp8_e5m2": 0.5}[dtype]
    assert 0 < error[torch.bfloat16] < error["fp8_e4m3"] < error["fp8_e5m2"]
    assert error["fp8_e4m3"] <= 1.5 * 16 * error[torch.bfloat16]
    assert error["fp8_e5m2"] <= 1.5 * 32 * error[torch.bfloat16]


def test_scales_calibrated_once_pass_to_an_engine(engine_pair):
    """docs/fp8.md's recipe: calibrate on representative text, pass the scales as lists."""
    paged = engine_pair[0]
    probe = PagedCache(paged.config, kv_cache_dtype="fp8_e4m3", kv_scale_calibration="per_head")
    with torch.no_grad():
        paged(torch.arange(3, 40).view(1, -1), past_key_values=probe)
    k_scale = [s.tolist() for s in probe.kv.k_scales]
    v_scale = [s.tolist() for s in probe.kv.v_scales]
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=16,
                                           kv_cache_dtype="fp8_e4m3", k_scale=k_scale, v_scale=v_scale))
    assert engine.kv_cache.calibrated and engine.kv_cache.calibration is None
    for given, kept in zip(probe.kv.k_scales + probe.kv.v_scales,
                           engine.kv_cache.k_scales + engine.kv_cache.v_scales):
        assert torch.equal(given, kept) and kept.shape == (2,)
    engine.generate([Request("a", [5, 6, 7], SamplingParams(max_new_tokens=3))])
    assert torch.equal(engine.kv_cache.k_scales[0], probe.kv.k_scales[0])  # not recalibrated
