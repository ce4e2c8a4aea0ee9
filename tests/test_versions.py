"""The tested range is declared once in versions.py; pyproject.toml declares its floors and
majors, the Makefile's matrix tests its ends, and an older release or another major is
refused in one sentence (a newer minor runs: tests/test_hf_self_check.py)."""

import re
from pathlib import Path

import pytest

from paged_attention_ext import versions

ROOT = Path(__file__).resolve().parent.parent


def requirement(text, name):
    """(floor, next major) of ``name``'s requirement in pyproject.toml."""
    found = set(re.findall(rf'"{name}>=(\d+)\.(\d+),<(\d+)"', text))
    assert len(found) == 1, f"pyproject.toml: one range for {name} expected, found {found}"
    first_major, first_minor, next_major = map(int, found.pop())
    return (first_major, first_minor), next_major


def test_pyproject_declares_floors_and_majors_not_caps():
    text = (ROOT / "pyproject.toml").read_text()
    for name, tested in (("torch", versions.TORCH_TESTED),
                         ("transformers", versions.TRANSFORMERS_TESTED)):
        assert requirement(text, name) == (tested[0], tested[1][0] + 1)


def test_the_ci_matrix_tests_both_ends():
    makefile = (ROOT / "Makefile").read_text()
    ends = {name: versions.release(re.search(rf"^{name} := (\S+)", makefile, re.M).group(1))
            for name in ("OLDEST_TORCH", "NEWEST_TORCH", "OLDEST_TRANSFORMERS", "NEWEST_TRANSFORMERS")}
    assert (ends["OLDEST_TORCH"], ends["NEWEST_TORCH"]) == versions.TORCH_TESTED
    assert (ends["OLDEST_TRANSFORMERS"], ends["NEWEST_TRANSFORMERS"]) == versions.TRANSFORMERS_TESTED


@pytest.mark.parametrize("version, runs", [
    ("2.9.1", False), ("2.10.0", True), ("2.15.0+cu128", True), ("2.16.0.dev20261201", True),
    ("3.0.0", False)])
def test_torch_older_or_of_another_major_is_one_sentence(version, runs):
    message = versions.refusal("torch", version, versions.TORCH_TESTED)
    if runs:
        assert message == ""
    else:
        assert message.count(". ") == 0 and message.endswith(".")
        assert f"found {version}" in message and "'torch>=2.10,<3'" in message


def test_transformers_older_than_the_range_is_refused_at_import(monkeypatch):
    import sys
    import transformers
    monkeypatch.setattr(transformers, "__version__", "5.17.2")
    for name in [m for m in sys.modules if m.startswith("paged_attention_ext.hf")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"supports transformers 5\.18 and later 5\.x releases "
                                          r"\(tested up to 5\.\d+\), found 5\.17\.2"):
        import paged_attention_ext.hf  # noqa: F401


def _load_library_copy(monkeypatch, torch_version):
    import importlib.util
    import torch
    import paged_attention_ext
    from paged_attention_ext import op_entry
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(op_entry, "register", lambda: None)  # installed once already
    path = Path(paged_attention_ext.__file__).parent / "_library.py"
    # A fresh copy of the loader (the real one has loaded the extension already).
    spec = importlib.util.spec_from_file_location("paged_attention_ext._library_probe", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_torch_older_than_the_range_is_refused_at_import(monkeypatch):
    with pytest.raises(ImportError, match=r"supports torch 2\.10 and later 2\.x releases \(tested "
                                          r"up to 2\.15\), found 2\.9\.1: install a supported torch "
                                          r"\(pip install 'torch>=2\.10,<3'\)\.$"):
        _load_library_copy(monkeypatch, "2.9.1")


def test_a_newer_torch_loads_with_a_warning(monkeypatch):
    with pytest.warns(versions.UntestedReleaseWarning, match=r"tested with torch up to 2\.15; "
                                                             r"torch 2\.16\.0 is newer"):
        _load_library_copy(monkeypatch, "2.16.0")
