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


@pytest.mark.parametrize("preset, latent, expanded", [
    # latent: layers * (kv_lora_rank 512 + qk_rope_head_dim 64); expanded: layers * heads * (192 + 128)
    ("deepseek-v3", 61 * 576 * 2, 61 * 128 * 320 * 2),
    ("deepseek-v2-lite", 27 * 576 * 2, 27 * 16 * 320 * 2),
    ("kimi-k2", 61 * 576 * 2, 61 * 64 * 320 * 2),
])
def test_mla_presets_give_latent_and_expanded_bytes(preset, latent, expanded):
    report = kv_report(PRESETS[preset], "bfloat16", max_len=8192, block_size=16, memory_gib=80)
    assert report["bytes_per_token"] == latent
    assert report["bytes_per_token_expanded"] == expanded
    assert report["latent_saving"] == pytest.approx(expanded / latent)
    assert report["tokens_fit"] == 80 * GIB // latent
    assert report["bytes_per_block"] == 16 * latent


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


# ---- sliding-window layers in KV groups -------------------------------------------------
HYBRID = ["gemma-3-27b", "gemma-3-1b", "gpt-oss-120b", "gemma-2-9b", "cohere-2-7b", "mistral-7b-v0.1"]


@pytest.mark.parametrize("preset", HYBRID)
@pytest.mark.parametrize("max_len", [4096, 32768])
def test_kv_groups_hold_their_tokens_within_a_block(preset, max_len):
    """Each group holds at most one block more than its tokens (all, or its window) need,
    and the sequence far less than one table for every layer once the context passes the window."""
    shape = PRESETS[preset]
    report = kv_report(shape, "bfloat16", max_len, block_size=16)["kv_groups"]
    for group in report["groups"]:
        needed = min(max_len, group["sliding_window"] or max_len)
        assert -(-needed // 16) <= group["blocks_held"] <= -(-needed // 16) + 1
    # The expected fraction: full layers' share plus the sliding layers' (window + block) / context.
    sliding = sum(1 for w in shape.windows() if w) / shape.layers
    estimate = 1 - sliding + sliding * min(1.0, (shape.sliding_window + 16) / max_len)
    padding = report["padded_layers"] * min(max_len, shape.sliding_window + 16) / (shape.layers * max_len)
    assert report["fraction_of_single_table"] <= estimate + padding + 1e-9
    if max_len > shape.sliding_window + 16:
        assert report["saving"] > 1.5


def test_gemma_3_at_32k_needs_a_fifth_of_one_table():
    report = kv_report(PRESETS["gemma-3-27b"], "bfloat16", 32768, block_size=16)["kv_groups"]
    assert report["num_groups"] == 7 and report["layers_per_group"] == 10
    assert 5.0 < report["saving"] < 5.4  # five sliding layers (1024 tokens) to each full one: ~5.2x


def test_layer_pattern_and_window_flags(capsys):
    assert main(["memory", "--layers", "6", "--kv-heads", "2", "--head-size", "64", "--sliding-window",
                 "512", "--layer-pattern", "5:1", "--max-len", "8192", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    groups = report["kv_groups"]
    assert [g["sliding_window"] for g in groups["groups"]] == [None, 512, 512, 512, 512, 512]
    # 512 keys back from the last token (8191) start at 7680: block 480, or 479 for the token
    # before it, which is kept so that it can be dropped again (speculative decoding).
    assert groups["groups"][0]["blocks_held"] == 512 and groups["groups"][1]["blocks_held"] == 33
    assert resolve_shape(None, 2, 2, 8, sliding_window=4).layer_pattern == (1, 0)


@pytest.mark.parametrize("argv, message", [
    (["--layer-pattern", "5-1"], "SLIDING:FULL"),
    (["--layer-pattern", "0:0"], "SLIDING:FULL"),
])
def test_bad_layer_patterns_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["memory", "--layers", "2", "--kv-heads", "2", "--head-size", "8", *argv])
    assert message in capsys.readouterr().err


def test_pattern_with_sliding_layers_needs_a_window():
    with pytest.raises(ValueError, match="give sliding_window"):
        resolve_shape(None, 2, 2, 8, layer_pattern=(1, 1))


def test_a_short_kv_group_says_it_is_padded(capsys):
    """Gemma-3-27B: groups of 10 layers (its full ones); the last of its 52 sliding layers' groups
    has 2 and holds the bytes of 10, since every group's page has one size (one pool)."""
    assert main(["memory", "--preset", "gemma-3-27b", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])["kv_groups"]
    assert [g["layers"] for g in report["groups"]] == [10] * 6 + [2]
    assert [g["padded_layers"] for g in report["groups"]] == [0] * 6 + [8]
    assert report["padded_layers"] == 8 and report["layers_per_group"] == 10
    assert report["groups"][6]["bytes_held"] == report["groups"][1]["bytes_held"]
    rows = [line for line in lines if line.lstrip().startswith("KV group ")]
    assert rows[6].lstrip().startswith("KV group 6 (2 layers, window 1024):")
    assert rows[6].endswith("(padded to 10 layers: all KV groups share one pool, so every page "
                            "holds 10 layers; 8 of them unused here)")
    assert not any("padded" in row for row in rows[:6])


def test_groups_of_equal_size_say_nothing_of_padding(capsys):
    assert main(["memory", "--preset", "gpt-oss-120b"]) == 0  # 18 sliding + 18 full layers
    out = capsys.readouterr().out
    assert "KV group 1 (18 layers" in out and "padded" not in out


# ---- chunked-attention layers in KV groups (Llama-4) -------------------------------------

@pytest.mark.parametrize("max_len", [4096, 8192, 8193, 32767, 32768, 32769, 40000])
def test_llama_4_scout_chunked_groups_hold_their_chunk_within_a_block(max_len):
    """Each chunked group holds the blocks of its last token's chunk (at most one block more
    than the tokens it reads), the NoPE full group every block."""
    report = kv_report(PRESETS["llama-4-scout"], "bfloat16", max_len, block_size=16)["kv_groups"]
    assert [g["kind"] for g in report["groups"]] == ["full attention"] + ["chunks of 8192"] * 3
    assert report["layers_per_group"] == 12 and report["padded_layers"] == 0
    chunk_tokens = max_len - (max_len - 1) // 8192 * 8192
    for group in report["groups"]:
        needed = chunk_tokens if group["chunk_size"] else max_len
        assert -(-needed // 16) <= group["blocks_held"] <= -(-needed // 16) + 1
    assert report["bytes_per_sequence"] <= report["bytes_per_sequence_ideal"] + 4 * report["bytes_per_block"]


def test_llama_4_scout_at_32k_holds_under_half_of_one_table():
    report = kv_report(PRESETS["llama-4-scout"], "bfloat16", 32768, block_size=16)
    groups = report["kv_groups"]
    assert report["bytes_per_token"] == 48 * 8 * 256 * 2  # 192 KiB: every layer, one table
    assert [g["blocks_held"] for g in groups["groups"]] == [2048, 512, 512, 512]
    # 12 full layers hold 32k tokens, 36 chunked ones 8k: (12 * 32k + 36 * 8k) / (48 * 32k).
    assert groups["fraction_of_single_table"] == pytest.approx((12 * 4 + 36) / (48 * 4))
    assert groups["fraction_of_ideal"] == 1.0


def test_attention_chunk_size_flag(capsys):
    assert main(["memory", "--layers", "4", "--kv-heads", "2", "--head-size", "64",
                 "--attention-chunk-size", "256", "--layer-pattern", "3:1", "--max-len", "1000",
                 "--block-size", "16", "--json"]) == 0
    out = capsys.readouterr().out
    assert "layers 3 chunked (chunks of 256) : 1 full" in out
    groups = json.loads(out.strip().splitlines()[-1])["kv_groups"]["groups"]
    assert [(g["chunk_size"], g["blocks_held"]) for g in groups] == [
        (None, 63), (256, 15), (256, 15), (256, 15)]  # 1000 tokens; 999 // 256 * 256 = 768


def test_a_shape_slides_or_chunks_not_both():
    with pytest.raises(ValueError, match="give sliding_window or attention_chunk_size, not both"):
        resolve_shape(None, 4, 2, 8, sliding_window=64, attention_chunk_size=256)
    assert resolve_shape(None, 4, 2, 8, attention_chunk_size=256).layer_pattern == (1, 0)


# ---- hybrid linear-attention shapes ------------------------------------------------------

@pytest.mark.parametrize("preset, full, linear", [("qwen3-next-80b-a3b", 12, 36),
                                                  ("qwen3.5-35b-a3b", 10, 30)])
def test_linear_attention_presets_split_kv_and_state(preset, full, linear):
    """K/V: the full layers only (2 heads of 256); state: per linear layer the conv window
    (q, k: 16 heads of 128; v: 32 heads of 128; 4 tokens) and the recurrent matrix (32 heads
    of 128 x 128), in 2-byte values."""
    report = kv_report(PRESETS[preset], "bfloat16", max_len=8192, memory_gib=80)["linear_state"]
    kv = full * 2 * 512 * 2 * 8192
    state = linear * ((2 * 16 * 128 + 32 * 128) * 4 + 32 * 128 * 128) * 2
    assert report["kv_bytes_per_sequence"] == kv
    assert report["state_bytes_per_sequence"] == state
    assert report["bytes_per_sequence_kv_every_layer"] == kv * (full + linear) // full
    assert report["sequences_fit"] == 80 * GIB // (kv + state)
    assert report["sequences_fit_kv_every_layer"] == 80 * GIB // (kv * 4)


def test_qwen3_next_8k_requests_in_80_gib(capsys):
    """The pool's bytes hold 355 sequences of 8k tokens (K/V of 12 full layers + 36 states),
    106 if every layer kept K/V; fp8 K/V leaves the states at 2 bytes."""
    report = kv_report(PRESETS["qwen3-next-80b-a3b"], "bfloat16", max_len=8192, memory_gib=80)
    assert (report["linear_state"]["sequences_fit"],
            report["linear_state"]["sequences_fit_kv_every_layer"]) == (355, 106)
    fp8 = kv_report(PRESETS["qwen3-next-80b-a3b"], "fp8", max_len=8192)["linear_state"]
    assert fp8["state_bytes_per_sequence"] == report["linear_state"]["state_bytes_per_sequence"]
    assert main(["memory", "--preset", "qwen3-next-80b-a3b", "--max-len", "8192",
                 "--memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "230.25 MiB: paged K/V 192 MiB + state 38.25 MiB" in out
    assert "355 (K/V in every layer: 106)" in out
    assert "fits in" not in out  # the K/V-only capacity would overstate it


def test_a_hybrid_manager_admits_what_its_blocks_and_slots_hold():
    """The block layer's side of the same count: 8k-token requests are admitted while both
    blocks and state slots last; the next is refused with nothing changed."""
    from paged_attention_ext.block_manager import BlockSpaceManager, SeqSpec

    blocks_per_request = 8192 // 16
    for blocks, slots, expected in ((10 * blocks_per_request, 12, 10), (12 * blocks_per_request, 7, 7)):
        manager = BlockSpaceManager(blocks, 0, 16, watermark=0.0, num_state_slots=slots)
        admitted = 0
        while manager.try_admit(admitted, [SeqSpec(admitted, 8192)], 8192) is not None:
            admitted += 1
        assert admitted == expected
        manager.check_invariants()


# ---- layers of several shapes and layers that reuse K/V (Gemma-4) -------------------------
@pytest.mark.parametrize("preset, per_token, saving", [("gemma-4-31b", 901120, 9.11),
                                                       ("gemma-4-e4b", 57344, 10.09)])
def test_gemma_4_groups_hold_their_layers_within_a_block(preset, per_token, saving):
    """At 32k each group holds at most one block more than its tokens need, in pages its own
    layers fill (no padding), against every layer stored in the largest shape in one table."""
    shape = PRESETS[preset]
    report = kv_report(shape, "bfloat16", 32768, block_size=16)
    assert report["bytes_per_token"] == per_token  # readers store nothing
    groups = report["kv_groups"]
    for group in groups["groups"]:
        needed = -(-min(32768, group["sliding_window"] or 32768) // 16)
        assert needed <= group["blocks_held"] <= needed + 1
        assert group["padded_bytes"] == 0
    excess = groups["bytes_per_sequence"] - groups["bytes_per_sequence_ideal"]
    assert 0 <= excess <= groups["num_groups"] * groups["bytes_per_block"]
    assert round(groups["saving"], 2) == saving
    assert groups["readers"] == shape.kv_shared_layers


def test_gemma_4_memory_command(capsys):
    assert main(["memory", "--preset", "gemma-4-e4b", "--max-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "the last 18 reusing earlier layers' K/V" in out
    assert "2 layers, full attention, 2 KV heads of 512" in out and "18 (store nothing)" in out


def test_simulate_refuses_layers_of_several_shapes():
    with pytest.raises(SystemExit, match="simulate replays layers of one shape; gemma-4-31b"):
        main(["simulate", "--preset", "gemma-4-31b", "--num-requests", "4"])
