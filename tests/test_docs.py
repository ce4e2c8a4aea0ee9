"""The Python examples in the README and the docs run as written, and their file references exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def python_blocks(path: Path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [ROOT / "README.md", DOCS / "allocator.md",
                                  DOCS / "huggingface.md", DOCS / "engine.md"],
                         ids=lambda p: p.name)
def test_doc_examples_run(path):
    blocks = python_blocks(path)
    assert blocks
    for code in blocks:
        exec(compile(code, f"{path.name} example", "exec"), {})


def test_readme_example_is_complete():
    """The README's op example builds its own cache and checks its result."""
    (code,) = python_blocks(ROOT / "README.md")
    for step in ("torch.ops.paged.write_kv(", "torch.ops.paged.attention(",
                 "torch.testing.assert_close("):
        assert step in code


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_doc_file_references_exist(path):
    """Relative links, and repository paths written in backticks, name files that exist."""
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    for target in re.findall(r"`((?:bench|paged_attention_ext|csrc|tests|docs)/[\w./-]+)`", text):
        if not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"{path.name} names files that do not exist: {missing}"


def test_op_reference_examples_run():
    """The ops' docstrings are the op reference: each public op has an example, and all run."""
    import doctest

    from paged_attention_ext import ops

    for name in ops.__all__:
        assert ">>> " in getattr(ops, name).__doc__, f"ops.{name} has no example"
    result = doctest.testmod(ops, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 * len(ops.__all__) and result.failed == 0, result


def test_chunked_example_runs():
    import doctest

    from paged_attention_ext import chunked

    result = doctest.testmod(chunked, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2 and result.failed == 0, result
