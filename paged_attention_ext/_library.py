"""Loads the compiled extension; its static initialisers register ``torch.ops.paged``."""

import torch  # noqa: F401  (the extension links against libtorch)

from . import _C  # noqa: F401
