"""The ops' Python entry (paged_attention_ext/op_entry.py): the private torch hooks it
relies on, that it sits on every op, and that it gives the same Python errors in every
mode, while the library below it raises only tagged RuntimeErrors."""

import pytest
import torch

import paged_attention_ext as pa
from paged_attention_ext import op_entry
from paged_case import make_case, random_query


def test_the_private_torch_hooks_exist():
    # If this fails, torch changed a private API op_entry.py needs: the ops would lose their
    # grad refusal and Python error types. Adapt op_entry.py to the new torch.
    assert isinstance(torch._C.DispatchKey.BackendSelect, torch._C.DispatchKey)
    below = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
    assert below.has(torch._C.DispatchKey.CPU) and not below.has(torch._C.DispatchKey.BackendSelect)
    after_autograd = torch._C._after_autograd_keyset
    assert after_autograd.has(torch._C.DispatchKey.CPU) and after_autograd.has(torch._C.DispatchKey.Functionalize)
    assert not after_autograd.has(torch._C.DispatchKey.AutogradCPU)
    assert callable(torch.ops.paged.attention.default._handle.redispatch_boxed)
    tensor, needs_grad = torch.zeros(1), torch.zeros(1, requires_grad=True)
    assert torch._C._any_requires_grad(tensor, [tensor, needs_grad], x=1)
    assert not torch._C._any_requires_grad(tensor, [tensor], x=needs_grad.detach())


def test_every_op_enters_through_it():
    defined = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
               if name.startswith("paged::")}
    assert set(op_entry.OPS) == defined
    for name in op_entry.TENSOR_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"paged::{name}", "Autograd"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"paged::{name}", "BackendSelect"), name
    for name in op_entry.TENSORLESS_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"paged::{name}", "BackendSelect"), name


def test_inference_mode_skips_it(case, monkeypatch):
    calls = []
    monkeypatch.setattr(op_entry, "raise_typed", lambda error: calls.append(error))
    args = attention_args(case, block_tables=case.block_tables.long())
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"^\[paged:TypeError\]"):
        torch.ops.paged.attention(**args)
    assert calls == []
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"^\[paged:TypeError\]"):
        torch.ops.paged.attention(**args)
    assert len(calls) == 1


@pytest.fixture
def case():
    return make_case([5, 20], num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)


def attention_args(case, **overrides):
    args = dict(query=random_query(2, 4, 64, torch.float32), key_cache=case.key_cache,
                value_cache=case.value_cache, block_tables=case.block_tables,
                seq_lens=case.seq_lens, scale=0.125)
    args.update(overrides)
    return args


MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("mode", MODES)
def test_errors_have_their_python_type_in_every_mode(case, mode):
    bad_dtype = attention_args(case, block_tables=case.block_tables.long())
    bad_block = attention_args(case, block_tables=torch.full_like(case.block_tables, 10**6))
    bad_shape = attention_args(case, seq_lens=case.seq_lens[:1])
    with MODES[mode]():
        with pytest.raises(TypeError, match=r"^paged.attention: argument 'block_tables' must have dtype Int"):
            pa.attention(**bad_dtype)
        with pytest.raises(IndexError, match=r"^paged.attention: block_tables\[0, 0\] = 1000000"):
            pa.attention(**bad_block)
        with pytest.raises(ValueError, match=r"^paged.attention: argument 'block_tables' has 2 rows"):
            pa.attention(**bad_shape)


@pytest.mark.parametrize("mode", MODES)
def test_direct_op_calls_raise_python_types_outside_inference_mode(case, mode):
    # Inference mode skips the entry: a direct call there raises the library's tagged
    # RuntimeError, whose message names the argument all the same.
    bad_shape = attention_args(case, seq_lens=case.seq_lens[:1])
    message = r"paged.attention: argument 'block_tables' has 2 rows"
    expected, prefix = (RuntimeError, r"^\[paged:ValueError\] ") if mode == "inference_mode" else (ValueError, "^")
    with MODES[mode](), pytest.raises(expected, match=prefix + message):
        torch.ops.paged.attention(**bad_shape)


def test_below_the_entry_the_library_raises_tagged_runtime_errors(case):
    # What a caller that bypasses the Python entry sees (csrc/errors.h).
    args = attention_args(case, block_tables=case.block_tables.long())
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    with pytest.raises(RuntimeError, match=r"^\[paged:TypeError\] paged.attention: argument 'block_tables'"):
        torch.ops.paged.attention.default.redispatch(cpu, *args.values())


@pytest.mark.parametrize("message, expected", [
    ("[paged:ValueError] paged.write_kv: bad", ValueError("paged.write_kv: bad")),
    ("[paged:IndexError] x", IndexError("x")),
    ("[paged:TypeError] y", TypeError("y")),
    ("[paged:KeyError] z", None),            # not a type the library raises
    ("CUDA error: out of memory", None),     # untagged: stays a RuntimeError
    ("x [paged:ValueError] y", None),        # the tag counts only in front
])
def test_python_error_reads_only_the_tag_in_front(message, expected):
    found = op_entry.python_error(RuntimeError(message))
    assert (found is None) == (expected is None)
    if expected is not None:
        assert type(found) is type(expected) and str(found) == str(expected)


def test_grad_is_refused_before_any_work_and_not_under_no_grad(case):
    key = torch.randn(1, 2, 64, requires_grad=True)
    before = case.key_cache.clone().view(torch.int32)  # bits: unused slots hold NaN
    slot = torch.tensor([0])
    with pytest.raises(NotImplementedError, match="paged.write_kv: argument 'key' requires grad"):
        pa.write_kv(key, key.detach(), case.key_cache, case.value_cache, slot)
    assert torch.equal(case.key_cache.view(torch.int32), before)
    with torch.no_grad():
        pa.write_kv(key, key.detach(), case.key_cache, case.value_cache, slot)
    block, offset = divmod(0, case.key_cache.shape[2])
    assert torch.equal(case.key_cache[block, :, offset], key[0].detach())


def test_a_bad_isa_request_is_a_value_error(monkeypatch):
    monkeypatch.setenv("PAGED_ATTENTION_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="^PAGED_ATTENTION_CPU_ISA must be one of generic, avx2"):
        pa.select_cpu_isa()


def test_meta_tensors_pass_the_entry_to_the_fake(case):
    args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in attention_args(case).items()}
    out = torch.ops.paged.attention(**args)
    assert out.device.type == "meta" and out.shape == (2, 4, 64)
