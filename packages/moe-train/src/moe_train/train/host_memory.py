"""Keep freed host memory for reuse instead of handing it back to the kernel.

glibc serves large allocations (activations, gradients, GEMM outputs) with fresh mmap
pages and unmaps them when freed, so every training step pays page faults that zero tens of
megabytes per tensor, which slows large CPU GEMMs markedly (the CPU benchmarks call
`keep_freed_host_memory` too, so their figures include it). PyTorch's CPU performance
guides suggest preloading jemalloc or tcmalloc for the same reason; adjusting glibc's own
policy needs no extra library and no environment variable.
"""

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def _glibc(name: str) -> Any:
    """glibc's function `name`; None off Linux or when the C library has no such function."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):
        return None


def keep_freed_host_memory() -> bool:
    """Serve all allocations from the heap and never trim it; True if glibc took the settings."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trimmed = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    unmapped = mallopt(_M_MMAP_MAX, 0)
    return bool(trimmed and unmapped)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2


def allocated_host_bytes() -> int | None:
    """Bytes the process has allocated through malloc and not freed (glibc), else None.

    CPU tensors are malloc'd, so the difference of two readings is the tensor memory that
    came into being in between: the activation memory of a forward, for instance. A reading
    allocates nothing itself (libc is looked up once).
    """
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)
