"""Attention over MLA latent rows, with ``kv_b_proj`` absorbed (DeepSeek's inference form).

A multi-head latent attention layer (DeepSeek-V2/V3, Kimi, Mistral-4, ...) expands each
token's latent ``c`` (``kv_lora_rank`` values) into per-head keys ``k_nope[h] = W_UK[h] c``
and values ``v[h] = W_UV[h] c`` (``kv_b_proj``'s rows, head by head) and appends the rotary
key ``k_rot`` that all heads share. Since

    q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_rot[h] . k_rot   and   sum_j p_j v_j[h] = W_UV[h] sum_j p_j c_j,

attention can read the stored rows ``(c, k_rot)`` directly: every query head attends over
one shared KV head with its query absorbed into the latent space, and its latent output is
projected by ``W_UV[h]``. The scores, and so the softmax, are the expanded attention's.

The two matmuls want ``W_UK`` as ``[heads, nope, latent]`` and ``W_UV`` transposed,
``[heads, latent, v_head_dim]``, each contiguous; a strided view of ``kv_b_proj``'s weight
makes the batched matmul copy it on every call (docs/performance.md, "MLA: decode over
latent rows"). :func:`absorbed_weights` derives them once
per layer and dtype and keeps them while the weight is the same tensor with the same
contents, place and dtype (a reloaded or moved weight is derived again).
"""

import weakref
from typing import Dict, NamedTuple, Tuple

import torch

from ..kv_cache import PagedKVCache
from .batch import flat_tokens


def _refuse(module: torch.nn.Module, reason: str) -> None:
    raise NotImplementedError(
        f"paged_attention_ext: layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__}) "
        f"{reason}, so its latent rows cannot be read with kv_b_proj absorbed; pass "
        "mla_storage='expanded' (PagedCache(config, mla_storage='expanded'), or the engine's "
        "HFModelRunner(model, mla_storage='expanded')) to store the expanded keys and values instead")


def write_latent_rows(kv_cache: PagedKVCache, layer_idx: int, latent: torch.Tensor,
                      rotary_key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store what an MLA layer hands ``Cache.update``: the normalised latent ``[batch, 1,
    tokens, kv_lora_rank]`` and the rotated key ``[batch, 1, tokens, qk_rope_head_dim]``,
    one row per token at ``slot_mapping`` (a ``values_in_keys`` cache)."""
    _, row_size, latent_size = kv_cache.layer_shape(layer_idx)
    if (latent.dim() != 4 or rotary_key.dim() != 4 or latent.shape[1] != 1
            or rotary_key.shape[1] != 1 or latent.shape[:3] != rotary_key.shape[:3]
            or latent.shape[3] != latent_size or rotary_key.shape[3] != row_size - latent_size):
        raise ValueError(f"paged_attention_ext: layer {layer_idx} stores latents "
                         f"{tuple(latent.shape)} and rotary keys {tuple(rotary_key.shape)}; its "
                         f"latent rows hold [batch, 1, tokens, {latent_size}] and [batch, 1, "
                         f"tokens, {row_size - latent_size}] (kv_lora_rank, qk_rope_head_dim)")
    kv_cache.write_columns(layer_idx, flat_tokens(latent), flat_tokens(rotary_key), slot_mapping)


def check_absorbable(model: torch.nn.Module, heads: int, latent_size: int) -> None:
    """Refuse, before anything runs, an MLA model with a layer whose ``kv_b_proj`` cannot be
    absorbed (:func:`latent_weights`)."""
    for module in model.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "layer_idx"):
            latent_weights(module, heads, latent_size)


def latent_weights(module: torch.nn.Module, heads: int, latent_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``W_UK`` ``[heads, qk_nope_head_dim, latent]`` and ``W_UV`` ``[heads, v_head_dim,
    latent]``: views of the layer's ``kv_b_proj`` weight (this rank's heads)."""
    projection = getattr(module, "kv_b_proj", None)
    if not isinstance(projection, torch.nn.Linear):
        _refuse(module, f"has a kv_b_proj of type {type(projection).__name__}, not a torch.nn.Linear")
    if projection.bias is not None:
        _refuse(module, "has a kv_b_proj with a bias")
    weight = projection.weight
    if not weight.dtype.is_floating_point or weight.element_size() < 2:
        _refuse(module, f"has a kv_b_proj weight of dtype {weight.dtype}")
    nope, value = module.config.qk_nope_head_dim, module.config.v_head_dim
    if tuple(weight.shape) != (heads * (nope + value), latent_size):
        _refuse(module, f"has a kv_b_proj weight of shape {tuple(weight.shape)}, not [{heads} heads "
                        f"x ({nope} + {value}), {latent_size}]")
    per_head = weight.view(heads, nope + value, latent_size)
    return per_head[:, :nope], per_head[:, nope:]


class AbsorbedWeights(NamedTuple):
    """A layer's ``W_UK`` ``[heads, nope, latent]`` and ``W_UV^T`` ``[heads, latent,
    v_head_dim]``, contiguous, in the dtype of the queries they multiply."""
    key: torch.Tensor
    value_t: torch.Tensor


class _Derived(NamedTuple):
    weight: "weakref.ref[torch.Tensor]"  # the very tensor they came from
    stamp: Tuple  # its storage, version (in-place writes), dtype, device and shape
    weights: AbsorbedWeights


# Per module and query dtype; a module that is collected takes its entries with it.
_DERIVED: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[torch.dtype, _Derived]]" = \
    weakref.WeakKeyDictionary()


