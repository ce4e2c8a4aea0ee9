"""Continuous batching's allowlist of attention implementations (transformers >= 5.19).

``ContinuousBatchingManager.switch_to_cb_friendly_attn`` accepts only ``paged|eager``,
``sdpa`` and flash implementations (any name containing "flash", which transformers then
loads as a flash-attention kernel), and transformers strips the ``paged|`` prefix from every
other registered name, so no registered function can run continuous batching. The hook
keeps a model whose implementation is ``paged_attention_ext`` as it is; every other
implementation goes through transformers' own switch.
"""

import functools

from transformers.generation.continuous_batching import continuous_api

HOOKED = "_paged_attention_ext_hook"


def install(implementation: str) -> None:
    """Let continuous batching keep ``implementation`` (idempotent)."""
    manager = continuous_api.ContinuousBatchingManager
    switch = manager.switch_to_cb_friendly_attn
    if getattr(switch, HOOKED, False):
        return

    @functools.wraps(switch)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if model.config._attn_implementation == implementation:
            return None  # already continuous-batching friendly: nothing to switch
        return switch(self, model, *args, **kwargs)

    setattr(switch_to_cb_friendly_attn, HOOKED, True)
    manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
