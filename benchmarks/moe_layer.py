"""MoE layer forward + backward on CPU against a dense SwiGLU doing the same FLOPs, and the cost
of growing the expert pool at a fixed active size.

The MoE layer is moe-train's own ``MoEFeedForward`` (router, local dispatcher, grouped-GEMM
SwiGLU experts, combine), built as the trainer builds it (``local_dispatcher``, the
config's ``group_alignment``), with fp32 parameters and bf16 compute under autocast like the
trainer (or fp32 throughout). Its limit is a dense SwiGLU of hidden ``top_k * expert_hidden``:
the same matmul FLOPs per token. Variants run interleaved in one loop and only ratios are
reported (the machines are shared and noisy). glibc's heap is set to keep freed memory, as the
trainer does, so allocation costs match training.

Two tables:
- layer: time of the MoE layer over the dense layer (target <= 1.15 at E=8 top-2), with a
  breakdown of the MoE time into router, permute (dispatch), grouped GEMMs (experts) and
  unpermute (combine), each timed alone forward + backward.
- scaling: top-4, fixed expert hidden, E in 8..128: tokens/s relative to E=8 (target at E=64:
  >= 0.95), beside the bound set by the one pass over the expert weight gradients that grows
  with E (the GEMMs write them in bf16; the fp32 parameters need them in fp32).

    uv run python benchmarks/moe_layer.py [--out bench_results/moe_layer.json]

On a machine shared with other jobs, wall times of multi-threaded runs swing with the load;
``--threads 1 --clock cpu`` (this process's CPU time) gives ratios that hold still.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from harness.output import print_table, write_json
from harness.timing import interleaved_medians
from moe_plan.config import ModelConfig, MoEConfig
from moe_train.model import local_dispatcher
from moe_train.model.moe import MoEFeedForward, SwiGLU
from moe_train.train.host_memory import keep_freed_host_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""wall: elapsed time. cpu: this process's CPU time, which on a shared machine leaves out the
time other processes held the cores (meaningful with --threads 1; with more threads it also
counts threads spinning at barriers)."""


def _init_normal(module: nn.Module, seed: int, std: float = 0.02) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def build_moe(d_model: int, num_experts: int, top_k: int, expert_hidden: int) -> MoEFeedForward:
    """moe-train's MoE block as the trainer builds it (local dispatch, default alignment)."""
    config = ModelConfig(
        d_model=d_model,
        moe=MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=expert_hidden),
    )
    config.validate("model")
    dispatcher = local_dispatcher(config.moe)
    moe = MoEFeedForward(config.d_model, config.moe, dispatcher)
    _init_normal(moe, seed=num_experts * 100 + top_k)
    return moe.train()


def _autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def _fwd_bwd_seconds(
    step: Callable[[], Tensor], grad_out: Tensor, dtype: torch.dtype, clock: Callable[[], float]
) -> float:
    start = clock()
    with _autocast(dtype):
        out = step()
    out.backward(grad_out)
    return clock() - start


def _clear_grads(*modules: nn.Module) -> None:
    for module in modules:
        for parameter in module.parameters():
            parameter.grad = None


