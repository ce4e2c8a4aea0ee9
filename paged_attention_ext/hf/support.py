"""Which transformers architectures the ``paged_attention_ext`` integration can run.

:func:`check_config` runs when a :class:`~paged_attention_ext.hf.PagedCache` is created and
raises ``NotImplementedError`` naming the architecture and the reason for models whose
attention this integration would compute wrongly, so that they fail there instead of
deep inside ``generate`` (or, worse, generating different tokens without an error).

Three safety nets stay in place for architectures this list does not know about: the
mask function refuses any mask other than causal or sliding-window causal, the attention
function refuses keyword arguments it does not handle, and ``PagedCache`` refuses to run
when the model's attention never reads the batch it published (a model whose attention
does not go through transformers' attention interface).
"""

from typing import AbstractSet, Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import transformers

from ..kv_groups import Chunked, Window, trailing_readers
from .self_check import verify_architecture, verify_variant

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# Hybrid families whose linear-attention layers (gated DeltaNet, KDA) keep their states
# through transformers' LinearAttentionLayer API (conv and recurrent states, last call
# update_recurrent_state), which PagedCache (linear_states.py) and the engine
# (linear_step.py) serve from state pools.
# Other "linear_attention" layers (Mamba's in Jamba, Bamba, Nemotron-H) are refused.
LINEAR_ATTENTION_TESTED = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                           "olmo_hybrid", "kimi_linear")

# model_type -> why it cannot run with PagedCache / paged_attention_ext.
REFUSED: Dict[str, str] = {
    "bloom": "ALiBi position biases computed inside its own attention code, which does not go "
             "through transformers' attention interface",
    "mpt": "ALiBi position biases computed inside its own attention code, which does not go "
           "through transformers' attention interface",
    "falcon": "its attention classes (selected from FALCON_ATTENTION_CLASSES, optionally with "
              "ALiBi) do not go through transformers' attention interface",
    "llama4": "the multimodal Llama4ForConditionalGeneration (its vision encoder's attention does "
              "not attend over a cache); run its text model: Llama4ForCausalLM(config.text_config)",
    "deepseek_v32": "DeepSeek sparse attention (an indexer picks the keys each query attends to)",
    "glm_moe_dsa": "DeepSeek sparse attention (an indexer picks the keys each query attends to)",
    "gemma3n": "layers that reuse another layer's K/V (num_kv_shared_layers)",
    "gemma3n_text": "layers that reuse another layer's K/V (num_kv_shared_layers)",
    "diffllama": "differential attention (two softmax maps per head, subtracted), computed from "
                 "keys it splits after the cache update",
    "doge": "dynamic mask attention (a learned mask added to the attention scores)",
    "recurrent_gemma": "recurrent (RG-LRU) blocks with their own state, not attention over a K/V "
                       "history",
    "mllama": "cross-attention layers over image features",
    "jetmoe": "mixture-of-attention heads that repeat the K/V heads after the cache update "
              "(query head h reads KV head h % kv_heads; the paged ops group h // group)",
    "hrm_text": "its attention modules store K/V under other cache layer indices than their own "
                "(one cache layer per reasoning cycle)",
}

# Multi-head latent attention models whose attention runs (and was tested) with the K/V
# expanded per head: key head qk_nope_head_dim + qk_rope_head_dim, value head v_head_dim.
MLA_TESTED = ("deepseek_v2", "deepseek_v3", "mistral4", "kimi_linear")

# Model types whose KV-shared layers (num_kv_shared_layers) get their source layer's K/V as
# that layer's update() returned them, and call no update() themselves (the tests cover
# them): the attention function then reads the source layer's blocks.
KV_SHARING_VERIFIED = ("gemma4", "gemma4_text")

# Model types whose causal-LM class does not declare _supports_attention_backend but whose
# attention does go through the interface (checked by the tests).
INTERFACE_VERIFIED = ("stablelm",) + LINEAR_ATTENTION_TESTED


