"""Number formats against the bf16 baseline: final loss and throughput of the tiny config.

Trains configs/tiny.yaml with the same seed in bf16 compute on fp32 parameters (the baseline)
and in each variant (`VARIANTS`: MXFP8 expert GEMMs, bf16 parameters with FP32 masters), and
compares the loss at the last step (mean over the last --loss-window steps; targets in
`TARGET_GAPS`) and the tokens/s (median over the steps after --warmup). Off SM100 GPUs the
MXFP8 run uses moe-kernels' exact emulation, so its throughput shows the cost of the
emulation, not MXFP8 hardware's speed-up. The runs go one after the other: on a shared
machine compare the tokens/s ratios with care.

    uv run python benchmarks/precision_training.py [--variants mxfp8 bf16-params]
        [--steps 300] [--threads 1]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe_train.config import load_config
from moe_train.train import measure_matmul_peak, read_metrics, train

CONFIGS = Path(__file__).parents[1] / "configs"
VARIANTS: dict[str, tuple[str, ...]] = {
    "bf16": ("--precision.param_dtype=float32",),
    "mxfp8": ("--precision.param_dtype=float32", "--precision.expert_gemm=mxfp8"),
    "bf16-params": ("--precision.param_dtype=bfloat16",),
}
"""Runs, all with bf16 compute: the baseline (fp32 parameters), MXFP8 expert GEMMs, and bf16
parameters with FP32 masters."""
TARGET_GAPS = {"mxfp8": 0.015, "bf16-params": 0.01}
"""Largest relative gap of each variant's final loss from the baseline's."""


def run_one(
    config_path: Path, name: str, args: argparse.Namespace, peak: float, root: Path
) -> dict:
    config = load_config(
        config_path,
        [
            "--precision.compute_dtype=bfloat16",
            *VARIANTS[name],
            f"--train.max_steps={args.steps}",
            f"--train.seed={args.seed}",
            "--train.progress=false",
            f"--train.peak_flops={peak}",
            f"--train.run_dir={root / name}",
            "--checkpoint.interval=0",
            "--checkpoint.interval_minutes=0",
        ],
    )
    start = time.perf_counter()
    result = train(config)
    wall_s = time.perf_counter() - start
    records = read_metrics(result.run_dir / "metrics.jsonl")
    timed = records[args.warmup :]
    return {
        "run": name,
        "steps": len(result.losses),
        "final_loss": statistics.fmean(result.losses[-args.loss_window :]),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "wall_s": wall_s,
        "losses": result.losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIGS / "tiny.yaml")
    parser.add_argument(
        "--variants", nargs="+", choices=list(TARGET_GAPS), default=list(TARGET_GAPS)
    )
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--loss-window", type=int, default=10, help="final loss: mean of the last this many steps"
    )
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's, as training)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/precision_training.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    peak = measure_matmul_peak(torch.bfloat16, torch.device("cpu"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("bf16", *args.variants):
            rows.append(run_one(args.config, name, args, peak, Path(tmp)))
            row = rows[-1]
            print(
                f"{row['run']:>11}: loss {row['final_loss']:.4f}  "
                f"{row['tokens_per_s']:,.0f} tok/s  ({row['wall_s']:.0f} s)",
                flush=True,
            )
    baseline = rows[0]
    for row in rows:
        row["relative_loss_gap"] = (row["final_loss"] - baseline["final_loss"]) / baseline[
            "final_loss"
        ]
        row["tokens_per_s_ratio"] = row["tokens_per_s"] / baseline["tokens_per_s"]
        if row["run"] in TARGET_GAPS:
            row["target_gap"] = TARGET_GAPS[row["run"]]
            row["within_target"] = abs(row["relative_loss_gap"]) <= row["target_gap"]
    print_table(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": str(args.config),
                "steps": args.steps,
                "seed": args.seed,
                "threads": torch.get_num_threads(),
                "loss_window": args.loss_window,
                "peak_flops": peak,
                "runs": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n{args.config.name}, {args.steps} steps, seed {args.seed}, threads "
        f"{torch.get_num_threads()}; loss = mean of the last {args.loss_window} steps"
    )
    header = (
        f"{'run':>11} {'loss':>8} {'gap vs bf16':>12} {'target':>8} {'tokens/s':>10} "
        f"{'vs bf16':>8} {'MFU':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        target = ""
        if "target_gap" in row:
            verdict = "ok" if row["within_target"] else "OUT"
            target = f"{100 * row['target_gap']:.1f}% {verdict}"
        print(
            f"{row['run']:>11} {row['final_loss']:>8.4f} {100 * row['relative_loss_gap']:>+11.2f}% "
            f"{target:>8} {row['tokens_per_s']:>10,.0f} {row['tokens_per_s_ratio']:>7.2f}x "
            f"{100 * row['mfu']:>5.1f}%"
        )


if __name__ == "__main__":
    main()
