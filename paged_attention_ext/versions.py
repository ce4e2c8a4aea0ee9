"""The torch and transformers releases this package supports: the range CI tests.

Read without importing the package (setup.py runs it before torch has the extension), so it
imports nothing. pyproject.toml declares the same ranges (tests/test_versions.py).
"""

from typing import Tuple

Release = Tuple[int, int]

# (first, last) minor releases, both ends tested in CI (.ci/run, `make test-stacks`).
TORCH_SUPPORTED: Tuple[Release, Release] = ((2, 10), (2, 15))
TRANSFORMERS_SUPPORTED: Tuple[Release, Release] = ((5, 18), (5, 24))


def release(version: str) -> Release:
    """(major, minor) of a version string such as ``2.15.0+cu128`` or ``5.24.0.dev0``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def unsupported(name: str, version: str, supported: Tuple[Release, Release]) -> str:
    """One sentence saying ``version`` is outside ``supported``, or "" when it is inside."""
    (first, last), found = supported, release(version)
    if first <= found <= last:
        return ""
    requirement = f"{name}>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"
    return (f"paged-attention-ext supports {name} {first[0]}.{first[1]} to {last[0]}.{last[1]}, "
            f"found {version}: install a supported {name} (pip install '{requirement}').")
