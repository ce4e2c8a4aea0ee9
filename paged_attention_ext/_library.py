"""Loads the compiled extension; its static initialisers register ``torch.ops.paged``."""

import torch

from .versions import TORCH_SUPPORTED, unsupported

_problem = unsupported("torch", torch.__version__, TORCH_SUPPORTED, rebuild=True)
if _problem:
    raise ImportError(_problem)

try:
    from . import _C  # noqa: F401
except ImportError as error:
    # An extension compiled against another torch fails with undefined symbols.
    raise ImportError(
        f"paged_attention_ext's compiled extension does not load with torch {torch.__version__} "
        f"({error}); it was built against another torch: build it again against this one "
        "(pip install --no-build-isolation .).") from error
