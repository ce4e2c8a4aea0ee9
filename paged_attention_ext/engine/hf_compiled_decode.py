"""Decode steps of a transformers model (the HF runner's) through one compiled forward over static
metadata buffers.

A decode step runs one token per sequence, so its shapes depend only on the batch size:
``input_ids``/``position_ids`` ``[1, rows]`` and the step's inputs
(:class:`~paged_attention_ext.step_buffers.StepBuffers`: per KV group a slot mapping
``[rows]`` and block tables of fixed width, the longest sequence the pool can hold, so
tables growing never change a shape). The step is copied into preallocated buffers and
the forward runs on their first ``rows`` rows; rows past the batch are padding: slot -1
(nothing written) and seq_len 0 (nothing read, output zero), so their logits are ignored.

* CPU: ``torch.compile`` (inductor by default) with the batch dimension dynamic, so one
  graph serves every batch size >= 2 and one batch size 1 (torch specializes sizes 0 and
  1); both are compiled at warm-up. Batches are not padded unless ``sizes`` asks for it.
  Inductor ``options`` pass through; with ``freezing`` the weights become constants of the
  graph (prepacked for oneDNN/MKL), so a step refuses to run once they have changed.
* CUDA: a CUDA graph per padded batch size (as vLLM), captured at warm-up from the
  (compiled) forward on all-padding buffers, replayed after the metadata copy; a batch
  runs in the graph of the next size up.

Cascade attention (shared prefixes read once, :mod:`paged_attention_ext.cascade`) has a
graph of its own per size: the host plans each step from the block tables and picks the
plain or the cascade graph, whose split lives in fixed buffers too (one group per row at
most, padded with empty groups).

Sampling stays outside (it is per request, on the logits). Batches larger than the largest
size run the eager path.
"""

import time
import types
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..hf.hooks.llama4_positions import RealPositions
from ..hf.packed_latents import PackedLatentCache, packed_arguments
from ..kv_cache import PagedKVCache
from ..step_buffers import StepBuffers
from ..step_inputs import StepInputs, StepPlan


# torch keeps at most `recompile_limit` (8) graphs per code object, and each engine adds two
# (CPU) or one per batch size (CUDA), plus the cascade split's (one on CPU, one per size >= 2
# on CUDA) when it is on. Each model gets copies of `_forward`'s code, so engines
# over different models do not fill one shared cache, while engines over the same model reuse
# its graphs. A copy serves one backend and set of inductor options (dynamo's guards do not
# see the config a graph was compiled under) and, with freezing, one state of the weights
# (a frozen graph holds them as constants: it must not serve an engine built after they
# changed).
_FORWARDS: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[Any, types.FunctionType]]" = \
    weakref.WeakKeyDictionary()


def _forward_of(model: torch.nn.Module, key: Any) -> types.FunctionType:
    copies = _FORWARDS.setdefault(model, {})
    if key not in copies:
        original = CompiledDecode._forward
        copies[key] = types.FunctionType(original.__code__.replace(), original.__globals__,
                                         original.__name__)
    return copies[key]


def _identity(tensor: torch.Tensor) -> Tuple[int, Optional[int]]:
    """Storage address and version counter (None for inference tensors, which have none)."""
    return tensor.data_ptr(), None if tensor.is_inference() else tensor._version


