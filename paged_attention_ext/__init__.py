"""vLLM-style PagedAttention as standalone PyTorch custom ops.

Importing the package loads the compiled library, which registers the ops under
``torch.ops.paged`` (CPU, and CUDA when built with it), and their fake (meta)
implementations for ``torch.compile``.
"""

from . import _library  # noqa: F401  (loads torch.ops.paged.*)
from . import fake  # noqa: F401  (fake tensor implementations)
from .attention_metadata import AttentionMetadata
from .ops import (
    CPU_ISAS,
    attention,
    attention_out,
    attention_with_lse,
    copy_blocks,
    cpu_isa,
    merge_attention_states,
    select_cpu_isa,
    shared_prefix_attention,
    swap_blocks,
    write_kv,
    write_latent,
)

__all__ = [
    "CPU_ISAS",
    "AttentionMetadata",
    "attention",
    "attention_out",
    "attention_with_lse",
    "copy_blocks",
    "cpu_isa",
    "merge_attention_states",
    "select_cpu_isa",
    "shared_prefix_attention",
    "swap_blocks",
    "write_kv",
    "write_latent",
]
__version__ = "0.1.0"
