"""Rowwise dispatch on one GPU (world size 1): proof of no host sync, latency vs all_to_all.

Runs in a one-rank NCCL group. The rowwise dispatcher is timed over its padded all-to-all
transport and over symmetric memory; all_to_all is the reference. Every forward + backward
of the rowwise backends runs under torch.cuda.set_sync_debug_mode("error"), which raises on
any device-to-host synchronisation. The symmetric-memory run's output and input gradient
must equal the padded all-to-all's bitwise (same algorithm, other transport). Exits 1 if any
backend failed. ``--device cpu`` runs the same script on gloo (no sync check): a dry run.

    PYTHONPATH=packages/moe-kernels/src:packages/moe-dispatch/src python benchmarks/gpu_dispatch.py
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.output import print_table, write_json
from moe_dispatch import AllToAllDispatcher, RowwiseDispatcher


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_backend(name, dispatcher, x, topk_idx, weight, steps, sync_free):
    def step():
        expert_input, _, handle = dispatcher.dispatch(x, topk_idx, weight)
        out = dispatcher.combine(expert_input * 1.0, handle)
        out.sum().backward()
        return out.detach()

    if isinstance(dispatcher, RowwiseDispatcher):
        dispatcher.transport.connect(x.device)  # a clear error if the memory path is broken
    x.grad = None
    result = (step(), x.grad.clone())
    synchronize(x.device)
    error = None
    sync_free = sync_free and x.device.type == "cuda"
    if sync_free:
        torch.cuda.set_sync_debug_mode("error")
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(x.device)
        elapsed = (time.perf_counter() - start) / steps
    except RuntimeError as e:
        elapsed, error = float("nan"), str(e).splitlines()[0]
    finally:
        if sync_free:
            torch.cuda.set_sync_debug_mode("default")
    row = {"backend": name, "ms": elapsed * 1e3, "sync_free_checked": sync_free, "error": error}
    return row, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=Path("bench_results/gpu_dispatch.json"))
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    group = dist.new_group([0])
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(args.tokens, args.experts, device=device, generator=generator)
    topk_idx = scores.topk(args.top_k, dim=1).indices
    weight = torch.rand(args.tokens, args.top_k, device=device, requires_grad=True)

    backends = [
        ("all_to_all", AllToAllDispatcher(args.experts, group), False),
        (
            "rowwise/all_to_all",
            RowwiseDispatcher(args.experts, group, 1.25, transport="all_to_all"),
            True,
        ),
        (
            "rowwise/symmetric_memory",
            RowwiseDispatcher(args.experts, group, 1.25, transport="symmetric_memory"),
            True,
        ),
    ]
    rows, results = [], {}
    for name, dispatcher, sync_free in backends:
        try:
            row, results[name] = run_backend(
                name, dispatcher, x, topk_idx, weight, args.steps, sync_free
            )
            rows.append(row)
        except Exception as e:  # report and go on: one table for the whole check
            rows.append(
                {
                    "backend": name,
                    "ms": float("nan"),
                    "sync_free_checked": sync_free,
                    "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                }
            )
    if "rowwise/all_to_all" in results and "rowwise/symmetric_memory" in results:
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                results["rowwise/all_to_all"], results["rowwise/symmetric_memory"], strict=True
            )
        )
        for row in rows:
            if row["backend"] == "rowwise/symmetric_memory" and not same and not row["error"]:
                row["error"] = "output or gradient differs from rowwise/all_to_all"
    reference = rows[0]["ms"]
    print_table(
        ("backend", "ms/step", "vs a2a", "sync-free", "error"),
        (
            [
                row["backend"],
                f"{row['ms']:.3f}",
                f"{row['ms'] / reference:.2f}",
                "checked" if row["sync_free_checked"] else "-",
                row["error"] or "",
            ]
            for row in rows
        ),
        left=["error"],
    )
    write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "rows": rows})
    dist.destroy_process_group()
    if any(row["error"] for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
