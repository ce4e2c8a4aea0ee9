"""Hugging Face transformers integration (transformers 5.x).

Importing this module registers the attention implementation ``paged_attention_ext``
(attention function and mask function) with transformers' registries. A model built with
it runs either the engine's packed forward (``paged_batch=PagedBatch(...)``) or
``generate`` with ``past_key_values=PagedCache(model.config)``. It also registers
``paged|paged_attention_ext`` for transformers' continuous batching (``generate_batch``),
which runs the paged ops on transformers' own paged cache.
"""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .attention import paged_attention_forward
from .batch import PagedBatch
from .cache import PagedCache, publish_padding_mask
from .continuous_batching import ATTN_IMPLEMENTATION as CB_ATTN_IMPLEMENTATION
from .continuous_batching import continuous_batching_attention_forward
from .support import check_config

ATTN_IMPLEMENTATION = "paged_attention_ext"

AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, publish_padding_mask)
AttentionInterface.register(CB_ATTN_IMPLEMENTATION, continuous_batching_attention_forward)

__all__ = ["ATTN_IMPLEMENTATION", "CB_ATTN_IMPLEMENTATION", "PagedBatch", "PagedCache", "check_config",
           "paged_attention_forward"]
