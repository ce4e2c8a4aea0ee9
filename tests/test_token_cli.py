"""Per-token formats in the command line: the memory calculator counts each row's scales as
the cache does, and the demo serves its batch from a per-token pool."""

import json

import pytest
import torch

from paged_attention_ext.kv_cache import PagedKVCache
from paged_attention_ext.tools import memory
from paged_attention_ext.tools.cli import main

FORMATS = {"int8_per_token_head": torch.int8, "int4_per_token_head": torch.uint8}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_memory_sizes_match_the_cache(name, capsys):
    assert main(["memory", "--layers", "3", "--kv-heads", "2", "--head-size", "64", "--dtype", name,
                 "--block-size", "16", "--memory-gib", "0.001", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cache = PagedKVCache(3, 2, 64, block_size=16, dtype=FORMATS[name],
                         memory_bytes=report["memory_bytes"])
    assert report["bytes_per_block"] == cache.block_bytes
    assert report["blocks_fit"] == cache.num_blocks
    assert report["blocks_fit"] * 16 == cache.usage(0)["device_tokens"] <= report["tokens_fit"]
    assert report["dtype_bytes"] is None  # no one size per value: a row's bytes count its scales


@pytest.mark.parametrize("name, per_head, ratio", [("int8_per_token_head", 132, 1.94),
                                                   ("int4_per_token_head", 72, 3.56)])
def test_tokens_per_pool_against_bf16_at_head_128(name, per_head, ratio):
    shape = memory.PRESETS["llama-3-8b"]  # 32 layers, 8 KV heads of 128
    report = memory.kv_report(shape, name, max_len=2048, memory_gib=16)
    bf16 = memory.kv_report(shape, "bfloat16", max_len=2048, memory_gib=16)
    assert report["bytes_per_token"] == 32 * 8 * 2 * per_head
    assert report["tokens_fit"] / bf16["tokens_fit"] == pytest.approx(ratio, abs=0.005)


def test_per_token_groups_are_sized_like_the_cache():
    """Gemma-4's groups of two shapes: pages sized by bytes, scales included."""
    shape = memory.PRESETS["gemma-4-e4b"]
    report = memory.kv_report(shape, "int4_per_token_head", max_len=4096, block_size=16)
    layers = [layer for layer in range(shape.layers) if layer not in shape.readers()]
    assert report["bytes_per_token"] == sum(memory.layer_bytes("int4_per_token_head",
                                                               shape.layer_shapes()[layer])
                                            for layer in layers)
    assert report["bytes_per_token"] == sum(heads * (size // 2 + 8 + size_v // 2 + 8)
                                            for heads, size, size_v in
                                            (shape.layer_shapes()[layer] for layer in layers))


def test_latent_rows_count_one_per_token_row_and_its_scales():
    """DeepSeek-V3's latent rows: 576 values and one scale (int8: 4 bytes), or 288 bytes and
    one (scale, low) pair (int4: 8 bytes), per token and layer."""
    shape = memory.PRESETS["deepseek-v3"]
    for dtype, row in (("int8_per_token_head", 576 + 4), ("int4_per_token_head", 288 + 8)):
        report = memory.kv_report(shape, dtype, max_len=16)
        assert report["bytes_per_token"] == shape.layers * row
        assert report["bytes_per_token_expanded"] == memory.expanded_bytes_per_token(shape, dtype)



def test_memory_command_prints_a_latent_rows_bytes(capsys):
    assert main(["memory", "--preset", "deepseek-v3", "--dtype", "int4_per_token_head"]) == 0
    out = capsys.readouterr().out
    assert "int4_per_token_head (296 bytes per row of 576 values, scales included)" in out
    assert f"({61 * 296} bytes)" in out


def test_memory_command_prints_a_rows_bytes(capsys):
    assert main(["memory", "--preset", "llama-3-8b", "--dtype", "int8_per_token_head"]) == 0
    out = capsys.readouterr().out
    assert "int8_per_token_head (132 bytes per row of 128 values, scales included)" in out
    assert "66 KiB (67584 bytes)" in out  # 32 layers x 8 heads x (K, V) x 132 bytes


@pytest.mark.parametrize("name, ratio", [("int8_per_token_head", 64 / 20), ("int4_per_token_head", 4)])
def test_demo_with_per_token_cache_holds_more_tokens(name, ratio, capsys):
    assert main(["demo", "--kv-cache-dtype", name, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pool = report["kv_pool"]
    # The built-in model is float32 with heads of 16: 64 bytes a row against 20 (int8) or 16.
    assert pool["dtype"] == name and pool["model_dtype"] == "float32"
    assert pool["tokens"] == pytest.approx(ratio * pool["model_dtype_tokens"], rel=0.01)
    assert report["engine"]["config"]["kv_cache_dtype"] == name
    assert report["ok"] is True
