"""moe-devices: which FP8 and grouped-GEMM kernels a kind of device runs, as one torch-free rule."""

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

__version__ = "0.1.0"
