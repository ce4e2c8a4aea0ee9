"""The accuracy facts docs/performance.md states about the per-token KV formats, on small
shapes with fixed seeds, through the same code as bench/bench_kv_accuracy.py: int8 is far
more accurate than int4, the rotation is what makes int4 workable on outlier keys, and
int4 is in line with llama.cpp's 4-bit formats. Also the anchors' definitions and the
bench's rounding cache (each stored token rounded once)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_kv_accuracy as bench  # noqa: E402
from paged_attention_ext.hf.transformers_behaviour import cache_keyword  # noqa: E402
from common import kv_formats as kf  # noqa: E402
from common.kv_activations import activations, attention  # noqa: E402


def errors(kind: str, queries: int = 1, head_size: int = 128, seed: int = 0):
    a = activations(kind, batch=2, kv_heads=2, heads=8, context=256, queries=queries,
                    head_size=head_size, seed=seed)
    want, _ = attention(a["query"], a["keys"], a["values"])
    out = {}
    for name, fmt in kf.FORMATS.items():
        got, _ = attention(a["query"], fmt.keys(a["keys"], None), fmt.values(a["values"], None))
        out[name] = ((got - want).norm() / want.norm()).item()
    return out


@pytest.fixture(scope="module", params=[("outliers", 1), ("outliers", 16), ("gaussian", 1)],
                ids=lambda p: f"{p[0]}-q{p[1]}")
def case(request):
    kind, queries = request.param
    return kind, errors(kind, queries)


def test_int8_error_well_under_int4(case):
    kind, e = case
    # Outlier channels set an unrotated int8 row's step too: the gap narrows to ~4x.
    assert e["int8_per_token_head"] < e["int4_per_token_head"] / (3 if kind == "outliers" else 10)
    # and about llama.cpp's q8_0, which spends a scale per 32 values
    assert e["int8_per_token_head"] < 3 * e["llama.cpp q8_0"]


def test_rotation_lowers_int4_error_on_outlier_keys():
    e = errors("outliers")
    assert e["int4_per_token_head"] < e["int4, unrotated"] / 2
    assert e["int4, K rotated only"] < 0.6 * e["int4, unrotated"]  # most of it: the keys
    # Gaussian rows have no outlier to spread: the rotation neither helps nor hurts much.
    g = errors("gaussian")
    assert g["int4_per_token_head"] == pytest.approx(g["int4, unrotated"], rel=0.15)


def test_int4_error_in_line_with_llama_cpp_4bit(case):
    kind, e = case
    best_block = min(e["llama.cpp q4_0"], e["llama.cpp q4_1"])
    # one scale pair per 128 values, not per 32: a wider range per scale on Gaussian rows
    assert e["int4_per_token_head"] < 1.4 * best_block
    if kind == "outliers":
        assert e["int4_per_token_head"] < best_block
    assert e["int4_per_token_head"] < 0.35  # the unrotated rows' error is above this


def test_llama_cpp_anchors_follow_their_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 64, generator=gen) * torch.logspace(-2, 2, 4).view(4, 1, 1)
    blocks = x.reshape(4, 3, 2, 32)
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = (largest / -8).half().float()
    q4_0 = kf.q4_0_rows(x).reshape(blocks.shape)
    levels = q4_0 / d
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.min() >= -8 - 1e-4
    assert levels.max() <= 7 + 1e-4
    assert torch.allclose(q4_0.gather(-1, blocks.abs().argmax(-1, keepdim=True)), -8 * d)
    step8 = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    # half a step, plus up to 127 times the fp16 rounding of the stored step (2**-11 relative)
    assert ((kf.q8_0_rows(x).reshape(blocks.shape) - blocks).abs() <= step8 * (0.5 + 127 / 2048)).all()
    q4_1 = kf.q4_1_rows(x).reshape(blocks.shape)
    assert torch.allclose(q4_1.amin(-1), blocks.amin(-1).half().float(), rtol=1e-3)
    # KIVI: keys per channel over 32-token groups (an incomplete last group stays exact)
    keys = torch.randn(2, 70, 64, generator=gen)
    rounded = kf.kivi_key_rows(keys)
    assert torch.equal(rounded[:, 64:], keys[:, 64:]) and not torch.equal(rounded[:, :64], keys[:, :64])
    assert rounded[0, :32, 0].unique().numel() <= 16  # 4 bits per channel and group


def test_rounding_cache_rounds_every_token_once():
    config = bench.model_configs()["qwen2_gqa"]  # a sliding-window layer too
    config.num_hidden_layers = 2
    model = bench.random_pair(config, seed=0)[1]
    seen = {"keys": 0, "values": 0}

    def counting(part, rows):
        def fn(x, scale=None):
            seen[part] += x.shape[0] * x.shape[1] * x.shape[2]
            return rows(x, scale)
        return fn

    fmt = kf.Format(counting("keys", kf.int8_rows), counting("values", kf.int8_rows), lambda d: 8.0)
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, **{cache_keyword(model): bench.RoundingCache(model.config, fmt)},
                             max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=0)
    fed = out.shape[1] - 1  # the last token is never fed back
    rows = fed * 2 * config.num_key_value_heads * config.num_hidden_layers
    assert seen == {"keys": rows, "values": rows}


def test_rounding_cache_rounds_kivi_key_groups_once_complete():
    config = bench.model_configs()["llama_gqa"]
    model = bench.random_pair(config, seed=0)[1]
    ids = torch.randint(1, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = bench.RoundingCache(model.config, kf.FORMATS["KIVI 4-bit"])
    with torch.no_grad():
        model.generate(ids, **{cache_keyword(model): cache}, max_new_tokens=50, min_new_tokens=50,
                       do_sample=False, pad_token_id=0)
    keys = cache.layers[0].keys  # 69 tokens: two complete groups, 5 newest exact
    assert keys.shape[-2] == 69 and cache.pending[0] == 5
    for group in (keys[..., :32, :], keys[..., 32:64, :]):
        assert torch.allclose(kf.kivi_key_rows(group), group, atol=1e-5)  # already on its grid