def _moe_stage_steps(
    moe: MoEFeedForward, x_TD: Tensor, dtype: torch.dtype
) -> Iterator[tuple[str, Callable[[], Tensor], Tensor]]:
    """(stage, forward of that stage alone on detached inputs, gradient of its output)."""
    with _autocast(dtype), torch.no_grad():
        routed = moe.router(x_TD)
        expert_input, rows_per_expert, handle = moe.dispatcher.dispatch(
            x_TD, routed.topk_idx_TK, routed.topk_weight_TK
        )
        expert_output = moe.experts(expert_input, rows_per_expert)
    generator = torch.Generator().manual_seed(1)

    def randn_like(t: Tensor) -> Tensor:
        return torch.randn(t.shape, generator=generator).to(t.dtype)

    x_leaf = x_TD.detach().requires_grad_()
    expert_input_leaf = expert_input.detach().requires_grad_()
    expert_output_leaf = expert_output.detach().requires_grad_()
    weight_leaf = routed.topk_weight_TK.detach().requires_grad_()
    state = handle.state

    def clear_leaf_grads() -> None:
        # Each stage starts from fresh leaves, so no stage pays for accumulating into a grad.
        for leaf in (x_leaf, expert_input_leaf, expert_output_leaf, weight_leaf):
            leaf.grad = None

    def router() -> Tensor:
        clear_leaf_grads()
        out = moe.router(x_leaf)
        # One scalar that reaches every differentiable router output.
        return (out.topk_weight_TK * 0.5).sum() + out.lb_loss + out.z_loss

    def permute() -> Tensor:
        clear_leaf_grads()
        return moe.dispatcher.dispatch(x_leaf, routed.topk_idx_TK, routed.topk_weight_TK)[0]

    def experts() -> Tensor:
        clear_leaf_grads()
        return moe.experts(expert_input_leaf, rows_per_expert)

    def unpermute() -> Tensor:
        clear_leaf_grads()
        leaf_state = type(state)(permutation=state.permutation, topk_weight_TK=weight_leaf)
        handle_with_leaf = dataclasses.replace(handle, state=leaf_state)
        return moe.dispatcher.combine(expert_output_leaf, handle_with_leaf)

    yield "router", router, torch.ones(())
    yield "permute", permute, randn_like(expert_input)
    yield "grouped GEMMs", experts, randn_like(expert_output)
    yield "unpermute", unpermute, randn_like(x_TD).to(expert_output.dtype)


def run_layer(args: argparse.Namespace) -> list[dict]:
    """MoE (E=args.experts, top_k) over dense SwiGLU with the same FLOPs, per dtype."""
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        moe = build_moe(args.d_model, args.experts, args.top_k, args.expert_hidden)
        dense = SwiGLU(args.d_model, args.top_k * args.expert_hidden)
        _init_normal(dense, seed=7)
        generator = torch.Generator().manual_seed(0)
        x_TD = torch.randn(args.tokens, args.d_model, generator=generator)
        grad_TD = torch.randn(args.tokens, args.d_model, generator=generator)
        x_leaf = x_TD.clone().requires_grad_()
        variants: dict[str, Callable[[], Tensor]] = {
            "moe": lambda moe=moe, x_leaf=x_leaf: moe(x_leaf),
            "dense": lambda dense=dense, x_leaf=x_leaf: dense(x_leaf),
        }
        stages = list(_moe_stage_steps(moe, x_TD, dtype))
        steps = [(name, step, grad_TD) for name, step in variants.items()] + stages

        def measure(step, grad, moe=moe, dense=dense, x_leaf=x_leaf, dtype=dtype) -> float:
            seconds = _fwd_bwd_seconds(step, grad, dtype, CLOCKS[args.clock])
            _clear_grads(moe, dense)
            x_leaf.grad = None
            return seconds

        measures = {name: partial(measure, step, grad) for name, step, grad in steps}
        seconds = interleaved_medians(measures, args.warmup, args.reps)
        ms = {name: 1e3 * value for name, value in seconds.items()}
        dense_ms = ms["dense"]
        row = {
            "dtype": dtype_name,
            "tokens": args.tokens,
            "d_model": args.d_model,
            "experts": args.experts,
            "top_k": args.top_k,
            "expert_hidden": args.expert_hidden,
            "group_alignment": moe.config.group_alignment,
            "threads": torch.get_num_threads(),
            "clock": args.clock,
            "dense_ms": dense_ms,
            "moe_ms": ms["moe"],
            "moe_over_dense": ms["moe"] / dense_ms,
            "stages_ms": {name: ms[name] for name, _, _ in stages},
        }
        row["stages_over_dense"] = {name: ms / dense_ms for name, ms in row["stages_ms"].items()}
        rows.append(row)
    return rows


def _weight_grad_cast_seconds(
    moe: MoEFeedForward, dtype: torch.dtype, clock: Callable[[], float]
) -> float:
    """Time of one pass that turns compute-dtype expert weight gradients into fp32.

    Every backward pays it (the GEMMs write gradients in the compute dtype; the parameters
    are fp32) and it grows with the expert count at a fixed active size, so it bounds how
    close a larger expert pool can come to the smaller one's throughput.
    """
    if dtype == torch.float32:
        return 0.0
    grads = [torch.ones(p.shape, dtype=dtype) for p in moe.experts.parameters()]
    start = clock()
    for grad in grads:
        grad.float()
    return clock() - start