def default_cuda_sizes(max_batch: int) -> Tuple[int, ...]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to ``max_batch``."""
    return tuple(s for s in [1, 2, 4] + list(range(8, max_batch + 1, 8)) if s <= max_batch)


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, table_width: int,
                 max_batch: int, backend: str = "inductor",
                 sizes: Optional[Sequence[int]] = None,
                 options: Optional[Mapping[str, Any]] = None,
                 cascade_min_saved_tokens: Optional[int] = None,
                 latents: Optional[PackedLatentCache] = None,
                 positions: Optional[RealPositions] = None) -> None:
        device = kv_cache.device
        self.model, self.kv_cache, self.device = model, kv_cache, device
        # An MLA model's latent rows, stored through Cache.update. Whether the model stores
        # every layer's is checked by the eager prefills (engine/hf_runner.py), which precede
        # any decode; a replayed graph runs no Python to count them.
        self.latents = latents
        # Llama-4's tempered layers: fed each step's positions inside the traced forward.
        self.real_positions = positions
        self.cuda_graphs = device.type == "cuda"
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_decode_batch must be an integer >= 1, got {max_batch!r}")
        if sizes is None:
            sizes = default_cuda_sizes(max_batch) if self.cuda_graphs else ()
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"decode batch sizes must be integers >= 1, got {tuple(sizes)}")
        if not callable(backend) and backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"compile_backend {backend!r} is not a torch.compile backend "
                             f"(e.g. 'inductor', 'aot_eager', 'eager')")
        options = dict(options or {})
        if options and backend != "inductor":
            raise ValueError(f"compile_options are inductor options; compile_backend is "
                             f"{backend!r}")
        unknown = sorted(set(options) - set(torch._inductor.list_options()))
        if unknown:
            raise ValueError(f"compile_options: {unknown} are not inductor options "
                             f"(torch._inductor.list_options() lists them)")
        self.sizes = sorted(set(sizes))  # empty: no padding (CPU)
        self.max_batch = self.sizes[-1] if self.sizes else max_batch
        n, longs = self.max_batch, dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(n, **longs)
        self.positions = torch.zeros(n, **longs)
        self.buffers = StepBuffers(kv_cache, n, n, table_width, decode=True,
                                   cascade_min_saved_tokens=cascade_min_saved_tokens)
        # A ready mask per layer type (none: attention follows the block tables), so the
        # compiled region skips transformers' mask construction; the eager steps of the same
        # model run it (and its checks).
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
        self._masks = {kind: None for kind in {"full_attention", *layer_types}}
        # Frozen weights (and buffers) are copied into the graph: a later change would reach
        # the eager steps only, so each step checks that none changed in place or was replaced.
        self._frozen = ([(t, _identity(t)) for t in (*model.parameters(), *model.buffers())]
                        if options.get("freezing") else [])
        # Set around every call rather than passed to torch.compile, whose `options` do not
        # reach freezing (the graph kept aten.mm on the weights, unpacked).
        self._options = options
        key = (backend, repr(sorted(options.items())),
               tuple(identity for _, identity in self._frozen))
        self._compiled = torch.compile(types.MethodType(_forward_of(model, key), self),
                                       backend=backend, fullgraph=True)
        self._graphs: Dict[int, Tuple["torch.cuda.CUDAGraph", torch.Tensor]] = {}
        self.calls = 0  # decode steps run here
        self.warmup_s: Optional[float] = None  # compile (and capture) time, once warmed up
        # An fp8 cache still to calibrate sets its scales in its first write (the first
        # prefill, eager): compiling before would trace that calibration on padding rows.
        if kv_cache.calibrated:
            self._warm_up()

    def fits(self, rows: int, width: int) -> bool:
        """Whether a decode batch of `rows` sequences, tables up to `width` blocks, can run
        here (compiling first if the cache has only now been calibrated)."""
        if self.warmup_s is None:
            if not self.kv_cache.calibrated:
                return False
            self._warm_up()
        return 1 <= rows <= self.max_batch and width <= self.buffers.width

    @property
    def cascade_calls(self) -> int:
        """Decode steps run with the cascade split."""
        return self.buffers.cascade_steps

    @property
    def cascade_saved_tokens(self) -> int:
        return self.buffers.cascade_saved_tokens

    @torch.no_grad()
    def run(self, ids: List[int], positions: List[int], plan: StepPlan) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (model dtype) of one decode token per sequence of ``plan``."""
        rows = len(ids)
        if any(_identity(tensor) != identity for tensor, identity in self._frozen):
            raise RuntimeError("compile_options freezing: the model's weights changed after the "
                               "compiled decode froze them; build a new engine")
        self.calls += 1
        size, cascade = self._stage(ids, positions, plan)
        if self.cuda_graphs:
            graph, logits = self._graphs[(size, cascade)]
            graph.replay()
            return logits[:rows]
        return self._call(size, cascade)[:rows]

    # ---- internals -------------------------------------------------------------------
    def _stage(self, ids: List[int], positions: List[int], plan: StepPlan) -> Tuple[int, bool]:
        """Copy the step into the buffers' first rows, padded to the next size; returns the
        size and whether the step takes the cascade split."""
        rows = len(ids)
        size = self._padded(rows)
        pad = size - rows
        meta = torch.tensor([ids + [0] * pad, positions + [0] * pad])
        self.ids[:size].copy_(meta[0], non_blocking=True)
        self.positions[:size].copy_(meta[1], non_blocking=True)
        if pad:  # padding rows: no blocks, no length, no slot
            plan = StepPlan([list(tables) + [[]] * pad for tables in plan.tables],
                            [list(slots) + [-1] * pad for slots in plan.slots],
                            list(plan.seq_lens) + [0] * pad, [1] * size)
        return size, bool(self.buffers.fill(plan).cascades)

    def _padded(self, rows: int) -> int:
        if not self.sizes:
            return rows
        return next(s for s in self.sizes if s >= rows)

    def _forward(self, ids, positions, slots, tables, seq_lens, cascade=(), chunks=()) -> torch.Tensor:
        # query_start_loc None: one query token per sequence (the decode form of the op).
        inputs = StepInputs(tuple(slots), tuple(tables), seq_lens, None, tuple(cascade),
                            chunk_local=tuple(chunks))
        masks = {} if self._masks is None else {"attention_mask": self._masks}
        if self.real_positions is not None:
            self.real_positions.feed(positions)
        logits = self.model(input_ids=ids, position_ids=positions, use_cache=False, **masks,
                            **packed_arguments(self.kv_cache, inputs, self.latents)).logits[0]
        if self.real_positions is not None:
            self.real_positions.clear()
        return logits

    def _call(self, size: int, cascade: bool = False) -> torch.Tensor:
        # Contiguous [1, size] views, so no guard relates the size to the buffer's length.
        inputs = self.buffers.inputs(size, size, cascade)
        slots, tables = inputs.slot_mappings, inputs.block_tables
        args = (self.ids[:size].view(1, size), self.positions[:size].view(1, size), slots, tables,
                inputs.seq_lens, inputs.cascades, inputs.chunk_local)
        if size > 1:  # one graph for every size >= 2 (1 is specialized by torch anyway)
            by_rows = [t for plan in inputs.cascades if plan is not None for t in plan.tensors()]
            by_rows += [t for chunk in inputs.chunk_local if chunk is not None
                        for t in chunk if t is not None]  # chunked groups: a row per sequence
            for tensor, dim in zip((args[0], args[1], *slots, *tables, args[4], *by_rows),
                                   (1, 1, *[0] * (2 * len(slots)), 0, *[0] * len(by_rows))):
                torch._dynamo.mark_dynamic(tensor, dim)
        try:
            if not self._options:
                return self._compiled(*args)
            with torch._inductor.config.patch(self._options):  # ~30 us
                return self._compiled(*args)
        finally:
            if self.real_positions is not None:
                self.real_positions.clear()  # also when the forward raised before its own clear

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Compile (and on CUDA capture) on all-padding buffers: nothing is written or read.

        Models whose forward takes no ready mask mapping (it has no such argument) trace
        transformers' mask construction instead; if that does not trace either, raise.
        """
        start = time.perf_counter()
        try:
            self._warm_up_sizes()
            self.warmup_s = time.perf_counter() - start
            return
        except torch._dynamo.exc.FailOnRecompileLimitHit as error:
            raise RuntimeError(
                f"compile_decode: earlier engines over this model hold the "
                f"{torch._dynamo.config.recompile_limit} graphs torch keeps per function "
                f"(torch._dynamo.config.recompile_limit); reuse an engine, or raise the "
                f"limit") from error
        except Exception as error:  # the model refused the mask mapping
            first = error
        self._masks = None
        try:
            self._warm_up_sizes()
        except Exception as error:
            raise NotImplementedError(
                f"compile_decode: {type(self.model).__name__}'s forward does not compile "
                f"(with a ready mask mapping: {type(first).__name__}: {str(first)[:200]}; "
                f"without: {type(error).__name__}: {str(error)[:200]})") from error
        self.warmup_s = time.perf_counter() - start

    def _warm_up_sizes(self) -> None:
        if not self.cuda_graphs:
            # The smallest size (1 has a graph of its own) and the largest (the rest).
            smallest = self.sizes[0] if self.sizes else 1
            for size in sorted({smallest, self.max_batch}):
                self._call(size)
            if self.buffers.plans_cascade and self.max_batch >= 2:
                size = max(2, smallest)
                self.buffers.stage_unsplit(size)
                self._call(size, cascade=True)
            return
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            for cascade in ((False, True) if self.buffers.plans_cascade and size >= 2 else (False,)):
                if cascade:
                    self.buffers.stage_unsplit(size)
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._call(size, cascade)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._call(size, cascade)
                pool = graph.pool()
                self._graphs[(size, cascade)] = (graph, logits)
        torch.cuda.synchronize()

