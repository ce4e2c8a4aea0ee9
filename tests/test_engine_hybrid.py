"""The engine on sliding-window models: each KV group keeps its own block tables,
sliding groups hold only their window, and the tokens equal transformers' ``generate``
(greedy, sampled n > 1, beams) under swap and recompute preemption and with prefix caching,
over contexts several windows long."""

import copy

import pytest
import transformers

from paged_attention_ext.block_table import NULL_BLOCK
from paged_attention_ext.engine import (EngineConfig, LLMEngine, Request, SamplingParams,
                                        generate_reference)
from paged_attention_ext.testing import random_pair

from engine_loop import serve_to_completion

WINDOW = 6
BLOCK_SIZE = 4
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2)
# (config, reference attention): soft caps (Gemma) and sinks (GPT-OSS) need eager.
SHAPES = {
    "gemma2": (lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                 attn_logit_softcapping=1.0,
                                                 final_logit_softcapping=3.0), "eager"),
    "gemma3": (lambda: transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6},
                                                     head_dim=16, sliding_window=WINDOW), "eager"),
    "gpt_oss": (lambda: transformers.GptOssConfig(**COMMON, head_dim=16, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=WINDOW),
                "eager"),
    "mistral": (lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW), "sdpa"),
    "qwen2": (lambda: transformers.Qwen2Config(**{**COMMON, "num_hidden_layers": 3},
                                               use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=1), "sdpa"),
}
SHARED = [9, 4, 33, 21, 8, 70, 3, 3, 15, 60, 2, 44, 5, 91, 12, 30]  # 4 blocks: a prefix-cache hit
REQUESTS = [
    Request("greedy", SHARED + [5, 17, 99, 3, 41, 8], SamplingParams(max_new_tokens=18)),
    Request("shared", SHARED + [7, 1], SamplingParams(max_new_tokens=14)),
    Request("sampled", [7, 7, 12, 90, 33, 2, 61, 18, 40], SamplingParams(
        max_new_tokens=16, temperature=0.8, top_k=30, n=3, seed=3)),
    Request("beam", [2, 64, 31, 18, 5, 77, 9, 100, 4, 16, 30], SamplingParams(
        max_new_tokens=12, num_beams=3, num_return_sequences=2)),
]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request):
    config, reference_attention = SHAPES[request.param]
    paged, reference = random_pair(config(), reference_attention=reference_attention)
    expected = {r.request_id: generate_reference(reference, r) for r in REQUESTS}
    return request.param, paged, expected


def serve(paged, **overrides):
    engine = LLMEngine(paged, EngineConfig(**{**dict(block_size=BLOCK_SIZE, num_device_blocks=256,
                                                     num_host_blocks=256,
                                                     record_block_contents=True), **overrides}))
    most_held = []  # per step: the most blocks a sequence's sliding group holds

    def check(_output):
        engine.check_invariants(deep=True)  # every KV group's tables read back token by token
        manager = engine.scheduler.manager
        for seq_id in list(manager.tables):
            for table in manager.tables[seq_id]:
                if table.sliding_window is not None and table.allocator is manager.device:
                    most_held.append(len(table.live_blocks))
    got = engine.generate(copy.deepcopy(REQUESTS), on_output=check)
    return engine, got, most_held


def test_kv_groups_follow_the_config(shape):
    name, paged, _ = shape
    windows = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=64,
                                            num_host_blocks=0)).kv_cache.kv_groups.windows
    assert {"gemma2": (None, WINDOW), "gemma3": (None,) + (WINDOW,) * 5,
            "gpt_oss": (None, WINDOW), "mistral": (WINDOW,),
            "qwen2": (None, WINDOW, WINDOW)}[name] == windows  # 1 full : 2 sliding layers


@pytest.mark.parametrize("pool,mode", [("large", "swap"), ("small", "swap"), ("small", "recompute")])
def test_tokens_equal_generate(shape, pool, mode):
    name, paged, expected = shape
    # Small: requests are preempted and come back (a window-only model needs few blocks).
    small = {"gemma3": 120, "mistral": 12}.get(name, 40)
    engine, got, most_held = serve(paged, num_device_blocks=256 if pool == "large" else small,
                                   preemption_mode=mode)
    assert got == expected
    # A prompt is held whole until it is computed (6 blocks); after that, the window.
    window_blocks = -(-(WINDOW - 1) // BLOCK_SIZE) + 1
    assert most_held and max(most_held) <= max(window_blocks + 1, -(-len(REQUESTS[0].prompt) // BLOCK_SIZE))
    assert sorted(most_held)[len(most_held) // 2] <= window_blocks + 1
    if pool == "small":
        assert sum(engine.report()["preemptions"].values()) > 0
    assert engine.report()["prefix_cache_hit_rate"] > 0


def test_compiled_decode_equals_generate(shape):
    _, paged, expected = shape
    _, got, _ = serve(paged, compile_decode=True, compile_backend="eager")
    assert got == expected


def test_sliding_groups_free_their_blocks(shape):
    """Long decodes: the sliding groups' tables hold NULL entries and the pool use stays at
    the full groups' share plus a window per sliding group."""
    name, paged, _ = shape
    engine = LLMEngine(paged, EngineConfig(block_size=BLOCK_SIZE, num_device_blocks=256,
                                           num_host_blocks=0, enable_prefix_caching=False))
    engine.add_request(Request("long", list(range(1, 30)), SamplingParams(max_new_tokens=60)))
    snapshots = []  # the sequence's tables after each step that left it running

    def snapshot_tables(engine):
        if engine.has_unfinished():
            [seq_id] = list(engine.scheduler.manager.tables)
            snapshots.append([list(t.blocks) for t in engine.scheduler.manager.tables[seq_id]])
    serve_to_completion(engine, check_deep=False, after_step=snapshot_tables)
    snapshot = snapshots[-1]
    layout = engine.kv_cache.kv_groups
    full_blocks = len(snapshot[0])
    for blocks, window in zip(snapshot, layout.windows):
        if window is None:
            assert NULL_BLOCK not in blocks
        else:
            assert len(blocks) == full_blocks and blocks.count(NULL_BLOCK) >= full_blocks - 3
    assert engine.scheduler.manager.num_used_device_blocks == 0  # finished: everything returned
    held = sum(len(b) - b.count(NULL_BLOCK) for b in snapshot)
    full_groups = sum(1 for w in layout.windows if w is None)
    assert held <= full_groups * full_blocks + (len(layout.windows) - full_groups) * 3
    assert held < len(layout.windows) * full_blocks  # one table per sequence would hold this