def _router_gemm_step(moe: MoEFeedForward, x_TD: Tensor) -> tuple[Callable[[], Tensor], Tensor]:
    """The router's own GEMM alone (fp32 logits, as the router computes them), and a gradient
    of its [T, E] output."""
    x_leaf = x_TD.detach().float().requires_grad_()
    weight = moe.router.gate.weight

    def gemm() -> Tensor:
        x_leaf.grad = None
        with torch.autocast(x_TD.device.type, enabled=False):
            return torch.nn.functional.linear(x_leaf, weight.float())

    grad = torch.randn(x_TD.shape[0], weight.shape[0], generator=torch.Generator().manual_seed(2))
    return gemm, grad


def run_scaling(args: argparse.Namespace) -> list[dict]:
    """Tokens/s of the MoE layer at each expert count relative to the first, interleaved, and
    where the time goes.

    Each expert count also times, alone, each stage of the layer (as the layer table does),
    the router's own GEMM (FLOPs that grow with E) and the weight-gradient cast pass. The
    grouped GEMMs do the same FLOPs at every E, in more and smaller groups. The time outside
    the two GEMMs is in two parts: the router's work on the [T, E] scores (softmax, top-k
    selection, balancing losses: it reads every token's E scores, as the GEMM writes them)
    and the permutation and combine (O(tokens x top-k), plus the zero rows that pad each
    expert's group to model.moe.group_alignment).
    """
    dtype = DTYPES[args.scaling_dtype]
    clock = CLOCKS[args.clock]
    generator = torch.Generator().manual_seed(0)
    x_TD = torch.randn(args.tokens, args.d_model, generator=generator)
    grad_TD = torch.randn(args.tokens, args.d_model, generator=generator)
    x_leaf = x_TD.clone().requires_grad_()
    layers = {
        experts: build_moe(args.d_model, experts, args.scaling_top_k, args.scaling_expert_hidden)
        for experts in args.scaling_experts
    }

    def seconds(moe: MoEFeedForward, step: Callable[[], Tensor], grad: Tensor, dt) -> float:
        # Every part starts without parameter gradients, as the layer does in training.
        _clear_grads(moe)
        x_leaf.grad = None
        return _fwd_bwd_seconds(step, grad, dt, clock)

    measures: dict[tuple[int, str], Callable[[], float]] = {}
    for experts, moe in layers.items():
        measures[experts, "layer"] = partial(seconds, moe, partial(moe, x_leaf), grad_TD, dtype)
        for name, step, grad in _moe_stage_steps(moe, x_TD, dtype):
            measures[experts, name] = partial(seconds, moe, step, grad, dtype)
        gemm, gemm_grad = _router_gemm_step(moe, x_TD)
        measures[experts, "router GEMM"] = partial(seconds, moe, gemm, gemm_grad, torch.float32)
        measures[experts, "cast"] = partial(_weight_grad_cast_seconds, moe, dtype, clock)
    by_part = interleaved_medians(measures, args.warmup, args.reps)
    medians = {
        experts: {part: value for (e, part), value in by_part.items() if e == experts}
        for experts in layers
    }
    for median in medians.values():
        median["scores"] = median["router"] - median["router GEMM"]
        median["permutation"] = median["permute"] + median["unpermute"]
        median["outside"] = median["scores"] + median["permutation"]
    first = medians[args.scaling_experts[0]]
    return [_scaling_row(args, experts, median, first) for experts, median in medians.items()]


