"""Dispatch backends on gloo (CPU): tokens/s of dispatch + combine, forward + backward, and the
bytes each backend moves per token copy against the minimum.

For each world size (spawned processes, one gloo rank each) and dtype, the backends run
interleaved in one loop (machines are shared and noisy: compare ratios, not lone times):
``local`` (each rank keeps all experts: no communication, the limit), ``all_to_all``
(dropless, uneven splits), ``all_to_all_dedup`` (dropless, a token sent once per destination
rank with its K local expert ids and weights) and ``rowwise`` (static capacity, fixed-size
blocks) over its two transports: ``rowwise/a2a`` (an even all-to-all) and ``rowwise/shm``
(symmetric memory: on CPU, blocks written straight into the peers' shared-memory buffers). Experts are the
identity, so the time is dispatch + combine alone. Bytes are counted for one forward dispatch
+ combine at ``dist.all_to_all_single`` (everything a rank hands to the collective, its own
block and the count exchange included) or, for ``rowwise/shm``, as the blocks written, and
compared with the minimum: each token copy sent once each way, ``2 * D * element_size``.

    uv run python benchmarks/dispatch.py --out bench_results/dispatch.json
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from harness.output import print_table, write_json
from harness.ranks import run_distributed
from harness.timing import interleaved_medians
from moe_dispatch import Dispatcher, make_dispatcher, make_row_transport

BACKENDS = ("local", "all_to_all", "all_to_all_dedup", "rowwise/a2a", "rowwise/shm")


class _ByteCounter:
    """Adds up, while enabled, the bytes handed to ``dist.all_to_all_single`` and the blocks a
    rowwise transport writes."""

    def __init__(self) -> None:
        self.enabled = False
        self.bytes = 0

    def all_to_all_single(self, send: Callable[..., Any]) -> Callable[..., Any]:
        def counted(output: Tensor, input: Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.enabled:
                self.bytes += input.numel() * input.element_size()
            return send(output, input, *args, **kwargs)

        return counted

    def exchange_blocks(self, transport: Any) -> Callable[..., Any]:
        exchange_blocks = transport.exchange_blocks

        def counted(block_shape, dtype, device, write_block, read, *args, **kwargs) -> Any:
            if self.enabled:
                self.bytes += transport.ep * math.prod(block_shape) * dtype.itemsize
            return exchange_blocks(block_shape, dtype, device, write_block, read, *args, **kwargs)

        return counted


def _dispatch_combine(
    dispatcher: Dispatcher, x_TD: Tensor, topk_idx_TK: Tensor, topk_weight_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Forward and backward through identity experts; returns (y, dropped copies)."""
    x_TD = x_TD.detach().requires_grad_()
    expert_input, _, handle = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK)
    y_TD = dispatcher.combine(expert_input, handle)
    y_TD.backward(torch.ones_like(y_TD))
    return y_TD, handle.dropped_copies


