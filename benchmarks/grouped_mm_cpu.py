"""Grouped GEMM on CPU, forward + backward: moe_kernels.grouped_mm vs a per-expert loop.

Compares, in one run and interleaved (the machines are shared, so ratios matter, not absolute
times): ``moe_kernels.grouped_mm``, raw ``torch._grouped_mm``, a Python loop of matmuls over
per-expert slices (split sizes read on the host), and one dense matmul with the same FLOPs (the
limit). Prints a table and writes JSON.

    uv run python benchmarks/grouped_mm_cpu.py --json /tmp/grouped_mm_cpu.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from harness.output import print_table, write_json
from harness.timing import interleaved_medians
from moe_kernels import grouped_mm


def _expert_contiguous_inputs(
    num_rows: int, size_k: int, size_n: int, num_experts: int, dtype: torch.dtype, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    expert_of_row = torch.randint(num_experts, (num_rows,), generator=generator)
    tokens_per_expert = torch.bincount(expert_of_row, minlength=num_experts)
    offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
    x = torch.randn(num_rows, size_k, generator=generator).to(dtype).requires_grad_()
    w = (torch.randn(num_experts, size_k, size_n, generator=generator) / size_k**0.5).to(dtype)
    return x, w.requires_grad_(), offsets, tokens_per_expert


def _loop_grouped_mm(x: Tensor, w: Tensor, split_sizes: list[int]) -> Tensor:
    # unbind, not w[expert]: one stacked weight gradient instead of E zero-filled full-size ones.
    pieces = torch.split(x, split_sizes)
    return torch.cat(
        [piece @ w_expert for piece, w_expert in zip(pieces, w.unbind(0), strict=True)]
    )


def _time_fwd_bwd(step: Callable[[], Tensor], grad_out: Tensor) -> float:
    start = time.perf_counter()
    out = step()
    out.backward(grad_out)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x, w, offsets, tokens_per_expert = _expert_contiguous_inputs(
            args.rows, args.k, args.n, args.experts, dtype, args.seed
        )
        w_dense = w[0].detach().clone().requires_grad_()
        grad_out = torch.randn(args.rows, args.n).to(dtype)

        def host_split_loop(x=x, w=w, tokens_per_expert=tokens_per_expert) -> Tensor:
            # The host read of the split sizes is part of the loop variant's cost.
            return _loop_grouped_mm(x, w, tokens_per_expert.tolist())

        variants: dict[str, Callable[[], Tensor]] = {
            "moe_kernels.grouped_mm": lambda x=x, w=w, offsets=offsets: grouped_mm(x, w, offsets)
        }
        alignment = 16 // x.element_size()
        if args.k % alignment == 0 and args.n % alignment == 0:
            variants["torch._grouped_mm"] = lambda x=x, w=w, offsets=offsets: torch._grouped_mm(
                x, w, offs=offsets
            )
        variants["per-expert loop"] = host_split_loop
        variants["dense matmul (limit)"] = lambda x=x, w_dense=w_dense: x @ w_dense
        measures = {name: partial(_time_fwd_bwd, step, grad_out) for name, step in variants.items()}
        medians = interleaved_medians(measures, args.warmup, args.reps)
        flops = 3 * 2 * args.rows * args.k * args.n  # forward + dgrad + wgrad
        loop_median = medians["per-expert loop"]
        for name, median in medians.items():
            rows.append(
                {
                    "dtype": dtype_name,
                    "variant": name,
                    "median_ms": median * 1e3,
                    "tflops": flops / median / 1e12,
                    "time_over_loop": median / loop_median,
                    "rows": args.rows,
                    "k": args.k,
                    "n": args.n,
                    "experts": args.experts,
                    "threads": torch.get_num_threads(),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="T * top_k (default 4096 * 2)")
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args()

    rows = run(args)
    print(
        f"grouped GEMM fwd+bwd on CPU: rows={args.rows} K={args.k} N={args.n} "
        f"E={args.experts} threads={torch.get_num_threads()}"
    )
    print_table(
        ("dtype", "variant", "median ms", "TFLOP/s", "time/loop"),
        (
            [
                row["dtype"],
                row["variant"],
                f"{row['median_ms']:.1f}",
                f"{row['tflops']:.3f}",
                f"{row['time_over_loop']:.2f}",
            ]
            for row in rows
        ),
        left=["variant"],
    )
    if args.json:
        write_json(Path(args.json), rows)


if __name__ == "__main__":
    main()