def _scaling_row(
    args: argparse.Namespace, experts: int, median: dict[str, float], first: dict[str, float]
) -> dict:
    """One expert count's row of the scaling table (times in ms, ratios to the first E)."""
    return {
        "dtype": args.scaling_dtype,
        "tokens": args.tokens,
        "d_model": args.d_model,
        "experts": experts,
        "top_k": args.scaling_top_k,
        "expert_hidden": args.scaling_expert_hidden,
        "ms": median["layer"] * 1e3,
        "tokens_per_s": args.tokens / median["layer"],
        "throughput_vs_first": first["layer"] / median["layer"],
        "grouped_gemms_ms": median["grouped GEMMs"] * 1e3,
        "grouped_gemms_vs_first": first["grouped GEMMs"] / median["grouped GEMMs"],
        "weight_grad_cast_ms": median["cast"] * 1e3,
        "throughput_vs_first_bound": first["layer"]
        / (first["layer"] + median["cast"] - first["cast"]),
        "router_gemm_ms": median["router GEMM"] * 1e3,
        "router_scores_ms": median["scores"] * 1e3,
        "permutation_ms": median["permutation"] * 1e3,
        "outside_gemms_ms": median["outside"] * 1e3,
        "outside_gemms_vs_first": median["outside"] / first["outside"],
        "permutation_vs_first": median["permutation"] / first["permutation"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-hidden", type=int, default=1024)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=DTYPES)
    parser.add_argument("--scaling-experts", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--scaling-top-k", type=int, default=4)
    parser.add_argument("--scaling-expert-hidden", type=int, default=512)
    parser.add_argument("--scaling-dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--no-scaling", action="store_true", help="skip the expert-scaling table")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's, as training)"
    )
    parser.add_argument(
        "--clock", default="wall", choices=CLOCKS, help="wall time, or process CPU time (cpu)"
    )
    parser.add_argument("--out", default="bench_results/moe_layer.json")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    heap_kept = keep_freed_host_memory()
    layer_rows = run_layer(args)
    print(
        f"MoE layer fwd+bwd over dense SwiGLU with the same FLOPs (CPU, {args.tokens} tokens, "
        f"d_model {args.d_model}, threads {torch.get_num_threads()}, {args.clock} clock, "
        f"heap kept {heap_kept})"
    )
    stage_names = list(layer_rows[0]["stages_ms"])
    print_table(
        ["dtype", "E", "k", "H", "dense ms", "moe ms", "moe/dense", *stage_names],
        (
            [
                row["dtype"],
                row["experts"],
                row["top_k"],
                row["expert_hidden"],
                f"{row['dense_ms']:.1f}",
                f"{row['moe_ms']:.1f}",
                f"{row['moe_over_dense']:.3f}",
                *(f"{row['stages_over_dense'][name]:.3f}" for name in stage_names),
            ]
            for row in layer_rows
        ),
    )
    print("(stage columns: that stage alone, fwd+bwd, as a fraction of the dense time)")

    scaling_rows = [] if args.no_scaling else run_scaling(args)
    if scaling_rows:
        print(
            f"\nexpert scaling ({args.scaling_dtype}, top-{args.scaling_top_k}, expert hidden "
            f"{args.scaling_expert_hidden}): throughput relative to E={args.scaling_experts[0]}"
        )
        print_table(
            [
                "E",
                "ms",
                "tokens/s",
                "relative",
                "GEMMs ms",
                "GEMMs rel",
                "cast ms",
                "bound",
                "router GEMM ms",
                "scores ms",
                "permute+combine ms",
                "outside ms",
                "outside rel",
                "permute+combine rel",
            ],
            (
                [
                    row["experts"],
                    f"{row['ms']:.1f}",
                    f"{row['tokens_per_s']:.0f}",
                    f"{row['throughput_vs_first']:.3f}",
                    f"{row['grouped_gemms_ms']:.1f}",
                    f"{row['grouped_gemms_vs_first']:.3f}",
                    f"{row['weight_grad_cast_ms']:.1f}",
                    f"{row['throughput_vs_first_bound']:.3f}",
                    f"{row['router_gemm_ms']:.1f}",
                    f"{row['router_scores_ms']:.1f}",
                    f"{row['permutation_ms']:.1f}",
                    f"{row['outside_gemms_ms']:.1f}",
                    f"{row['outside_gemms_vs_first']:.3f}",
                    f"{row['permutation_vs_first']:.3f}",
                ]
                for row in scaling_rows
            ),
        )
        print(
            "(GEMMs: the experts' grouped GEMMs and SwiGLU alone, fwd+bwd, and their speed "
            "relative to the first E; cast: one compute-dtype -> fp32 pass over the expert "
            "weight gradients, timed alone; bound: the relative throughput if that pass were "
            "the only cost growing with E; scores: the router's work on its [T, E] scores "
            "(softmax, top-k, losses) less its GEMM; permute+combine: the dispatch's "
            "permutation and the combine; outside: their sum, each stage timed alone, and "
            "relative to the first E (goal at the last E: <= 1.1))"
        )

    print()
    document = {
        "heap_kept": heap_kept,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "layer": layer_rows,
        "scaling": scaling_rows,
    }
    write_json(Path(args.out), document)


if __name__ == "__main__":
    main()
