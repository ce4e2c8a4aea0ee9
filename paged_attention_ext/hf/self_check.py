"""On a transformers release newer than the tested ones, check each architecture before it runs.

A new release can change how a model hands its attention to this integration (mask
functions, cache calls, the keyword arguments of the attention function) without any
error. So before the first paged forward of an architecture (``check_config``, the
continuous-batching attention's first call) on such a release, :func:`verify_architecture`
builds a tiny random twin of the model (the same config class, two small layers covering
each of its layer types) and generates a few tokens from a left-padded batch with paged
attention and with eager attention. It refuses with the difference if they disagree, and
remembers the verdict per config class for the rest of the process. On a tested release
it does nothing. A twin that does not even run with eager attention (a config the twin's
small sizes do not fit) proves nothing either way: that architecture runs, with a warning.

``PAGED_ATTENTION_SKIP_SELF_CHECK=1`` skips it (for a user who has checked the release
otherwise).
"""

import contextvars
import copy
import os
import time
import warnings
from typing import Dict, Optional, Union

import torch
import transformers

from ..versions import TRANSFORMERS_TESTED, UntestedReleaseWarning, is_untested
from .transformers_behaviour import cache_keyword

# Sizes of the twin: small enough to build and run in a fraction of a second, with more
# than one KV head per group and a window shorter than the prompt, so that a dropped
# scale, a wrong mask or a wrong head mapping changes the logits.
_TWIN_SIZES = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    vocab_size=128, head_dim=16, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, n_shared_experts=1, sliding_window=6, initializer_range=0.2)
_TWIN_LAYERS = 2
_PROMPT_LENGTH, _PADDING, _NEW_TOKENS = 9, 3, 4
# fp32 logits of the twin: paged and eager sum in different orders; a real fault moves
# them by far more.
_TOLERANCE = 1e-3

# config class -> None (verified), what differs, or Inconclusive; seconds each check took;
# classes warned about (an inconclusive check on a new release).
_verdicts: Dict[type, Union[None, str, "Inconclusive"]] = {}
_elapsed: Dict[type, float] = {}
_running = set()
_warned = set()


def _release() -> str:
    return transformers.__version__


def needed() -> bool:
    """Whether this transformers release is newer than the tested ones (and not skipped)."""
    return (is_untested(_release(), TRANSFORMERS_TESTED)
            and os.environ.get("PAGED_ATTENTION_SKIP_SELF_CHECK", "0") != "1")


def twin_config(text_config) -> transformers.PretrainedConfig:
    """A two-layer, small-width copy of ``text_config`` (same class, same layer types)."""
    values = text_config.to_dict()
    for name, size in _TWIN_SIZES.items():
        if values.get(name) is not None:
            values[name] = size
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    if kv_heads:  # MHA stays MHA, MQA stays MQA, GQA keeps groups of two
        values["num_key_value_heads"] = 4 if kv_heads >= heads else (1 if kv_heads == 1 else 2)
    if values.get("q_lora_rank") is not None:
        values["q_lora_rank"] = 48
    if values.get("kv_lora_rank") is not None:  # MLA: K/V expand to every query head
        values["num_key_value_heads"] = values["num_attention_heads"]
        if values.get("head_dim") is not None:
            values["head_dim"] = values["qk_rope_head_dim"]  # the rotary part's size
    if values.get("first_k_dense_replace"):
        values["first_k_dense_replace"] = 1
    layer_types = values.get("layer_types")
    if layer_types:
        kinds = list(dict.fromkeys(layer_types))[:_TWIN_LAYERS]
        values["layer_types"] = (kinds * _TWIN_LAYERS)[:_TWIN_LAYERS]
    values["num_hidden_layers"] = _TWIN_LAYERS
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        values[name] = None
    values.pop("_attn_implementation_internal", None)
    return type(text_config).from_dict(values)


def _generate(model, cache=None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, _PROMPT_LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :_PADDING], mask[1, :_PADDING] = 0, 0
    # By the name the release takes without a deprecation warning (transformers 6 drops the old).
    extra = {} if cache is None else {cache_keyword(model): cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=_NEW_TOKENS, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **extra)
    return torch.stack(out.logits, dim=1)


def _model_builder(text_config):
    """How to build a model of ``text_config``'s class: its causal-LM class as transformers
    maps it, else the one the config names (``architectures``)."""
    from .support import causal_lm_class
    model_class = causal_lm_class(text_config.model_type)
    if model_class is None:
        named = (getattr(transformers, name, None)
                 for name in getattr(text_config, "architectures", None) or ()
                 if name.endswith("ForCausalLM"))
        model_class = next((found for found in named if found is not None), None)
    if model_class is None:
        return transformers.AutoModelForCausalLM.from_config  # raises, naming the config
    return model_class._from_config


class Inconclusive(Exception):
    """The twin could not be built or run with eager attention: nothing to compare against."""


