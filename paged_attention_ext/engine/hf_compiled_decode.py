"""Decode steps of a transformers model (the HF runner's) through one compiled forward over static
metadata buffers.

A decode step runs one token per sequence, so its shapes depend only on the batch size:
``input_ids``/``position_ids`` ``[1, rows]``, ``slot_mapping``/``seq_lens`` ``[rows]`` and a
block table of fixed width (the longest sequence the pool can hold), so tables growing
never change a shape. The metadata is copied into preallocated buffers and the forward
runs on their first ``rows`` rows; rows past the batch are padding: slot -1 (nothing
written) and seq_len 0 (nothing read, output zero), so their logits are ignored.

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

from ..cascade import CascadeBuffers, stage_split, unsplit_layout
from ..hf import PagedBatch
from ..kv_cache import PagedKVCache


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
                 cascade_min_saved_tokens: Optional[int] = None) -> None:
        device = kv_cache.device
        self.model, self.kv_cache, self.device = model, kv_cache, device
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
        groups = range(len(kv_cache.kv_groups.groups))  # a slot mapping and tables per KV group
        self.slots = [torch.full((n,), -1, **longs) for _ in groups]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.tables = [torch.zeros(n, table_width, dtype=torch.int32, device=device) for _ in groups]
        # Cascade buffers for the KV groups without a window (the others attend plainly).
        self.cascade_min_saved_tokens = cascade_min_saved_tokens
        self._cascade = ([None if group.sliding_window is not None else
                          CascadeBuffers(n, n, table_width, device) for group in kv_cache.kv_groups.groups]
                         if cascade_min_saved_tokens is not None else [])
        self.cascade_calls = 0  # decode steps run with the cascade split
        self.cascade_saved_tokens = 0
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
        return 1 <= rows <= self.max_batch and width <= self.tables[0].shape[1]

    @torch.no_grad()
    def run(self, ids: List[int], positions: List[int], slots: List[List[int]],
            tables: List[List[List[int]]], seq_lens: List[int]) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (model dtype) of one decode token per sequence;
        ``slots`` and ``tables`` per KV group."""
        rows = len(ids)
        if any(_identity(tensor) != identity for tensor, identity in self._frozen):
            raise RuntimeError("compile_options freezing: the model's weights changed after the "
                               "compiled decode froze them; build a new engine")
        self.calls += 1
        size = self._stage(ids, positions, slots, tables, seq_lens)
        cascade = self._stage_cascade(tables, seq_lens, size)
        if self.cuda_graphs:
            graph, logits = self._graphs[(size, cascade)]
            graph.replay()
            return logits[:rows]
        return self._call(size, cascade)[:rows]

    # ---- internals -------------------------------------------------------------------
    def _stage(self, ids: List[int], positions: List[int], slots: List[List[int]],
               tables: List[List[List[int]]], seq_lens: List[int]) -> int:
        """Copy the metadata into the buffers' first rows, padding to the next size (returned)."""
        rows = len(ids)
        size = self._padded(rows)
        pad = size - rows
        meta = torch.tensor([ids + [0] * pad, positions + [0] * pad, seq_lens + [0] * pad]
                            + [group_slots + [-1] * pad for group_slots in slots])
        width = max(len(t) for t in tables[0])
        flat: List[int] = []
        for group_tables in tables:
            for table in group_tables:
                flat += table
                flat += [0] * (width - len(table))
        staged = torch.tensor(flat, dtype=torch.int32).view(len(tables), rows, width)
        self.ids[:size].copy_(meta[0], non_blocking=True)
        self.positions[:size].copy_(meta[1], non_blocking=True)
        self.seq_lens[:size].copy_(meta[2], non_blocking=True)
        for g, (slot_buffer, table_buffer) in enumerate(zip(self.slots, self.tables)):
            slot_buffer[:size].copy_(meta[3 + g], non_blocking=True)
            table_buffer[:rows, :width].copy_(staged[g], non_blocking=True)
        return size

    def _stage_cascade(self, tables: List[List[List[int]]], seq_lens: List[int], size: int) -> bool:
        """Plan the step's split per KV group into the buffers; whether the cascade graph
        runs (padding rows, seq_len 0, form empty groups)."""
        if size < 2 or not self._cascade:
            return False
        pad = size - len(seq_lens)
        saved = stage_split(self._cascade, [list(t) + [[]] * pad for t in tables],
                            seq_lens + [0] * pad, [1] * size, self.kv_cache.block_size,
                            self.cascade_min_saved_tokens)
        if saved is None:
            return False
        self.cascade_calls += 1
        self.cascade_saved_tokens += saved
        return True

    def _stage_unsplit(self, size: int) -> None:
        """A valid split of an all-padding batch (warm-up): one empty group."""
        for buffers in self._cascade:
            if buffers is not None:
                buffers.stage(unsplit_layout([[]] * size, [0] * size, [1] * size), size, size)

    def _padded(self, rows: int) -> int:
        if not self.sizes:
            return rows
        return next(s for s in self.sizes if s >= rows)

    def _forward(self, ids, positions, slots, tables, seq_lens, cascade=()) -> torch.Tensor:
        # query_start_loc None: one query token per sequence (the decode form of the op).
        batch = PagedBatch(self.kv_cache, slot_mapping=slots[0], block_tables=tables[0],
                           seq_lens=seq_lens, query_start_loc=None,
                           other_groups=tuple(zip(slots[1:], tables[1:])), cascades=tuple(cascade))
        masks = {} if self._masks is None else {"attention_mask": self._masks}
        return self.model(input_ids=ids, position_ids=positions, paged_batch=batch,
                          use_cache=False, **masks).logits[0]

    def _call(self, size: int, cascade: bool = False) -> torch.Tensor:
        # Contiguous [1, size] views, so no guard relates the size to the buffer's length.
        slots = tuple(buffer[:size] for buffer in self.slots)
        tables = tuple(buffer[:size] for buffer in self.tables)
        splits = tuple(None if buffers is None else buffers.plan(size, size)
                       for buffers in self._cascade) if cascade else ()
        args = (self.ids[:size].view(1, size), self.positions[:size].view(1, size), slots, tables,
                self.seq_lens[:size], splits)
        if size > 1:  # one graph for every size >= 2 (1 is specialized by torch anyway)
            split_tensors = [t for plan in splits if plan is not None for t in plan.tensors()]
            for tensor, dim in zip((args[0], args[1], *slots, *tables, args[4], *split_tensors),
                                   (1, 1, *[0] * (2 * len(slots)), 0, *[0] * len(split_tensors))):
                torch._dynamo.mark_dynamic(tensor, dim)
        if not self._options:
            return self._compiled(*args)
        with torch._inductor.config.patch(self._options):  # ~30 us
            return self._compiled(*args)

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
            if self._cascade and self.max_batch >= 2:
                size = max(2, smallest)
                self._stage_unsplit(size)
                self._call(size, cascade=True)
            return
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            for cascade in ((False, True) if self._cascade and size >= 2 else (False,)):
                if cascade:
                    self._stage_unsplit(size)
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