def _dispatch_combine_forward(
    dispatcher: Dispatcher, x_TD: Tensor, topk_idx_TK: Tensor, topk_weight_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Forward only (for counting bytes); returns (y, dropped copies)."""
    expert_input, _, handle = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weight_TK)
    return dispatcher.combine(expert_input, handle), handle.dropped_copies


def _timed(step: Callable[..., Any], *inputs: Any) -> float:
    """Seconds of ``step(*inputs)`` on the slowest rank (every rank starts together)."""
    dist.barrier()
    start = time.perf_counter()
    step(*inputs)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    """The rows of one world size (each rank returns the same)."""
    counter = _ByteCounter()
    # The backends call it through the module: (output, input, ...).
    dist.all_to_all_single = counter.all_to_all_single(dist.all_to_all_single)
    group = dist.group.WORLD
    shared_memory = make_row_transport("symmetric_memory", group)
    shared_memory.exchange_blocks = counter.exchange_blocks(shared_memory)
    rowwise = {
        "num_experts": args.experts,
        "capacity_factor": args.capacity_factor,
        "group": group,
        "max_tokens_per_rank": args.tokens,
    }
    dispatchers = {
        "local": make_dispatcher("local", num_experts=args.experts),
        "all_to_all": make_dispatcher("all_to_all", num_experts=args.experts, group=group),
        "all_to_all_dedup": make_dispatcher(
            "all_to_all_dedup", num_experts=args.experts, group=group
        ),
        "rowwise/a2a": make_dispatcher("rowwise", **rowwise),
        "rowwise/shm": make_dispatcher("rowwise", **rowwise, row_transport=shared_memory),
    }
    generator = torch.Generator().manual_seed(1000 + rank)
    scores_TE = torch.rand(args.tokens, args.experts, generator=generator)
    topk_idx_TK = scores_TE.topk(args.top_k, dim=1).indices
    topk_weight_TK = torch.softmax(torch.randn(args.tokens, args.top_k, generator=generator), 1)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x_TD = torch.randn(args.tokens, args.dim, generator=generator).to(dtype)
        weight_TK = topk_weight_TK.to(dtype)
        measures = {
            name: partial(
                _timed, _dispatch_combine, dispatchers[name], x_TD, topk_idx_TK, weight_TK
            )
            for name in BACKENDS
        }
        seconds_per_step = interleaved_medians(measures, args.warmup, args.iters)
        for name in BACKENDS:
            counter.bytes, counter.enabled = 0, True
            with torch.no_grad():
                _, dropped = _dispatch_combine_forward(
                    dispatchers[name], x_TD, topk_idx_TK, weight_TK
                )
            counter.enabled = False
            stats = torch.tensor([counter.bytes, int(dropped)], dtype=torch.float64)
            dist.all_reduce(stats)
            num_copies = args.tokens * args.top_k * world_size
            seconds = seconds_per_step[name]
            rows.append(
                {
                    "backend": name,
                    "ep": world_size,
                    "dtype": dtype_name,
                    "seconds_per_step": seconds,
                    "tokens_per_s": args.tokens * world_size / seconds,
                    "bytes_per_copy": float(stats[0]) / num_copies,
                    "min_bytes_per_copy": 2 * args.dim * x_TD.element_size(),
                    "dropped_frac": float(stats[1]) / num_copies,
                }
            )
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for world_size in args.world_sizes:
        rows += run_distributed(_bench_rank, world_size, args=(args,), timeout=1800.0)[0]
    local_tokens_per_s = {
        (row["ep"], row["dtype"]): row["tokens_per_s"] for row in rows if row["backend"] == "local"
    }
    for row in rows:
        row["vs_local"] = row["tokens_per_s"] / local_tokens_per_s[(row["ep"], row["dtype"])]
        row["bytes_vs_min"] = row["bytes_per_copy"] / row["min_bytes_per_copy"]
    return rows


TABLE = ("backend", "ep", "dtype", "ms/step", "tokens/s", "vs local")
TABLE += ("B/copy", "min B", "x min", "dropped")


def table_row(row: dict) -> list:
    return [
        row["backend"],
        row["ep"],
        row["dtype"],
        f"{row['seconds_per_step'] * 1e3:.1f}",
        f"{row['tokens_per_s']:.0f}",
        f"{row['vs_local']:.2f}",
        f"{row['bytes_per_copy']:.0f}",
        row["min_bytes_per_copy"],
        f"{row['bytes_vs_min']:.2f}",
        f"{row['dropped_frac']:.3f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (T)")
    parser.add_argument("--dim", type=int, default=512, help="model width (D)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts (E)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="for rowwise")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench_results/dispatch.json"))
    args = parser.parse_args()
    rows = run(args)
    print_table(TABLE, map(table_row, rows))
    config = {key: value for key, value in vars(args).items() if key != "out"}
    write_json(args.out, {"config": config, "results": rows})


if __name__ == "__main__":
    main()
