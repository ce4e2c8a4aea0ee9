"""What differs between the supported transformers releases (tests/test_hf_hooks.py checks each)."""

import transformers

from ..versions import release

# 5.19 strips the ``paged|`` prefix from every implementation name but ``paged|eager``
# (continuous batching included), so one name serves generate and continuous batching.
STRIPS_PAGED_PREFIX: bool = release(transformers.__version__) >= (5, 19)