def compare_on_twin(text_config) -> Optional[str]:
    """Generate on a tiny twin of ``text_config`` with eager and with paged attention; None
    when they agree, else what differs. Raises :class:`Inconclusive` when the eager side
    cannot run (a config the twin's sizes do not fit), which says nothing about paged attention."""
    from .cache import PagedCache
    from .handoff import ATTN_IMPLEMENTATION

    build = _model_builder(text_config)
    try:
        config = twin_config(text_config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            eager = build(copy.deepcopy(config), attn_implementation="eager",
                          dtype=torch.float32).eval()
        expected = _generate(eager)
    except Exception as error:
        raise Inconclusive(f"{type(error).__name__}: {error}") from error
    paged = build(copy.deepcopy(config), attn_implementation=ATTN_IMPLEMENTATION,
                  dtype=torch.float32).eval()
    paged.load_state_dict(eager.state_dict())
    got = _generate(paged, PagedCache(paged.config, block_size=4))
    if got.shape != expected.shape:
        return f"paged generate gave logits {tuple(got.shape)}, eager {tuple(expected.shape)}"
    difference = (got - expected).abs().max().item()
    if not difference <= _TOLERANCE:  # also NaN
        return (f"paged and eager logits differ by up to {difference:.3g} (tolerance "
                f"{_TOLERANCE:g})")
    return None


def verify_architecture(config) -> None:
    """Refuse ``config``'s architecture (``NotImplementedError``) when paged attention does
    not reproduce eager attention on its tiny twin; a no-op on tested transformers releases
    and for a config class already verified."""
    if not needed():
        return
    text_config = config.get_text_config(decoder=True)
    outcome = _outcome(text_config)
    if isinstance(outcome, Inconclusive):
        # Refusing here would lock users out over the twin, not over a change: the other
        # safety nets (mask check, argument check, unread batches) still run.
        if type(text_config) not in _warned:
            _warned.add(type(text_config))
            warnings.warn(
                f"paged_attention_ext: could not self-check the {text_config.model_type!r} "
                f"architecture on transformers {_release()} (its tiny twin does not run with "
                f"eager attention: {outcome}); running it without the check.",
                UntestedReleaseWarning, stacklevel=2)
        return
    if outcome is not None:
        raise NotImplementedError(
            f"paged_attention_ext: on transformers {_release()} (newer than the "
            f"tested {TRANSFORMERS_TESTED[1][0]}.{TRANSFORMERS_TESTED[1][1]}) the "
            f"{text_config.model_type!r} architecture failed its self-check against eager "
            f"attention on a tiny random twin: {outcome}. transformers changed something this "
            "integration relies on: use a tested transformers release (pip install "
            f"'transformers<={TRANSFORMERS_TESTED[1][0]}.{TRANSFORMERS_TESTED[1][1]}.*') and report "
            "it; PAGED_ATTENTION_SKIP_SELF_CHECK=1 skips the check at your own risk.")


def verify_variant(config, variant: str) -> None:
    """Run an architecture whose ``variant`` (say, multi-head latent attention in a model
    family not checked by the tests) the integration should handle only if paged attention
    reproduces eager attention on its tiny twin, on any transformers release;
    ``NotImplementedError`` naming the variant and the difference, or why the twin could not
    decide, otherwise."""
    text_config = config.get_text_config(decoder=True)
    outcome = _outcome(text_config)
    if outcome is None:
        return
    why = (f"its tiny random twin could not be run with eager attention to check it ({outcome})"
           if isinstance(outcome, Inconclusive) else
           f"on its tiny random twin paged attention does not reproduce eager attention: {outcome}")
    raise NotImplementedError(f"paged_attention_ext does not support the "
                              f"{text_config.model_type!r} architecture: {variant}, and {why}")


def _outcome(text_config):
    """The twin's verdict for ``text_config``'s class, computed once per process: None
    (paged equals eager), what differs, or :class:`Inconclusive`."""
    kind = type(text_config)
    if kind in _running:  # the twin's own PagedCache
        return None
    if kind not in _verdicts:
        _running.add(kind)
        start = time.perf_counter()
        try:
            # A fresh context: the twin's forwards must not see or disturb the hand-offs
            # (context variables) of a forward that may be under way.
            outcome = contextvars.Context().run(_checked, text_config)
        finally:
            _running.discard(kind)
        _verdicts[kind] = outcome
        if outcome is None:
            _elapsed[kind] = time.perf_counter() - start
    return _verdicts[kind]


def _checked(text_config):
    try:
        return compare_on_twin(text_config)
    except Inconclusive as why:
        return why
    except NotImplementedError:
        raise  # the integration refuses this architecture anyway: its own message says why
    except Exception as error:  # a hook that broke: report it as the difference
        return f"the check raised {type(error).__name__}: {error}"


def forget_verdicts() -> None:
    """Check every architecture again (tests; a process that switches releases)."""
    _verdicts.clear()
    _elapsed.clear()
    _warned.clear()
