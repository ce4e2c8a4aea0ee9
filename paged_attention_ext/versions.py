"""The torch and transformers releases this package is tested with, and what it does with others.

* A release inside the tested range runs.
* A newer release of the same major version runs too, with one ``UntestedReleaseWarning``:
  the stable ABI keeps the compiled library loading under a newer torch, and the
  transformers integration guards what a new release could change (every private hook
  checks its assumptions where it is used; ``hf/self_check.py`` compares paged against
  eager attention on a tiny twin of each architecture before its first paged forward).
* An older release, or another major version, is refused in one sentence.

Read without importing the package (setup.py runs it before torch has the extension), so it
imports nothing but the standard library. pyproject.toml declares the floors and majors
(tests/test_versions.py).
"""

import warnings
from typing import Tuple

Release = Tuple[int, int]

# (first, last) minor releases, both ends tested in CI (.ci/run, `make test-stacks`).
TORCH_TESTED: Tuple[Release, Release] = ((2, 10), (2, 15))
TRANSFORMERS_TESTED: Tuple[Release, Release] = ((5, 18), (5, 25))


class UntestedReleaseWarning(UserWarning):
    """A dependency is newer than the newest release this package was tested with."""


def release(version: str) -> Release:
    """(major, minor) of a version string such as ``2.15.0+cu128`` or ``5.24.0.dev0``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def is_untested(version: str, tested: Tuple[Release, Release]) -> bool:
    """Whether ``version`` is newer than the tested range but of its last major version."""
    found, last = release(version), tested[1]
    return found > last and found[0] == last[0]


def refusal(name: str, version: str, tested: Tuple[Release, Release]) -> str:
    """One sentence refusing ``version`` (older than the tested range, or another major
    version), or "" when the package runs with it."""
    (first, last), found = tested, release(version)
    if first <= found and found[0] == last[0]:
        return ""
    requirement = f"{name}>={first[0]}.{first[1]},<{last[0] + 1}"
    return (f"paged-attention-ext supports {name} {first[0]}.{first[1]} and later {last[0]}.x "
            f"releases (tested up to {last[0]}.{last[1]}), found {version}: install a supported "
            f"{name} (pip install '{requirement}').")


_warned = set()


def warn_if_untested(name: str, version: str, tested: Tuple[Release, Release]) -> bool:
    """Warn once per process when ``version`` is newer than the tested range; return whether
    it is."""
    if not is_untested(version, tested):
        return False
    if (name, version) not in _warned:
        _warned.add((name, version))
        last = tested[1]
        warnings.warn(
            f"paged-attention-ext was tested with {name} up to {last[0]}.{last[1]}; {name} "
            f"{version} is newer. It runs with checks: a change it relies on raises an error "
            "naming it (report it), never a silent wrong answer.",
            UntestedReleaseWarning, stacklevel=3)
    return True
