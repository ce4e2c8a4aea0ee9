"""Host memory for KV pools: transparent huge pages where Linux offers them.

Paged attention reads a pool's blocks in table order, which is random in memory. With
4 KiB pages nearly every block costs a TLB miss and a page walk that itself misses the
cache; 2 MiB pages cover 512 times more memory per TLB entry.
"""

import ctypes
import sys
from typing import Sequence

import torch

_MADV_HUGEPAGE = 14
_PAGE = 4096


def _advise_huge_pages(tensor: torch.Tensor) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    start = tensor.data_ptr() // _PAGE * _PAGE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0


def zeros_huge_pages(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are huge where the kernel allows it.

    The advice must come before the first write: zero-filling afterwards is what makes
    the kernel back the range with huge pages. Without THP support this is torch.zeros.
    """
    tensor = torch.empty(tuple(shape), dtype=dtype)
    _advise_huge_pages(tensor)
    return tensor.zero_()
