"""vLLM with paged_attention_ext's attention backend, offline on CPU.

Each case runs vLLM twice on the same tiny random-weight model and prompts, each run in its
own process (the plugin overrides the backend process-wide): once with the plugin (every
attention layer on paged.write_kv / paged.attention) and once without it (vLLM's own CPU
backend, ``VLLM_PLUGINS=""``). Greedy fp32 tokens must match. A child also reports which
attention class its layers ran, so a plugin that silently failed to load cannot pass.

Run in the vLLM environment (see the Makefile's test-vllm); skipped where vLLM is missing.
This file is also the child: ``python tests/test_vllm.py '<case as JSON>'`` prints the result.
"""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

try:
    import vllm  # noqa: F401
except ImportError:  # the main test environment has no vLLM
    vllm = None

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(vllm is None, reason="vLLM is not installed (make test-vllm sets it up)"),
]

BLOCK_SIZE = 32  # vLLM's CPU backend (the baseline) needs multiples of 32

# Tiny models: GQA everywhere, head size 32 (vLLM's CPU backend starts there).
MODELS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  num_attention_heads=4, num_key_value_heads=2),
    # Qwen2's head size is hidden_size / num_attention_heads.
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128,
                  num_attention_heads=4, num_key_value_heads=1),
    # A window shorter than the prompts, so it changes the result.
    "mistral_window": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=24),
    # 5 sliding : 1 full layers: vLLM's hybrid KV-cache manager gives each KV group its own
    # block tables, the sliding groups' out-of-window entries pointing at its null block.
    "gemma3_hybrid": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                          num_attention_heads=4, num_key_value_heads=2, sliding_window=24,
                          num_hidden_layers=6, query_pre_attn_scalar=32),
}
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32,
              vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              # Weights large enough that attention moves the logits (vLLM's dummy loader
              # draws them from +-1e-3, where every backend gives the same tokens).
              initializer_range=0.2, torch_dtype="float32")


def write_model(folder: str, name: str) -> None:
    """A random-weight model (config + safetensors, no tokenizer) in ``folder``."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**{**COMMON, **MODELS[name]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(folder)


def prompts(seed: int, count: int, shared_prefix: int) -> list[list[int]]:
    """``count`` prompts of varied lengths (1 to 3 blocks and more), sharing a prefix."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    lengths = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 70, 5, 45, 100]
    return [prefix + [rng.randrange(3, 500) for _ in range(lengths[i % len(lengths)])]
            for i in range(count)]


# ---------------------------------------------------------------- child (one vLLM run)

def _kv_cache_groups(worker) -> int:
    """How many KV-cache groups (block tables per request) vLLM's cache manager runs."""
    return len(worker.model_runner.kv_cache_config.kv_cache_groups)


# vLLM's attention layer classes (Llama-4's chunked layers are ChunkedLocalAttention).
ATTENTION_LAYERS = ("Attention", "MLAAttention", "ChunkedLocalAttention")


def _attention_classes(worker) -> list[str]:
    """Names of the attention impl classes of the worker's model, MLA and chunked layers'
    included (runs in the worker)."""
    model = worker.model_runner.model
    return sorted({type(m.impl).__name__ for m in model.modules()
                   if type(m).__name__ in ATTENTION_LAYERS})


def _attention_backends(worker) -> list[str]:
    """Each attention layer's backend class, in layer order: vLLM wraps a chunked layer's
    backend in a ChunkedLocalAttention_<chunk>_ subclass (runs in the worker)."""
    model = worker.model_runner.model
    return [m.attn_backend.__name__ for m in model.modules() if type(m).__name__ in ATTENTION_LAYERS]


def _cascade_steps(worker) -> int:
    """Steps the backend's metadata builders built with a cascade split (runs in the worker)."""
    return sum(getattr(builder, "cascade_steps", 0)
               for groups in getattr(worker.model_runner, "attn_groups", [])
               for group in groups for builder in group.metadata_builders)


