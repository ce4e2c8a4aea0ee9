"""The engine loop: schedule, move blocks, one packed forward, choose tokens, stream."""

import copy
import itertools
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional, Union

import torch

from ..block_table import block_hashes
from ..kv_cache import PagedKVCache
from ..kv_groups import Chunked, KVGroupLayout
from ..quantization import kv_cache_dtype
from ..state_cache import StatePools, state_bytes
from .beam_search import BeamSearch
from .checks import check_engine
from .config import EngineConfig
from .contents import BlockContents
from .metrics import EngineMetrics
from .model_runner import ModelRunner, ModelSpec
from .params import Request
from .sampler import sample_many
from .scheduler import Preemption, Scheduler, SchedulerOutput
from .sequence import GroupStatus, Sequence, SequenceGroup


@dataclass
class _Choice:
    """A group's next tokens, chosen but not yet adopted."""

    tokens: list                                   # per row a token; beams: (row, token) pairs
    generator: Optional[torch.Generator] = None    # sampling: the advanced copy
    beam: Optional[BeamSearch] = None              # beam search: the advanced copy


@dataclass
class RequestOutput:
    request_id: str
    new_tokens: List[List[int]]  # per sample: this step's token ([] for beams: final only)
    finished: bool
    outputs: List[List[int]]     # once finished: each sample's tokens, or the best beams first


