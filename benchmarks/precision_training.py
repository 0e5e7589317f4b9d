"""MXFP8 expert GEMMs against bf16: final loss and throughput of the tiny config.

Trains configs/tiny.yaml twice with the same seed, in bf16 and with precision.expert_gemm: mxfp8,
and compares the loss at the last step (mean over the last --loss-window steps; target: within
1.5% of bf16) and the tokens/s (median over the steps after --warmup). Off SM100 GPUs the MXFP8
run uses moe-kernels' exact emulation, so its throughput shows the cost of the emulation, not
MXFP8 hardware's speed-up. The runs go one after the other: on a shared machine compare the
tokens/s ratio with care.

    uv run python benchmarks/mxfp8_training.py [--steps 300] [--threads 1]
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
TARGET_GAP = 0.015


def run_one(
    config_path: Path, mxfp8: bool, args: argparse.Namespace, peak: float, root: Path
) -> dict:
    name = "mxfp8" if mxfp8 else "bf16"
    config = load_config(
        config_path,
        [
            "--precision.compute_dtype=bfloat16",
            f"--precision.expert_gemm={'mxfp8' if mxfp8 else 'torch'}",
            f"--train.max_steps={args.steps}",
            f"--train.seed={args.seed}",
            "--train.progress=false",
            f"--train.peak_flops={peak}",
            f"--train.run_dir={root / name}",
        ],
    )
    start = time.perf_counter()
    result = train(config)
    wall_s = time.perf_counter() - start
    records = read_metrics(result.run_dir / "metrics.jsonl")
    timed = records[args.warmup :]
    return {
        "run": name,
        "mxfp8": mxfp8,
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
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--loss-window", type=int, default=10, help="final loss: mean of the last this many steps"
    )
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's, as training)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/mxfp8_training.json"))
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    peak = measure_matmul_peak(torch.bfloat16, torch.device("cpu"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mxfp8 in (False, True):
            rows.append(run_one(args.config, mxfp8, args, peak, Path(tmp)))
            row = rows[-1]
            print(
                f"{row['run']:>6}: loss {row['final_loss']:.4f}  "
                f"{row['tokens_per_s']:,.0f} tok/s  ({row['wall_s']:.0f} s)",
                flush=True,
            )

    bf16, mxfp8 = rows
    gap = (mxfp8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
    throughput_ratio = mxfp8["tokens_per_s"] / bf16["tokens_per_s"]
    print()
    print(
        f"{args.config.name}, {args.steps} steps, seed {args.seed}, threads "
        f"{torch.get_num_threads()}; loss = mean of the last {args.loss_window} steps"
    )
    header = (
        f"{'run':>6} {'loss':>8} {'gap vs bf16':>12} {'tokens/s':>10} {'vs bf16':>8} {'MFU':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        row_gap = (row["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
        ratio = row["tokens_per_s"] / bf16["tokens_per_s"]
        print(
            f"{row['run']:>6} {row['final_loss']:>8.4f} {100 * row_gap:>+11.2f}% "
            f"{row['tokens_per_s']:>10,.0f} {ratio:>7.2f}x {100 * row['mfu']:>5.1f}%"
        )
    within = abs(gap) <= TARGET_GAP
    print(
        f"\nMXFP8 final loss {100 * gap:+.2f}% from bf16: "
        f"{'within' if within else 'OUTSIDE'} the {100 * TARGET_GAP:.1f}% target"
    )
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
                "relative_loss_gap": gap,
                "target_gap": TARGET_GAP,
                "within_target": within,
                "tokens_per_s_ratio": throughput_ratio,
                "runs": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
