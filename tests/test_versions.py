"""The supported range is declared once in versions.py; pyproject.toml and the Makefile's
matrix say the same, and a release outside it is refused in one sentence."""

import re
from pathlib import Path

import pytest

from paged_attention_ext import versions

ROOT = Path(__file__).resolve().parent.parent


def requirement(text, name):
    found = set(re.findall(rf'"{name}>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text))
    assert len(found) == 1, f"pyproject.toml: one range for {name} expected, found {found}"
    first_major, first_minor, beyond_major, beyond_minor = map(int, found.pop())
    return (first_major, first_minor), (beyond_major, beyond_minor - 1)


def test_pyproject_declares_the_supported_ranges():
    text = (ROOT / "pyproject.toml").read_text()
    assert requirement(text, "torch") == versions.TORCH_SUPPORTED
    assert requirement(text, "transformers") == versions.TRANSFORMERS_SUPPORTED


def test_the_ci_matrix_tests_both_ends():
    makefile = (ROOT / "Makefile").read_text()
    ends = {name: versions.release(re.search(rf"^{name} := (\S+)", makefile, re.M).group(1))
            for name in ("OLDEST_TORCH", "NEWEST_TORCH", "OLDEST_TRANSFORMERS", "NEWEST_TRANSFORMERS")}
    assert (ends["OLDEST_TORCH"], ends["NEWEST_TORCH"]) == versions.TORCH_SUPPORTED
    assert (ends["OLDEST_TRANSFORMERS"], ends["NEWEST_TRANSFORMERS"]) == versions.TRANSFORMERS_SUPPORTED


@pytest.mark.parametrize("version, inside", [
    ("2.9.1", False), ("2.10.0", True), ("2.15.0+cu128", True), ("2.16.0.dev20261201", False)])
def test_torch_outside_the_range_is_one_sentence(version, inside):
    message = versions.unsupported("torch", version, versions.TORCH_SUPPORTED)
    if inside:
        assert message == ""
    else:
        assert message.count(". ") == 0 and message.endswith(".")
        assert f"found {version}" in message and "'torch>=2.10,<2.16'" in message


def test_transformers_outside_the_range_is_refused_at_import(monkeypatch):
    import sys
    import transformers
    monkeypatch.setattr(transformers, "__version__", "5.17.2")
    for name in [m for m in sys.modules if m.startswith("paged_attention_ext.hf")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"supports transformers 5\.18 to 5\.24, found 5\.17\.2"):
        import paged_attention_ext.hf  # noqa: F401


def test_torch_outside_the_range_is_refused_at_import(monkeypatch):
    import importlib.util
    import torch
    import paged_attention_ext
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    path = Path(paged_attention_ext.__file__).parent / "_library.py"
    # A fresh copy of the loader (the real one has loaded the extension already).
    spec = importlib.util.spec_from_file_location("paged_attention_ext._library_probe", path)
    with pytest.raises(ImportError, match=r"supports torch 2\.10 to 2\.15, found 2\.9\.1: install a "
                                          r"supported torch \(pip install 'torch>=2\.10,<2\.16'\)\.$"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
