"""The engine over a model that is not a transformers model: the ModelRunner interface.

``CacheReadingRunner`` writes each token it computes into the KV pool at the slot the
scheduler placed it, and picks the next token from the context it reads back through the
block tables. A slot, block table, copy-on-write copy or swap gone wrong would change what
it reads, so its outputs equal :func:`continue_tokens` (the same rule on the plain token
list) only if the engine's block accounting is right; it also checks that each position
it reads holds that position.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import paged_attention_ext

from paged_attention_ext.engine import (EngineConfig, LLMEngine, ModelRunner, ModelSpec, Request,
                                        SamplingParams)
from paged_attention_ext.engine.scheduler import SchedulerOutput
from paged_attention_ext.engine.sequence import GroupStatus

from engine_loop import serve_to_completion

VOCAB = 97
EOS = 0


def next_token(context: List[int]) -> int:
    return (sum(context) * 31 + len(context)) % VOCAB


def continue_tokens(prompt: List[int], max_new_tokens: int) -> List[int]:
    """What the runner must generate for ``prompt``, EOS included."""
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if out[-1] == EOS:
            break
    return out


class CacheReadingRunner(ModelRunner):
    """Stores each token (keys) and its position (values) at its slot; the logits of a
    sequence's last token favour :func:`next_token` of the tokens its block table holds."""

    def __init__(self) -> None:
        super().__init__(ModelSpec(layer_windows=(None,), num_kv_heads=1, head_size=8,
                                   head_size_v=None, dtype=torch.float32,
                                   device=torch.device("cpu"), vocab_size=VOCAB))
        self.forwards = 0

    def forward(self, step: SchedulerOutput) -> List[torch.Tensor]:
        self.forwards += 1
        keys, values = self.kv_cache.layer(0)
        block_size = self.kv_cache.block_size
        logits = []
        for group in step.groups:
            rows = []
            for seq in group.live_seqs:
                [slots], [table] = step.slots[seq.seq_id], step.tables[seq.seq_id]
                for slot, position in zip(slots, range(seq.num_computed, len(seq.token_ids))):
                    block, offset = divmod(slot, block_size)
                    keys[block, 0, offset] = seq.token_ids[position]
                    values[block, 0, offset] = position
                context = []
                for position in range(len(seq.token_ids)):
                    block, offset = table[position // block_size], position % block_size
                    assert values[block, 0, offset, 0] == position, "a slot holds another position"
                    context.append(int(keys[block, 0, offset, 0]))
                row = torch.full((VOCAB,), -1e4)
                row[next_token(context)] = 0.0
                rows.append(row)
            logits.append(torch.stack(rows))
        return logits


def requests() -> List[Request]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, VOCAB, (8,), generator=g).tolist()  # a prefix-cache hit
    out = [Request(f"r{i}", torch.randint(1, VOCAB, (5 + i,), generator=g).tolist(),
                   SamplingParams(max_new_tokens=10, eos_token_ids=(EOS,))) for i in range(4)]
    out += [Request(f"s{i}", shared + [i + 1],
                    SamplingParams(max_new_tokens=8, n=2, temperature=1.0, seed=i,
                                   eos_token_ids=(EOS,))) for i in range(2)]
    return out


def serve(preemption_mode: str) -> Dict:
    """Serve :func:`requests` on a pool too small for all at once, checking the block
    manager and the recorded cache contents after every step."""
    engine = LLMEngine(CacheReadingRunner(), EngineConfig(
        block_size=4, num_device_blocks=12, num_host_blocks=64 if preemption_mode == "swap" else 0,
        preemption_mode=preemption_mode, record_block_contents=True))
    preempted = set()
    for request in requests():
        engine.add_request(request)

    def note_preempted(engine):
        preempted.update(r for r, g in engine._groups.items() if g.status is GroupStatus.SWAPPED
                         or (g.status is GroupStatus.WAITING and g.seqs[0].output_ids))
    outputs = serve_to_completion(engine, after_step=note_preempted)
    usage = engine.scheduler.manager.usage()
    return {"outputs": outputs, "preempted": sorted(preempted), "report": engine.report(),
            "blocks_used": [usage["device_blocks_used"], usage["host_blocks_used"]],
            "forwards": engine.runner.forwards}


def expected() -> Dict[str, List[List[int]]]:
    return {r.request_id: [continue_tokens(r.prompt, r.params.max_new_tokens)] * r.params.n
            for r in requests()}


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_serves_a_runner_that_is_not_transformers(mode):
    served = serve(mode)
    assert served["outputs"] == expected()
    assert served["preempted"] and served["report"]["preemptions"][mode] > 0
    assert served["blocks_used"] == [0, 0]  # finished: every block returned
    assert served["report"]["steps"] == served["forwards"]
    assert served["report"]["compiled_decode"] is None
    assert served["report"]["cascade"] == {"steps": 0, "saved_key_reads": 0}


def test_prompt_outside_the_runners_vocabulary_raises():
    engine = LLMEngine(CacheReadingRunner(), EngineConfig(block_size=4, num_device_blocks=8))
    with pytest.raises(ValueError, match=f"prompt.1. = {VOCAB} is not in the model's vocabulary"):
        engine.add_request(Request("r0", [1, VOCAB]))


def test_a_setting_the_runner_does_not_apply_raises():
    with pytest.raises(NotImplementedError, match="CacheReadingRunner has no compiled decode"):
        LLMEngine(CacheReadingRunner(), EngineConfig(block_size=4, num_device_blocks=8,
                                                     compile_decode=True))


@pytest.mark.parametrize("setting", [dict(compile_backend="eager"), dict(max_decode_batch=8),
                                     dict(decode_batch_sizes=(1, 2)),
                                     dict(compile_options={"freezing": True})])
def test_compiled_decode_settings_without_it_raise(setting):
    # Every runner would ignore them: the base class refuses them for all.
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"^{name}: settings of the compiled decode, which is off"):
        LLMEngine(CacheReadingRunner(), EngineConfig(block_size=4, num_device_blocks=8, **setting))


def test_engine_core_imports_neither_transformers_nor_hf(tmp_path):
    """engine.py and scheduler.py load, and serve this runner, with transformers unimportable."""
    script = f"""
import importlib.util, json, sys
sys.modules["transformers"] = None  # importing it raises
import paged_attention_ext.engine.engine, paged_attention_ext.engine.scheduler
spec = importlib.util.spec_from_file_location("runner_test", {str(Path(__file__))!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
outputs = module.serve("swap")["outputs"]
print(json.dumps({{"outputs": outputs, "hf": sorted(m for m in sys.modules if m.startswith("paged_attention_ext.hf"))}}))
"""
    # The package this process tests (the source tree, or where pip installed it), not
    # whatever the child's working directory would shadow it with; and the tests' own modules
    # (engine_loop).
    package_root = Path(paged_attention_ext.__file__).resolve().parents[1]
    path = os.pathsep.join([str(package_root), str(Path(__file__).parent)])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    child = json.loads(result.stdout.strip().splitlines()[-1])
    assert child["hf"] == []
    assert child["outputs"] == expected()
