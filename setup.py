"""Build of paged_attention_ext._C: C++ always, CUDA sources when a CUDA torch and nvcc exist."""

import glob
import os
import re
import runpy
import subprocess

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))

# Refuse an unsupported torch before compiling anything (the package itself is not
# importable yet: versions.py imports nothing).
_versions = runpy.run_path(os.path.join(ROOT, "paged_attention_ext", "versions.py"))
_problem = _versions["refusal"]("torch", torch.__version__, _versions["TORCH_TESTED"])
if _problem:
    raise SystemExit(_problem)


def want_cuda() -> bool:
    if os.environ.get("PAGED_ATTENTION_FORCE_CPU", "0") == "1":
        return False
    if torch.version.cuda is None or CUDA_HOME is None:
        return False
    check_cuda_toolkit()
    return True


def check_cuda_toolkit() -> None:
    """Refuse, in one sentence, a toolkit of another CUDA major than torch's (nvcc's
    objects would not link against torch's CUDA runtime)."""
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    try:
        found = re.search(r"release (\d+)\.(\d+)", subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True).stdout)
    except OSError:
        found = None
    if found is None:
        raise SystemExit(f"No nvcc found at {nvcc} (CUDA_HOME={CUDA_HOME}): point CUDA_HOME at a "
                         f"CUDA {torch.version.cuda} toolkit, or build the CPU kernels only with "
                         "PAGED_ATTENTION_FORCE_CPU=1.")
    toolkit = f"{found.group(1)}.{found.group(2)}"
    if found.group(1) != torch.version.cuda.split(".")[0]:
        raise SystemExit(f"torch {torch.__version__} is built for CUDA {torch.version.cuda} and the "
                         f"CUDA toolkit at {CUDA_HOME} is {toolkit}: install a torch built for CUDA "
                         f"{toolkit}, point CUDA_HOME at a CUDA {torch.version.cuda} toolkit, or build "
                         "the CPU kernels only with PAGED_ATTENTION_FORCE_CPU=1.")


def stable_abi_target() -> str:
    """The oldest supported torch as TORCH_TARGET_VERSION encodes it (torch's
    TORCH_VERSION_X_Y_0: major << 56 | minor << 48): the library then uses only the stable
    ABI that torch offers, which every later one keeps."""
    major, minor = _versions["TORCH_TESTED"][0][:2]
    return f"0x{(major << 56) | (minor << 48):016x}"


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def extension():
    # No -march: the ISA-specific kernels carry their own target pragmas and are
    # chosen at run time, so the library runs on any x86-64 CPU.
    # The stable ABI of the oldest supported torch (TORCH_TARGET_VERSION: only what it
    # offers compiles), so the one library loads into every torch of the range.
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp", "-fvisibility=hidden", "-Wno-psabi",
                 f"-DTORCH_TARGET_VERSION={stable_abi_target()}"]
    cpp = sources("csrc/*.cpp") + sources("csrc/cpu/*.cpp")
    common = dict(
        name="paged_attention_ext._C",
        extra_link_args=["-fopenmp"],
        # The module stub needs only the stable ABI (torch defines Py_LIMITED_API
        # for 3.10): one wheel per torch version for every CPython it supports.
        py_limited_api=True,
    )
    cuda_sources = sources("csrc/cuda/*.cu")
    if want_cuda() and cuda_sources:
        # The GPUs users have (A100, A10/RTX 30xx, L4/L40/RTX 40xx, H100/H200), plus
        # PTX for newer ones; TORCH_CUDA_ARCH_LIST overrides it (gpu_check.sh builds
        # for the local GPU only).
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.6;8.9;9.0+PTX")
        # No --use_fast_math: the kernels call fast intrinsics (__expf, __logf) where
        # accuracy allows, and fast math would swap tanhf (soft cap) for a hardware
        # approximation with a relative error of 2^-11.
        nvcc_flags = ["-O3", "-lineinfo"]
        # The torch-aware host side of the CUDA ops (csrc/cuda/*.cpp) goes through
        # the host compiler; nvcc sees only the torch-free kernels.
        return CUDAExtension(
            sources=cpp + sources("csrc/cuda/*.cpp") + cuda_sources,
            extra_compile_args={"cxx": cxx_flags + ["-DPAGED_WITH_CUDA", "-DUSE_CUDA"], "nvcc": nvcc_flags},
            **common,
        )
    return CppExtension(sources=cpp, extra_compile_args={"cxx": cxx_flags}, **common)


setup(
    packages=find_packages(include=["paged_attention_ext", "paged_attention_ext.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    # Build files per torch release: stacks built from one tree never share objects.
    options={"build": {"build_base": os.path.join("build", f"torch-{torch.__version__}")},
             "bdist_wheel": {"py_limited_api": "cp310"}},
)
