"""What a benchmark result was measured on: the source revision, the CPU, torch and the ops'
instruction set, recorded beside every result."""

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F

import paged_attention_ext as pa


def sdpa_has_enable_gqa() -> bool:
    """Whether this torch's SDPA accepts ``enable_gqa=True``."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 4, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (elsewhere: what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512vbmi", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_details() -> Dict[str, object]:
    """Vendor, family / model and the instruction-set flags the kernels care about."""
    info: Dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if ":" in line:
            key, value = (x.strip() for x in line.split(":", 1))
            info.setdefault(key, value)
        elif info:
            break
    flags = set(info.get("flags", "").split())
    return {"model_name": info.get("model name"), "vendor": info.get("vendor_id"),
            "family": info.get("cpu family"), "model": info.get("model"),
            "flags": [f for f in CPU_FLAGS if f in flags]}


def source_revision() -> str:
    """The commit the library was built from, "+dirty" if the C++ or Python sources differ."""
    root = Path(pa.__file__).resolve().parent.parent
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True).stdout.strip()
        except OSError:  # no git on this machine (the GPU check's)
            return ""
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--", "csrc", "paged_attention_ext") else "")


def machine_info() -> Dict[str, object]:
    return {
        "source": source_revision(),
        "cpu_model": cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "paged_cpu_isa": pa.cpu_isa(),
        "sdpa_gqa": "enable_gqa" if sdpa_has_enable_gqa() else "repeat_interleave",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
