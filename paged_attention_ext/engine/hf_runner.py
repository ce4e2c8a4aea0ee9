"""The model runner of a transformers causal LM: one packed forward per engine step.

The only engine modules that import :mod:`paged_attention_ext.hf` are this one and
:mod:`~paged_attention_ext.engine.hf_compiled_decode`: here the model's config becomes
the engine's :class:`~paged_attention_ext.engine.model_runner.ModelSpec` (refusing what
the ops cannot run), and each step becomes a call of the model.

Every scheduled sequence contributes the tokens whose K/V is not cached yet (a whole
prompt, the part of it the prefix cache missed, a recomputation, or one decode token),
packed sequence after sequence into a single row. The ``paged_attention_ext`` attention
writes each token's K/V to its slot and attends with the multi-token form of
``paged.attention``; only the last position of each sequence goes through the LM head.

A hybrid model's linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear)
run the packed row per sequence from the sequences' state slots
(:class:`~paged_attention_ext.hf.linear_step.LinearStep` in the ``paged_batch``, through the
hook :mod:`~paged_attention_ext.hf.hooks.packed_linear_attention`); their new states reach
the state pools in :meth:`HFModelRunner.commit`, once the engine adopts the step.

A step in which every sequence computes one token (a decode step) goes through the
:class:`~paged_attention_ext.engine.hf_compiled_decode.CompiledDecode` forward when the
config asks for one; prefills and mixed steps run eager (docs/engine.md says why).
"""

import contextlib
from typing import Hashable, List, Optional, Tuple

import torch

from ..block_table import blocks_needed
from ..hf import ATTN_IMPLEMENTATION
from ..hf.hooks import llama4_positions, packed_linear_attention
from ..hf.latent_attention import check_absorbable, forget_absorbed_weights
from ..hf.linear_states import LINEAR_ATTENTION
from ..hf.linear_step import LinearStep, probe_states
from ..hf.packed_latents import PackedLatentCache, packed_arguments
from ..hf.support import (check_config, check_mla_storage, kv_head_shape, kv_readers,
                          layer_shapes, layer_windows, mla_latent_shape)
from ..kv_cache import PagedKVCache
from ..state_cache import StatePools
from ..step_buffers import StepBuffers
from ..step_inputs import StepInputs, StepPlan, plan_cascades
from .config import EngineConfig
from .hf_compiled_decode import CompiledDecode
from .model_runner import ModelRunner, ModelSpec, RunnerStats
from .scheduler import SchedulerOutput


def model_spec(model: torch.nn.Module, mla_storage: str = "latent") -> ModelSpec:
    """The KV layout of a transformers model loaded with the paged attention (an MLA model's
    as ``mla_storage`` says: latent rows, or K/V expanded per query head); an architecture
    the ops cannot run raises here."""
    check_mla_storage("HFModelRunner", mla_storage)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"load the model with attn_implementation={ATTN_IMPLEMENTATION!r}")
    text = model.config.get_text_config()
    layer_types = check_config(model.config, text)
    linear = [i for i, kind in enumerate(layer_types) if kind == LINEAR_ATTENTION]
    if llama4_positions.tempered_layers(model):
        llama4_positions.check()
    shapes = layer_shapes(text)  # Gemma-4: per layer; None: one for every layer
    latent = mla_latent_shape(text) if mla_storage == "latent" else None
    if latent is not None:
        # Read with kv_b_proj absorbed: a projection that cannot be is refused now.
        check_absorbable(model, text.num_attention_heads, latent.head_size_v)
        forget_absorbed_weights(model)  # a runner derives them from the weights it is given
        shape = latent
    else:  # expanded MLA: K/V per query head, key and value sizes differ
        shape = shapes[0] if shapes is not None else kv_head_shape(text)
    return ModelSpec(layer_windows=tuple(layer_windows(text, layer_types)),
                     num_kv_heads=shape.num_kv_heads, head_size=shape.head_size,
                     head_size_v=shape.head_size_v if shape.head_size_v != shape.head_size else None,
                     dtype=model.dtype, device=model.device, vocab_size=text.vocab_size,
                     layer_shapes=None if shapes is None else tuple(tuple(s) for s in shapes),
                     kv_readers=tuple(sorted(kv_readers(text, layer_types).items())),
                     values_in_keys=latent is not None,
                     linear_layers=tuple(linear),
                     linear_states=tuple(_linear_states(model, linear, text.hidden_size)))


