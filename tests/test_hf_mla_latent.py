"""MLA models in a PagedCache keep their latent rows: one row of ``kv_lora_rank +
qk_rope_head_dim`` values per token, shared by every head, read with ``kv_b_proj``
absorbed. Token equality with eager for greedy, sampled and beam search decoding lives in
test_hf_architectures.py; here: the bytes, the compiled path, fp8 rows, and the refusals."""

import copy

import pytest
import torch
import transformers

from paged_attention_ext.hf import CompiledPagedCache, PagedCache
from paged_attention_ext.hf import latent_prefill
from paged_attention_ext.hf.latent_attention import absorbed_weights, forget_absorbed_weights
from paged_attention_ext.testing import random_pair

from hf_prompts import left_padded

BLOCK_SIZE = 4
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2)
# Dense layers: an expert choice that a rounding moves would swamp the logit comparisons.
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
           q_lora_rank=48, first_k_dense_replace=2)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    paged, reference = random_pair(transformers.DeepseekV3Config(**TINY, **MLA),
                                   reference_attention="eager")
    return reference, paged


def generate(model, cache=None, **kwargs):
    ids, mask = left_padded([9, 5], seed=3)
    extra = {} if cache is None else {"past_key_values": cache}
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=10,
                              do_sample=False, **kwargs, **extra)


def test_latent_rows_hold_each_token_once_for_every_head(pair):
    reference, paged = pair
    latent, expanded = PagedCache(paged.config, block_size=BLOCK_SIZE), \
        PagedCache(paged.config, block_size=BLOCK_SIZE, mla_storage="expanded")
    assert torch.equal(generate(paged, latent), generate(paged, expanded))
    # Per token and layer: 32 + 8 values against 4 heads x (24 + 16).
    per_block = latent.kv.block_bytes, expanded.kv.block_bytes
    assert per_block[1] / per_block[0] == 4 * (24 + 16) / (32 + 8)
    key_rows, values = latent.kv.layer(1)
    assert values.data_ptr() == key_rows.data_ptr() and values.stride() == key_rows.stride()


def test_compiled_forward_over_latent_rows(pair):
    """CompiledPagedCache: prefill and decode graphs over the latent rows, no graph break."""
    from torch._dynamo.utils import counters
    reference, paged = pair
    want = generate(reference)
    torch._dynamo.reset()
    counters.clear()
    forward = paged.forward
    paged.forward = torch.compile(forward, fullgraph=True, backend="eager")
    try:
        cache = CompiledPagedCache(paged.config, block_size=BLOCK_SIZE, max_cache_len=32)
        got = generate(paged, cache)
    finally:
        paged.forward = forward
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert cache.kv.values_in_keys


def _teacher_forced_error(model, cache, reference):
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids, past_key_values=cache).logits.float()
    return (got - want).abs().max().item() / want.abs().max().item()


def test_fp8_latent_rows_share_one_scale_and_stay_as_close_as_expanded(pair):
    reference, paged = pair
    latent = PagedCache(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype="fp8_e4m3")
    expanded = PagedCache(paged.config, block_size=BLOCK_SIZE, kv_cache_dtype="fp8_e4m3",
                          mla_storage="expanded")
    errors = [_teacher_forced_error(paged, cache, reference) for cache in (latent, expanded)]
    assert latent.kv.dtype == torch.float8_e4m3fn
    for layer in range(2):
        scales = latent.kv.scales(layer)
        assert torch.equal(scales["k_scale"], scales["v_scale"]) and scales["k_scale"].numel() == 1
    # One scale for the latent and the rotary key (vLLM's latent cache has one too) costs
    # some precision against expanded K/V's two scales per layer; measured 1.6x here.
    assert errors[0] <= 2 * errors[1] + 0.01, errors


def test_latent_rows_refuse_a_kv_b_proj_they_cannot_absorb(pair):
    reference, paged = pair
    model = copy.deepcopy(paged)
    attention = model.model.layers[0].self_attn

    class Quantized(torch.nn.Module):  # stands for a quantized projection
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return self.linear(x)

    attention.kv_b_proj = Quantized(attention.kv_b_proj)
    with pytest.raises(NotImplementedError, match="layer 0.*Quantized.*mla_storage='expanded'"):
        generate(model, PagedCache(model.config, block_size=BLOCK_SIZE))
    # The expanded form serves it.
    assert torch.equal(generate(model, PagedCache(model.config, block_size=BLOCK_SIZE,
                                                  mla_storage="expanded")), generate(reference))


