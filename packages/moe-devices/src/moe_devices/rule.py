"""Which FP8 and grouped-GEMM kernels a kind of device runs: one rule of its compute
capability and of the software installed beside it.

Torch-free: moe-kernels applies the rule to the device it runs on, the planner to the device
kind it plans for, so both name the same kernels for the same device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Capability = tuple[int, int]
"""A CUDA device's compute capability (major, minor): (9, 0) is sm_90, an H100."""

MXFP8_CAPABILITY_MAJOR = 10
"""torchao's MXFP8 grouped GEMM kernels run on sm_100 devices (B200, B300) only."""
MXFP8_MIN_CUDA: tuple[int, int] = (12, 8)
"""The oldest CUDA that torch must be built with for torchao's MXFP8 kernels."""
SCALED_GROUPED_MM_CAPABILITY_MAJOR = 9
"""``torch._scaled_grouped_mm`` with rowwise FP8 operands runs on sm_90 devices (H100, H200)
only: torch builds it for Hopper, not for sm_100 or later (its own tests gate the kernel on
``SM90OrLater and not SM100OrLater``); an sm_100 device runs FP8 experts as MXFP8."""
FP8_LINEAR_MIN_CAPABILITY: Capability = (8, 9)
"""FP8 tensor cores (``torch._scaled_mm``, torchao's FP8 linears) need sm_89 or newer."""

Mxfp8Kernel = Literal["torchao", "emulated"]
"""The MXFP8 grouped GEMM: torchao's kernels, or the exact emulation."""
Fp8RowwiseKernel = Literal["scaled_mm", "emulated"]
"""The rowwise FP8 grouped GEMM: ``torch._scaled_grouped_mm``, or the exact emulation."""
Fp8LinearKernel = Literal["native", "emulated"]
"""torchao's FP8 linear layers: on FP8 tensor cores, or its emulation."""
GroupedMmKernel = Literal["torch", "measured"]
"""The grouped GEMM backend ``auto``: ``torch._grouped_mm``, or whichever of torch and
Triton is measured faster per shape."""
ExpertGemmPath = Literal["mxfp8", "fp8_rowwise", "grouped_mm"]
"""What the experts' GEMMs run when left to the device: MXFP8, rowwise FP8, or the grouped
GEMM in the compute dtype."""

Name = TypeVar("Name", bound=str)


@dataclass(frozen=True)
class Choice(Generic[Name]):
    """One kernel the rule picks, and why, in words."""

    name: Name
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


@dataclass(frozen=True)
class Software:
    """What is installed beside the device. The defaults are everything the fast paths need:
    what the planner assumes of a device kind."""

    cuda: tuple[int, int] | None = MXFP8_MIN_CUDA
    """The CUDA version torch is built with; None without CUDA."""
    torchao: bool = True
    """Whether torchao is installed (moe-kernels' ``mxfp8`` extra)."""
    torchao_mxfp8_kernels: bool = True
    """Whether that torchao has its compiled sm_100 MXFP8 kernels."""
    scaled_grouped_mm: bool = True
    """Whether torch has ``torch._scaled_grouped_mm``."""
    triton: bool = True
    """Whether Triton is installed."""


@dataclass(frozen=True)
class KernelPaths:
    """The kernels one kind of device runs, each with the reason in words."""

    device: str
    """``cpu``, or the capability as ``sm_<major><minor>``."""
    mxfp8: Choice[Mxfp8Kernel]
    fp8_rowwise: Choice[Fp8RowwiseKernel]
    fp8_linear: Choice[Fp8LinearKernel]
    grouped_mm: Choice[GroupedMmKernel]
    expert_gemm: Choice[ExpertGemmPath]
    """What the experts run when the choice is left to the device, with bf16 compute."""

    def auto_expert_gemm(self, compute_dtype: str) -> Choice[ExpertGemmPath]:
        """What the experts run when left to the device, with ``compute_dtype`` compute (a
        dtype name such as ``bfloat16``): the FP8 GEMMs take bf16 inputs only."""
        if compute_dtype == "bfloat16":
            return self.expert_gemm
        return Choice("grouped_mm", f"{compute_dtype} compute; the FP8 GEMMs take bfloat16")

    def gemm_kernel(self, path: ExpertGemmPath) -> Choice[str]:
        """The kernel that runs the expert GEMM ``path`` on this device."""
        return {"mxfp8": self.mxfp8, "fp8_rowwise": self.fp8_rowwise}.get(path, self.grouped_mm)

    def runs_in_fp8(self, path: ExpertGemmPath) -> bool:
        """Whether the expert GEMM ``path`` runs on this device's FP8 tensor cores."""
        return path != "grouped_mm" and self.gemm_kernel(path).name != "emulated"