def _linear_states(model: torch.nn.Module, linear: List[int],
                   hidden_size: int) -> List[Tuple[Hashable, Tuple[int, ...], torch.dtype]]:
    """The states one sequence keeps in each linear layer: each layer's own forward run on one
    token with an empty Cache (transformers creates a layer's states on first use)."""
    modules = packed_linear_attention.linear_modules(model, linear)
    return [state for layer_idx, module in modules.items()
            for state in probe_states(packed_linear_attention.module_call(module), layer_idx,
                                      hidden_size, model.dtype, model.device)]


class HFModelRunner(ModelRunner):
    """``model``: a transformers causal LM loaded with ``attn_implementation="paged_attention_ext"``.

    ``mla_storage``: for multi-head latent attention models (DeepSeek-V2/V3, Kimi, ...),
    ``"latent"`` keeps one row of ``kv_lora_rank + qk_rope_head_dim`` values per token and
    layer, read with ``kv_b_proj`` absorbed; ``"expanded"`` keeps the per-head K/V
    transformers expands (for a ``kv_b_proj`` that is not a plain ``nn.Linear``). Other
    models ignore it.
    """

    compiles_decode = True

    def __init__(self, model: torch.nn.Module, mla_storage: str = "latent") -> None:
        super().__init__(model_spec(model, mla_storage))
        self.model = model
        # Latent rows: transformers hands the latents to Cache.update only.
        self._latents = PackedLatentCache(model) if self.spec.values_in_keys else None
        # Readers store nothing; linear-attention layers keep states, not latents.
        skipped = set(dict(self.spec.kv_readers)) | set(self.spec.linear_layers)
        self._stored_layers = [i for i in range(self.spec.num_layers) if i not in skipped]
        if self.spec.linear_layers:
            packed_linear_attention.install(model, list(self.spec.linear_layers))
        self._linear_step: Optional[LinearStep] = None  # the last forward's, until commit()
        # Llama-4's NoPE layers, told each packed token's real position (hf/hooks).
        self._positions = llama4_positions.installed(model)
        self.decode: Optional[CompiledDecode] = None
        self._buffers: Optional[StepBuffers] = None  # the eager steps' inputs
        self.cascade_min_saved_tokens: Optional[int] = None
        self.cascade_steps = 0          # steps that ran cascade attention
        self.cascade_saved_tokens = 0   # key reads (per layer and KV head) their prefixes saved

    def bind(self, kv_cache: PagedKVCache, config: EngineConfig,
             states: Optional[StatePools] = None) -> None:
        """Take the pools, and compile the decode forward if ``config`` asks (which
        compiles and warms up here, at engine creation)."""
        if config.compile_decode and self.spec.linear_layers:
            raise NotImplementedError(
                "compile_decode=True: the compiled decode does not run linear-attention layers "
                f"(layers {list(self.spec.linear_layers)} of {type(self.model).__name__}), whose "
                "states the eager forward gathers per step; set compile_decode=False")
        super().bind(kv_cache, config, states)
        self._buffers = None
        self.cascade_min_saved_tokens = config.cascade_min_saved_tokens
        if config.compile_decode:
            # The longest table a sequence can have: the pool, or the model's positions.
            positions = getattr(self.model.config.get_text_config(), "max_position_embeddings",
                                1 << 30)
            width = min(kv_cache.num_blocks, blocks_needed(positions, kv_cache.block_size))
            self.decode = CompiledDecode(self.model, kv_cache, width, config.max_decode_batch,
                                         config.compile_backend, config.decode_batch_sizes,
                                         config.compile_options, config.cascade_min_saved_tokens,
                                         self._latents, self._positions)

    def stats(self) -> RunnerStats:
        decode = self.decode
        if decode is None:
            return RunnerStats(self.cascade_steps, self.cascade_saved_tokens)
        return RunnerStats(self.cascade_steps + decode.cascade_calls,
                           self.cascade_saved_tokens + decode.cascade_saved_tokens,
                           decode.calls, decode.warmup_s)

    @torch.no_grad()
    def forward(self, step: SchedulerOutput) -> List[torch.Tensor]:
        ids, positions, plan = self._plan(step)
        self._linear_step = None
        if (self.decode is not None and len(ids) == len(plan.seq_lens)
                and self.decode.fits(len(ids), plan.width())):
            logits = self.decode.run(ids, positions, plan)
        else:
            logits = self._packed(ids, positions, plan, step)
        return list(logits.float().split([len(g.live_seqs) for g in step.groups]))

    def commit(self) -> None:
        if self._linear_step is not None:
            self._linear_step.commit()
            self._linear_step = None

    def _plan(self, step: SchedulerOutput) -> Tuple[List[int], List[int], StepPlan]:
        """The step's token ids and positions, and its plan: every live sequence's
        uncomputed tokens packed in the scheduled order."""
        num_kv_groups = len(self.kv_cache.kv_groups.groups)
        ids: List[int] = []
        positions: List[int] = []
        slots: List[List[int]] = [[] for _ in range(num_kv_groups)]
        tables: List[List[List[int]]] = [[] for _ in range(num_kv_groups)]
        seq_lens: List[int] = []
        query_lens: List[int] = []
        for group in step.groups:
            for seq in group.live_seqs:
                start, end = seq.num_computed, len(seq.token_ids)
                placed = step.slots[seq.seq_id]
                if len(placed) != num_kv_groups or any(len(p) != end - start for p in placed):
                    raise RuntimeError(f"sequence {seq.seq_id}: {end - start} tokens to compute in "
                                       f"{num_kv_groups} KV group(s), slots placed for "
                                       f"{[len(p) for p in placed]}")
                ids += seq.token_ids[start:end]
                positions += range(start, end)
                for g, seq_table in enumerate(step.tables[seq.seq_id]):
                    slots[g] += placed[g]
                    tables[g].append(seq_table)
                seq_lens.append(end)
                query_lens.append(end - start)
        return ids, positions, StepPlan(tables, slots, seq_lens, query_lens)

    def _inputs(self, plan: StepPlan) -> StepInputs:
        """The eager step's inputs, written into persistent buffers (grown, by doubling,
        to the first step they cannot hold: a prompt may exceed max_num_batched_tokens)."""
        buffers = self._buffers
        if buffers is None or not buffers.fits(plan):
            old = (0, 0, 0) if buffers is None else (buffers.max_seqs, buffers.max_tokens,
                                                      buffers.width)
            need = (len(plan.seq_lens), plan.num_tokens, plan.width())
            # Normal tensors even under inference_mode, so later steps outside it may write them.
            with torch.inference_mode(False):
                self._buffers = buffers = StepBuffers(
                    self.kv_cache, *(o if n <= o else max(n, 2 * o) for n, o in zip(need, old)))
        return buffers.fill_sized(plan, plan_cascades(plan, self.kv_cache,
                                                      self.cascade_min_saved_tokens))

    def _packed(self, ids: List[int], positions: List[int], plan: StepPlan,
                step: SchedulerOutput) -> torch.Tensor:
        """The eager packed forward: logits of each sequence's last token."""
        inputs = self._inputs(plan)
        if inputs.cascades:
            self.cascade_steps += 1
            self.cascade_saved_tokens += inputs.cascade_saved_tokens
        device = self.kv_cache.device
        last_rows = (inputs.query_start_loc[1:] - 1).long()
        linear = self._linear(step) if self.spec.linear_layers else None
        position_ids = torch.tensor([positions]).to(device)
        tempered = contextlib.nullcontext() if self._positions is None else self._positions.at(
            position_ids)
        with tempered:
            logits = self.model(input_ids=torch.tensor([ids]).to(device), position_ids=position_ids,
                                use_cache=False, logits_to_keep=last_rows,
                                **packed_arguments(self.kv_cache, inputs, self._latents,
                                                   linear)).logits[0]
        if self._latents is not None:
            self._latents.check_stored(self._stored_layers)
        self._linear_step = linear  # stored by commit(), once the engine adopts the step
        return logits

    def _linear(self, step: SchedulerOutput) -> LinearStep:
        """The linear layers' runs of the step: each live sequence from its state slot (a
        sequence that has computed nothing starts without a state, as a first forward does)."""
        seqs = [seq for group in step.groups for seq in group.live_seqs]
        return LinearStep(self.states, [step.state_slots[s.seq_id] for s in seqs],
                          [len(s.token_ids) - s.num_computed for s in seqs],
                          [s.num_computed > 0 for s in seqs])