class LLMEngine:
    """Continuous batching of requests over a paged KV cache.

    ``model`` is a transformers causal LM loaded with
    ``attn_implementation="paged_attention_ext"``, or any model behind a
    :class:`~paged_attention_ext.engine.model_runner.ModelRunner`.
    """

    def __init__(self, model: Union[torch.nn.Module, ModelRunner],
                 config: EngineConfig = EngineConfig()) -> None:
        runner = model if isinstance(model, ModelRunner) else _transformers_runner(model)
        spec = runner.spec
        # Sliding-window and chunked layers get KV groups of their own, which free what leaves
        # their span; layers of different K/V shapes get groups per shape either way.
        if not config.hybrid_kv_groups and any(isinstance(w, Chunked) for w in spec.layer_windows):
            # A chunked layer's chunks come from its group's tables (chunk_local), not a layer option.
            raise NotImplementedError("this model has chunked-attention layers, which need KV "
                                      "groups of their own: set hybrid_kv_groups=True")
        windows = spec.layer_windows if config.hybrid_kv_groups else (None,) * spec.num_layers
        _check_state_slots(spec, config)
        # A hybrid model's linear-attention layers store no K/V: their states have pools of their own.
        kv_groups = KVGroupLayout.from_windows(windows, spec.layer_shapes, dict(spec.kv_readers),
                                               without_kv=spec.linear_layers)
        self.config = config
        self.kv_cache = PagedKVCache(
            spec.num_layers, spec.num_kv_heads, spec.head_size, config.block_size,
            dtype=kv_cache_dtype(config.kv_cache_dtype, spec.dtype), device=spec.device,
            num_blocks=config.num_device_blocks, num_host_blocks=config.num_host_blocks,
            head_size_v=spec.head_size_v, k_scale=config.k_scale, v_scale=config.v_scale,
            calibration=config.kv_scale_calibration, kv_groups=kv_groups,
            values_in_keys=spec.values_in_keys)
        self.states = _state_pools(spec, config)
        # The scheduler owns the block manager: the engine goes through it.
        self.scheduler = Scheduler(config, kv_groups.windows)
        runner.bind(self.kv_cache, config, self.states)
        self.runner = runner
        self.contents = BlockContents(config.block_size) if config.record_block_contents else None
        self.metrics = EngineMetrics()
        self._groups: Dict[str, SequenceGroup] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError naming it if it cannot be served."""
        if request.request_id in self._groups:
            raise ValueError(f"request {request.request_id} already exists")
        for position, token in enumerate(request.prompt):
            if token >= self.runner.spec.vocab_size:
                raise ValueError(f"request {request.request_id}: prompt[{position}] = {token} is "
                                 f"not in the model's vocabulary (size {self.runner.spec.vocab_size})")
        params = request.params
        width = params.num_beams if params.is_beam_search else params.n
        if self.states is not None and width > self.config.num_state_slots:
            raise ValueError(f"request {request.request_id}: its {width} sequences need a state slot "
                             f"each, more than EngineConfig.num_state_slots="
                             f"{self.config.num_state_slots}; raise num_state_slots")
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

    def check_invariants(self, deep: bool = False) -> None:
        """Block manager invariants, and every request where its status says.

        ``deep``: also check the cache's content as recorded at each write, copy and
        swap: every block in the prefix cache holds exactly the tokens (after exactly
        the prefix) its name says, and every sequence's blocks hold its computed tokens.
        """
        if deep and self.contents is None:
            raise ValueError("check_invariants(deep=True) needs "
                             "EngineConfig(record_block_contents=True)")
        check_engine(self.scheduler, self._groups, self.contents if deep else None)

    def report(self) -> Dict:
        stats = self.runner.stats()
        compiled = (None if stats.compiled_decode_steps is None else
                    {"steps": stats.compiled_decode_steps,
                     "compile_and_warmup_s": stats.compile_and_warmup_s})
        cascade = {"steps": stats.cascade_steps, "saved_key_reads": stats.cascade_saved_key_reads}
        return {**self.metrics.report(self.scheduler), "kv_bytes_per_block": self.kv_cache.block_bytes,
                "compiled_decode": compiled,
                "cascade": cascade, "config": asdict(self.config)}

    # ---- one step -------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Preempt, place this step's tokens, one packed forward, choose tokens, stream.

        A step is two transactions. The first preempts (and copies swapped-out blocks to
        the host); the second places tokens, moves blocks, runs the model and chooses
        the next tokens. If either raises, it is rolled back: block tables, reference
        counts, the prefix cache, the queues and every sequence are as they were before
        it (the prefix cache may have forgotten blocks the failed part evicted, since
        their memory may have been written). A failure in the second part keeps the
        first part's preemptions, whose blocks may already have been reused.
        """
        # Most steps preempt nothing: they skip the first transaction (and its checkpoint).
        preemption = Preemption()
        if self.scheduler.must_preempt():
            with self.scheduler.transaction():
                preemption = self.scheduler.preempt()
                self.kv_cache.swap_out(preemption.swap_out)
                if self.states is not None:
                    self.states.apply(preemption.state_moves)
            if self.contents is not None:
                self.contents.swap_out(preemption.swap_out)
            self.metrics.on_preempt(preemption.counts)
        with self.scheduler.transaction():
            plan = self.scheduler.schedule(admit=not preemption.any)
            self.kv_cache.swap_in(plan.swap_in)
            self.kv_cache.apply_copies(plan.copies)
            if self.states is not None:
                self.states.apply(plan.state_moves)
            logits = self.runner.forward(plan) if plan.groups else []
            choices = self._choose_all(plan.groups, logits)
            self.runner.commit()
        return self._commit(plan, choices)

    def _choose_all(self, groups: List[SequenceGroup], logits: List[torch.Tensor]) -> List[_Choice]:
        """Every group's next tokens, without changing the groups: the requests' generators
        and beam states advance on copies that the commit adopts. Greedy and sampled
        groups are chosen together (:func:`sampler.sample_many`)."""
        choices: List[Optional[_Choice]] = [None] * len(groups)
        samples, members = [], []
        for i, group in enumerate(groups):
            if group.beam:
                beam = copy.copy(group.beam)  # step() only rebinds its attributes (beam_search.py)
                choices[i] = _Choice(beam.step(logits[i], [s.output_ids for s in group.seqs]),
                                     beam=beam)
                continue
            params = group.request.params
            live = ([True] * params.n if len(group.seqs) < params.n  # first token: n samples
                    else [not s.finished for s in group.seqs])
            generator = None
            if group.generator is not None:
                generator = torch.Generator(device=group.generator.device)
                generator.set_state(group.generator.get_state())
            samples.append((logits[i], live, params, generator))
            members.append(i)
        for i, tokens, (_, _, _, generator) in zip(members, sample_many(samples), samples):
            choices[i] = _Choice(tokens, generator=generator)
        return choices

    def _commit(self, plan: SchedulerOutput, choices: List["_Choice"]) -> List[RequestOutput]:
        """Adopt a step that ran: record what was written, append the chosen tokens, stream."""
        self.metrics.on_step(self.scheduler)
        if self.contents is not None:
            self.contents.swap_in(plan.swap_in)
            self.contents.copy(plan.copies)
            keys = self.scheduler.manager.group_keys
        for group in plan.groups:
            for seq in group.live_seqs:
                end = len(seq.token_ids)
                if self.contents is not None:
                    for slots, key in zip(plan.slots[seq.seq_id], keys):  # every KV group's
                        self.contents.write(slots, seq.token_ids[seq.num_computed:],
                                            range(seq.num_computed, end), seq.block_hashes, key)
                seq.num_computed = end
        outputs = []
        for group, choice in zip(plan.groups, choices):
            new_tokens = (self._advance_beams(group, choice) if group.beam
                          else self._advance_samples(group, choice))
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

    def _advance_samples(self, group: SequenceGroup, choice: "_Choice") -> List[List[int]]:
        params = group.request.params
        group.generator = choice.generator
        if len(group.seqs) < params.n:
            # First token: the samples share the prompt's blocks from here on.
            parent = group.seqs[0]
            for _ in range(params.n - 1):
                child = Sequence(next(self._ids), list(parent.token_ids), parent.prompt_len,
                                 parent.num_computed, block_hashes=list(parent.block_hashes))
                self.scheduler.fork(parent, child)
                group.seqs.append(child)
        new_tokens: List[List[int]] = []
        for seq, token in zip(group.seqs, choice.tokens):
            if seq.finished:
                new_tokens.append([])
                continue
            seq.token_ids.append(token)
            self._name_blocks(seq)
            new_tokens.append([token])
            if token in params.eos_token_ids or len(seq.output_ids) >= params.max_new_tokens:
                seq.finished = True
                self.scheduler.release(seq)
        return new_tokens

    def _advance_beams(self, group: SequenceGroup, choice: "_Choice") -> List[List[int]]:
        old = group.seqs
        group.beam = choice.beam
        if group.beam.done:
            return []
        new_beams = choice.tokens
        bases = [(list(s.token_ids), s.block_hashes) for s in old]
        parents = {p for p, _ in new_beams}
        for row, seq in enumerate(old):
            if row not in parents:
                self.scheduler.release(seq)
        # A beam continued more than once forks; its blocks are shared, copied on write.
        seqs: List[Sequence] = []
        reused = set()
        for parent, token in new_beams:
            if parent in reused:
                seq = Sequence(next(self._ids), [], old[parent].prompt_len, old[parent].num_computed)
                self.scheduler.fork(old[parent], seq)
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