def causal_lm_class(model_type: str):
    """transformers' causal-LM class for ``model_type`` (as AutoModelForCausalLM maps it),
    or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def mla_head_sizes(text_config) -> Optional[tuple]:
    """(key head size, value head size) for an MLA config, else None."""
    if getattr(text_config, "kv_lora_rank", None) is None:
        return None
    return (text_config.qk_nope_head_dim + text_config.qk_rope_head_dim, text_config.v_head_dim)


# How an MLA model's K/V is stored: its latent rows, or the K/V transformers expands per head.
MLA_STORAGES = ("latent", "expanded")


def check_mla_storage(owner: str, mla_storage: str) -> None:
    if mla_storage not in MLA_STORAGES:
        raise ValueError(f"{owner}: mla_storage must be one of {MLA_STORAGES}, got {mla_storage!r}")


def per_layer_values(text_config, name: str) -> Optional[List[Any]]:
    """Each layer's ``name`` where the config declares it per layer (transformers'
    heterogeneous configs list it in ``per_layer_attributes``: Gemma-4's ``head_dim``), read
    through ``per_layer_config``, as transformers asks: reading the global attribute of such
    a config raises its ``AmbiguousGlobalPerLayerAttributeError``. None for a global one."""
    if name not in (getattr(text_config, "per_layer_attributes", None) or ()):
        return None
    layers = text_config.per_layer_config
    return [getattr(layers[i], name, None) for i in range(text_config.num_hidden_layers)]


def shape_attribute(text_config, name: str) -> Any:
    """``name`` (a K/V shape attribute) of every layer: the global value, or the one value
    every layer's per-layer config holds; ``NotImplementedError`` when layers differ."""
    values = per_layer_values(text_config, name)
    if values is None:
        value = getattr(text_config, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
    distinct = sorted(set(values), key=str)
    if len(distinct) > 1:
        layers = {value: [i for i, v in enumerate(values) if v == value] for value in distinct}
        summary = "; ".join(f"{value} on layer{'s' if len(layers[value]) > 1 else ''} "
                            f"{_layer_ranges(layers[value])}" for value in distinct)
        raise NotImplementedError(
            f"{type(text_config).__name__} has a different {name} per layer ({summary}), which "
            "PagedCache serves only for attention over per-head K/V (not multi-head latent "
            "attention)")
    return distinct[0]


def _layer_ranges(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: List[List[int]] = []
    for layer in layers:
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class KVHeadShape(NamedTuple):
    """What one layer stores per token, on one tensor-parallel rank: ``num_kv_heads`` keys
    of ``head_size`` and as many values of ``head_size_v``."""

    num_kv_heads: int
    head_size: int
    head_size_v: int


def layer_shapes(text_config, tp_size: int = 1) -> Optional[List[KVHeadShape]]:
    """Each layer's K/V shape where layers differ in KV heads or head size (Gemma-4: sliding
    layers of ``head_dim`` beside full ones of ``global_head_dim``, with their own KV head
    count), read through transformers' per-layer config API; None where one shape serves
    every layer (:func:`kv_head_shape`). ``NotImplementedError`` for an MLA model whose
    layers differ."""
    per_layer = {name: per_layer_values(text_config, name)
                 for name in ("num_key_value_heads", "head_dim")}
    if all(values is None or len(set(values)) == 1 for values in per_layer.values()):
        return None
    if mla_head_sizes(text_config) is not None:
        shape_attribute(text_config, "head_dim")  # raises, naming the layers
        shape_attribute(text_config, "num_key_value_heads")
    heads = shape_attribute(text_config, "num_attention_heads")
    layers = text_config.num_hidden_layers
    each = {name: values if values is not None else [getattr(text_config, name, None)] * layers
            for name, values in per_layer.items()}
    shapes = []
    for layer, (kv_heads, head_size) in enumerate(zip(each["num_key_value_heads"], each["head_dim"])):
        kv_heads = kv_heads or heads
        head_size = head_size or text_config.hidden_size // heads
        if kv_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the {kv_heads} KV heads of layer "
                             f"{layer} of {type(text_config).__name__}")
        shapes.append(KVHeadShape(kv_heads // tp_size, head_size, head_size))
    return shapes


def kv_readers(text_config, layer_types: Sequence[str]) -> Dict[int, int]:
    """Layers that store no K/V and read an earlier layer's (``num_kv_shared_layers``): each
    of the last ``num_kv_shared_layers`` layers reads the last layer before them of its own
    type, as transformers' Gemma-4 hands it ``shared_kv_states``. Empty for other models."""
    try:
        return trailing_readers(layer_types, getattr(text_config, "num_kv_shared_layers", None) or 0)
    except ValueError as error:
        raise NotImplementedError(f"{type(text_config).__name__}: {error}") from None


def kv_head_shape(text_config, tp_size: int = 1) -> KVHeadShape:
    """The K/V shape the paged pools of a transformers text config hold.

    ``tp_size`` ranks of tensor parallelism each hold ``1 / tp_size`` of the heads. MLA
    models (:func:`mla_head_sizes`) store K/V expanded per query head, so their KV heads
    are ``num_attention_heads`` (whatever ``num_key_value_heads`` says) and the key and
    value head sizes differ.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    heads = shape_attribute(text_config, "num_attention_heads")
    mla = mla_head_sizes(text_config)
    if mla is not None:
        kv_heads, (head_size, head_size_v) = heads, mla
    else:
        kv_heads = shape_attribute(text_config, "num_key_value_heads") or heads
        head_size = shape_attribute(text_config, "head_dim") or text_config.hidden_size // heads
        head_size_v = head_size
    if kv_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the {kv_heads} KV heads of "
                         f"{type(text_config).__name__}")
    return KVHeadShape(kv_heads // tp_size, head_size, head_size_v)


def mla_latent_shape(text_config) -> Optional[KVHeadShape]:
    """An MLA model's latent row as the pools' shape, or None for other models: one KV head
    (shared by every query head, whole on every tensor-parallel rank) of ``kv_lora_rank +
    qk_rope_head_dim`` values, the normalised latent then the rotary key; the values are its
    first ``kv_lora_rank`` columns (``PagedKVCache(values_in_keys=True)``)."""
    if mla_head_sizes(text_config) is None:
        return None
    lora, rope = text_config.kv_lora_rank, text_config.qk_rope_head_dim
    return KVHeadShape(1, lora + rope, lora)


def check_config(config, text_config) -> List[str]:
    """Each layer's attention type, or ``NotImplementedError`` (architecture and reason).

    On a transformers release newer than the tested ones, the architecture's first check
    also runs its self-check (self_check.py)."""
    model_type = getattr(text_config, "model_type", "") or getattr(config, "model_type", "")

    def refuse(reason: str):
        raise NotImplementedError(f"paged_attention_ext does not support the {model_type!r} "
                                  f"architecture: {reason}")

    for kind in {getattr(config, "model_type", ""), model_type}:
        if kind in REFUSED:
            model_type = kind
            refuse(REFUSED[kind])
    if getattr(config, "is_encoder_decoder", False):
        refuse("encoder-decoder models need a cross-attention cache (only decoder-only models are "
               "supported)")
    if getattr(text_config, "num_kv_shared_layers", None) and model_type not in KV_SHARING_VERIFIED:
        refuse("layers that reuse another layer's K/V (num_kv_shared_layers) in a way the tests "
               f"do not cover (they cover {', '.join(KV_SHARING_VERIFIED)})")
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        # As transformers' DynamicCache infers them.
        kind = ("sliding_attention" if getattr(text_config, "sliding_window", None) else
                "chunked_attention" if getattr(text_config, "attention_chunk_size", None) else
                "full_attention")
        layer_types = [kind] * text_config.num_hidden_layers
    supported = SUPPORTED_LAYER_TYPES
    if {getattr(config, "model_type", ""), model_type} & set(LINEAR_ATTENTION_TESTED):
        supported += ("linear_attention",)
    unsupported = sorted(set(layer_types) - set(supported))
    if unsupported:
        refuse(f"its layer types {unsupported} are not attention over a causal K/V history "
               f"(linear attention / state-space layers, ...); PagedCache "
               f"supports {list(SUPPORTED_LAYER_TYPES)}, and 'linear_attention' in "
               f"{', '.join(LINEAR_ATTENTION_TESTED)}")
    if getattr(text_config, "alibi", False) is True:
        refuse("ALiBi position biases (alibi=True) inside its own attention code")
    try:
        shape_attribute(text_config, "num_attention_heads")
        layer_shapes(text_config)  # layers of different K/V shapes get pools per shape
        kv_readers(text_config, layer_types)
    except NotImplementedError as error:
        refuse(str(error))
    model_class = causal_lm_class(model_type)
    if (model_class is not None and not getattr(model_class, "_supports_attention_backend", False)
            and model_type not in INTERFACE_VERIFIED):
        refuse(f"{model_class.__name__} does not route its attention through transformers' "
               "attention interface (it does not declare _supports_attention_backend), so the "
               "paged attention would never run")
    if mla_head_sizes(text_config) is not None and model_type not in MLA_TESTED:
        # Not refused for want of a name: it runs where its tiny twin equals eager.
        verify_variant(config, "multi-head latent attention (kv_lora_rank) in a variant the "
                               f"tests do not cover (they cover {', '.join(MLA_TESTED)})")
    verify_architecture(config)
    return list(layer_types)


def layer_windows(text_config, layer_types: Sequence[str]) -> List[Window]:
    """Each layer's sliding window (None: full attention; :class:`~paged_attention_ext.
    kv_groups.Chunked`: chunked local attention), from :func:`check_config`'s layer types and
    the config's ``sliding_window`` and ``attention_chunk_size``: what the block manager may
    free."""
    windows = {"full_attention": None}
    for kind, name in (("sliding_attention", "sliding_window"),
                       ("chunked_attention", "attention_chunk_size")):
        if kind in layer_types:
            value = getattr(text_config, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NotImplementedError(f"{type(text_config).__name__} has {kind} layers but "
                                          f"{name}={value!r} (a positive int is needed)")
            windows[kind] = value if kind == "sliding_attention" else Chunked(value)
    # Linear-attention layers store no K/V (KVGroupLayout's without_kv): no window.
    return [windows.get(kind) for kind in layer_types]


def sink_logits_of(module: torch.nn.Module, s_aux, sinks, heads: int, device) -> Optional[torch.Tensor]:
    """The learned per-head sink logits (``s_aux`` or ``sinks``, as models pass them) as
    fp32 ``[heads]``, or None."""
    if s_aux is not None and sinks is not None:
        raise ValueError("attention got both s_aux and sinks (one set of attention sinks expected)")
    value = s_aux if s_aux is not None else sinks
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.numel() != heads:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"attention sinks (s_aux/sinks) of layer {getattr(module, 'layer_idx', '?')} "
                         f"must be one logit per query head ({heads}), got {shape}")
    return value.detach().reshape(heads).to(device=device, dtype=torch.float32).contiguous()


def refuse_unapplied_kwargs(kwargs: Mapping[str, Any], ignored: AbstractSet[str], caller: str,
                            unset: Tuple[Any, ...] = (None,)) -> None:
    """Raise ``NotImplementedError`` naming the attention keyword arguments ``caller`` would
    not apply: those outside ``ignored`` whose value is not one of ``unset``."""
    unknown = sorted(name for name, value in kwargs.items()
                     if name not in ignored and not any(value is nothing for nothing in unset))
    if unknown:
        raise NotImplementedError(
            f"{caller} passed attention arguments {unknown}, which this implementation does not "
            "apply (refused rather than ignored: they would change the result)")
