"""paged_attention_ext.layouts: other engines' cache layouts as views in the ops' shape."""

import doctest

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import layouts
from paged_attention_ext.layouts import from_nhd, split_kv


def test_layout_helper_examples_run():
    """paged_attention_ext.layouts documents its views with examples; they run."""
    result = doctest.testmod(layouts, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0, result


def test_from_nhd_is_the_transposed_view_of_the_same_memory():
    nhd = torch.randn(3, 4, 2, 8)  # [blocks, block_size, kv_heads, head]
    view = from_nhd(nhd)
    assert view.shape == (3, 2, 4, 8) and view.data_ptr() == nhd.data_ptr()
    assert torch.equal(view[1, 0, 2], nhd[1, 2, 0])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_split_kv_views_key_and_value_halves(layout):
    kv = torch.randn(2, 3, 4, 2, 8)
    key, value = split_kv(kv, layout)
    assert key.shape == value.shape == ((3, 2, 4, 8) if layout == "NHD" else (3, 4, 2, 8))
    assert key.data_ptr() == kv[0].data_ptr() and value.data_ptr() == kv[1].data_ptr()
    if layout == "NHD":
        assert torch.equal(value[2, 1, 3], kv[1, 2, 3, 1])
    else:
        assert torch.equal(value, kv[1])


def test_write_kv_through_the_views_lands_in_the_joint_tensor():
    kv = torch.zeros(2, 2, 4, 2, 8)  # vLLM: [2, blocks, block_size, kv_heads, head]
    key_cache, value_cache = split_kv(kv)
    key, value = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    pa.write_kv(key, value, key_cache, value_cache, torch.tensor([6]))  # block 1, slot 2
    assert torch.equal(kv[0, 1, 2], key[0]) and torch.equal(kv[1, 1, 2], value[0])
    assert int((kv != 0).sum()) == 2 * 2 * 8


@pytest.mark.parametrize("make, match", [
    (lambda: from_nhd(torch.zeros(2, 4, 8)), r"from_nhd: argument 'cache' must be 4-D"),
    (lambda: split_kv(torch.zeros(3, 2, 4, 2, 8)), r"split_kv: argument 'kv_cache' must be 5-D"),
    (lambda: split_kv(torch.zeros(2, 4, 2, 8)), r"must be 5-D with a leading dimension of 2"),
    (lambda: split_kv(torch.zeros(2, 2, 4, 2, 8), layout="nhd"), r"must be 'NHD' or 'HND', got 'nhd'"),
])
def test_wrong_shapes_and_layouts_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()
