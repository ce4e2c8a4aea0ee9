"""The ``paged-attention`` command line (also ``python -m paged_attention_ext``).

Every subcommand accepts ``--json``: the last line printed is then one JSON object.
The help texts are plain text (argparse prints them as written), not this reStructuredText.
"""

import argparse
import json
import sys
import time
from dataclasses import asdict
from statistics import mean
from typing import Callable, Dict, List, NoReturn, Optional

from ..kv_groups import KVGroupLayout
from . import demo, memory, simulator, walkthrough, workloads

Command = Callable[[argparse.Namespace], Dict]


DESCRIPTION = ("The paged-attention command line (also python -m paged_attention_ext). Every "
               "subcommand accepts --json: the last line printed is then one JSON object.")


def add_command(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose --help opens with its one-line summary."""
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-attention", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands below; COMMAND --help for its options")
    serve = add_command(sub, "demo", "serve a mixed batch with the paged engine under a small KV "
                                     "pool and check it against transformers generate")
    demo.add_arguments(serve)
    serve.set_defaults(run=demo.run)
    walk = add_command(sub, "walkthrough", "run every op on a small paged cache and check it "
                                           "against the reference implementation")
    walk.add_argument("--seed", type=int, default=0,
                      help="seed of the random queries, keys and values (default %(default)s)")
    walk.set_defaults(run=walkthrough.run)
    add_memory_command(sub)
    add_simulate_command(sub)
    for child in sub.choices.values():
        child.add_argument("--json", action="store_true",
                           help="end the output with one line holding the report as a JSON object")
    return parser


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def layer_pattern(text: str):
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) + int(parts[1]) < 1:
        raise argparse.ArgumentTypeError(f"must be SLIDING:FULL layer counts such as 5:1, got {text!r}")
    return int(parts[0]), int(parts[1])


def fail(message: str) -> NoReturn:
    raise SystemExit(f"paged-attention: error: {message}")


# ---- memory ----------------------------------------------------------------------------

def add_memory_command(sub: argparse._SubParsersAction) -> None:
    cmd = add_command(sub, "memory",
                      "KV-cache bytes per token, sequence and block for a model shape")
    add_shape_arguments(cmd)
    cmd.add_argument("--dtype", choices=memory.DTYPES, default="float16",
                     help="dtype of the cached keys and values (default %(default)s)")
    cmd.add_argument("--max-len", type=positive_int, default=2048, metavar="TOKENS",
                     help="tokens per sequence (default %(default)s)")
    cmd.add_argument("--block-size", type=positive_int, metavar="TOKENS",
                     help="also report bytes per block of this many tokens")
    cmd.add_argument("--memory-gib", type=positive_float, metavar="GIB",
                     help="also report how many tokens, blocks and sequences fit")
    cmd.set_defaults(run=run_memory)


def add_shape_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--preset", choices=sorted(memory.PRESETS), metavar="NAME",
                     help="a known model shape, one of %(choices)s; explicit flags override its "
                          "fields")
    cmd.add_argument("--layers", type=positive_int, metavar="N",
                     help="attention layers of the model")
    cmd.add_argument("--kv-heads", type=positive_int, metavar="N",
                     help="key/value heads per layer (fewer than the query heads with "
                          "grouped-query attention)")
    cmd.add_argument("--head-size", type=positive_int, metavar="N",
                     help="size of one head's key and value vectors")
    cmd.add_argument("--sliding-window", type=positive_int, metavar="TOKENS",
                     help="window of the sliding-window layers, in tokens")
    cmd.add_argument("--layer-pattern", type=layer_pattern, metavar="SLIDING:FULL",
                     help="SLIDING:FULL layers repeating from the first (Gemma-3 5:1, GPT-OSS 1:1; "
                          "default with a window: every layer sliding)")
    cmd.add_argument("--attention-chunk-size", type=positive_int, metavar="TOKENS",
                     help="chunk of the chunked-attention layers, in tokens (Llama-4): the "
                          "pattern's first count is then chunked layers")


def shape_from(args: argparse.Namespace) -> "memory.ModelShape":
    try:
        return memory.resolve_shape(args.preset, args.layers, args.kv_heads, args.head_size,
                                    args.sliding_window, args.layer_pattern,
                                    args.attention_chunk_size)
    except ValueError as error:
        fail(str(error))


def local_layers(shape: "memory.ModelShape") -> str:
    """The pattern's first kind of layer in words."""
    if shape.attention_chunk_size:
        return f"chunked (chunks of {shape.attention_chunk_size})"
    return f"sliding (window {shape.sliding_window})"


def padding_note(padded_layers: int, layers_per_group: int) -> str:
    """Why a KV group of fewer layers holds the bytes of a full one."""
    if not padded_layers:
        return ""
    return (f" (padded to {layers_per_group} layers: all KV groups share one pool, so every "
            f"page holds {layers_per_group} layers; {padded_layers} of them unused here)")


def run_memory(args: argparse.Namespace) -> Dict:
    shape = shape_from(args)
    report = {"preset": args.preset, **memory.kv_report(shape, args.dtype, args.max_len,
                                                         args.block_size, args.memory_gib)}
    size = memory.format_bytes
    latent = shape.latent_size is not None
    rows = [("KV cache per token" + (" (latent rows)" if latent else ""),
             f"{size(report['bytes_per_token'])} ({report['bytes_per_token']} bytes)"),
            (f"per sequence of {args.max_len} tokens",
             f"{size(report['bytes_per_sequence'])} ({report['bytes_per_sequence']} bytes)")]
    if latent:
        rows.insert(1, ("KV cache per token, K/V per head",
                        f"{size(report['bytes_per_token_expanded'])}: the latent rows are "
                        f"{report['latent_saving']:.1f}x less"))
    if args.block_size is not None:
        rows.append((f"per block of {args.block_size} tokens", size(report["bytes_per_block"])))
    if args.memory_gib is not None:
        blocks = f"{report['blocks_fit']} blocks, " if args.block_size is not None else ""
        rows.append((f"fits in {size(report['memory_bytes'])}", f"{report['tokens_fit']} tokens, {blocks}"
                     f"{report['sequences_fit']} sequences of {args.max_len} tokens"))
    groups = report.get("kv_groups")
    if groups is not None:
        bs = args.block_size or 16
        for g, group in enumerate(groups["groups"]):
            kind = group["kind"]
            if group["shape"] is not None:
                heads, head_size, _ = group["shape"]
                kind += f", {heads} KV heads of {head_size}"
                note = (f" (its layers fill {1 - group['padded_bytes'] / groups['bytes_per_block']:.0%} "
                        "of a page)" if group["padded_bytes"] else "")
            else:
                note = padding_note(group["padded_layers"], groups["layers_per_group"])
            rows.append((f"KV group {g} ({group['layers']} layers, {kind})",
                         f"{group['blocks_held']} blocks of {bs} tokens held, "
                         f"{size(group['bytes_held'])}{note}"))
        if groups["readers"]:
            rows.append(("layers reusing another's K/V", f"{groups['readers']} (store nothing)"))
        baseline = ("one pool shape (the largest) and one table for all layers"
                    if shape.is_heterogeneous else "one table for all layers")
        rows.append((f"per sequence of {args.max_len} tokens, KV groups",
                     f"{size(groups['bytes_per_sequence'])}: {groups['fraction_of_single_table']:.1%} "
                     f"of {baseline} ({groups['saving']:.2f}x less), "
                     f"{groups['fraction_of_ideal']:.1%} of what the layers read"))
        if args.memory_gib is not None:
            rows.append(("sequences fit, KV groups", f"{groups['sequences_fit']}"))
    linear = report.get("linear_state")
    if linear is not None:
        # K/V alone is not what a sequence takes: its rows give way to K/V + state.
        rows = [row for row in rows if not row[0].startswith(("per sequence of", "fits in"))]
        rows += [(f"per sequence of {args.max_len} tokens",
                  f"{size(linear['bytes_per_sequence'])}: paged K/V "
                  f"{size(linear['kv_bytes_per_sequence'])} + state "
                  f"{size(linear['state_bytes_per_sequence'])} ({linear['linear_layers']} "
                  "linear-attention layers, one fixed state each)"),
                 ("K/V in every layer instead", f"{size(linear['bytes_per_sequence_kv_every_layer'])} "
                  f"({linear['saving']:.2f}x more)")]
        if args.memory_gib is not None:
            rows.append((f"sequences of {args.max_len} tokens fit in {size(report['memory_bytes'])}",
                         f"{linear['sequences_fit']} (K/V in every layer: "
                         f"{linear['sequences_fit_kv_every_layer']})"))
    overridden = args.preset and any(v is not None for v in (
        args.layers, args.kv_heads, args.head_size, args.sliding_window, args.layer_pattern,
        args.attention_chunk_size))
    name = f"{args.preset} (overridden)" if overridden else args.preset or "model"
    pattern = (f", layers {shape.layer_pattern[0]} {local_layers(shape)} : "
               f"{shape.layer_pattern[1]} full" if groups is not None else "")
    heads = (f"latent rows of {shape.latent_size} (expanded: {shape.kv_heads} heads, key head "
             f"{shape.head_size}, value head {shape.head_size_v})" if latent else
             f"{shape.kv_heads} KV heads, head size {shape.head_size}")
    if linear is not None:
        heads += f" (and {shape.linear_layers} linear-attention layers)"
    if shape.full_kv_heads or shape.full_head_size:
        full_heads, full_size, _ = shape.layer_shapes()[shape.windows().index(None)]
        heads += f" (full layers: {full_heads} KV heads, head size {full_size})"
    if shape.kv_shared_layers:
        heads += f", the last {shape.kv_shared_layers} reusing earlier layers' K/V"
    element = report["dtype_bytes"]
    row = shape.latent_size if latent else shape.head_size  # a latent row, or a key row
    values = (f"{element} byte{'s' if element != 1 else ''} per value" if element is not None
              else f"{memory.row_bytes(args.dtype, row)} bytes per row of {row} values, scales "
                   "included")
    print(f"{name}: {shape.layers} layers, {heads}, {args.dtype} ({values}){pattern}")
    width = max(len(label) for label, _ in rows) + 1
    for label, value in rows:
        print(f"  {label + ':':<{width}} {value}")
    return report


# ---- simulate --------------------------------------------------------------------------

def add_simulate_command(sub: argparse._SubParsersAction) -> None:
    cmd = add_command(sub, "simulate", "replay a request trace through KV-cache allocation "
                                       "strategies and report memory utilisation and sharing")
    cmd.add_argument("--workload", choices=sorted(workloads.WORKLOADS), default="sharegpt",
                     help="synthetic length distribution (default %(default)s; see docs/memory.md)")
    cmd.add_argument("--trace", metavar="FILE",
                     help="JSON lines of {\"prompt_len\": int, \"output_len\": int}; replaces "
                          "--workload")
    cmd.add_argument("--save-trace", metavar="FILE", help="write the trace used as JSON lines")
    cmd.add_argument("--num-requests", type=positive_int, default=1000, metavar="N",
                     help="requests in the synthetic trace (default %(default)s)")
    cmd.add_argument("--seed", type=int, default=0,
                     help="seed of the synthetic trace and of beam search's switches (default "
                          "%(default)s)")
    cmd.add_argument("--max-len", type=positive_int, default=2048, metavar="TOKENS",
                     help="longest request in tokens; the max_len strategy reserves this much per "
                          "request (default %(default)s)")
    cmd.add_argument("--block-size", type=positive_int, default=16, metavar="TOKENS",
                     help="tokens per block of the paged strategies (default %(default)s)")
    cmd.add_argument("--pool-tokens", type=positive_int, default=32768, metavar="SLOTS",
                     help="KV pool size in token slots (default %(default)s)")
    cmd.add_argument("--parallel-samples", type=positive_int, default=1, metavar="N",
                     help="also measure sharing with N parallel samples per request")
    cmd.add_argument("--beam-width", type=positive_int, default=1, metavar="N",
                     help="also measure sharing in beam search of width N")
    cmd.add_argument("--beam-switch-prob", type=probability, default=0.1, metavar="P",
                     help="per step, chance that a beam is replaced by a child of the top beam "
                          "(default %(default)s)")
    add_shape_arguments(cmd)  # optional: a model whose sliding layers get KV groups
    cmd.add_argument("--dtype", choices=memory.DTYPES, default="float16",
                     help="with a model shape: bytes per token of each KV group (default "
                          "%(default)s)")
    cmd.set_defaults(run=run_simulate)


class Progress:
    """One stderr line as each phase of a run starts ("[2/5] ..."), the time so far on
    the next: the report stays on stdout (and --json's last line)."""

    def __init__(self, command: str, phases: int) -> None:
        self.command, self.phases, self.done = command, phases, 0
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        self.done += 1
        print(f"{self.command}: [{self.done}/{self.phases}] {message} "
              f"({time.perf_counter() - self.start:.1f} s so far)", file=sys.stderr, flush=True)

    def finish(self) -> None:
        print(f"{self.command}: done in {time.perf_counter() - self.start:.1f} s", file=sys.stderr,
              flush=True)


def run_simulate(args: argparse.Namespace) -> Dict:
    groups = bool(args.preset or args.layers or args.sliding_window or args.layer_pattern
                  or args.attention_chunk_size)
    if groups and shape_from(args).is_heterogeneous:
        fail(f"simulate replays layers of one shape; {args.preset} has layers of several shapes or "
             "layers that reuse K/V: `paged-attention memory` sizes its KV groups")
    progress = Progress("simulate", 1 + len(simulator.STRATEGIES) + groups
                        + (args.parallel_samples > 1) + (args.beam_width > 1))
    progress(f"reading the trace {args.trace}" if args.trace else
             f"drawing {args.num_requests} {args.workload} requests (seed {args.seed})")
    try:
        trace = (workloads.load_trace(args.trace) if args.trace else
                 workloads.synthetic_trace(args.workload, args.num_requests, args.seed, args.max_len))
    except (OSError, ValueError) as error:
        fail(str(error))
    longest = max(r.prompt_len + r.output_len for r in trace)
    if longest > args.max_len or args.max_len > args.pool_tokens:
        fail(f"need longest request ({longest}) <= --max-len ({args.max_len}) <= --pool-tokens "
             f"({args.pool_tokens})")
    if args.save_trace:
        workloads.save_trace(trace, args.save_trace)
    source = args.trace or f"{args.workload} (seed {args.seed})"
    report: Dict = {
        "workload": source, "num_requests": len(trace),
        "mean_prompt_len": mean(r.prompt_len for r in trace),
        "mean_output_len": mean(r.output_len for r in trace),
        "max_len": args.max_len, "block_size": args.block_size, "pool_tokens": args.pool_tokens,
        "strategies": {},
    }
    print(f"{source}: {len(trace)} requests, mean prompt {report['mean_prompt_len']:.1f}, "
          f"mean output {report['mean_output_len']:.1f} tokens; max_len {args.max_len}, "
          f"pool {args.pool_tokens} token slots, block size {args.block_size}")
    print(f"{'strategy':<9} {'utilisation':>11} {'at peak':>8} {'requests fit':>12} "
          f"{'preemptions':>11} {'steps':>7} {'waste/request':>13}")
    for name in simulator.STRATEGIES:
        progress(f"replaying {len(trace)} requests through the {name} strategy")
        stats = simulator.replay(trace, simulator.make_strategy(name, args.pool_tokens, args.max_len,
                                                                args.block_size))
        report["strategies"][name] = asdict(stats)
        fit = f"{stats.mean_batch:.1f}" if stats.mean_batch is not None else "all"
        print(f"{name:<9} {stats.utilisation:>11.1%} {stats.utilisation_at_peak:>8.1%} {fit:>12} "
              f"{stats.preemptions:>11} {stats.steps:>7} {stats.mean_waste_at_finish:>13.1f}")
    print("utilisation: share of reserved slots holding tokens, time average and at the step storing "
          "the most tokens\nrequests fit: mean running requests while others wait; waste/request: "
          "empty reserved slots when a request finishes (docs/memory.md)")
    if groups:
        progress(f"replaying {len(trace)} requests through paged-groups (KV groups) and paged "
                 "in the same pool bytes")
        report["kv_groups"] = simulate_kv_groups(args, trace)
    if args.parallel_samples > 1:
        progress(f"parallel sampling: {len(trace)} requests of {args.parallel_samples} samples")
        stats = simulator.parallel_sampling_savings(trace, args.parallel_samples, args.block_size)
        report["parallel_sampling"] = asdict(stats)
        print(f"parallel sampling, {stats.width} samples: sharing saves {stats.saved_fraction:.1%} "
              f"of KV blocks")
    if args.beam_width > 1:
        progress(f"beam search: {len(trace)} requests of width {args.beam_width}")
        stats = simulator.beam_search_savings(trace, args.beam_width, args.block_size,
                                              args.beam_switch_prob, args.seed)
        report["beam_search"] = {**asdict(stats), "switch_prob": args.beam_switch_prob}
        print(f"beam search, width {stats.width} (switch prob {args.beam_switch_prob}): "
              f"sharing saves {stats.saved_fraction:.1%} of KV blocks")
    progress.finish()
    return report


def simulate_kv_groups(args: argparse.Namespace, trace) -> Dict:
    """The paged-groups strategy over the same trace and pool bytes, per KV group."""
    shape = shape_from(args)
    layout = KVGroupLayout.from_windows(shape.windows())
    strategy = simulator.PagedGroups(args.pool_tokens, args.block_size, layout)
    stats = simulator.replay(trace, strategy)
    paged = simulator.replay(trace, simulator.make_strategy("paged", args.pool_tokens, args.max_len,
                                                            args.block_size))
    layer_bytes = shape.expanded_layer_bytes(args.dtype)
    groups = [{"layers": len(g.layers), "sliding_window": None if g.chunk_size else g.sliding_window,
               "chunk_size": g.chunk_size, "kind": memory.window_label(g.sliding_window),
               "bytes_per_token": layout.layers_per_group * layer_bytes, "utilisation": u,
               "padded_layers": layout.layers_per_group - len(g.layers)}
              for g, u in zip(layout.groups, strategy.group_utilisation())]
    fit = f"{stats.mean_batch:.1f}" if stats.mean_batch is not None else "all"
    paged_fit = f"{paged.mean_batch:.1f}" if paged.mean_batch is not None else "all"
    print(f"KV groups of {shape.layers} layers ({shape.layer_pattern[0]} {local_layers(shape)} : "
          f"{shape.layer_pattern[1]} full), same pool bytes: requests fit "
          f"{fit} (paged, one table for every layer: {paged_fit}), {stats.preemptions} preemptions, "
          f"{stats.steps} steps")
    for g, group in enumerate(groups):
        print(f"  group {g}: {group['layers']} layers, {group['kind']}, "
              f"{memory.format_bytes(group['bytes_per_token'])} per token"
              f"{padding_note(group['padded_layers'], layout.layers_per_group)}, "
              f"utilisation {group['utilisation']:.1%}")
    return {"layers": shape.layers, "sliding_window": shape.sliding_window,
            "attention_chunk_size": shape.attention_chunk_size, "layer_pattern": list(shape.layer_pattern), "groups": groups,
            "requests_fit": stats.mean_batch, "requests_fit_single_table": paged.mean_batch,
            "peak_batch": stats.peak_batch, "peak_batch_single_table": paged.peak_batch,
            "preemptions": stats.preemptions, "steps": stats.steps}


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    report = args.run(args)
    if args.json:
        print(json.dumps(report))
    return 0 if report.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
