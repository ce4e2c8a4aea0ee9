"""The engine's packed row through a hybrid model's linear-attention modules.

transformers' linear-attention modules (gated DeltaNet in Qwen3-Next, Qwen3.5 and
OLMo-hybrid, KDA in Kimi-Linear) run their input as whole rows, each from the state of the
``Cache`` they are handed. The engine's packed row holds several sequences one after
another, and it passes no Cache. :func:`install` therefore replaces each linear module's
``forward`` on the instance (no class, weight or state-dict name changes) with one that,
when the call's ``paged_batch`` carries a :class:`~paged_attention_ext.hf.linear_step.LinearStep`,
runs the module's own forward once per run of the step (the decode sequences as one batch,
every other sequence alone), each with a Cache of that run's states, and puts the outputs
back in the row's order. Every other call (``generate`` with any Cache, no ``paged_batch``)
goes straight through.

What it relies on, checked by :func:`install` (an error names what changed) and by
tests/test_hf_hooks.py on every family: the linear module of layer ``i`` is the one module
with ``layer_idx == i``; its forward's first parameters are ``hidden_states``, the Cache
(``cache_params`` up to transformers 5.2x, ``cache`` later) and ``attention_mask``; it
returns the ``[batch, tokens, hidden]`` output; it keeps its states only in the Cache it is
handed. The engine's row has no padding, so a mask (none, or all ones) is not passed on.
"""

import inspect
from typing import Callable, Dict, List, Tuple

import torch

from ..linear_step import LinearStep
from ..packed_latents import PackedLatentCache

HOOKED = "_paged_attention_ext_packed_linear"
_CACHE_NAMES = ("cache_params", "cache")


def linear_modules(model: torch.nn.Module, layer_ids: List[int]) -> Dict[int, torch.nn.Module]:
    """Each linear layer's module; raises naming what changed if the layout is not the one
    the hook relies on."""
    modules: Dict[int, List[torch.nn.Module]] = {i: [] for i in layer_ids}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx in modules:
            modules[layer_idx].append(module)
    found = {}
    for layer_idx, candidates in modules.items():
        if len(candidates) != 1:
            raise NotImplementedError(
                f"{type(model).__name__}: expected one module with layer_idx={layer_idx} (the "
                f"linear-attention layer), found {[type(m).__name__ for m in candidates]}; this "
                "transformers release changed what the engine's linear-attention hook relies on")
        found[layer_idx] = candidates[0]
    return found


def cache_parameter(module: torch.nn.Module) -> str:
    """The name under which the module's forward takes its Cache."""
    forward = getattr(module.forward, "__wrapped_linear_forward__", module.forward)
    parameters = tuple(inspect.signature(forward).parameters)[:3]
    if (len(parameters) == 3 and parameters[0] == "hidden_states" and parameters[1] in _CACHE_NAMES
            and parameters[2] == "attention_mask"):
        return parameters[1]
    raise NotImplementedError(
        f"{type(module).__name__}.forward now takes {parameters}, not (hidden_states, "
        f"cache_params | cache, attention_mask); this transformers release changed what the "
        "engine's linear-attention hook relies on")


def install(model: torch.nn.Module, layer_ids: List[int]) -> None:
    """Hook every linear layer's module (idempotent)."""
    for layer_idx, module in linear_modules(model, layer_ids).items():
        if not getattr(module.forward, HOOKED, False):
            module.forward = _packed_forward(module.forward, cache_parameter(module), layer_idx)


def module_call(module: torch.nn.Module) -> Callable:
    """A call ``(hidden_states, cache) -> output`` of the module's own forward (hooked or not)."""
    name = cache_parameter(module)
    original = getattr(module.forward, "__wrapped_linear_forward__", module.forward)
    return lambda hidden_states, cache: original(hidden_states, **{name: cache})


def _packed_forward(original: Callable, name: str, layer_idx: int) -> Callable:
    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        batch = kwargs.get("paged_batch")
        step = getattr(batch, "linear", None)
        if step is None:
            return original(hidden_states, *args, **kwargs)
        kwargs.pop("paged_batch")
        cache = kwargs.pop(name, None)
        mask = kwargs.pop("attention_mask", None)
        _check_packed(step, hidden_states, args, cache, mask, layer_idx)
        return _run(original, name, layer_idx, step, hidden_states, kwargs)

    setattr(forward, HOOKED, True)
    forward.__wrapped_linear_forward__ = original
    return forward


def _check_packed(step: LinearStep, hidden_states: torch.Tensor, args: Tuple, cache, mask,
                  layer_idx: int) -> None:
    # The only Cache the engine's forward passes is an MLA model's PackedLatentCache (Kimi-Linear's
    # full layers), which holds no linear state.
    if args or not (cache is None or isinstance(cache, PackedLatentCache)):
        raise NotImplementedError(
            f"linear-attention layer {layer_idx} got a Cache or positional arguments beside the "
            "engine's packed row; the engine's forward passes neither (use_cache=False), but "
            "for the latent rows' PackedLatentCache")
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != step.num_tokens:
        raise ValueError(f"linear-attention layer {layer_idx}: the packed row is "
                         f"{tuple(hidden_states.shape[:2])}, the step has {step.num_tokens} tokens")
    if mask is not None and not bool(mask.all()):
        raise ValueError(f"linear-attention layer {layer_idx}: the engine's packed row has no "
                         "padding, but the call carries a mask with masked positions")


def _run(original: Callable, name: str, layer_idx: int, step: LinearStep,
         hidden_states: torch.Tensor, kwargs: Dict) -> torch.Tensor:
    """The module once per run of the step, the outputs in the row's order."""
    row = hidden_states[0]
    output = None
    for run in step.runs:
        rows = run.rows.to(row.device)
        part = row.index_select(0, rows)
        part = part.unsqueeze(1) if run.batched else part.unsqueeze(0)
        cache = step.cache(layer_idx, run)
        out = original(part, **{name: cache}, **kwargs)
        step.keep(layer_idx, run, cache)
        out = out.reshape(-1, out.shape[-1])
        if output is None:
            output = out.new_empty(step.num_tokens, out.shape[-1])
        output.index_copy_(0, rows, out)
    return output.unsqueeze(0)
