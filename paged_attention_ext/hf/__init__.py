"""Hugging Face transformers integration.

Importing this module registers the attention implementation ``paged_attention_ext``
(attention function and mask function) with transformers' registries.
"""

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .attention import paged_attention_forward
from .batch import PagedBatch

ATTN_IMPLEMENTATION = "paged_attention_ext"


def _no_mask(*args, **kwargs):
    """Masks come from block tables, sequence lengths and query_start_loc instead."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)

__all__ = ["ATTN_IMPLEMENTATION", "PagedBatch", "paged_attention_forward"]
