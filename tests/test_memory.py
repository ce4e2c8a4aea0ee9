"""The KV-cache size calculator and its `paged-attention memory` command."""

import json

import pytest

from paged_attention_ext.tools.cli import main
from paged_attention_ext.tools.memory import (GIB, PRESETS, ModelShape, bytes_per_token, format_bytes,
                                        kv_report, resolve_shape)


def test_llama_2_7b_float16_is_512_kib_per_token_and_1_gib_per_2048_tokens():
    report = kv_report(PRESETS["llama-2-7b"], "float16", max_len=2048)
    assert report["bytes_per_token"] == 512 * 1024
    assert report["bytes_per_sequence"] == GIB


@pytest.mark.parametrize("preset, dtype, expected", [
    ("llama-3-8b", "bfloat16", 128 * 1024),  # GQA: 8 KV heads
    ("mistral-7b", "float16", 128 * 1024),
    ("qwen2-7b", "float16", 2 * 28 * 4 * 128 * 2),
    ("llama-2-13b", "float16", 800 * 1024),  # the vLLM paper's 800 KB per token (OPT-13B)
    ("llama-2-7b", "float32", 1024 * 1024),
    ("llama-2-7b", "fp8", 256 * 1024),
])
def test_bytes_per_token_of_presets(preset, dtype, expected):
    assert bytes_per_token(PRESETS[preset], dtype) == expected


def test_explicit_fields_override_the_preset():
    assert resolve_shape("llama-2-7b", kv_heads=8) == ModelShape(layers=32, kv_heads=8, head_size=128)
    assert resolve_shape(None, 2, 4, 64) == ModelShape(2, 4, 64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers=2, kv_heads=4), "missing: head_size"),
    (dict(preset="gpt-5"), "unknown preset"),
    (dict(layers=0, kv_heads=1, head_size=1), "layers must be >= 1"),
])
def test_bad_shapes_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_shape(**kwargs)


def test_block_and_capacity_report():
    report = kv_report(PRESETS["llama-2-7b"], "float16", 2048, block_size=16, memory_gib=40)
    assert report["bytes_per_block"] == 8 << 20
    assert (report["tokens_fit"], report["blocks_fit"], report["sequences_fit"]) == (81920, 5120, 40)


def test_format_bytes():
    assert format_bytes(524288) == "512 KiB"
    assert format_bytes(GIB) == "1 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"


def test_cli_json_last_line(capsys):
    assert main(["memory", "--preset", "llama-2-7b", "--block-size", "16", "--memory-gib", "2",
                 "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "512 KiB" in lines[1] and "1 GiB" in lines[2]
    report = json.loads(lines[-1])
    assert report["bytes_per_token"] == 524288 and report["bytes_per_sequence"] == GIB
    assert report["blocks_fit"] == 256 and report["sequences_fit"] == 2


def test_cli_needs_a_full_shape(capsys):
    with pytest.raises(SystemExit, match="missing: kv_heads, head_size"):
        main(["memory", "--layers", "2"])
