"""MoE layer on one GPU: proves forward+backward has no host sync, and times it.

The layer is what the trainer's MoE block runs without the router: tokens permuted into
expert order (the `local` dispatcher), SwiGLU experts as two grouped GEMMs, weighted combine.
For each grouped-GEMM path (torch, triton, emulated MXFP8) it runs forward+backward under
`torch.cuda.set_sync_debug_mode("error")` (any device-to-host sync raises) and reports the time
against a dense SwiGLU layer doing the same FLOPs, measured in the same run. Needs only
moe-kernels and moe-dispatch (the GPU machine has no pyyaml for moe-train).

    PYTHONPATH=packages/moe-kernels/src:packages/moe-dispatch/src python benchmarks/gpu_moe_layer.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.output import print_table, write_json
from harness.timing import device_timer, median_seconds
from moe_dispatch import make_dispatcher
from moe_kernels import grouped_mm, mxfp8_grouped_mm


def _moe_layer(x, topk_idx, topk_weight, w_gate_up, w_down, dispatcher, path):
    expert_input, tokens_per_expert, handle = dispatcher.dispatch(x, topk_idx, topk_weight)
    offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
    if path == "mxfp8":
        gate, up = mxfp8_grouped_mm(expert_input, w_gate_up, offsets).chunk(2, dim=-1)
        out = mxfp8_grouped_mm(F.silu(gate) * up, w_down, offsets)
    else:
        gate, up = grouped_mm(expert_input, w_gate_up, offsets, backend=path).chunk(2, dim=-1)
        out = grouped_mm(F.silu(gate) * up, w_down, offsets, backend=path)
    return dispatcher.combine(out, handle)


def _time_ms(fn, warmup: int, reps: int, device: torch.device) -> float:
    return 1e3 * median_seconds(fn, warmup, reps, device_timer(device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1408)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench_results/gpu_moe_layer.json"))
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on the CPU, torch path only, no sync check (to test this script)",
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        args.tokens, args.dim, args.hidden, args.experts, args.reps = 256, 64, 32, 8, 2
    dtype = torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    tokens, dim, hidden, experts, top_k = (
        args.tokens,
        args.dim,
        args.hidden,
        args.experts,
        args.top_k,
    )

    def param(*shape):
        scale = shape[-2] ** -0.5
        w = torch.randn(*shape, device=device, dtype=dtype, generator=generator) * scale
        return w.requires_grad_()

    x = torch.randn(tokens, dim, device=device, dtype=dtype, generator=generator)
    x.requires_grad_()
    scores = torch.rand(tokens, experts, device=device, generator=generator)
    topk_weight, topk_idx = scores.softmax(-1).topk(top_k, dim=-1)
    w_gate_up, w_down = param(experts, dim, 2 * hidden), param(experts, hidden, dim)
    dense_up, dense_down = param(dim, 2 * top_k * hidden), param(top_k * hidden, dim)
    grad_out = torch.randn(tokens, dim, device=device, dtype=dtype, generator=generator)
    dispatcher = make_dispatcher("local", num_experts=experts, group_alignment=128)

    def dense():
        gate, up = (x @ dense_up).chunk(2, dim=-1)
        ((F.silu(gate) * up) @ dense_down).backward(grad_out)

    rows = []
    dense_ms = _time_ms(dense, 3, args.reps, device)
    for path in ("torch", "mxfp8") if args.cpu_smoke else ("torch", "triton", "mxfp8"):

        def step(path=path):
            y = _moe_layer(x, topk_idx, topk_weight, w_gate_up, w_down, dispatcher, path)
            y.backward(grad_out)

        row = {"path": path}
        try:
            step()  # compile / autotune outside the sync check
            row["host_sync"] = "n/a (cpu)"
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                    row["host_sync"] = "none"
                except RuntimeError as e:
                    row["host_sync"] = f"SYNC: {str(e).splitlines()[0][:80]}"
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            row["ms"] = _time_ms(step, 2, args.reps, device)
            row["over_dense"] = row["ms"] / dense_ms
        except Exception as e:  # report every path, even when one fails
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        rows.append(row)

    print(f"MoE layer fwd+bwd, bf16, T={tokens} D={dim} H={hidden} E={experts} top-{top_k}")
    print(f"dense SwiGLU of the same FLOPs: {dense_ms:.2f} ms")
    print_table(
        ("path", "host sync", "ms", "x dense"),
        (
            [row["path"], "ERROR", "-", "-"]
            if "error" in row
            else [row["path"], row["host_sync"], f"{row['ms']:.2f}", f"{row['over_dense']:.2f}"]
            for row in rows
        ),
    )
    for row in rows:
        if "error" in row:
            print(f"{row['path']}: {row['error']}")
    document = {"args": vars(args) | {"out": str(args.out)}, "dense_ms": dense_ms, "rows": rows}
    write_json(args.out, document)
    ok = all(row.get("host_sync") in ("none", "n/a (cpu)") for row in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
