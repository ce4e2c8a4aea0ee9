"""The Python examples in the docs run as written."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(path: Path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("name", ["allocator.md", "huggingface.md", "engine.md"])
def test_doc_examples_run(name):
    blocks = python_blocks(DOCS / name)
    assert blocks
    for code in blocks:
        exec(compile(code, f"{name} example", "exec"), {})
