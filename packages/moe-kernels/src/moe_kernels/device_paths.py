"""moe-devices' rule applied to the device the kernels run on, and the one warning a kernel
gives where it falls back from what was asked.

Every kernel that picks a path by device (MXFP8, rowwise FP8, the grouped GEMM's ``auto``)
asks ``device_kernel_paths``, and so does the trainer for its banner and manifest: what they
report is what runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings

import torch

from moe_devices import Choice, KernelPaths, Software, kernel_paths
from moe_kernels.torchao_import import quiet_torchao_import

__all__ = ["device_kernel_paths", "installed_software"]


def _version(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "12.8"; None for None."""
    if text is None:
        return None
    parts = text.split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


@functools.cache
def installed_software() -> Software:
    """What is installed beside the devices of this process (torchao's compiled MXFP8
    kernels are looked for only where the rule would run them: see `device_kernel_paths`)."""
    return Software(
        cuda=_version(torch.version.cuda),
        torchao=importlib.util.find_spec("torchao") is not None,
        scaled_grouped_mm=hasattr(torch, "_scaled_grouped_mm"),
        triton=importlib.util.find_spec("triton") is not None,
    )


@functools.cache
def _torchao_has_mxfp8_kernels() -> bool:
    """Whether the installed torchao was built with its sm_100 MXFP8 kernels (imports it)."""
    with quiet_torchao_import():
        from torchao.prototype.moe_training import mxfp8_grouped_mm as torchao_mxfp8

    return bool(getattr(torchao_mxfp8, "_SM100_KERNELS_AVAILABLE", False))


def device_kernel_paths(device: torch.device | str) -> KernelPaths:
    """`moe_devices.kernel_paths` for `device` (a CUDA device by its capability, anything else
    as a CPU) with the software installed here."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    software = installed_software()
    paths = kernel_paths(capability, software)
    if paths.mxfp8.name == "torchao" and not _torchao_has_mxfp8_kernels():
        paths = kernel_paths(capability, dataclasses.replace(software, torchao_mxfp8_kernels=False))
    return paths


_warned: set[tuple[str, str]] = set()


def warn_fallback(function: str, device: torch.device, choice: Choice[str]) -> None:
    """Warn once per function and reason that `function` runs `choice` (an emulation) on a
    GPU instead of its native kernel. Elsewhere the emulation is the only path: no warning."""
    if device.type != "cuda" or (function, choice.reason) in _warned:
        return
    _warned.add((function, choice.reason))
    warnings.warn(
        f"{function} runs {choice.name} on {device}: {choice.reason}", RuntimeWarning, stacklevel=3
    )
