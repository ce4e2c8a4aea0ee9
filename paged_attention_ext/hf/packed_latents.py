"""The transformers ``Cache`` of a packed forward whose MLA model keeps latent rows.

transformers' multi-head latent attention (DeepSeek-V2/V3, Kimi, Mistral-4, ...) hands its
compressed latents (the normalised latent and the rotated key) to ``Cache.update`` only, and
then expands them per head for the attention function. The engine's packed forward passes
no history through the cache (its :class:`~paged_attention_ext.hf.PagedBatch` travels as a
keyword argument), so for a model stored as latent rows it passes this cache as well:
``update`` stores each layer's latents at the batch's slots (:func:`write_latent_rows`, as
:class:`~paged_attention_ext.hf.PagedCache` does) and returns them unchanged, and the
attention function reads the rows with ``kv_b_proj`` absorbed.

It keeps no history and no layers: transformers sees a cache of length 0, so it builds a
plain causal mask over the packed row, which the attention function does not apply (the
block tables keep the sequences apart).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import Cache

from ..kv_cache import PagedKVCache
from ..step_inputs import StepInputs
from .batch import PagedBatch
from .latent_attention import write_latent_rows
from .linear_step import LinearStep
from .transformers_behaviour import cache_keyword


class PackedLatentCache(Cache):
    """Stores an MLA model's latents at the slots of the forward's batch (:meth:`begin`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(layers=[])
        self.keyword = cache_keyword(model)  # the forward's name for its cache
        self.batch: Optional[PagedBatch] = None
        self.stored: List[int] = []  # the layers whose latents this forward stored

    def begin(self, batch: PagedBatch) -> None:
        """The next forward writes at ``batch``'s slots."""
        self.batch = batch
        self.stored = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the layer's latent (``key_states``) and rotary key (``value_states``)."""
        batch = self.batch
        if batch is None:
            raise RuntimeError("PackedLatentCache: begin(batch) before the forward")
        write_latent_rows(batch.kv_cache, layer_idx, key_states, value_states,
                          batch.slots_of(layer_idx))
        self.stored.append(layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # no history: the packed forward's positions come as position_ids

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, int]:
        return query_length, 0

    def check_stored(self, layers: Sequence[int]) -> None:
        """Raise unless the forward stored exactly ``layers``' latents, in order: a model
        whose attention does not hand its latents to the cache would attend over rows never
        written."""
        if self.stored != list(layers):
            raise RuntimeError(
                f"paged_attention_ext: the forward stored the latents of layers {self.stored}, not "
                f"of every MLA layer {list(layers)}: the model does not hand its latents to "
                "Cache.update as transformers' MLA attention does; store the expanded keys and "
                "values instead (mla_storage='expanded')")


def packed_arguments(kv_cache: PagedKVCache, inputs: StepInputs,
                     latents: Optional[PackedLatentCache],
                     linear: Optional[LinearStep] = None) -> Dict[str, Any]:
    """The paged keyword arguments of a packed forward over ``inputs``: its batch, whose
    attention function also stores the K/V, or, for a model stored as latent rows, the batch
    (reading only) and ``latents``, whose ``update`` stores them. ``linear``: a hybrid
    model's linear-attention runs of the step (hf/hooks/packed_linear_attention.py)."""
    if latents is None:
        return {"paged_batch": PagedBatch(kv_cache, inputs, linear=linear)}
    batch = PagedBatch(kv_cache, inputs, write_kv=False, linear=linear)
    latents.begin(batch)
    return {"paged_batch": batch, latents.keyword: latents}
