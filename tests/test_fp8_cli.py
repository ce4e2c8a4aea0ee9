"""fp8 in the command line: the memory calculator agrees with the cache's accounting, and the
demo serves its batch from an fp8 pool holding more tokens in the same bytes."""

import json

import pytest
import torch

from paged_attention_ext.kv_cache import PagedKVCache
from paged_attention_ext.tools import memory
from paged_attention_ext.tools.cli import main


@pytest.mark.parametrize("name, dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2), ("bfloat16", torch.bfloat16)])
def test_memory_sizes_match_the_cache(name, dtype, capsys):
    assert main(["memory", "--layers", "3", "--kv-heads", "2", "--head-size", "64", "--dtype", name,
                 "--block-size", "16", "--memory-gib", "0.001", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    scales = dict(k_scale=1.0, v_scale=1.0) if dtype.itemsize == 1 else {}
    cache = PagedKVCache(3, 2, 64, block_size=16, dtype=dtype, memory_bytes=report["memory_bytes"],
                         **scales)
    assert report["bytes_per_block"] == cache.block_bytes
    assert report["blocks_fit"] == cache.num_blocks
    assert report["blocks_fit"] * 16 == cache.usage(0)["device_tokens"] <= report["tokens_fit"]
    assert memory.DTYPE_BYTES[name] == dtype.itemsize


def test_demo_with_fp8_cache_holds_more_tokens(capsys):
    assert main(["demo", "--kv-cache-dtype", "fp8_e4m3", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    pool = report["kv_pool"]
    # The built-in model is float32: the same bytes hold 4x its tokens, 2x bf16's.
    assert pool["dtype"] == "float8_e4m3fn" and pool["model_dtype"] == "float32"
    assert pool["tokens"] == 4 * pool["model_dtype_tokens"] == 2 * pool["bfloat16_tokens"]
    # --blocks 40 of fp32: 4 layers x 2 KV heads x 16 tokens x (16 + 16) values x 4 bytes each.
    assert pool["bytes"] == 40 * 4 * 2 * 16 * 32 * 4 and pool["model_dtype_tokens"] == 640
    assert report["engine"]["kv_blocks_total"] == pool["blocks"] == 160
    assert report["engine"]["config"]["kv_cache_dtype"] == "fp8_e4m3"
    assert report["ok"] is True and "KV capacity       2560 tokens" in out
