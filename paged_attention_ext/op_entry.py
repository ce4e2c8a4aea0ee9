"""Where calls of the paged ops enter: a Python kernel at torch's Autograd key.

torch runs that key for every call in grad and no-grad mode, on every backend, before the
CPU or CUDA kernel; inference mode skips it (no tensor there can need a gradient), so the
calls engines make pay nothing for it. The kernel does what the compiled library cannot do
through torch's stable ABI:

- refuses arguments that require grad: the ops have no backward, and without this torch's
  autograd fallback would hand back results that silently have no gradient;
- raises the kernels' argument errors as their Python types: the C++ checks throw
  ``RuntimeError("[paged:ValueError] <message>")`` (csrc/errors.h) because torch
  translates other C++ exception types differently from release to release. Under
  inference mode the wrappers in ops.py do this translation, on the error path only; a
  direct ``torch.ops.paged.*`` call there raises the tagged RuntimeError.

It costs a Python call per op call (bench/bench_op_overhead.py), so it does the least it
can: one C check for grad (``_any_requires_grad``), the Python walk over the arguments only to
name the one that requires grad, and the redispatch straight on the operator handle. The two
ops without tensor arguments (``cpu_isa``, ``select_cpu_isa``) have no Autograd key to run;
they enter at BackendSelect, which every call of them runs.

Private torch hooks used (tests/test_op_entry.py fails loudly if they change):
``torch._C._after_autograd_keyset``, ``torch._C._dispatch_keyset_full_after``,
``torch._C.DispatchKey.BackendSelect``, ``torch._C._any_requires_grad`` and
``OpOverload._handle.redispatch_boxed``.
"""

import re
from collections.abc import Callable
from typing import Any

import torch

# Every op of the library, with the dispatch key it enters at (cpu_isa and select_cpu_isa
# raise a ValueError for a bad PAGED_ATTENTION_CPU_ISA).
TENSOR_OPS = ("attention", "attention_with_lse", "attention_out", "shared_prefix_attention",
              "merge_attention_states", "write_kv", "write_latent", "copy_blocks",
              "swap_blocks")
TENSORLESS_OPS = ("cpu_isa", "select_cpu_isa")
OPS = TENSOR_OPS + TENSORLESS_OPS
ENTRY_KEY = {**{name: "Autograd" for name in TENSOR_OPS}, **{name: "BackendSelect" for name in TENSORLESS_OPS}}

_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError}
_TAG = re.compile(r"\[paged:(\w+)\] ")
# The kernels below each entry key: the backend's (CPU, CUDA, Meta for fakes), and for the
# Autograd entry the functionalization and fake-tensor keys of torch.compile between.
_BELOW = {"Autograd": torch._C._after_autograd_keyset,
          "BackendSelect": torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)}


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in value)
    return False


def _refuse_grad(name: str, arg_names: list[str], args: tuple, kwargs: dict) -> None:
    for arg_name, value in [*zip(arg_names, args), *kwargs.items()]:
        if _requires_grad(value):
            raise NotImplementedError(
                f"paged.{name}: argument '{arg_name}' requires grad, but the paged ops have no "
                "backward (they are for inference); call them under torch.no_grad() or "
                "torch.inference_mode(), or pass a detached tensor")


def python_error(error: RuntimeError) -> Exception | None:
    """The Python exception a kernel's tagged error stands for; None for other errors."""
    found = _TAG.match(str(error))
    if found is None or found.group(1) not in _ERROR_TYPES:
        return None
    return _ERROR_TYPES[found.group(1)](str(error)[found.end():])


def raise_typed(error: RuntimeError) -> None:
    """Raises the Python exception a kernel's tagged error stands for; returns for others."""
    typed = python_error(error)
    if typed is not None:
        raise typed from None


def _entry_kernel(op: torch._ops.OpOverload, below: torch._C.DispatchKeySet) -> Callable:
    name = op._schema.name.split("::")[1]
    arg_names = [a.name for a in op._schema.arguments]
    redispatch = op._handle.redispatch_boxed
    any_requires_grad = torch._C._any_requires_grad

    def enter(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and any_requires_grad(*args, **kwargs):
            _refuse_grad(name, arg_names, args, kwargs)
        try:
            return redispatch(keyset & below, *args, **kwargs)
        except RuntimeError as error:
            raise_typed(error)
            raise

    return enter


def register() -> torch.library.Library:
    """Installs the entry kernel of every op (once, when the package loads the library)."""
    library = torch.library.Library("paged", "IMPL")
    for name in OPS:
        op = getattr(torch.ops.paged, name).default
        key = ENTRY_KEY[name]
        library.impl(name, _entry_kernel(op, _BELOW[key]), key, with_keyset=True)
    return library
