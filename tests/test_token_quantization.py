"""The per-token formats' definition (token_quantization.py): rotation, rounding, packing."""

import pytest
import torch

from paged_attention_ext import token_quantization as tq


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 192, 256, 512, 576])
def test_rotation_is_orthonormal_and_inverted_by_unrotate(head_size):
    x = torch.randn(7, head_size)
    r = tq.rotate(x)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(tq.unrotate(r), x, atol=1e-5, rtol=1e-5)
    q = torch.randn(head_size)
    torch.testing.assert_close(tq.rotate(q) @ r.T, q @ x.T, atol=1e-4, rtol=1e-4)


def test_rotation_blocks_and_signs():
    assert [tq.rotation_block(d) for d in (64, 80, 96, 128, 576, 1024)] == [64, 16, 32, 128, 64, 512]
    signs = tq.rotation_signs(512)
    assert set(signs.tolist()) == {1.0, -1.0}
    assert 200 < int((signs < 0).sum()) < 312  # balanced, not all one sign
    # Matches the explicit matrix H_n diag(s) / sqrt(n) for one block.
    n = 8
    h = torch.tensor([[1.0]])
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(3, n)
    want = (x * tq.rotation_signs(n)) @ h.T / n ** 0.5
    torch.testing.assert_close(tq.rotate(x), want)


def test_int8_rows_spend_the_full_range_and_round_to_nearest():
    x = torch.randn(5, 3, 128) * torch.logspace(-3, 3, 5)[:, None, None]
    q, scale = tq.quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 3)
    assert (q.abs().amax(-1) == 127).all()
    err = (tq.dequantize_int8(q, scale) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()


def test_int8_zero_and_nan_rows():
    x = torch.zeros(2, 64)
    x[1, 3] = float("nan")
    q, scale = tq.quantize_int8(x)
    assert (q == 0).all()
    assert scale[0] == 0 and scale[1].isnan()
    assert (tq.dequantize_int8(q, scale)[0] == 0).all()


@pytest.mark.parametrize("rotated", [True, False])
def test_int4_packing_rounding_and_constant_rows(rotated):
    x = torch.randn(4, 2, 96)
    x[0, 0] = 2.5  # a constant row is stored exactly
    packed, scales = tq.quantize_int4(x, rotated=rotated)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 2, 48) and scales.shape == (4, 2, 2)
    nibbles = torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2)
    r = tq.rotate(x) if rotated else x
    want = torch.round((r - scales[..., 1, None]) / scales[..., 0, None]).nan_to_num(0).clamp(0, 15)
    assert torch.equal(nibbles.float(), want)
    back = tq.dequantize_int4(packed, scales, rotated=rotated)
    if not rotated:
        torch.testing.assert_close(back[0, 0], x[0, 0])
    rel = (back - x).norm() / x.norm()
    assert rel < 0.12


def test_rotation_lowers_int4_error_on_outlier_channels():
    x = torch.randn(256, 128)
    x[:, [5, 77]] *= 30.0  # outlier channels, as real models' keys have
    err = {rot: ((tq.dequantize_int4(*tq.quantize_int4(x, rot), rotated=rot) - x).norm() / x.norm()).item()
           for rot in (True, False)}
    assert err[True] < 0.5 * err[False]


def test_format_shapes_and_bytes():
    assert tq.scale_shape(torch.int8, 10, 4, 16) == (10, 4, 16)
    assert tq.scale_shape(torch.uint8, 10, 4, 16) == (10, 4, 16, 2)
    assert tq.bytes_per_token_head(torch.int8, 128) == 132
    assert tq.bytes_per_token_head(torch.uint8, 128) == 72
    assert tq.head_size_of(torch.empty(1, 1, 1, 64, dtype=torch.uint8)) == 128
    with pytest.raises(ValueError, match="head_size 65 must be even"):
        tq.stored_head_size(torch.uint8, 65)
    with pytest.raises(ValueError, match="not a per-token"):
        tq.scale_shape(torch.float8_e4m3fn, 1, 1, 1)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_reference_ops_over_a_per_token_cache_equal_attention_over_its_values(dtype):
    from paged_attention_ext import reference
    torch.manual_seed(0)
    num_blocks, heads, kv_heads, block_size, head_size = 6, 4, 2, 4, 64
    stored = tq.stored_head_size(dtype, head_size)
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, stored, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(tq.scale_shape(dtype, num_blocks, kv_heads, block_size))
    v_scale = torch.zeros_like(k_scale)
    key, value = torch.randn(9, kv_heads, head_size), torch.randn(9, kv_heads, head_size)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7, 20])  # positions 0..8 in blocks 3, 1, 5
    reference.write_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    block_tables = torch.tensor([[3, 1, 5, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([9], dtype=torch.int32)
    query = torch.randn(1, heads, head_size)
    out = reference.attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125,
                              k_scale=k_scale, v_scale=v_scale)
    # The same attention over the dequantized rows.
    keys, values = tq.dequantize(*tq.quantize(key, dtype)), tq.dequantize(*tq.quantize(value, dtype))
    scores = torch.einsum("hd,thd->ht", query[0], keys.repeat_interleave(2, dim=1)) * 0.125
    want = torch.einsum("ht,thd->hd", scores.softmax(-1), values.repeat_interleave(2, dim=1))
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)
    exact = torch.einsum("ht,thd->hd", (torch.einsum("hd,thd->ht", query[0], key.repeat_interleave(2, 1))
                                        * 0.125).softmax(-1), value.repeat_interleave(2, 1))
    assert (out[0] - exact).abs().max() < (0.05 if dtype == torch.int8 else 0.5)