def run_case(case: dict) -> dict:
    """Generate greedily with vLLM as ``case`` says; the tokens per batch and what ran."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=case["model"], skip_tokenizer_init=True, dtype=case.get("dtype", "float32"),
              max_model_len=256, block_size=BLOCK_SIZE, enforce_eager=True, seed=0,
              enable_prefix_caching=case.get("prefix_caching", False),
              num_gpu_blocks_override=case.get("num_blocks"),
              max_num_seqs=case.get("max_num_seqs", 8),
              tensor_parallel_size=case.get("tp", 1), disable_log_stats=False,
              kv_cache_dtype=case.get("kv_cache_dtype", "auto"),
              attention_backend=case.get("attention_backend"))
    params = SamplingParams(max_tokens=case["max_tokens"], temperature=0.0, ignore_eos=True)
    batches = []
    for batch in case["batches"]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                            use_tqdm=False)
        batches.append([list(o.outputs[0].token_ids) for o in outs])
    preemptions = sum(getattr(m, "value", 0) for m in llm.get_metrics()
                      if "preempt" in m.name)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return dict(tokens=batches, attention=llm.collective_rpc(_attention_classes),
                backends=llm.collective_rpc(_attention_backends)[0],
                kv_cache_groups=llm.collective_rpc(_kv_cache_groups)[0],
                preemptions=preemptions, cached_tokens_last_batch=cached,
                cascade_steps=sum(llm.collective_rpc(_cascade_steps)))


def start_vllm(case: dict, plugin: bool) -> subprocess.Popen:
    """``run_case`` started in a fresh process, with or without the paged_attention plugin;
    finish_vllm collects it."""
    tp = case.get("tp", 1)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
               # One process unless tensor parallel needs its workers.
               VLLM_ENABLE_V1_MULTIPROCESSING="0" if tp == 1 else "1")
    if tp > 1:
        # vLLM binds each rank to a NUMA node of its own by default; this host has one.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp))
        # _attention_classes travels to the worker processes pickled.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # an allow-list naming no plugin
    elif "kv_cache_layout" in case:
        env["VLLM_KV_CACHE_LAYOUT"] = case["kv_cache_layout"]
    if "cascade_min_saved_tokens" in case:
        env["PAGED_ATTENTION_CASCADE_MIN_SAVED_TOKENS"] = str(case["cascade_min_saved_tokens"])
    # The case (a few KB of token ids) travels as the child's argument.
    return subprocess.Popen([sys.executable, __file__, json.dumps(case)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_vllm(proc: subprocess.Popen, timeout: float = 900) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        # vLLM logs to stdout, Python's tracebacks go to stderr.
        raise AssertionError(f"vLLM run failed (rc {proc.returncode}):\n"
                             f"{stdout[-4000:]}\n{stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_vllm(case: dict, plugin: bool) -> dict:
    return finish_vllm(start_vllm(case, plugin))


# ---------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name in MODELS:
        dirs[name] = str(tmp_path_factory.mktemp(name))
        write_model(dirs[name], name)
    return dirs


def run_both(case: dict) -> tuple:
    """(with the plugin, without it): both runs at once. Each is one process with one OpenMP
    thread (tensor parallel: one per rank), so the pair shares this 2-core machine's cores
    instead of queueing."""
    runs = [start_vllm(case, plugin) for plugin in (True, False)]
    try:
        ours, theirs = [finish_vllm(run) for run in runs]
    finally:
        for proc in runs:  # the other run, when one failed
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ours, theirs


def check_same(case: dict) -> dict:
    ours, theirs = run_both(case)
    assert ours["attention"] == [["PagedAttentionImpl"]] * case.get("tp", 1), ours["attention"]
    assert theirs["attention"] == [["CPUAttentionBackendImpl"]] * case.get("tp", 1)
    assert ours["tokens"] == theirs["tokens"]
    return ours


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_equals_vllm_cpu_backend_with_prefix_caching(model_dirs, name):
    """Mixed prefill/decode batches; the second batch repeats and extends the first, so it
    starts from cached prefix blocks (prefill after a prefix hit)."""
    first = prompts(seed=1, count=6, shared_prefix=40)
    second = first[:3] + prompts(seed=2, count=3, shared_prefix=40)
    ours = check_same(dict(model=model_dirs[name], batches=[first, second], max_tokens=12,
                           prefix_caching=True))
    assert ours["cached_tokens_last_batch"] > 0  # the prefix cache was hit


def test_hybrid_model_runs_under_vllms_hybrid_kv_cache_manager(model_dirs):
    """Gemma-3's sliding and full layers in KV groups of their own (vLLM frees the sliding
    groups' out-of-window blocks), long enough to pass the window many times, under
    preemption: the same tokens as vLLM's CPU backend."""
    batch = prompts(seed=5, count=8, shared_prefix=0)
    ours = check_same(dict(model=model_dirs["gemma3_hybrid"], batches=[batch], max_tokens=60,
                           num_blocks=64))
    assert ours["kv_cache_groups"] > 1
    assert ours["preemptions"] > 0


