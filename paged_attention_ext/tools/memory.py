"""KV-cache size calculator: bytes per token, sequence and block for a model shape.

Every layer stores one key and one value vector per KV head per token, so
``bytes_per_token = 2 * layers * kv_heads * head_size * dtype_bytes``.
"""

from dataclasses import asdict, dataclass
from typing import Dict, Optional

GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_size: int


# Published configurations (config.json of each model).
PRESETS: Dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(layers=32, kv_heads=32, head_size=128),
    "llama-2-13b": ModelShape(layers=40, kv_heads=40, head_size=128),
    "llama-2-70b": ModelShape(layers=80, kv_heads=8, head_size=128),
    "llama-3-8b": ModelShape(layers=32, kv_heads=8, head_size=128),
    "mistral-7b": ModelShape(layers=32, kv_heads=8, head_size=128),
    "qwen2-7b": ModelShape(layers=28, kv_heads=4, head_size=128),
    "opt-13b": ModelShape(layers=40, kv_heads=40, head_size=128),  # the vLLM paper's model
}

# fp8 names as the caches' kv_cache_dtype takes them (docs/fp8.md); "fp8" is fp8_e4m3.
DTYPE_BYTES: Dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
                               "fp8_e5m2": 1, "int8": 1}


def resolve_shape(preset: Optional[str] = None, layers: Optional[int] = None,
                  kv_heads: Optional[int] = None, head_size: Optional[int] = None) -> ModelShape:
    """A preset's shape with any explicitly given field overriding it; no preset needs all three."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    base = asdict(PRESETS[preset]) if preset else {}
    given = {k: v for k, v in dict(layers=layers, kv_heads=kv_heads, head_size=head_size).items()
             if v is not None}
    fields = {**base, **given}
    missing = [k for k in ("layers", "kv_heads", "head_size") if k not in fields]
    if missing:
        raise ValueError("give --preset or all of --layers --kv-heads --head-size "
                         f"(missing: {', '.join(missing)})")
    bad = [k for k, v in fields.items() if v < 1]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be >= 1")
    return ModelShape(**fields)


def bytes_per_token(shape: ModelShape, dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
    return 2 * shape.layers * shape.kv_heads * shape.head_size * DTYPE_BYTES[dtype]


def kv_report(shape: ModelShape, dtype: str, max_len: int, block_size: Optional[int] = None,
              memory_gib: Optional[float] = None) -> Dict:
    """Sizes per token, per max_len sequence and per block, and what fits in memory_gib."""
    per_token = bytes_per_token(shape, dtype)
    report = {**asdict(shape), "dtype": dtype, "dtype_bytes": DTYPE_BYTES[dtype],
              "bytes_per_token": per_token, "max_len": max_len,
              "bytes_per_sequence": per_token * max_len}
    if block_size is not None:
        report.update(block_size=block_size, bytes_per_block=per_token * block_size)
    if memory_gib is not None:
        memory = int(memory_gib * GIB)
        report.update(memory_bytes=memory, tokens_fit=memory // per_token,
                      sequences_fit=memory // (per_token * max_len))
        if block_size is not None:
            report["blocks_fit"] = memory // (per_token * block_size)
    return report


def format_bytes(n: float) -> str:
    """Binary units, trailing zeros dropped: 524288 -> '512 KiB', 1073741824 -> '1 GiB'."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.2f}".rstrip("0").rstrip(".") + f" {units[i]}"
