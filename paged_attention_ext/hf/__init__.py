"""Hugging Face transformers integration (transformers 5.18 and later 5.x: ``versions.py``).

Importing this module registers the attention implementation ``paged_attention_ext``
(attention function and mask function) with transformers' registries. A model built with
it runs either the engine's packed forward (``paged_batch=PagedBatch(...)``) or
``generate`` with ``past_key_values=PagedCache(model.config)``. It also registers
:data:`CB_ATTN_IMPLEMENTATION` for transformers' continuous batching (``generate_batch``),
which runs the paged ops on transformers' own paged cache: ``paged|paged_attention_ext`` up
to transformers 5.18, the same ``paged_attention_ext`` from 5.19.
"""

import transformers

from ..versions import TRANSFORMERS_TESTED, refusal, warn_if_untested

_problem = refusal("transformers", transformers.__version__, TRANSFORMERS_TESTED)
if _problem:
    raise ImportError(_problem)
warn_if_untested("transformers", transformers.__version__, TRANSFORMERS_TESTED)

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from .attention import paged_attention_forward  # noqa: E402
from .batch import PagedBatch  # noqa: E402
from .cache import PagedCache  # noqa: E402
from .compiled_cache import CompiledPagedCache  # noqa: E402
from .continuous_batching import CB_ATTN_IMPLEMENTATION  # noqa: E402
from .continuous_batching import continuous_batching_attention_forward  # noqa: E402
from .handoff import ATTN_IMPLEMENTATION, publish_padding_mask  # noqa: E402
from .support import check_config  # noqa: E402

AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, publish_padding_mask)
if CB_ATTN_IMPLEMENTATION == ATTN_IMPLEMENTATION:
    # One name for both (paged_attention_forward hands continuous-batching calls on), which
    # continuous batching's allowlist does not know.
    from .hooks import cb_attention_allowlist  # noqa: E402
    cb_attention_allowlist.install(ATTN_IMPLEMENTATION)
else:
    AttentionInterface.register(CB_ATTN_IMPLEMENTATION, continuous_batching_attention_forward)

__all__ = ["ATTN_IMPLEMENTATION", "CB_ATTN_IMPLEMENTATION", "CompiledPagedCache", "PagedBatch",
           "PagedCache", "check_config", "paged_attention_forward"]