def test_cascade_split_planned_from_shared_prompt_blocks(model_dirs):
    """vLLM 0.32 passes no common prefix (it removed cascade attention); on the CPU the
    builder plans the split from the block table: requests on the cached shared prompt
    read its blocks once per step, with the CPU backend's tokens."""
    batch = prompts(seed=6, count=6, shared_prefix=70)
    ours = check_same(dict(model=model_dirs["llama"], batches=[batch, batch], max_tokens=12,
                           prefix_caching=True, cascade_min_saved_tokens=1))
    assert ours["cascade_steps"] > 0
    off = run_vllm(dict(model=model_dirs["llama"], batches=[batch], max_tokens=4,
                        prefix_caching=True, cascade_min_saved_tokens="none"), plugin=True)
    assert off["cascade_steps"] == 0


def test_greedy_equals_vllm_cpu_backend_under_preemption(model_dirs):
    """Too few blocks for the batch: vLLM preempts and recomputes requests."""
    batch = prompts(seed=3, count=8, shared_prefix=0)
    ours = check_same(dict(model=model_dirs["llama"], batches=[batch], max_tokens=40,
                           num_blocks=12))
    assert ours["preemptions"] > 0


def test_greedy_equals_vllm_cpu_backend_tensor_parallel(model_dirs):
    """tensor_parallel_size=2: two worker processes (gloo), each with its own KV heads."""
    batch = prompts(seed=1, count=6, shared_prefix=40)
    check_same(dict(model=model_dirs["llama"], batches=[batch], max_tokens=12,
                    prefix_caching=True, tp=2))


def test_fp8_cache_runs(model_dirs):
    """kv_cache_dtype="fp8": vLLM allocates the cache as uint8 and the backend reads it as
    e4m3 with vLLM's per-layer scales. Values are checked against the reference ops in
    test_vllm_backend.py; here vLLM's CPU backend is no oracle: its greedy tokens differ
    from ours on some prompts from the first token on (docs/integrations.md)."""
    batch = prompts(seed=4, count=6, shared_prefix=0)
    ours = run_vllm(dict(model=model_dirs["llama"], batches=[batch], max_tokens=12,
                         kv_cache_dtype="fp8"), plugin=True)
    assert ours["attention"] == [["PagedAttentionImpl"]]
    assert [len(t) for t in ours["tokens"][0]] == [12] * len(batch)


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "int4_per_token_head"])
def test_per_token_caches_run(model_dirs, kv_cache_dtype):
    """vLLM's per-token names through its engine: the pages hold each block's rows and
    scales as the backend lays them out (values checked against the reference ops in
    test_vllm_backend.py; vLLM's CPU backend serves no per-token cache to compare with)."""
    batch = prompts(seed=4, count=6, shared_prefix=24)
    ours = run_vllm(dict(model=model_dirs["llama"], batches=[batch], max_tokens=12,
                         kv_cache_dtype=kv_cache_dtype, prefix_caching=True), plugin=True)
    assert ours["attention"] == [["PagedAttentionImpl"]]
    assert [len(t) for t in ours["tokens"][0]] == [12] * len(batch)


# Qwen3-Next-shaped: gated-DeltaNet layers beside full attention. vLLM's CPU gated-DeltaNet
# kernel takes bf16 only, and linear-attention heads of 128.
HYBRID_LINEAR_MODEL = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                           hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=32,
                           num_attention_heads=4, num_key_value_heads=2, linear_num_value_heads=4,
                           linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, full_attention_interval=2,
                           vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                           initializer_range=0.2, torch_dtype="float32")


def test_block_compact_layout(model_dirs):
    """The page-compact order (each block's key tile, then its value tile), which vLLM's
    hybrid manager picks when a block also holds linear-attention states: the same tokens
    as vLLM's CPU backend in its own layout."""
    batch = prompts(seed=2, count=6, shared_prefix=0)
    check_same(dict(model=model_dirs["llama"], batches=[batch], max_tokens=12,
                    kv_cache_layout="LBHNC"))


