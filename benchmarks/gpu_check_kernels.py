"""The GPU check's kernel rows (`gpu_train_check.py` runs them after its training rows): the
grouped GEMM's Triton and torch backends, the FP8 grouped GEMM against bf16, and one rowwise
transport exchange; each at the trained model's shapes, returning a table row."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from gpu_check_support import Row, amount, host_sync_forbidden, one_line, synchronize
from grouped_mm_backends import bench_shape
from moe_dispatch import make_dispatcher, make_row_transport
from moe_kernels import fp8_rowwise_grouped_mm, fp8_rowwise_scaled_mm_supported, grouped_mm
from moe_plan.config import Config

# ---- grouped GEMM -------------------------------------------------------------------------


def grouped_gemm_row(check: str, config: Config, reps: int, device: torch.device) -> Row:
    """Triton vs torch grouped GEMM, forward + backward, at `config`'s gate_up shape (`reps`
    timed calls per backend)."""
    moe, data = config.model.moe, config.data
    rows = data.micro_batch_size * data.seq_len * moe.top_k
    shape = (rows, moe.num_experts, config.model.d_model, 2 * moe.expert_hidden)
    triton = "triton backend" if device.type == "cuda" else "triton backend [interpreter]"
    timing = argparse.Namespace(warmup=2 if device.type == "cuda" else 1, reps=reps)
    timing.seed = 0
    results = bench_shape(
        shape, torch.bfloat16, device, ["torch backend", triton, "dense matmul (limit)"], timing
    )
    by_variant = {r["variant"]: r for r in results}
    torch_tflops = by_variant["torch backend"]["tflops"]
    triton_tflops = by_variant[triton]["tflops"]
    difference = by_variant[triton]["max_rel_diff_vs_torch_backend"]
    agree = difference is not None and difference < 5e-2
    figure = (
        f"T={shape[0]} E={shape[1]} K={shape[2]} N={shape[3]}: triton {triton_tflops:.1f}, "
        f"torch {torch_tflops:.1f}, dense {by_variant['dense matmul (limit)']['tflops']:.1f} "
        f"TFLOP/s; triton/torch {triton_tflops / torch_tflops:.2f}; rel diff {difference:.1e}"
    )
    result = "ok" if agree else "FAIL"
    if device.type != "cuda":
        result = "skipped (cpu)" if agree else "FAIL"
        figure += " (interpreter: agreement checked, speeds mean nothing)"
    return Row(check, result, figure, {"rows": results})


def _time_fwd_bwd(gemm: Callable[[], Tensor], grad_out: Tensor, reps: int, device) -> float:
    """Seconds per forward + backward of ``gemm()`` (after one warm-up call)."""
    gemm().backward(grad_out)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        gemm().backward(grad_out)
    synchronize(device)
    return (time.perf_counter() - start) / reps


def fp8_gemm_row(check: str, config: Config, reps: int, device: torch.device) -> Row:
    """fp8_rowwise_grouped_mm vs bf16 grouped_mm, forward + backward, at `config`'s gate_up
    and down shapes (balanced groups, `reps` timed calls each); speeds and the FP8 result's
    relative difference."""
    moe, d_model = config.model.moe, config.model.d_model
    kernel = fp8_rowwise_scaled_mm_supported(torch.empty(0, device=device, dtype=torch.bfloat16))
    details: dict = {"kernel": kernel or "scaled_mm"}
    generator = torch.Generator(device=device).manual_seed(0)
    figures = []
    for name, k, n in (
        ("gate_up", d_model, 2 * moe.expert_hidden),
        ("down", moe.expert_hidden, d_model),
    ):
        details[name] = _fp8_shape(config, k, n, reps, device, generator)
        tflops = details[name]["tflops"]
        figures.append(
            f"{name} T={details[name]['shape'][0]} E={moe.num_experts} K={k} N={n}: fp8 "
            f"{tflops['fp8']:.1f}, bf16 {tflops['bf16']:.1f} TFLOP/s "
            f"(x{tflops['fp8'] / tflops['bf16']:.2f})"
        )
    worst = max(details[name]["rel_diff_vs_bf16"] for name in ("gate_up", "down"))
    # e4m3 rounds each operand by up to 2^-4 (typically far less): a few percent apart at most.
    agree = worst < 0.1
    figure = "; ".join(figures) + f"; rel diff vs bf16 {worst:.1e}"
    result = "ok" if agree else "FAIL"
    if device.type != "cuda" or details["kernel"] != "scaled_mm":
        result = "skipped (cpu)" if agree and device.type != "cuda" else result
        figure += f" (emulated: {details['kernel']}; speeds mean nothing)"
    return Row(check, result, figure, details)


def _fp8_shape(
    config: Config, k: int, n: int, reps: int, device: torch.device, generator: torch.Generator
) -> dict:
    """One [T, k] x [E, k, n] grouped GEMM of a micro-batch's routed copies in FP8 and in bf16:
    its shape, TFLOP/s of each, and the FP8 result's relative difference."""
    moe, data = config.model.moe, config.data
    rows = data.micro_batch_size * data.seq_len * moe.top_k
    offsets = (torch.arange(1, moe.num_experts + 1, device=device) * rows // moe.num_experts).int()
    x = torch.randn(rows, k, device=device, generator=generator, dtype=torch.bfloat16)
    w = torch.randn(moe.num_experts, k, n, device=device, generator=generator, dtype=torch.bfloat16)
    x.requires_grad_(), w.mul_(k**-0.5).requires_grad_()
    grad_out = torch.randn(rows, n, device=device, generator=generator, dtype=torch.bfloat16)
    with torch.no_grad():
        bf16 = grouped_mm(x, w, offsets).float()
        fp8 = fp8_rowwise_grouped_mm(x, w, offsets).float()
    flops = 3 * 2 * rows * k * n  # forward, input and weight gradients
    seconds = {
        "bf16": _time_fwd_bwd(lambda: grouped_mm(x, w, offsets), grad_out, reps, device),
        "fp8": _time_fwd_bwd(lambda: fp8_rowwise_grouped_mm(x, w, offsets), grad_out, reps, device),
    }
    return {
        "shape": (rows, moe.num_experts, k, n),
        "tflops": {key: flops / value / 1e12 for key, value in seconds.items()},
        "rel_diff_vs_bf16": ((fp8 - bf16).norm() / bf16.norm()).item(),
    }


# ---- rowwise transports and nvshmem -------------------------------------------------------


def exchange_row(
    check: str,
    transport_name: str,
    config: Config,
    reps: int,
    device: torch.device,
    group: dist.ProcessGroup,
) -> Row:
    """One dispatch block of a layer through the transport at ep = 1: right bytes, no sync
    (`reps` timed exchanges)."""
    try:
        transport = make_row_transport(transport_name, group)
        transport.connect(device)
    except (ImportError, ValueError, RuntimeError) as e:  # BackendUnavailable is a RuntimeError
        return Row(check, "skipped (cpu)" if device.type == "cpu" else "skipped", one_line(e))
    moe, data = config.model.moe, config.data
    # A layer's dispatch block: what one rank sends another, sized by the rowwise dispatcher.
    dispatcher = make_dispatcher(
        "rowwise", num_experts=moe.num_experts, capacity_factor=moe.capacity_factor, group=group
    )
    capacity = dispatcher.capacity(data.micro_batch_size * data.seq_len, moe.top_k)
    ep = group.size()
    block_shape = (moe.num_experts // ep, capacity, config.model.d_model)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    payload_PB = torch.randn((ep, *block_shape), device=device, dtype=dtype)

    def exchange() -> Tensor:
        return transport.exchange_blocks(
            block_shape,
            dtype,
            device,
            lambda peer, dest: dest.copy_(payload_PB[peer]),
            lambda received: received.clone(),
        )

    received_PB = exchange()  # allocates the buffers (host-blocking, once)
    rank = dist.get_rank(group)
    if not torch.equal(received_PB[rank], payload_PB[rank]):
        return Row(check, "FAIL", "received block differs from the block sent to itself")
    synchronize(device)
    start = time.perf_counter()
    with host_sync_forbidden(device):
        for _ in range(reps):
            exchange()
    synchronize(device)
    seconds = (time.perf_counter() - start) / reps
    block_bytes = payload_PB.numel() * payload_PB.element_size()
    sync = "no host sync; " if device.type == "cuda" else ""
    figure = (
        f"{sync}block {tuple(block_shape)} bf16 ({amount(block_bytes, 'B')}) in "
        f"{1e3 * seconds:.2f} ms ({amount(block_bytes / seconds, 'B/s')})"
    )
    details = {"block_shape": block_shape, "block_bytes": block_bytes, "ms": 1e3 * seconds}
    return Row(check, "ok", figure, details)
