"""Shapes, sizes, sweeps and repetition plans of the CPU performance study."""

from dataclasses import dataclass

import torch

NUM_HEADS = 32
HEAD_SIZE = 128
BATCH = 16
CONTEXT = 2048
BLOCK_SIZE = 16
KV_HEADS = (32, 8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-3}

MIB = 1 << 20
GIB = 1 << 30
POOL_BYTES = GIB  # each of the K and V pools (huge pages)
PLAIN_POOL_BYTES = 512 * MIB  # each of the plain-allocation K and V pools
READ_BYTES = GIB
COPY_BYTES = 256 * MIB

CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_SERIES = (("fp32", 32), ("fp32", 8), ("bf16", 32), ("bf16", 8))
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
L3_CONTEXT = 512
LONG_CONTEXT = 32768
LONG_KV_HEADS = (32, 8)

MT_SEQ_LEN = 4096
MT_QUERIES = 512
MT_KV_HEADS = 8
MT_DTYPES = ("fp32", "bf16")
MATMUL_N = 4096

CACHE_KV_HEADS = 8


@dataclass(frozen=True)
class Plan:
    warmup: int
    decode_reps: int
    sweep_reps: int
    long_reps: int
    mt_reps: int
    cache_op_reps: int


FULL = Plan(warmup=2, decode_reps=60, sweep_reps=30, long_reps=30, mt_reps=9, cache_op_reps=50)
QUICK = Plan(warmup=1, decode_reps=4, sweep_reps=2, long_reps=3, mt_reps=2, cache_op_reps=4)
