"""PagedCache under transformers' tensor parallelism.

A tiny random Llama (4 query heads, 2 KV heads) is saved to a temporary folder and loaded
by two processes (``torchrun --nproc-per-node 2``, gloo on CPU) with
``DistributedConfig(tp_plan="auto")``: each rank's attention gets its own query and KV
heads, and a PagedCache there sizes its pools from the keys it stores (1 KV head per
rank, not the config's 2). Greedy and beam-search output of each rank equals the
single-process run, and the block tables are the same on every rank (every rank places
the same tokens, so the ranks' block managers make the same decisions). transformers'
continuous batching with ``paged|paged_attention_ext`` on the sharded model (its cache
holds the rank's KV heads) returns the single-process ``sdpa`` tokens.

Run by ``make test-integration`` (marker ``integration``); the file is also the worker
the test launches.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_attention_ext.testing import TINY

BLOCK_SIZE = 4
# Two rows, the second left-padded: 9 and 6 tokens; a repeated prompt prefix for the cache.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 5, 6, 7, 8, 20, 21]]
MASK = [[1] * 9, [0, 0, 0] + [1] * 6]
RUNS = {  # name: (PagedCache arguments (max_cache_len: CompiledPagedCache), generate() arguments)
    "greedy": ({}, dict(max_new_tokens=8, do_sample=False)),
    "beam": ({}, dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)),
    # Compile mode's fixed pools are sized before the first forward: from the config's head
    # count divided by the tensor-parallel size (run eagerly here).
    "fixed pools": (dict(max_cache_len=24), dict(max_new_tokens=8, do_sample=False)),
}


def run_generations(model) -> dict:
    """Each run's tokens, the pool's KV heads and every row's block table afterwards."""
    from paged_attention_ext.hf import CompiledPagedCache, PagedCache

    ids, mask = torch.tensor(PROMPTS), torch.tensor(MASK)
    result = {}
    for name, (cache_kwargs, kwargs) in RUNS.items():
        cache_class = CompiledPagedCache if "max_cache_len" in cache_kwargs else PagedCache
        cache = cache_class(model.config, block_size=BLOCK_SIZE, **cache_kwargs)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, pad_token_id=0,
                                 **kwargs)
        result[name] = {
            "tokens": out.tolist(),
            "kv_heads": cache.kv.num_kv_heads,
            "block_tables": [cache.manager.block_ids(seq, 0) for seq in cache.rows if seq is not None],
        }
    return result


def run_continuous_batching(model, implementation: str) -> list:
    """``generate_batch`` tokens of the prompts (without their padding)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(implementation)
    rows = [[t for t, keep in zip(p, m) if keep] for p, m in zip(PROMPTS, MASK)]
    out = model.generate_batch(
        rows, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False,
                                                 eos_token_id=None, pad_token_id=0),
        continuous_batching_config=ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=32,
                                                            max_batch_tokens=16))
    return [[out[f"req_{i}"].generated_tokens, out[f"req_{i}"].error] for i in range(len(rows))]


def worker(model_dir: str, out_dir: str) -> None:
    """One rank: load with tp_plan="auto", generate, write rank<N>.json."""
    import transformers
    from transformers import DistributedConfig

    import paged_attention_ext.hf  # noqa: F401  (registers the attention implementation)

    torch.set_num_threads(1)
    model = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, attn_implementation="paged_attention_ext",
        distributed_config=DistributedConfig(tp_plan="auto")).eval()
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    result = run_generations(model)
    result["local_k_proj_rows"] = k_proj.to_local().shape[0] if hasattr(k_proj, "to_local") else None
    # transformers' continuous batching on the sharded model, attention on the paged ops.
    result["continuous_batching"] = run_continuous_batching(model, paged_attention_ext.hf.CB_ATTN_IMPLEMENTATION)
    rank = torch.distributed.get_rank()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.mark.integration
def test_paged_cache_under_tensor_parallel_equals_single_process(tmp_path, one_thread):
    pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate "
                        "(pip install paged-attention-ext[tp])")
    import transformers

    import paged_attention_ext.hf  # noqa: F401

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--standalone", __file__, str(model_dir), str(tmp_path)]
    # Its own session, so a timeout ends the launcher and both workers.
    launcher = subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        output, _ = launcher.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        output, _ = launcher.communicate()
        pytest.fail("the two tensor-parallel processes did not finish in 240 s:\n" + output[-3000:])
    assert launcher.returncode == 0, output[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    single = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, attn_implementation="paged_attention_ext").eval()
    want = run_generations(single)
    batching_want = run_continuous_batching(single, "sdpa")
    assert all(error is None and len(tokens) == 8 for tokens, error in batching_want)
    kv_heads = TINY["num_key_value_heads"]
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    for rank in ranks:
        assert rank["local_k_proj_rows"] == kv_heads // 2 * head_dim  # really sharded
        for name in RUNS:
            assert rank[name]["tokens"] == want[name]["tokens"], name
            assert rank[name]["kv_heads"] == kv_heads // 2  # the rank's own heads
            assert want[name]["kv_heads"] == kv_heads
            assert rank[name]["block_tables"] == ranks[0][name]["block_tables"], name
        assert rank["continuous_batching"] == batching_want


if __name__ == "__main__":
    worker(*sys.argv[1:3])
