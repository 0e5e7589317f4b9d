"""What every Triton kernel module of moe-kernels needs: a lazy import and a device check.

Triton is imported only when a ``backend="triton"`` path is taken, so the package works
without it; on a CPU the kernels run only under the Triton interpreter.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torch import Tensor


def import_kernels(module: str, caller: str) -> ModuleType:
    """``moe_kernels.<module>``, imported on first use, with a clear error without triton."""
    try:
        return importlib.import_module(f"moe_kernels.{module}")
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("triton"):
            raise
        raise ImportError(
            f"{caller}: backend='triton' needs the triton package (installed with moestack-kernels on "
            "Linux; otherwise `pip install triton`); use backend='torch' instead"
        ) from e


def check_device(caller: str, tensor: Tensor, interpreted: bool) -> None:
    """Refuse CPU tensors unless the kernels were built for the Triton interpreter."""
    if tensor.device.type == "cpu" and not interpreted:
        raise ValueError(
            f"{caller}: backend='triton' got CPU tensors, which need the Triton interpreter: set "
            "TRITON_INTERPRET=1 before moe-kernels' Triton kernels are first imported (a slow "
            "test vehicle), or use backend='torch' on CPU"
        )
