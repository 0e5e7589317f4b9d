"""Grouped GEMM backends, forward + backward: torch vs Triton vs a per-expert loop vs dense.

Times, in one run and interleaved (ratios matter, not lone absolute times), for each shape:
``moe_kernels.grouped_mm`` with ``backend="torch"`` and ``backend="triton"``, a Python loop of
matmuls over per-expert slices (split sizes read on the host), and one dense matmul with the
same FLOPs (the limit). Rows are routed uniformly at random to the experts.

- On CUDA: the MoE shapes T in {8192, 16384, 32768} rows, E in {8, 64}, (K, N) in
  {(2048, 1408), (4096, 2048)}, bf16 (Triton autotunes during the warm-up calls).
- On CPU: the torch backend, the loop and dense at smaller shapes, in bf16 and fp32; the Triton
  kernels only run under the Triton interpreter there, so they are timed at one tiny shape,
  labelled ``[interpreter]``, to show they run and agree; that speed means nothing.

Prints a table and writes JSON (default ``bench_results/grouped_mm_backends.json``).

    uv run python benchmarks/grouped_mm_backends.py
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from grouped_mm_cpu import _expert_contiguous_inputs, _loop_grouped_mm
from harness.output import print_table, write_json
from harness.timing import device_timer, interleaved_medians
from moe_kernels import grouped_mm

GPU_SHAPES = [
    (rows, experts, size_k, size_n)
    for rows in (8192, 16384, 32768)
    for experts in (8, 64)
    for size_k, size_n in ((2048, 1408), (4096, 2048))
]
CPU_SHAPES = [
    (rows, experts, size_k, size_n)
    for rows in (4096,)
    for experts in (8, 64)
    for size_k, size_n in ((512, 352), (1024, 512))
]
INTERPRETER_SHAPE = (64, 4, 32, 32)


def _fwd_bwd(forward: Callable[[], Tensor], grad_out: Tensor) -> Callable[[], None]:
    def step() -> None:
        forward().backward(grad_out)

    return step


def _max_relative_difference(actual: Tensor, expected: Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual.float() - expected.float()).abs().max() / scale).item()


def bench_shape(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    variants: list[str],
    args: argparse.Namespace,
) -> list[dict]:
    """One row per variant: median ms and TFLOP/s of forward + backward at this shape."""
    rows, experts, size_k, size_n = shape
    x_cpu, w_cpu, offsets_cpu, tokens_per_expert = _expert_contiguous_inputs(
        rows, size_k, size_n, experts, dtype, args.seed
    )
    x = x_cpu.detach().to(device).requires_grad_()
    w = w_cpu.detach().to(device).requires_grad_()
    offsets = offsets_cpu.to(device)
    w_dense = w[0].detach().clone().requires_grad_()
    grad_out = torch.randn(rows, size_n, dtype=torch.float32).to(device, dtype)
    split_sizes = tokens_per_expert.to(device)

    forwards: dict[str, Callable[[], Tensor]] = {
        "torch backend": lambda: grouped_mm(x, w, offsets, backend="torch"),
        "triton backend": lambda: grouped_mm(x, w, offsets, backend="triton"),
        "triton backend [interpreter]": lambda: grouped_mm(x, w, offsets, backend="triton"),
        # The host read of the split sizes is part of the loop variant's cost.
        "per-expert loop": lambda: _loop_grouped_mm(x, w, split_sizes.tolist()),
        "dense matmul (limit)": lambda: x @ w_dense,
    }
    steps = {name: _fwd_bwd(forwards[name], grad_out) for name in variants}
    timer = device_timer(device)
    measures = {name: partial(timer, step) for name, step in steps.items()}
    medians = interleaved_medians(measures, args.warmup, args.reps)

    agreement: dict[str, float] = {}
    reference = grouped_mm(x, w, offsets, backend="torch").detach()
    for name in variants:
        if name.startswith("triton"):
            agreement[name] = _max_relative_difference(forwards[name]().detach(), reference)

    flops = 3 * 2 * rows * size_k * size_n  # forward + dgrad + wgrad
    dense_median = medians["dense matmul (limit)"]
    results = []
    for name, median in medians.items():
        results.append(
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype).removeprefix("torch."),
                "variant": name,
                "rows": rows,
                "experts": experts,
                "k": size_k,
                "n": size_n,
                "median_ms": median * 1e3,
                "tflops": flops / median / 1e12,
                "fraction_of_dense": dense_median / median,
                "max_rel_diff_vs_torch_backend": agreement.get(name),
                "reps": args.reps,
            }
        )
    return results


def _parse_shape(text: str) -> tuple[int, int, int, int]:
    rows, experts, size_k, size_n = (int(part) for part in text.split(","))
    return rows, experts, size_k, size_n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=_parse_shape,
        default=None,
        help="ROWS,EXPERTS,K,N each (default: the MoE shapes on CUDA, smaller ones on CPU)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", default=None, help="default bfloat16 (+ float32 on CPU)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="default 3 on CUDA, 1 on CPU")
    parser.add_argument("--reps", type=int, default=None, help="default 10 on CUDA, 5 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench_results/grouped_mm_backends.json")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    if args.warmup is None:
        args.warmup = 3 if on_gpu else 1
    if args.reps is None:
        args.reps = 10 if on_gpu else 5
    dtypes = [
        getattr(torch, name)
        for name in args.dtypes or (["bfloat16"] if on_gpu else ["bfloat16", "float32"])
    ]
    limit_and_loop = ["per-expert loop", "dense matmul (limit)"]

    results = []
    for dtype in dtypes:
        if on_gpu:
            for shape in args.shapes or GPU_SHAPES:
                variants = ["torch backend", "triton backend", *limit_and_loop]
                results += bench_shape(shape, dtype, device, variants, args)
            continue
        for shape in args.shapes or CPU_SHAPES:
            results += bench_shape(shape, dtype, device, ["torch backend", *limit_and_loop], args)
        # Triton on CPU only runs under its interpreter, which Triton reads when the kernels are
        # decorated (at the first backend="triton" call, which imports them).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        variants = ["torch backend", "triton backend [interpreter]", *limit_and_loop]
        results += bench_shape(INTERPRETER_SHAPE, dtype, device, variants, args)

    print(f"grouped GEMM fwd+bwd on {results[0]['device']}, threads={torch.get_num_threads()}")
    header = ("dtype", "rows", "E", "K", "N", "variant", "median ms", "TFLOP/s", "of dense")
    print_table([*header, "rel diff"], map(_table_row, results), left=["variant"])
    write_json(Path(args.json), results)


def _table_row(row: dict) -> list:
    diff = row["max_rel_diff_vs_torch_backend"]
    return [
        row["dtype"],
        row["rows"],
        row["experts"],
        row["k"],
        row["n"],
        row["variant"],
        f"{row['median_ms']:.2f}",
        f"{row['tflops']:.3f}",
        f"{row['fraction_of_dense']:.2f}",
        "" if diff is None else f"{diff:.1e}",
    ]


if __name__ == "__main__":
    main()