def test_linear_attention_hybrid_under_vllms_hybrid_manager(tmp_path):
    """vLLM keeps the gated-DeltaNet layers' states (its own kernels) in pages beside the full
    layers' K/V, in the block-compact layout; the plugin serves the full layers. Only bf16
    runs there, where two backends' roundings split near-tied logits now and then: every
    prompt's first token (its prefill) must agree, and nearly all the others."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**HYBRID_LINEAR_MODEL)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(tmp_path)
    case = dict(model=str(tmp_path), batches=[prompts(seed=7, count=8, shared_prefix=0)],
                max_tokens=12, dtype="bfloat16")
    ours, theirs = run_both(case)
    assert ours["attention"] == [["PagedAttentionImpl"]], ours["attention"]
    assert theirs["attention"] == [["CPUAttentionBackendImpl"]]
    assert ours["kv_cache_groups"] > 1
    pairs = list(zip(ours["tokens"][0], theirs["tokens"][0]))
    assert all(a[0] == b[0] for a, b in pairs)
    agreeing = sum(x == y for a, b in pairs for x, y in zip(a, b))
    assert agreeing >= 0.8 * sum(len(a) for a, _ in pairs), pairs


# DeepSeek-V2-shaped, dense MLPs: vLLM's own CPU MLA decode kernel (the baseline) takes only
# latent rows of 512 + 64 and blocks of 16 (its platform sets the block size).
MLA_MODEL = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                 hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                 kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                 first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, vocab_size=512, max_position_embeddings=512,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                 initializer_range=0.2, torch_dtype="float32")


def test_mla_greedy_equals_vllm_cpu_mla_backend(tmp_path):
    """vLLM's CPU_MLA with the plugin (latents written and decoded by the ops) against vLLM's
    own CPU MLA backend: same greedy tokens over prefill and decode of mixed lengths."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**MLA_MODEL)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(tmp_path)
    # On a CPU with AMX vLLM picks its AMX_MLA backend (bf16 and fp16 weights only) unless
    # CPU_MLA is asked for by name.
    case = dict(model=str(tmp_path), batches=[prompts(seed=5, count=5, shared_prefix=0)],
                max_tokens=16, attention_backend="CPU_MLA")
    ours, theirs = run_both(case)
    assert ours["attention"] == [["PagedMLAImpl"]], ours["attention"]
    assert theirs["attention"] == [["CPUMLAImpl"]], theirs["attention"]
    assert ours["tokens"] == theirs["tokens"]


# Llama-4 text: layers 0-2 chunked local attention (chunks of two blocks), layer 3 NoPE full
# attention with the attention temperature (stepping every 16 positions).
LLAMA4_CHUNK = 2 * BLOCK_SIZE
LLAMA4_MODEL = dict(architectures=["Llama4ForCausalLM"], model_type="llama4_text",
                    hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                    attention_chunk_size=LLAMA4_CHUNK, floor_scale=16, attn_scale=0.5,
                    vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    initializer_range=0.2, torch_dtype="float32")


def write_llama4(folder, **overrides) -> str:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**{**LLAMA4_MODEL, **overrides})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def test_llama4_chunked_local_attention_equals_vllm_cpu_backend(tmp_path):
    """vLLM builds Llama-4's chunked layers as ChunkedLocalAttention, which wraps the selected
    backend (ours, or vLLM's CPU one) in a builder that splits each request into one virtual
    request per chunk (its queries, its chunk's keys, its chunk's blocks): the plugin's
    builder takes those tables and lengths as they come. Prompts of up to three chunks and 60
    new tokens each, prefix caching (a second batch on the first's prompts) and preemption:
    the same tokens as vLLM's CPU backend."""
    first = prompts(seed=8, count=8, shared_prefix=40)
    second = first[:3] + prompts(seed=9, count=3, shared_prefix=40)
    case = dict(model=write_llama4(tmp_path / "chunked"), batches=[first, second], max_tokens=60,
                prefix_caching=True, num_blocks=64)
    ours, theirs = run_both(case)
    chunked = f"ChunkedLocalAttention_{LLAMA4_CHUNK}_"
    assert ours["backends"] == [chunked + "PagedAttentionBackend"] * 3 + ["PagedAttentionBackend"]
    assert theirs["backends"] == [chunked + "CPUAttentionBackend"] * 3 + ["CPUAttentionBackend"]
    assert ours["attention"] == [["PagedAttentionImpl"]], ours["attention"]
    assert ours["tokens"] == theirs["tokens"]
    assert ours["kv_cache_groups"] > 1 and ours["preemptions"] > 0
    assert ours["cached_tokens_last_batch"] > 0
    # The check can fail: one chunk longer than every sequence gives other tokens.
    unchunked = run_vllm(dict(case, model=write_llama4(tmp_path / "unchunked",
                                                       attention_chunk_size=512)), plugin=True)
    assert unchunked["tokens"] != ours["tokens"]


def test_docs_example_runs(tmp_path):
    """docs/integrations.md's vLLM example runs as written (vLLM's default processes)."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "integrations.md")).read()
    section = text[text.index("\n## vLLM\n"):]
    (code,) = re.findall(r"```python\n(.*?)```", section[:section.index("\n## ", 5)], re.S)
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[[")]
    tokens = ast.literal_eval(printed[-1])
    assert [len(t) for t in tokens] == [8, 8, 8]


if __name__ == "__main__":
    result = run_case(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
