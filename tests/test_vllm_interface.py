"""The vLLM backend against the attention-backend interface of vLLM 0.33 and later.

No CPU build of those releases exists and they need a GPU to run a model, so instead of
vLLM's engine this checks what the engine relies on: the plugin imports and registers;
the backend, its metadata builder and its impl implement every abstract method of vLLM's
base classes with vLLM's signatures, fit the calls vLLM's attention layer and workers make
(read from vLLM's source), and use nothing vLLM removed; and a metadata build from vLLM's
``CommonAttentionMetadata`` followed by the impl's cache update and forward, on CPU
tensors, equals the reference ops. ``paged_attention_ext.vllm.compat``'s checks raise
naming what a release lacks.

Run in the Makefile's vllm-interface-check venv (vLLM 0.34 without its CUDA-only
dependencies, the package's wheel); skipped where vLLM is missing or older than 0.33.
"""

import ast
import inspect
import warnings
from pathlib import Path

import pytest
import torch

try:
    import vllm
except ImportError:
    vllm = None


def vllm_release() -> tuple:
    try:
        return tuple(int(part) for part in vllm.__version__.split("+")[0].split(".")[:2])
    except (AttributeError, ValueError):
        return (0, 0)


SUPPORTED = vllm is not None and vllm_release() >= (0, 33)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not SUPPORTED,
                       reason="needs vLLM >= 0.33 (make vllm-interface-check sets it up)"),
]

if SUPPORTED:
    from test_vllm_backend import (BLOCK_SIZE, HEAD_SIZE, HEADS, KV_HEADS, NUM_BLOCKS,
                                   CacheWriter, Layer, page_view)
    from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl,
                                           AttentionMetadataBuilder, AttentionType,
                                           CommonAttentionMetadata)
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    import paged_attention_ext.vllm
    from paged_attention_ext import reference
    from paged_attention_ext.vllm import compat
    from paged_attention_ext.vllm.backend import (PagedAttentionBackend, PagedAttentionImpl,
                                                  PagedAttentionMetadata,
                                                  PagedAttentionMetadataBuilder)
    from paged_attention_ext.vllm.mla import CPUMLABackend, CPUMLAImpl, PagedMLABackend, PagedMLAImpl

    CLASSES = [(PagedAttentionBackend, AttentionBackend),
               (PagedAttentionMetadataBuilder, AttentionMetadataBuilder),
               (PagedAttentionImpl, AttentionImpl)]
    VLLM_DIR = Path(vllm.__file__).parent
    # The plugin as imported (the wheel's copy in the interface check's venv).
    PLUGIN_SOURCES = sorted(Path(paged_attention_ext.vllm.__file__).parent.glob("*.py"))
else:
    CLASSES = []


# ---------------------------------------------------------------- (a) import and register

def test_plugin_registers_the_backend_without_warnings():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with warnings.catch_warnings():
        warnings.simplefilter("error", compat.UntestedVLLMWarning)
        paged_attention_ext.vllm.register()  # a tested release: no warning
    assert AttentionBackendEnum.CPU_ATTN.get_class() is PagedAttentionBackend
    assert AttentionBackendEnum.CUSTOM.get_class() is PagedAttentionBackend
    assert PagedAttentionBackend.get_name() == "CUSTOM"
    assert PagedAttentionBackend.get_impl_cls() is PagedAttentionImpl
    assert PagedAttentionBackend.get_builder_cls() is PagedAttentionMetadataBuilder
    assert AttentionBackendEnum.CPU_MLA.get_class() is PagedMLABackend
    assert PagedMLABackend.get_impl_cls() is PagedMLAImpl
    # vLLM's AMX MLA backend stays vLLM's (docs/integrations.md).
    if "AMX_MLA" in AttentionBackendEnum.__members__:
        assert not AttentionBackendEnum.AMX_MLA.get_path().startswith("paged_attention_ext")


# ---------------------------------------------------------------- (b) vLLM's interface