def _stamp(weight: torch.Tensor) -> Tuple:
    # An inference-mode tensor keeps no version counter: its storage, dtype and device still
    # tell a replacement, not a write in place (forget_absorbed_weights is for those).
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), version, weight.dtype, weight.device, tuple(weight.shape)


def absorbed_weights(module: torch.nn.Module, heads: int, latent_size: int,
                     dtype: torch.dtype) -> AbsorbedWeights:
    """The layer's absorbed weights in ``dtype``, derived from ``kv_b_proj`` on the first call
    and again only when its weight changed (replaced, reloaded in place, moved, cast).
    Inside ``torch.compile`` they are derived in the graph (which keeps no Python state)."""
    key_weight, value_weight = latent_weights(module, heads, latent_size)
    if torch.compiler.is_compiling():
        return AbsorbedWeights(key_weight.to(dtype), value_weight.to(dtype).transpose(1, 2))
    weight = module.kv_b_proj.weight
    stamp = _stamp(weight)
    per_dtype = _DERIVED.setdefault(module, {})
    derived = per_dtype.get(dtype)
    if derived is None or derived.weight() is not weight or derived.stamp != stamp:
        with torch.no_grad():
            weights = AbsorbedWeights(
                key_weight.to(dtype).contiguous(),
                value_weight.to(dtype).transpose(1, 2).contiguous())
        derived = per_dtype[dtype] = _Derived(weakref.ref(weight), stamp, weights)
    return derived.weights


def forget_absorbed_weights(model: torch.nn.Module) -> None:
    """Drop every layer's derived weights, so the next call derives them from ``kv_b_proj``
    as it is. Needed after writes the version stamp cannot see: through ``weight.data``
    (``weight.data.copy_(new)``) or in place on an inference-mode weight."""
    for module in model.modules():
        _DERIVED.pop(module, None)


def absorb_query(query: torch.Tensor, weights: AbsorbedWeights) -> torch.Tensor:
    """``[tokens, heads, nope + rope]`` queries as latent-row queries ``[tokens, heads,
    latent + rope]``: the non-rotary part mapped through ``W_UK[h]^T``, the rotary part kept."""
    nope = weights.key.shape[1]
    absorbed = torch.bmm(query[..., :nope].transpose(0, 1), weights.key).transpose(0, 1)
    return torch.cat((absorbed, query[..., nope:]), dim=-1)


def project_output(latent_out: torch.Tensor, weights: AbsorbedWeights) -> torch.Tensor:
    """``[tokens, heads, latent]`` attention outputs as ``[tokens, heads, v_head_dim]``."""
    return torch.bmm(latent_out.transpose(0, 1), weights.value_t).transpose(0, 1)
