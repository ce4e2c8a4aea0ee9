"""Loads the compiled extension (its static initialisers register ``torch.ops.paged``) and
installs the ops' Python entry (op_entry.py)."""

import torch

from .versions import TORCH_TESTED, refusal, warn_if_untested

_problem = refusal("torch", torch.__version__, TORCH_TESTED)
if _problem:
    raise ImportError(_problem)
warn_if_untested("torch", torch.__version__, TORCH_TESTED)

try:
    from . import _C  # noqa: F401
except ImportError as error:
    # The library uses torch's stable ABI of torch 2.10, which every later torch keeps; a
    # failure here is a damaged install or a torch that broke that promise.
    raise ImportError(
        f"paged_attention_ext's compiled extension does not load with torch {torch.__version__} "
        f"({error}); reinstall paged-attention-ext, and report it if that does not help.") from error

from . import op_entry  # noqa: E402  (after _C: it registers on the ops _C defines)

_ENTRY = op_entry.register()
