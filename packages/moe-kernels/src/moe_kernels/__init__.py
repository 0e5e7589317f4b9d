"""moe-kernels: grouped GEMM and token permutation for Mixture-of-Experts training."""

from moe_kernels.grouped_mm import (
    GROUPED_MM_BACKENDS,
    GROUPED_MM_DTYPES,
    GroupedMmBackend,
    grouped_mm,
)
from moe_kernels.permute import Permutation, permute, unpermute

__version__ = "0.1.0"

__all__ = [
    "GROUPED_MM_BACKENDS",
    "GROUPED_MM_DTYPES",
    "GroupedMmBackend",
    "Permutation",
    "__version__",
    "grouped_mm",
    "permute",
    "unpermute",
]
