"""Continuous batching's allowlist of attention implementations (transformers >= 5.19).

``ContinuousBatchingManager.switch_to_cb_friendly_attn`` accepts only ``paged|eager``,
``sdpa`` and flash implementations (any name containing "flash", which transformers then
loads as a flash-attention kernel), and transformers strips the ``paged|`` prefix from every
other registered name, so no registered function can run continuous batching. The hook
keeps a model whose implementation is ``paged_attention_ext`` as it is; every other
implementation goes through transformers' own switch.

A release that renames or removes that method loses only continuous batching with this
implementation: the hook then installs nothing and warns once, naming the change, and
transformers' own refusal of the name stays in place (no wrong answer, generate unaffected).
"""

import functools
import inspect
import warnings

import transformers

HOOKED = "_paged_attention_ext_hook"
# What the hook relies on: the manager class, its method and the method's leading parameters.
_MODULE = "transformers.generation.continuous_batching.continuous_api"
_METHOD = "ContinuousBatchingManager.switch_to_cb_friendly_attn"
_PARAMETERS = ("self", "model")


def _switch():
    """The method the hook wraps, or a sentence saying what changed."""
    try:
        from transformers.generation.continuous_batching import continuous_api
        manager = continuous_api.ContinuousBatchingManager
        switch = manager.switch_to_cb_friendly_attn
    except (ImportError, AttributeError) as error:
        return None, None, f"{_MODULE}.{_METHOD} is gone ({error})"
    parameters = tuple(inspect.signature(switch).parameters)[:len(_PARAMETERS)]
    if parameters != _PARAMETERS:
        return None, None, f"{_METHOD} now takes {parameters}, not {_PARAMETERS}"
    return manager, switch, ""


def install(implementation: str) -> bool:
    """Let continuous batching keep ``implementation`` (idempotent); False, with a warning,
    when this transformers release no longer has what the hook relies on."""
    manager, switch, changed = _switch()
    if changed:
        warnings.warn(
            f"paged_attention_ext: transformers {transformers.__version__} changed continuous "
            f"batching ({changed}); generate_batch with attn_implementation={implementation!r} "
            "is unavailable on this release (generate and the engine are not affected).",
            RuntimeWarning, stacklevel=2)
        return False
    if getattr(switch, HOOKED, False):
        return True

    @functools.wraps(switch)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if model.config._attn_implementation == implementation:
            return None  # already continuous-batching friendly: nothing to switch
        return switch(self, model, *args, **kwargs)

    setattr(switch_to_cb_friendly_attn, HOOKED, True)
    manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    return True
