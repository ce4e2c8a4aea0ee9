"""The KV cache of a whole model: every layer's K and V pools plus host swap pools.

Sizes the device pool from a block count or a memory budget and applies the block
manager's copy-on-write and swap mappings with the paged ops, all layers at once.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import ops
from .host_memory import zeros_huge_pages


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def bytes_per_block(num_layers: int, num_kv_heads: int, head_size: int, block_size: int,
                    dtype: torch.dtype, head_size_v: Optional[int] = None) -> int:
    """K and V of one block across all layers (``head_size_v``: the value head size, if it differs)."""
    element = torch.empty((), dtype=dtype).element_size()
    head_size_v = head_size if head_size_v is None else head_size_v
    return num_layers * num_kv_heads * block_size * (head_size + head_size_v) * element


def check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    """A ValueError/TypeError naming the argument unless ``value`` is an int >= ``minimum``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class PagedKVCache:
    """Every layer's K and V pools (``[num_blocks, num_kv_heads, block_size, head_size]``).

    ``head_size_v`` is the value head size when it differs from the key head size (MLA
    models as transformers runs them: key ``qk_nope + qk_rope``, value ``v_head_dim``);
    None means ``head_size``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float16, device: "str | torch.device" = "cpu",
                 num_blocks: Optional[int] = None, memory_bytes: Optional[int] = None,
                 num_host_blocks: int = 0, head_size_v: Optional[int] = None) -> None:
        check_int("num_layers", num_layers, 1)
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("head_size", head_size, 1)
        check_int("head_size_v", head_size_v, 1, optional=True)
        check_int("block_size", block_size, 1)
        check_int("num_blocks", num_blocks, 1, optional=True)
        check_int("memory_bytes", memory_bytes, 0, optional=True)
        check_int("num_host_blocks", num_host_blocks, 0)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.head_size_v = head_size if head_size_v is None else head_size_v
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.block_bytes = bytes_per_block(num_layers, num_kv_heads, head_size, block_size, dtype,
                                           self.head_size_v)
        if num_blocks is None:
            num_blocks = memory_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"the pool must hold at least one block ({self.block_bytes} bytes), "
                             f"memory_bytes={memory_bytes} holds none")
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        shape_v = shape[:3] + (self.head_size_v,)
        host_shape = (num_host_blocks,) + shape[1:]
        host_shape_v = (num_host_blocks,) + shape_v[1:]
        # Pinned host memory lets device <-> host swaps run asynchronously.
        pin = self.device.type == "cuda"
        self.key_caches: List[torch.Tensor] = []
        self.value_caches: List[torch.Tensor] = []
        self.host_key_caches: List[torch.Tensor] = []
        self.host_value_caches: List[torch.Tensor] = []
        for _ in range(num_layers):
            self.key_caches.append(self._device_pool(shape))
            self.value_caches.append(self._device_pool(shape_v))
            self.host_key_caches.append(torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
            self.host_value_caches.append(torch.zeros(host_shape_v, dtype=dtype, pin_memory=pin))

    def _device_pool(self, shape: Tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return zeros_huge_pages(shape, self.dtype)  # random block order: spare the TLB
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def layer(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.key_caches[index], self.value_caches[index]

    def apply_copies(self, copies: Sequence[Tuple[int, int]]) -> None:
        """Copy-on-write / fork copies for every layer in one op call."""
        if copies:
            # The CUDA kernel reads the mapping on the device, the CPU one on the host.
            ops.copy_blocks(self.key_caches, self.value_caches, self._mapping(copies, self.device))

    def swap_out(self, mapping: Sequence[Tuple[int, int]]) -> None:
        """Copy (device block, host block) rows from the device pools to the host pools."""
        self._swap(mapping, self.key_caches + self.value_caches,
                   self.host_key_caches + self.host_value_caches)

    def swap_in(self, mapping: Sequence[Tuple[int, int]]) -> None:
        """Copy (host block, device block) rows from the host pools to the device pools."""
        self._swap(mapping, self.host_key_caches + self.host_value_caches,
                   self.key_caches + self.value_caches)

    def usage(self, used_blocks: int, used_host_blocks: int = 0) -> Dict[str, float]:
        """Bytes reserved and in use, given the block manager's counts."""
        return {
            "device_bytes": self.num_blocks * self.block_bytes,
            "device_bytes_used": used_blocks * self.block_bytes,
            "device_fraction_used": used_blocks / self.num_blocks,
            "host_bytes": self.num_host_blocks * self.block_bytes,
            "host_bytes_used": used_host_blocks * self.block_bytes,
        }

    def _swap(self, mapping, sources: List[torch.Tensor], targets: List[torch.Tensor]) -> None:
        if not mapping:
            return
        rows = self._mapping(mapping, torch.device("cpu"))  # swaps plan their copies on the host
        for src, dst in zip(sources, targets):
            ops.swap_blocks(src, dst, rows)

    @staticmethod
    def _mapping(pairs: Sequence[Tuple[int, int]], device: torch.device) -> torch.Tensor:
        return torch.tensor(list(pairs), dtype=torch.int64, device=device).view(-1, 2)
