"""The engine loop: schedule, move blocks, one packed forward, choose tokens, stream."""

import itertools
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional

import torch

from ..block_manager import BlockSpaceManager
from ..block_table import block_hashes
from ..hf import ATTN_IMPLEMENTATION
from ..kv_cache import PagedKVCache
from .beam_search import BeamSearch
from .metrics import EngineMetrics
from .params import Request
from .runner import ModelRunner
from .sampler import next_tokens
from .scheduler import Scheduler
from .sequence import GroupStatus, Sequence, SequenceGroup


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_device_blocks: int = 512
    num_host_blocks: int = 512
    enable_prefix_caching: bool = True
    # "swap" or "recompute"; swap had the higher throughput over bench/bench_engine.py's
    # preemption workloads (docs/engine.md).
    preemption_mode: str = "swap"
    max_num_batched_tokens: int = 4096  # tokens per step; prefills beyond decodes queue up
    watermark: float = 0.01             # pool share kept free at admission for decoding


@dataclass
class RequestOutput:
    request_id: str
    new_tokens: List[List[int]]  # per sample: this step's token ([] for beams: final only)
    finished: bool
    outputs: List[List[int]]     # once finished: each sample's tokens, or the best beams first


class LLMEngine:
    """Continuous batching of requests over a paged KV cache.

    ``model`` is a transformers causal LM loaded with
    ``attn_implementation="paged_attention_ext"``.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig = EngineConfig()) -> None:
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"load the model with attn_implementation={ATTN_IMPLEMENTATION!r}")
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        self.config = config
        self.kv_cache = PagedKVCache(
            text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads, config.block_size,
            dtype=model.dtype, device=model.device, num_blocks=config.num_device_blocks,
            num_host_blocks=config.num_host_blocks)
        self.manager = BlockSpaceManager(config.num_device_blocks, config.num_host_blocks,
                                         config.block_size, config.enable_prefix_caching,
                                         config.watermark)
        self.scheduler = Scheduler(self.manager, config.preemption_mode,
                                   config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv_cache)
        self.metrics = EngineMetrics()
        self._groups: Dict[str, SequenceGroup] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._groups:
            raise ValueError(f"request {request.request_id} already exists")
        params = request.params
        generator = None
        if params.do_sample:
            generator = torch.Generator(device=self.kv_cache.device).manual_seed(params.seed)
        prompt = Sequence(next(self._ids), list(request.prompt), len(request.prompt))
        self._name_blocks(prompt)
        group = SequenceGroup(
            group_id=next(self._ids), request=request, seqs=[prompt],
            arrival=next(self._ids), generator=generator,
            beam=BeamSearch(len(request.prompt), params) if params.is_beam_search else None)
        self._groups[request.request_id] = group
        self.metrics.on_arrival(request.request_id)
        self.scheduler.add(group)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and release its blocks."""
        group = self._groups.pop(request_id)
        group.status = GroupStatus.ABORTED
        self.scheduler.remove(group)
        self.metrics.on_finish()

    def status(self, request_id: str) -> Optional[GroupStatus]:
        """Where a request is; None once it finished or was aborted."""
        group = self._groups.get(request_id)
        return group.status if group is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, requests: Iterable[Request],
                 on_output: Optional[Callable[[RequestOutput], None]] = None) -> Dict[str, List[List[int]]]:
        """Serve `requests` to completion; `on_output` sees every step's stream."""
        for request in requests:
            self.add_request(request)
        results: Dict[str, List[List[int]]] = {}
        while self.has_unfinished():
            for output in self.step():
                if on_output is not None:
                    on_output(output)
                if output.finished:
                    results[output.request_id] = output.outputs
        return results

    def report(self) -> Dict:
        return {**self.metrics.report(self.manager), "config": asdict(self.config)}

    # ---- one step -------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        plan = self.scheduler.schedule()
        self.metrics.on_schedule(self.manager, self.scheduler.running, plan.preempted)
        # Swap-outs read blocks that this step's allocations may already reuse.
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        self.kv_cache.apply_copies(plan.copies)
        if not plan.groups:
            return []
        logits = self.runner.forward(plan.groups, plan.slots, self.manager)
        outputs = []
        for group, rows in zip(plan.groups, logits):
            for seq in group.live_seqs:
                seq.num_computed = len(seq.token_ids)
            new_tokens = self._advance_beams(group, rows) if group.beam else self._advance_samples(group, rows)
            request_id = group.request.request_id
            self.metrics.on_tokens(request_id, group.request.params.num_beams
                                   if group.beam else sum(map(len, new_tokens)))
            finished = group.beam.done if group.beam else not group.live_seqs
            if finished:
                group.results = group.beam.results() if group.beam else [s.output_ids for s in group.seqs]
                group.status = GroupStatus.FINISHED
                self.scheduler.remove(group)
                del self._groups[request_id]
                self.metrics.on_finish()
            outputs.append(RequestOutput(request_id, new_tokens, finished, group.results))
        return outputs

    def _advance_samples(self, group: SequenceGroup, logits: torch.Tensor) -> List[List[int]]:
        params = group.request.params
        if len(group.seqs) < params.n:
            # First token: the samples share the prompt's blocks from here on.
            parent = group.seqs[0]
            for _ in range(params.n - 1):
                child = Sequence(next(self._ids), list(parent.token_ids), parent.prompt_len,
                                 parent.num_computed, block_hashes=list(parent.block_hashes))
                self.manager.fork(parent.seq_id, child.seq_id)
                group.seqs.append(child)
        tokens = next_tokens(logits, [not s.finished for s in group.seqs], params, group.generator)
        new_tokens: List[List[int]] = []
        for seq, token in zip(group.seqs, tokens):
            if seq.finished:
                new_tokens.append([])
                continue
            seq.token_ids.append(token)
            self._name_blocks(seq)
            new_tokens.append([token])
            if token in params.eos_token_ids or len(seq.output_ids) >= params.max_new_tokens:
                seq.finished = True
                self.manager.free_seq(seq.seq_id)
        return new_tokens

    def _advance_beams(self, group: SequenceGroup, logits: torch.Tensor) -> List[List[int]]:
        old = group.seqs
        new_beams = group.beam.step(logits, [s.output_ids for s in old])
        if group.beam.done:
            return []
        bases = [(list(s.token_ids), s.block_hashes) for s in old]
        parents = {p for p, _ in new_beams}
        for row, seq in enumerate(old):
            if row not in parents:
                self.manager.free_seq(seq.seq_id)
        # A beam continued more than once forks; its blocks are shared, copied on write.
        seqs: List[Sequence] = []
        reused = set()
        for parent, token in new_beams:
            if parent in reused:
                seq = Sequence(next(self._ids), [], old[parent].prompt_len, old[parent].num_computed)
                self.manager.fork(old[parent].seq_id, seq.seq_id)
            else:
                seq = old[parent]
                reused.add(parent)
            seq.token_ids = bases[parent][0] + [token]
            seq.block_hashes = bases[parent][1]
            self._name_blocks(seq)
            seqs.append(seq)
        group.seqs = seqs
        return []

    def _name_blocks(self, seq: Sequence) -> None:
        """Extend the sequence's block names over the blocks its new tokens filled."""
        if self.config.enable_prefix_caching:
            seq.block_hashes = block_hashes(seq.token_ids, self.config.block_size,
                                            known=seq.block_hashes)