def incompatibilities(ours, theirs) -> list:
    """How a call that vLLM's signature ``theirs`` accepts could fail on ``ours``: the
    positional parameters must match by name and kind, in order; every keyword-only one
    must exist; a parameter ours requires must be one vLLM's requires."""
    kinds = inspect.Parameter
    positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ours_params = list(inspect.signature(ours).parameters.values())
    their_params = list(inspect.signature(theirs).parameters.values())
    ours_positional = [p for p in ours_params if p.kind in positional]
    takes_any_keyword = any(p.kind is kinds.VAR_KEYWORD for p in ours_params)
    theirs_by_name = {p.name: p for p in their_params}
    problems = []
    for i, p in enumerate(p for p in their_params if p.kind in positional):
        q = ours_positional[i] if i < len(ours_positional) else None
        if q is None or (q.name, q.kind) != (p.name, p.kind):
            problems.append(f"parameter {i}: vLLM's {p.name} ({p.kind.description}), ours "
                            f"{'none' if q is None else f'{q.name} ({q.kind.description})'}")
    for p in their_params:
        if (p.kind is kinds.KEYWORD_ONLY and not takes_any_keyword
                and p.name not in {q.name for q in ours_params}):
            problems.append(f"keyword {p.name} missing")
    for q in ours_params:
        p = theirs_by_name.get(q.name)
        if (q.default is q.empty and q.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
                and (p is None or p.default is not p.empty)):
            problems.append(f"{q.name} is required by ours, not by vLLM's")
    return problems


@pytest.mark.parametrize("ours,base", CLASSES, ids=lambda c: c.__name__)
def test_every_abstract_method_is_implemented(ours, base):
    assert base.__abstractmethods__  # vLLM's base still declares what a backend must have
    assert not ours.__abstractmethods__
    for name in base.__abstractmethods__:
        assert inspect.getattr_static(ours, name) is not inspect.getattr_static(base, name), name


# The MLA backend extends vLLM's concrete CPU MLA classes (no abstract methods to check).
OVERRIDING = CLASSES + ([(PagedMLABackend, CPUMLABackend), (PagedMLAImpl, CPUMLAImpl)]
                        if SUPPORTED else [])


@pytest.mark.parametrize("ours,base", OVERRIDING, ids=lambda c: c.__name__)
def test_overrides_keep_vllms_signatures_and_types(ours, base):
    """Every method and attribute ours overrides: vLLM's kind (static, class, instance
    method) and a signature that takes every call vLLM's does; attributes keep the type."""
    problems = {}
    for name, value in vars(ours).items():
        if (name.startswith("__") and name != "__init__") or not hasattr(base, name):
            continue
        theirs = inspect.getattr_static(base, name)
        if isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
            if type(value) is not type(theirs):
                problems[name] = f"{type(value).__name__}, vLLM's is {type(theirs).__name__}"
            elif incompatibilities(getattr(ours, name), getattr(base, name)):
                problems[name] = incompatibilities(getattr(ours, name), getattr(base, name))
        elif not isinstance(value, property) and type(value) is not type(theirs):
            problems[name] = f"{type(value).__name__}, vLLM's is {type(theirs).__name__}"
    assert not problems, problems


def call_sites(relative_path: str, matches) -> list:
    """(positional count, keyword names) of each call in vLLM's source file that
    ``matches(call)``; read, not imported (it may need packages this venv lacks)."""
    tree = ast.parse((VLLM_DIR / relative_path).read_text())
    return [(sum(not isinstance(a, ast.Starred) for a in node.args),
             [k.arg for k in node.keywords if k.arg is not None])
            for node in ast.walk(tree) if isinstance(node, ast.Call) and matches(node)]


def calls_name(name):
    return lambda call: isinstance(call.func, ast.Name) and call.func.id == name


def calls_method(method, receiver=None):
    def matches(call):
        func = call.func
        return (isinstance(func, ast.Attribute) and func.attr == method
                and (receiver is None or isinstance(func.value, ast.Attribute)
                     and func.value.attr == receiver))
    return matches


# How vLLM constructs and calls the three classes: (file, call, what it calls on ours).
VLLM_CALLS = {
    "layer builds the impl": ("model_executor/layers/attention/attention.py",
                              calls_name("impl_cls"), lambda: PagedAttentionImpl.__init__),
    "layer writes the cache": ("model_executor/layers/attention/attention.py",
                               calls_method("do_kv_cache_update", "impl"),
                               lambda: PagedAttentionImpl.do_kv_cache_update),
    "layer runs attention": ("model_executor/layers/attention/attention.py",
                             calls_method("forward", "impl"),
                             lambda: PagedAttentionImpl.forward),
    "worker builds the builder": ("v1/worker/utils.py", calls_name("builder_cls"),
                                  lambda: PagedAttentionMetadataBuilder.__init__),
    "worker builds metadata": ("v1/worker/utils.py", calls_method("build"),
                               lambda: PagedAttentionMetadataBuilder.build),
}


