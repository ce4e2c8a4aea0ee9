"""The repository's text speaks of the project, not of the work that made it.

A comment, docstring or page that names a work-log entry or a ticket number ("see the
session N run", "fixed for issue N") tells a reader nothing they can look up: each such
text must say what the thing is and why. References to other projects' tickets are
written as URLs or ``owner/repo#N``, which this check leaves alone.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# "session", "sessions", "issue", "issues", then whitespace and a number (optionally "#N").
WORK_LOG_REFERENCE = re.compile(r"(?i)\b(sessions?|issues?)\s+#?\d")

# Folders never walked when git is unavailable: version control, environments, builds.
SKIPPED_DIRS = {".git", "build", "dist", "__pycache__", ".pytest_cache", "node_modules"}


def repository_files():
    """The files git tracks (that still exist); without git, every file under the root
    outside hidden folders, virtual environments and build outputs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = None
    if listed:
        paths = (ROOT / name for name in os.fsdecode(listed).split("\0") if name)
        return sorted(p for p in paths if p.is_file() and not p.is_symlink())
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")
                   and not d.endswith(".egg-info")]
        found.extend(Path(folder) / name for name in files)
    return sorted(p for p in found if p.is_file() and not p.is_symlink())


def text_of(path: Path):
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def work_log_references(text: str):
    """(line number, line) of each line that names a work-log entry or a ticket number."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if WORK_LOG_REFERENCE.search(line)]


# The examples are split where the pattern would match, so this file passes its own check.
@pytest.mark.parametrize("line", [
    "measured in session" + " 3",
    "see Sessions" + " 18-31",
    "fixed for issue" + " 25",
    "(issues" + " 16 and 17.1)",
    "Issue" + " #5 asks for it",
    "## fp8 KV caches (Issue" + " 16)",
    "the issue" + "\t14 item 2",
])
def test_the_check_finds_work_log_references(line):
    assert work_log_references(line) == [(1, line.strip())]


@pytest.mark.parametrize("line", [
    "transformers#48305 is the upstream bug",
    "https://github.com/huggingface/transformers/issues/48305",
    "start_new_session=True",
    "the issue width of the core: 4 per cycle",
    "cpu_kernel_cycles_session17_zen3.json",
])
def test_the_check_leaves_other_text_alone(line):
    assert work_log_references(line) == []


def test_no_text_refers_to_work_log_entries_or_ticket_numbers():
    files = repository_files()
    assert ROOT / "README.md" in files and ROOT / "pyproject.toml" in files
    hits = []
    for path in files:
        text = text_of(path)
        if text is None:
            continue
        for n, line in work_log_references(text):
            hits.append(f"{path.relative_to(ROOT)}:{n}: {line[:120]}")
    assert not hits, ("text names a work-log entry or ticket number; say what the thing is "
                      "and why instead:\n" + "\n".join(hits))