def _sm(capability: Capability) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _mxfp8(capability: Capability | None, software: Software) -> Choice[Mxfp8Kernel]:
    if capability is None:
        return Choice("emulated", "the device is a CPU")
    if capability[0] != MXFP8_CAPABILITY_MAJOR:
        return Choice("emulated", f"the GPU is {_sm(capability)}; torchao's MXFP8 needs sm_100")
    if software.cuda is None or software.cuda < MXFP8_MIN_CUDA:
        cuda = software.cuda
        built = "without CUDA" if cuda is None else f"with CUDA {cuda[0]}.{cuda[1]}"
        return Choice("emulated", f"torch is built {built}; torchao's MXFP8 needs CUDA >= 12.8")
    if not software.torchao:
        return Choice("emulated", "torchao is not installed (moestack-kernels[mxfp8])")
    if not software.torchao_mxfp8_kernels:
        return Choice("emulated", "this torchao is built without its sm_100 MXFP8 kernels")
    return Choice("torchao", f"torchao's MXFP8 kernels on {_sm(capability)}")


def _fp8_rowwise(capability: Capability | None, software: Software) -> Choice[Fp8RowwiseKernel]:
    if capability is None:
        return Choice("emulated", "the device is a CPU")
    if capability[0] != SCALED_GROUPED_MM_CAPABILITY_MAJOR:
        return Choice("emulated", f"the GPU is {_sm(capability)}; scaled_mm needs sm_90")
    if not software.scaled_grouped_mm:
        return Choice("emulated", "this torch has no _scaled_grouped_mm")
    return Choice("scaled_mm", f"torch._scaled_grouped_mm on {_sm(capability)}")


def _fp8_linear(capability: Capability | None) -> Choice[Fp8LinearKernel]:
    if capability is None:
        return Choice("emulated", "the device is a CPU")
    if capability < FP8_LINEAR_MIN_CAPABILITY:
        return Choice("emulated", f"the GPU is {_sm(capability)}; FP8 needs sm_89 or newer")
    return Choice("native", f"FP8 tensor cores on {_sm(capability)}")


def _grouped_mm(capability: Capability | None, software: Software) -> Choice[GroupedMmKernel]:
    if capability is None:
        return Choice("torch", "the device is a CPU, where Triton runs only under its interpreter")
    if not software.triton:
        return Choice("torch", "triton is not installed")
    return Choice("measured", f"torch or Triton, the faster per shape on {_sm(capability)}")


@functools.cache
def kernel_paths(capability: Capability | None, software: Software = Software()) -> KernelPaths:
    """The kernels a device of ``capability`` (None: a CPU) runs with ``software`` beside it.

    The experts, left to the device, run MXFP8 where torchao's kernels run, else rowwise FP8
    where ``torch._scaled_grouped_mm`` does, else the grouped GEMM in the compute dtype.
    """
    if capability is not None and not (
        len(capability) == 2 and all(isinstance(part, int) and part >= 0 for part in capability)
    ):
        raise ValueError(f"capability={capability!r} must be (major, minor), e.g. (9, 0), or None")
    mxfp8 = _mxfp8(capability, software)
    fp8_rowwise = _fp8_rowwise(capability, software)
    if mxfp8.name == "torchao":
        expert_gemm: Choice[ExpertGemmPath] = Choice("mxfp8", mxfp8.reason)
    elif fp8_rowwise.name == "scaled_mm":
        expert_gemm = Choice("fp8_rowwise", fp8_rowwise.reason)
    else:
        expert_gemm = Choice("grouped_mm", f"no native FP8 grouped GEMM: {fp8_rowwise.reason}")
    return KernelPaths(
        device="cpu" if capability is None else _sm(capability),
        mxfp8=mxfp8,
        fp8_rowwise=fp8_rowwise,
        fp8_linear=_fp8_linear(capability),
        grouped_mm=_grouped_mm(capability, software),
        expert_gemm=expert_gemm,
    )