@pytest.mark.parametrize("call", list(VLLM_CALLS))
def test_vllms_calls_fit(call):
    """The calls in vLLM's attention layer and worker bind to ours, e.g. do_kv_cache_update,
    which vLLM calls on any impl whose backend sets forward_includes_kv_cache_update=False
    but which its base class does not declare."""
    path, matches, target = VLLM_CALLS[call]
    sites = call_sites(path, matches)
    assert sites, f"vLLM's {path} no longer makes this call"
    signature = inspect.signature(target())
    for positional, keywords in sites:
        signature.bind(None, *[None] * positional, **dict.fromkeys(keywords))  # None: self


# vLLM's removals near the attention backend: (module, name or None for the module itself,
# release that removed it, whether the name is unique enough to ban anywhere in the plugin).
REMOVED = [
    ("vllm.v1.attention.backend", "AttentionMetadataBuilder.build_for_drafting", (0, 34), True),
    ("vllm.v1.attention.backend", "CommonAttentionMetadata.naive_query_lens", (0, 34), True),
    ("vllm.v1.attention.backends.utils", "reorder_batch_to_split_decodes_and_prefills", (0, 34),
     True),
    ("vllm.v1.worker.gpu_model_runner", None, (0, 34), True),  # the V1 model runner
    ("vllm.v1.worker.cpu_model_runner", None, (0, 34), True),
    ("vllm.v1.worker.gpu_input_batch", None, (0, 34), True),
    # The CPU kernels moved to vllm._cpu_ops.
    ("vllm._custom_ops", "cpu_attention_with_kv_cache", (0, 34), False),
    ("vllm._custom_ops", "cpu_attn_reshape_and_cache", (0, 34), False),
    # Now in vllm.v1.kv_cache_interface only.
    ("vllm.utils.torch_utils", "is_quantized_kv_cache", (0, 33), False),
]
REMOVED_IDS = [f"{module}.{name}" if name else module for module, name, _, _ in REMOVED]


def vllm_defines(module: str, name) -> bool:
    """Whether vLLM's source defines ``module`` (name None) or ``name`` in it (a function,
    class or assignment, or ``Class.member``); read, not imported."""
    base = VLLM_DIR.joinpath(*module.split(".")[1:])
    path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    if name is None or not path.exists():
        return path.exists()
    scope = ast.parse(path.read_text()).body
    *owners, leaf = name.split(".")
    for owner in owners:
        scope = next((n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), [])
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == leaf:
                return True
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == leaf for t in targets):
            return True
    return False


@pytest.mark.parametrize("removal", REMOVED, ids=REMOVED_IDS)
def test_vllm_removed_what_the_plugin_must_not_use(removal):
    module, name, removed_in, _ = removal
    if vllm_release() < removed_in:
        pytest.skip(f"removed in vLLM {removed_in[0]}.{removed_in[1]}")
    assert not vllm_defines(module, name)
    if module == "vllm._custom_ops":
        assert vllm_defines("vllm._cpu_ops", name)
    if name == "is_quantized_kv_cache":
        assert vllm_defines("vllm.v1.kv_cache_interface", name)


@pytest.mark.parametrize("removal", REMOVED, ids=REMOVED_IDS)
def test_plugin_uses_nothing_vllm_removed(removal):
    """Neither imported nor, for names unique to the removal, named anywhere in the
    plugin's code (docstrings and comments aside), nor defined on its classes."""
    module, name, _, unique = removal
    leaf = (name or module).split(".")[-1]
    spelled = leaf if name else module  # as a string, e.g. for importlib
    used = []
    for path in PLUGIN_SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                used += [a.name for a in node.names if a.name == module]
            elif isinstance(node, ast.ImportFrom) and node.module == module:
                used += [f"{module}.{a.name}" for a in node.names
                         if name is None or a.name == name]
            elif (isinstance(node, ast.ImportFrom) and name is None
                  and any(f"{node.module}.{a.name}" == module for a in node.names)):
                used.append(module)
            elif unique and (isinstance(node, ast.Name) and node.id == leaf
                             or isinstance(node, ast.Attribute) and node.attr == leaf
                             or isinstance(node, ast.FunctionDef) and node.name == leaf
                             or isinstance(node, ast.Constant) and node.value == spelled):
                used.append(f"{path.name}:{node.lineno}")
    assert not used
    for ours, _ in CLASSES:
        assert leaf not in vars(ours)


# ---------------------------------------------------------------- (c) build and forward

