"""The devices `moe-plan` knows, from their makers' published figures.

Each can be overridden from the command line; for another device, give all four figures (and
its FP8 rate and compute capability, if it runs FP8 natively). Which FP8 kernels a device runs
is moe-devices' rule of its capability, the one the kernels apply at run time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from moe_devices import Capability, KernelPaths, kernel_paths


@dataclass(frozen=True)
class Device:
    """One accelerator and its links, as the planner's roofline sees them."""

    name: str
    memory_gib: float
    """Memory a training process can use."""
    bf16_tflops: float
    """Dense bf16 matrix-multiply peak (no sparsity)."""
    capability: Capability
    """CUDA compute capability: which FP8 kernels run (`moe_devices.kernel_paths`)."""
    intra_node_gbps: float
    """GB/s one device sends to its node's peers (NVLink, one direction)."""
    inter_node_gbps: float
    """GB/s one device sends to other nodes (its network adapter, one direction)."""
    gpus_per_node: int = 8
    fp8_tflops: float = 0.0
    """Dense FP8 (e4m3) matrix-multiply peak, no sparsity; 0 where FP8 does not run natively.
    Rowwise FP8 and MXFP8 (where `mxfp8`) run at this rate."""
    memory_tbps: float = 0.0
    """Memory (HBM) bandwidth in TB/s, for the memory-bound kernels; 0 leaves them out."""

    @property
    def kernel_paths(self) -> KernelPaths:
        """The kernels this kind of device runs, with the software they need installed."""
        return kernel_paths(self.capability)

    @property
    def mxfp8(self) -> bool:
        """Whether MXFP8 matrix multiplies run natively (at the FP8 rate)."""
        return self.kernel_paths.mxfp8.name == "torchao"


FLAGS = {
    "memory_gib": "--gpu-memory-gib",
    "bf16_tflops": "--gpu-tflops",
    "intra_node_gbps": "--intra-node-gbps",
    "inter_node_gbps": "--inter-node-gbps",
    "fp8_tflops": "--gpu-fp8-tflops",
    "capability": "--gpu-capability",
}
"""The command-line flag of each figure."""

DEVICES: dict[str, Device] = {
    # Memory as the driver reports it (a little under the marketed GB); NVLink 4 is 900 GB/s
    # and NVLink 5 1.8 TB/s both directions together; one 400 Gb/s adapter per H100, H200 and
    # B200, one 800 Gb/s adapter per B300. Dense FP8 peaks: 1979 TFLOP/s (H100, H200),
    # 4500 (B200, B300), MXFP8 on B200 and B300 at the same rate. Memory bandwidth: 3.35 TB/s
    # (H100 SXM), 4.8 (H200), 8 (B200, B300). Compute capability 9.0 (H100, H200), 10.0
    # (B200), 10.3 (B300).
    "h100": Device("H100 SXM", 79.6, 989.0, (9, 0), 450.0, 50.0, 8, 1979.0, 3.35),
    "h200": Device("H200 SXM", 139.8, 989.0, (9, 0), 450.0, 50.0, 8, 1979.0, 4.8),
    "b200": Device("B200", 178.0, 2250.0, (10, 0), 900.0, 50.0, 8, 4500.0, 8.0),
    "b300": Device("B300", 268.0, 2250.0, (10, 3), 900.0, 100.0, 8, 4500.0, 8.0),
}

CUSTOM_CAPABILITY: dict[bool, Capability] = {True: (9, 0), False: (8, 0)}
"""The capability a device of figures is taken to have without --gpu-capability, by whether
it has an FP8 rate: the oldest with native FP8 grouped GEMMs, or the oldest without."""


def parse_capability(text: str) -> Capability:
    """`MAJOR.MINOR` (e.g. 9.0) as a capability; ValueError naming the flag otherwise."""
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if match is None:
        raise ValueError(f"--gpu-capability {text!r} must be MAJOR.MINOR, e.g. 9.0 or 10.0")
    return int(match[1]), int(match[2])


def device_with(
    name: str | None,
    *,
    memory_gib: float | None = None,
    tflops: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    gpus_per_node: int | None = None,
    fp8_tflops: float | None = None,
    capability: Capability | None = None,
) -> Device:
    """A known device with some figures overridden, or (name None) one made of the figures,
    all of which but `fp8_tflops` (0, no native FP8, unless given) and `capability` (from
    `CUSTOM_CAPABILITY` unless given) must then be given. Raises ValueError naming what is
    missing or wrong."""
    figures = {
        "memory_gib": memory_gib,
        "bf16_tflops": tflops,
        "intra_node_gbps": intra_node_gbps,
        "inter_node_gbps": inter_node_gbps,
    }
    if fp8_tflops is not None and not (0 <= fp8_tflops < math.inf):
        raise ValueError(
            f"--gpu-fp8-tflops {fp8_tflops} must be a positive dense FP8 rate, "
            "or 0 for a device without native FP8"
        )
    if name is None:
        missing = [k for k, v in figures.items() if v is None]
        if missing:
            flags = ", ".join(FLAGS[k] for k in missing)
            raise ValueError(f"without --gpu, give every device figure; missing {flags}")
        device = Device("custom", 0.0, 0.0, CUSTOM_CAPABILITY[bool(fp8_tflops)], 0.0, 0.0)
    elif name not in DEVICES:
        raise ValueError(f"--gpu {name!r} is not one of {', '.join(DEVICES)}")
    else:
        device = DEVICES[name]
    changes = {k: v for k, v in figures.items() if v is not None}
    if gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    for key, value in changes.items():
        if not value > 0:
            raise ValueError(f"{FLAGS.get(key, '--gpus-per-node')} {value} must be positive")
    if fp8_tflops is not None:
        changes["fp8_tflops"] = fp8_tflops
    if capability is not None:
        changes["capability"] = capability
    return replace(device, **changes)
