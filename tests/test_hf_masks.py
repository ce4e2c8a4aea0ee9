"""The mask check on the masks the installed transformers really builds.

The masks come from transformers' own creation functions (whose composition of closures
changes between releases: 5.23 wraps packed forwards in remap_positions_for_packed_sequence),
called with ``attn_implementation="paged_attention_ext"``, so they reach the paged mask
function exactly as a model forward does. Causal, sliding-window and packed causal masks are
accepted; masks the paged ops cannot apply raise.
"""

import pytest
import torch
import transformers
from transformers import masking_utils

import paged_attention_ext.hf  # noqa: F401  (registers the mask function)
from paged_attention_ext.hf import ATTN_IMPLEMENTATION
from paged_attention_ext.testing import TINY

WINDOW = 3


def config(**overrides):
    config = transformers.MistralConfig(**{**TINY, "sliding_window": WINDOW, **overrides})
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def embeds(rows, tokens):
    return torch.zeros(rows, tokens, 0)


def left_padded_mask():
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    return mask


# Four sequences of 3, 1, 4 and 2 tokens in one row, as the engine packs them (the third
# continues a cached prefix: positions 5..8).
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 0, 5, 6, 7, 8, 0, 1]])


@pytest.mark.parametrize("create", [masking_utils.create_causal_mask,
                                    masking_utils.create_sliding_window_causal_mask])
def test_left_padded_prefill_is_accepted(create):
    mask = left_padded_mask()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert create(config(), embeds(2, 7), mask, None, positions) is None


@pytest.mark.parametrize("create", [masking_utils.create_causal_mask,
                                    masking_utils.create_sliding_window_causal_mask])
def test_packed_forward_is_accepted(create):
    assert create(config(), embeds(1, 10), None, None, PACKED_POSITIONS) is None


def test_image_token_block_is_refused():
    # Tokens 1..4 see each other both ways (a bidirectional image block over causal text).
    def image_block(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx >= 1) & (q_idx < 5) & (kv_idx >= 1) & (kv_idx < 5)

    with pytest.raises(NotImplementedError, match="asked for another mask"):
        masking_utils.create_causal_mask(config(), embeds(2, 7), left_padded_mask(), None, None,
                                         or_mask_function=image_block)


def test_bidirectional_mask_is_refused():
    with pytest.raises(NotImplementedError, match="asked for another mask"):
        masking_utils.create_bidirectional_mask(config(), embeds(2, 7), left_padded_mask())


def test_window_other_than_the_configs_is_refused():
    # A window of 2 where the model's layers attend with 3: the ops would see one more key.
    other = masking_utils.sliding_window_causal_mask_function(WINDOW - 1)
    with pytest.raises(NotImplementedError, match="asked for another mask"):
        masking_utils.create_causal_mask(config(), embeds(2, 7), left_padded_mask(), None, None,
                                         and_mask_function=other)