@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_metadata_build_and_forward_equal_reference(kv_cache_dtype):
    """One step of a decode (33 cached tokens + 1) and a prefill (17 new tokens), plus one
    padding token, as vLLM 0.34 hands it over: CommonAttentionMetadata built by hand, the
    builder and impl constructed and called as vLLM's worker and layer call them."""
    torch.manual_seed(2)
    fp8 = kv_cache_dtype == "fp8"
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    spec = PagedAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype))
    # vLLM's VllmConfig needs a platform, which a GPU build of vLLM finds none of on this
    # host; the builder does not read it (vLLM's base class stores it).
    builder = PagedAttentionBackend.get_builder_cls()(spec, ["model.layers.0.self_attn.attn"],
                                                      None, torch.device("cpu"))
    scale = HEAD_SIZE ** -0.5
    impl = PagedAttentionBackend.get_impl_cls()(HEADS, HEAD_SIZE, scale, KV_HEADS, None, None,
                                                kv_cache_dtype, None, AttentionType.DECODER,
                                                None)
    layer = Layer(0.25)
    scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale) if fp8 else {}
    cached = 33
    block_table = torch.randperm(NUM_BLOCKS).to(torch.int32)[:6].view(2, 3)
    cache = CacheWriter(impl, layer, dtype, block_table, scales)
    kv, want_k, want_v = cache.kv, cache.want_k, cache.want_v

    cache.write(cache.slots(0, 0, cached))  # the decode's earlier steps
    step = cache.slots(0, cached, cached + 1) + cache.slots(1, 0, 17) + [-1]  # vLLM pads: -1
    key, value = cache.write(step)
    query_start_loc = torch.tensor([0, 1, 18], dtype=torch.int32)
    seq_lens = torch.tensor([34, 17], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens, num_reqs=2, num_actual_tokens=18, max_query_len=17, max_seq_len=34,
        block_table_tensor=block_table, slot_mapping=torch.tensor(step))
    metadata = builder.build(0, common)  # vLLM 0.34 always passes common_prefix_len 0
    assert isinstance(metadata, PagedAttentionMetadata)
    assert metadata.cascade is None  # no shared blocks, nothing to split

    query = torch.randn(len(step), HEADS, HEAD_SIZE)
    output = torch.full((len(step), HEADS, HEAD_SIZE), 7.0)
    assert impl.forward(layer, query, key, value, kv, metadata, output=output) is output
    want = reference.attention(query[:18], want_k, want_v, block_table, seq_lens, scale,
                               query_start_loc, **scales)
    torch.testing.assert_close(output[:18], want)
    assert (output[18] == 7.0).all()  # the padding row is left alone


# ---------------------------------------------------------------- compat's errors

def test_a_missing_name_raises_naming_it():
    with pytest.raises(compat.VLLMInterfaceError,
                       match=r"vllm\.v1\.attention\.backend\.NoSuchBase \(testing\)"):
        compat.need("vllm.v1.attention.backend", ["AttentionBackend", "NoSuchBase"], "testing")
    with pytest.raises(compat.VLLMInterfaceError, match=r"the module vllm\.v1\.no_such_module"):
        compat.need("vllm.v1.no_such_module", ["X"], "testing")
    with pytest.raises(compat.VLLMInterfaceError, match=r"CommonAttentionMetadata\.no_such_field"):
        compat.need_fields(CommonAttentionMetadata, ["seq_lens", "no_such_field"], "testing")
    from vllm.v1.kv_cache_interface import KVCacheLayout

    with pytest.raises(compat.VLLMInterfaceError, match=r"KVCacheLayout\.NO_SUCH_ORDER"):
        compat.need_member(KVCacheLayout, "NO_SUCH_ORDER", "testing")


def test_missing_fp8_scales_raise_naming_them():
    impl = PagedAttentionImpl(HEADS, HEAD_SIZE, 0.1, KV_HEADS, None, None, "fp8")
    key = value = torch.randn(1, KV_HEADS, HEAD_SIZE)
    with pytest.raises(compat.VLLMInterfaceError, match="_k_scale and _v_scale"):
        impl.do_kv_cache_update(object(), key, value, page_view(torch.float8_e4m3fn),
                                torch.tensor([0]))


@pytest.mark.parametrize("version,untested", [("0.32.0+cpu", False), ("0.34.0", False),
                                              ("0.35.0", True), ("1.0.0", True),
                                              ("0.31.2", True), ("dev", True)])
def test_untested_releases_run_with_a_warning(monkeypatch, version, untested):
    monkeypatch.setattr(vllm, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.warn_if_untested() is untested
    assert [w.category for w in caught] == [compat.UntestedVLLMWarning] * untested
    if untested:
        assert version in str(caught[0].message)
