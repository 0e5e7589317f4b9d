"""moe-kernels: grouped GEMM, token permutation, MXFP8 and rowwise FP8 for Mixture-of-Experts training."""

from moe_kernels.device_paths import device_kernel_paths, installed_software
from moe_kernels.fp8_rowwise import (
    FP8_ROWWISE_KERNELS,
    Fp8RowwiseKernel,
    dequantize_fp8_rowwise,
    fp8_rowwise_grouped_mm,
    fp8_rowwise_scaled_mm_supported,
    to_fp8_rowwise,
    to_fp8_rowwise_token_groups,
)
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
from moe_kernels.row_store import ROW_STORE_BACKENDS, RowStoreBackend, store_rows
from moe_kernels.torchao_import import quiet_torchao_import

__all__ = [
    "FP8_ROWWISE_KERNELS",
    "GROUPED_MM_BACKENDS",
    "GROUPED_MM_DTYPES",
    "MXFP8_KERNELS",
    "MXFP8_SCALE_MODES",
    "PERMUTE_BACKENDS",
    "ROW_STORE_BACKENDS",
    "Fp8RowwiseKernel",
    "GroupedMmBackend",
    "Mxfp8Kernel",
    "Mxfp8ScaleMode",
    "Permutation",
    "PermuteBackend",
    "RowStoreBackend",
    "__version__",
    "dequantize_fp8_rowwise",
    "dequantize_mxfp8",
    "device_kernel_paths",
    "fp8_rowwise_grouped_mm",
    "fp8_rowwise_scaled_mm_supported",
    "grouped_mm",
    "installed_software",
    "mxfp8_grouped_mm",
    "permute",
    "quiet_torchao_import",
    "store_rows",
    "to_fp8_rowwise",
    "to_fp8_rowwise_token_groups",
    "to_mxfp8",
    "unpermute",
]

__version__ = "0.1.0"
