"""Peak matmul rate of the machine: the denominator of MFU."""

import time

import torch

# Dense (non-sparse) bf16 tensor-core peaks from vendor data sheets, FLOP/s.
KNOWN_GPU_BF16_PEAK = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "B200": 2250e12,
    "B300": 2250e12,
    "GB200": 2500e12,
    "MI300X": 1307e12,
}


def measure_matmul_peak(
    dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...] = (1024, 2048)
) -> float:
    """Best FLOP/s of square matmuls of `dtype` on `device` over a few sizes and repeats."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        a @ b  # warm up the library's kernel choice
        for _ in range(4):
            _sync(device)
            start = time.perf_counter()
            a @ b
            _sync(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def peak_flops(
    dtype: torch.dtype, device: torch.device, override: float | None
) -> tuple[float, str]:
    """(peak FLOP/s, where it came from): the override, a known GPU's data sheet, or measured."""
    if override is not None:
        return override, "train.peak_flops"
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for model, flops in KNOWN_GPU_BF16_PEAK.items():
            if model in name.split() or f" {model}" in name:
                return flops, f"data sheet of {name}"
    return measure_matmul_peak(dtype, device), f"measured {dtype} matmul on {device.type}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
