"""moe-devices: which FP8 and grouped-GEMM kernels a kind of device runs, as one torch-free rule."""

import importlib.metadata

from moe_devices.rule import (
    FP8_LINEAR_MIN_CAPABILITY,
    MXFP8_CAPABILITY_MAJOR,
    MXFP8_MIN_CUDA,
    SCALED_GROUPED_MM_CAPABILITY_MAJOR,
    Capability,
    Choice,
    ExpertGemmPath,
    Fp8LinearKernel,
    Fp8RowwiseKernel,
    GroupedMmKernel,
    KernelPaths,
    Mxfp8Kernel,
    Software,
    kernel_paths,
)

try:
    __version__ = importlib.metadata.version("moestack-devices")
except importlib.metadata.PackageNotFoundError:  # imported from source via PYTHONPATH
    __version__ = "0+unknown"

__all__ = [
    "FP8_LINEAR_MIN_CAPABILITY",
    "MXFP8_CAPABILITY_MAJOR",
    "MXFP8_MIN_CUDA",
    "SCALED_GROUPED_MM_CAPABILITY_MAJOR",
    "Capability",
    "Choice",
    "ExpertGemmPath",
    "Fp8LinearKernel",
    "Fp8RowwiseKernel",
    "GroupedMmKernel",
    "KernelPaths",
    "Mxfp8Kernel",
    "Software",
    "__version__",
    "kernel_paths",
]
