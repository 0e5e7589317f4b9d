"""Number formats against the bf16 baseline: final loss and throughput of the tiny config.

Trains configs/tiny.yaml in bf16 compute on fp32 parameters (the baseline) and in each
variant (`VARIANTS`: MXFP8 or rowwise FP8 expert GEMMs, rowwise FP8 expert GEMMs and linears,
bf16 parameters with FP32 masters), once per seed,
and compares the loss at the last step (mean over the last --loss-window steps) and the
tokens/s (median over the steps after --warmup). Runs of one seed see the same batches and
start from the same weights, yet their trajectories part: one seed's gap moves by more than
a percent either way from seed to seed, so the target (`TARGET_GAPS`) is judged on the mean
gap over the seeds, and the table shows each seed's gap beside it. The rows fp32 and
bf16-init, without a target, show how large such gaps are when nothing is quantized: a
variant's mean gap means something only where it stands out of theirs; one seed's gap
spreads by about 2% (sample deviation), so the default is eight seeds. Off SM100 GPUs the
MXFP8 run (off SM90 GPUs the rowwise FP8 runs) uses the exact emulation, so its throughput
shows the cost of the emulation, not FP8 hardware's speed-up. Each run trains in a process
of its own, --jobs at once (the losses do not depend on it; the tokens/s of runs that share
a machine do, so compare their ratios with care).

    uv run python benchmarks/precision_training.py [--variants mxfp8 bf16-params fp8-rowwise
        fp8-rowwise-linears fp8-dispatch fp32 bf16-init]
        [--steps 300] [--seeds 0 1 2 3 4 5 6 7] [--jobs 2] [--threads 1]
"""

import argparse
import statistics
from pathlib import Path

import torch

from harness.output import print_table, write_json
from harness.seeds import (
    add_seed_arguments,
    gap_cells,
    median_ratio,
    run_seeds,
    runs_peak_flops,
    seed_comparison,
    train_seeded,
)

CONFIGS = Path(__file__).parents[1] / "configs"
VARIANTS: dict[str, tuple[str, ...]] = {
    "bf16": ("--precision.param_dtype=float32",),
    "fp32": ("--precision.param_dtype=float32", "--precision.compute_dtype=float32"),
    "bf16-init": ("--precision.param_dtype=float32", "--model.init_std=0.02002"),
    "mxfp8": ("--precision.param_dtype=float32", "--precision.expert_gemm=mxfp8"),
    "bf16-params": ("--precision.param_dtype=bfloat16",),
    "fp8-rowwise": ("--precision.param_dtype=float32", "--precision.expert_gemm=fp8_rowwise"),
    "fp8-rowwise-linears": (
        "--precision.param_dtype=float32",
        "--precision.expert_gemm=fp8_rowwise",
        "--precision.linear=fp8_rowwise",
    ),
    "fp8-dispatch": ("--precision.param_dtype=float32", "--model.moe.dispatch_dtype=fp8"),
}
"""Runs: the baseline (bf16 compute on fp32 parameters); two references without a target,
fp32 compute (what the bf16 roundings cost) and the baseline with init_std 0.02002 (tiny's
0.02 plus 0.1%: how far a harmless perturbation moves the last loss); and in bf16 compute
MXFP8 expert GEMMs, bf16 parameters with FP32 masters, rowwise FP8 expert GEMMs, and rowwise
FP8 expert GEMMs and linear layers (attention, shared experts, dense layers), and the token
rows the experts receive rounded to FP8 as FP8 dispatch sends them (model.moe.dispatch_dtype;
one process rounds them exactly as an expert-parallel exchange would)."""
TARGET_GAPS = {
    "mxfp8": 0.015,
    "bf16-params": 0.01,
    "fp8-rowwise": 0.01,
    "fp8-rowwise-linears": 0.01,
    "fp8-dispatch": 0.01,
}
"""Largest relative gap of each variant's final loss from the baseline's."""


def run_one(name: str, seed: int, args: argparse.Namespace, peak: float, root: Path) -> dict:
    """Train one variant at one seed; its final loss and speed."""
    records, wall_s = train_seeded(args, VARIANTS[name], seed, root / f"{name}-{seed}", peak)
    losses = [r["loss"] for r in records]
    timed = records[args.warmup :]
    return {
        "run": name,
        "seed": seed,
        "steps": len(losses),
        "final_loss": statistics.fmean(losses[-args.loss_window :]),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "wall_s": wall_s,
        "losses": losses,
        "grad_norms": [r["grad_norm"] for r in records],
    }


def summarise(runs: list[dict], names: list[str]) -> list[dict]:
    """Per variant: the loss and speed over the seeds, and each seed's gap from the baseline
    of the same seed (relative, signed); the target is judged on the mean gap."""
    rows = []
    for name in names:
        row, pairs = seed_comparison(runs, name, "bf16")
        row["tokens_per_s"] = statistics.median(mine["tokens_per_s"] for mine, _ in pairs)
        row["tokens_per_s_ratio"] = median_ratio(pairs, "tokens_per_s")
        row["mfu"] = statistics.median(mine["mfu"] for mine, _ in pairs)
        if name in TARGET_GAPS:
            row["target_gap"] = TARGET_GAPS[name]
            row["within_target"] = abs(row["relative_loss_gap_mean"]) <= row["target_gap"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_arguments(parser, config=CONFIGS / "tiny.yaml", steps=300, seeds=range(8))
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[name for name in VARIANTS if name != "bf16"],
        default=list(TARGET_GAPS),
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/precision_training.json"))
    args = parser.parse_args()
    peak = runs_peak_flops(args)
    names = ["bf16", *args.variants]
    runs = run_seeds(
        names,
        args.seeds,
        lambda name, seed, root: run_one(name, seed, args, peak, root),
        lambda run: (
            f"{run['run']:>11} seed {run['seed']}: loss {run['final_loss']:.4f}  "
            f"{run['tokens_per_s']:,.0f} tok/s  ({run['wall_s']:.0f} s)"
        ),
        args.jobs,
    )
    rows = summarise(runs, names)
    print_summary(rows, args)
    document = {
        "config": str(args.config),
        "steps": args.steps,
        "seeds": args.seeds,
        "threads": torch.get_num_threads(),
        "jobs": args.jobs,
        "loss_window": args.loss_window,
        "peak_flops": peak,
        "variants": rows,
        "runs": runs,
    }
    write_json(args.out, document)


def print_summary(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{args.config.name}, {args.steps} steps, seeds {' '.join(map(str, args.seeds))}, "
        f"threads {torch.get_num_threads()}; loss = mean of the last {args.loss_window} steps, "
        "averaged over the seeds; gap = relative to bf16 at the same seed"
    )
    print_table(
        ("run", "loss", "mean gap", "target", "gap per seed", "tokens/s", "vs bf16", "MFU"),
        map(_table_row, rows),
    )


def _table_row(row: dict) -> list:
    target = ""
    if "target_gap" in row:
        verdict = "ok" if row["within_target"] else "OUT"
        target = f"{100 * row['target_gap']:.1f}% {verdict}"
    mean_gap, per_seed = gap_cells(row, "bf16")
    return [
        row["run"],
        f"{row['final_loss_mean']:.4f}",
        mean_gap,
        target,
        per_seed,
        f"{row['tokens_per_s']:,.0f}",
        f"{row['tokens_per_s_ratio']:.2f}x",
        f"{100 * row['mfu']:.1f}%",
    ]


if __name__ == "__main__":
    main()
