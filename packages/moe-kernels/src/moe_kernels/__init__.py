"""moe-kernels: grouped GEMM, token permutation and MXFP8 for Mixture-of-Experts training."""

import importlib.metadata

from moe_kernels.grouped_mm import (
    GROUPED_MM_BACKENDS,
    GROUPED_MM_DTYPES,
    GroupedMmBackend,
    grouped_mm,
)
from moe_kernels.mxfp8 import (
    MXFP8_KERNELS,
    MXFP8_SCALE_MODES,
    Mxfp8Kernel,
    Mxfp8ScaleMode,
    dequantize_mxfp8,
    mxfp8_grouped_mm,
    to_mxfp8,
)
from moe_kernels.permute import (
    PERMUTE_BACKENDS,
    Permutation,
    PermuteBackend,
    permute,
    unpermute,
)

try:
    __version__ = importlib.metadata.version("moestack-kernels")
except importlib.metadata.PackageNotFoundError:  # imported from source via PYTHONPATH
    __version__ = "0+unknown"

__all__ = [
    "GROUPED_MM_BACKENDS",
    "GROUPED_MM_DTYPES",
    "MXFP8_KERNELS",
    "MXFP8_SCALE_MODES",
    "PERMUTE_BACKENDS",
    "GroupedMmBackend",
    "Mxfp8Kernel",
    "Mxfp8ScaleMode",
    "Permutation",
    "PermuteBackend",
    "__version__",
    "dequantize_mxfp8",
    "grouped_mm",
    "mxfp8_grouped_mm",
    "permute",
    "to_mxfp8",
    "unpermute",
]