def _check_state_slots(spec: ModelSpec, config: EngineConfig) -> None:
    """State slots are sized for a model with linear-attention layers, and only for one."""
    for name in ("num_state_slots", "num_host_state_slots"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"EngineConfig.{name} must be an int >= 0 or None, got {value!r}")
    if spec.linear_layers and not config.num_state_slots:
        raise ValueError(
            f"this model has linear-attention layers ({len(spec.linear_layers)}), which keep "
            f"a fixed-size state per sequence ({_state_bytes(spec)} bytes): set "
            "EngineConfig.num_state_slots to the most sequences the device holds at once")
    if not spec.linear_layers and (config.num_state_slots is not None
                                   or config.num_host_state_slots is not None):
        raise ValueError("EngineConfig.num_state_slots / num_host_state_slots size the states of "
                         "linear-attention layers, which this model does not have; leave them None")


def _state_bytes(spec: ModelSpec) -> int:
    """Bytes of one sequence's linear-attention states (one slot)."""
    return sum(state_bytes([shape], dtype) for _, shape, dtype in spec.linear_states)


def _state_pools(spec: ModelSpec, config: EngineConfig) -> Optional[StatePools]:
    """The linear layers' state pools, allocated whole at creation (None: no linear layers)."""
    if not spec.linear_layers:
        return None
    pools = StatePools(config.num_state_slots, config.host_state_slots)
    for key, shape, dtype in spec.linear_states:
        pools.pool(key, shape, dtype, spec.device)
    return pools


def _transformers_runner(model: torch.nn.Module) -> ModelRunner:
    # Imported on use: only a transformers model needs transformers (and paged_attention_ext.hf).
    from .hf_runner import HFModelRunner
    return HFModelRunner(model)