def test_unknown_mla_storage_is_refused(pair):
    with pytest.raises(ValueError, match="mla_storage must be one of"):
        PagedCache(pair[1].config, mla_storage="compressed")


def test_absorbed_weights_are_derived_once_and_again_when_the_weight_changes(pair):
    reference, paged = pair
    model = copy.deepcopy(paged)
    attention = model.model.layers[1].self_attn
    heads, latent = model.config.num_attention_heads, model.config.kv_lora_rank
    nope = model.config.qk_nope_head_dim

    def derived(dtype=torch.float32):
        return absorbed_weights(attention, heads, latent, dtype)

    def expected(weight):
        per_head = weight.view(heads, -1, latent)
        return per_head[:, :nope], per_head[:, nope:].transpose(1, 2)

    first = derived()
    assert derived() is first  # reused, not copied again
    assert first.key.is_contiguous() and first.value_t.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(first, expected(attention.kv_b_proj.weight)))
    # Written in place (a reload through load_state_dict copies into the same tensor).
    with torch.no_grad():
        attention.kv_b_proj.weight.mul_(-1)
    changed = derived()
    assert changed is not first
    assert all(torch.equal(a, b) for a, b in zip(changed, expected(attention.kv_b_proj.weight)))
    # Replaced by another tensor of the same contents, then cast: derived again each time.
    attention.kv_b_proj.weight = torch.nn.Parameter(attention.kv_b_proj.weight.detach().clone())
    replaced = derived()
    assert replaced is not changed
    bf16 = derived(torch.bfloat16)
    assert bf16.key.dtype == torch.bfloat16 and derived() is replaced
    attention.kv_b_proj.to(torch.float64)  # the same Parameter, its data cast
    assert derived().key.dtype == torch.float32 and derived() is not replaced
    with torch.inference_mode():  # an inference tensor: no version counter to read
        weight = torch.randn_like(attention.kv_b_proj.weight)
    attention.kv_b_proj.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert all(torch.equal(a, b.float()) for a, b in zip(derived(), expected(weight)))
    # Writes the stamp cannot see (through .data; in place on an inference tensor) take
    # forget_absorbed_weights.
    for write in ("data", "inference"):
        before = derived()
        if write == "data":
            attention.kv_b_proj.weight.data.mul_(-1)
        else:
            with torch.inference_mode():
                attention.kv_b_proj.weight.mul_(-1)
        forget_absorbed_weights(model)
        assert derived() is not before
        assert all(torch.equal(a, b.float()) for a, b in zip(derived(), expected(attention.kv_b_proj.weight)))


def test_generate_after_reloading_kv_b_proj_uses_the_new_weights(pair):
    reference, paged = pair
    reference, paged = copy.deepcopy(reference), copy.deepcopy(paged)
    before = generate(paged, PagedCache(paged.config, block_size=BLOCK_SIZE))
    assert torch.equal(before, generate(reference))
    torch.manual_seed(5)
    state = {name: torch.randn_like(tensor) * 0.2 for name, tensor in paged.state_dict().items()
             if name.endswith("kv_b_proj.weight")}
    for model in (reference, paged):
        model.load_state_dict(state, strict=False)
    want = generate(reference)
    assert not torch.equal(want, before)  # the stale weights would give the old tokens
    assert torch.equal(generate(paged, PagedCache(paged.config, block_size=BLOCK_SIZE)), want)


@pytest.mark.parametrize("kwargs", [{}, dict(num_beams=3, num_return_sequences=2)])
def test_prefill_through_expanded_rows_equals_eager(pair, monkeypatch, kwargs):
    """Prompts of 9 and 5 tokens past a threshold of 4 query rows: the prefill's sequences
    are expanded, every decode step absorbed."""
    reference, paged = pair
    monkeypatch.setattr(latent_prefill, "EXPAND_MIN_QUERIES", 4)
    monkeypatch.setattr(latent_prefill, "EXPANSION_COST", 0.0)
    queries = []
    run = latent_prefill._run_expanded
    monkeypatch.setattr(latent_prefill, "_run_expanded",
                        lambda module, metadata, query, *args: queries.append(query.shape[0])
                        or run(module, metadata, query, *args))
    got = generate(paged, PagedCache(paged.config, block_size=BLOCK_SIZE), **kwargs)
    assert torch.equal(got, generate(reference, **kwargs))
    rows = 3 if kwargs else 1  # beams: the prompts repeated
    assert queries == [rows * (9 + 5)] * paged.config.num_hidden_layers
