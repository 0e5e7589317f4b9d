"""Balancing scope and multi-token prediction against the default recipe: final loss of the
tiny config over several seeds.

Trains configs/tiny.yaml (bf16 compute) once per seed in the baseline (`lb_scope:
micro_batch`, no MTP) and each variant (`VARIANTS`), all at the same micro-batch size
(--micro-batch-size, small so that a micro-batch's balance differs from the global batch's),
and compares the LM loss at the end (mean over the last --loss-window steps; the MTP loss is
not in it), each seed's gap from the baseline of the same seed, the expert load (busiest
expert over the mean, worst layer, same window) and the tokens/s. Runs of one seed see the
same batches and start from the same main-model weights; judge a variant on the mean gap
over the seeds, beside the per-seed gaps.

    uv run python benchmarks/recipe_training.py [--variants global_batch mtp1]
        [--steps 200] [--seeds 0 1 2] [--micro-batch-size 2]
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.output import print_table, write_json
from harness.processes import benchmark_run_overrides
from moe_train.config import load_config
from moe_train.train import measure_matmul_peak, read_metrics, train

CONFIGS = Path(__file__).parents[1] / "configs"
BASELINE = "micro_batch"
VARIANTS: dict[str, tuple[str, ...]] = {
    BASELINE: ("--model.moe.lb_scope=micro_batch",),
    "global_batch": ("--model.moe.lb_scope=global_batch",),
    "sequence": ("--model.moe.lb_scope=sequence",),
    "mtp1": ("--model.mtp_depth=1", "--model.mtp_loss_weight=0.3"),
}
"""The baseline and the variants, each one change from it."""


def run_one(
    config_path: Path, name: str, seed: int, args: argparse.Namespace, peak: float, root: Path
) -> dict:
    """Train one variant at one seed; its final losses, load and speed."""
    config = load_config(
        config_path,
        [
            "--precision.compute_dtype=bfloat16",
            f"--data.micro_batch_size={args.micro_batch_size}",
            *VARIANTS[name],
            *benchmark_run_overrides(args.steps, root / f"{name}-{seed}", peak),
            f"--train.seed={seed}",
        ],
    )
    start = time.perf_counter()
    result = train(config)
    wall_s = time.perf_counter() - start
    records = read_metrics(result.run_dir / "metrics.jsonl")
    window = records[-args.loss_window :]
    return {
        "run": name,
        "seed": seed,
        "steps": len(result.losses),
        "final_loss": statistics.fmean(result.losses[-args.loss_window :]),
        "final_mtp_loss": (
            statistics.fmean(r["mtp_loss"] for r in window) if "mtp_loss" in window[0] else None
        ),
        "final_load_max_over_mean": statistics.fmean(
            r["expert_load_max_over_mean"] for r in window
        ),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[args.warmup :]),
        "wall_s": wall_s,
        "losses": result.losses,
    }


def summarise(runs: list[dict], names: list[str]) -> list[dict]:
    """Per run: means over the seeds, and each seed's loss gap from the baseline of the same
    seed (relative, signed)."""
    by_key = {(run["run"], run["seed"]): run for run in runs}
    seeds = sorted({run["seed"] for run in runs})
    rows = []
    for name in names:
        mine = [by_key[name, seed] for seed in seeds]
        base = [by_key[BASELINE, seed] for seed in seeds]
        gaps = [
            (m["final_loss"] - b["final_loss"]) / b["final_loss"]
            for m, b in zip(mine, base, strict=True)
        ]
        mtp = [m["final_mtp_loss"] for m in mine if m["final_mtp_loss"] is not None]
        rows.append(
            {
                "run": name,
                "seeds": seeds,
                "final_loss_mean": statistics.fmean(m["final_loss"] for m in mine),
                "relative_loss_gaps": gaps,
                "relative_loss_gap_mean": statistics.fmean(gaps),
                "final_mtp_loss_mean": statistics.fmean(mtp) if mtp else None,
                "load_max_over_mean": statistics.fmean(m["final_load_max_over_mean"] for m in mine),
                "tokens_per_s_ratio": statistics.median(
                    m["tokens_per_s"] / b["tokens_per_s"] for m, b in zip(mine, base, strict=True)
                ),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIGS / "tiny.yaml")
    variants = [name for name in VARIANTS if name != BASELINE]
    parser.add_argument("--variants", nargs="+", choices=variants, default=variants)
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per seed and variant"
    )
    parser.add_argument(
        "--micro-batch-size", type=int, default=2, help="data.micro_batch_size of every run"
    )
    parser.add_argument(
        "--loss-window", type=int, default=10, help="final loss: mean of the last this many steps"
    )
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument("--out", type=Path, default=Path("bench_results/recipe_training.json"))
    args = parser.parse_args()

    peak = measure_matmul_peak(torch.bfloat16, torch.device("cpu"))
    names = [BASELINE, *args.variants]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in names:
                runs.append(run_one(args.config, name, seed, args, peak, Path(tmp)))
                run = runs[-1]
                print(
                    f"{run['run']:>12} seed {seed}: loss {run['final_loss']:.4f}  "
                    f"({run['wall_s']:.0f} s)",
                    flush=True,
                )
    rows = summarise(runs, names)
    print(
        f"\n{args.config.name}, {args.steps} steps, micro-batches of {args.micro_batch_size}, "
        f"seeds {' '.join(map(str, args.seeds))}; loss = LM loss, mean of the last "
        f"{args.loss_window} steps, averaged over the seeds; gap = relative to {BASELINE} at "
        "the same seed"
    )
    print_table(
        ("run", "loss", "mean gap", "gap per seed", "mtp loss", "load max/mean", "tok/s ratio"),
        map(_table_row, rows),
    )
    document = {
        "config": str(args.config),
        "steps": args.steps,
        "seeds": args.seeds,
        "micro_batch_size": args.micro_batch_size,
        "loss_window": args.loss_window,
        "rows": rows,
        "runs": runs,
    }
    write_json(args.out, document)


def _table_row(row: dict) -> list:
    per_seed = ""
    if row["run"] != BASELINE:
        per_seed = " ".join(f"{100 * gap:+.2f}%" for gap in row["relative_loss_gaps"])
    mtp = row["final_mtp_loss_mean"]
    return [
        row["run"],
        f"{row['final_loss_mean']:.4f}",
        f"{100 * row['relative_loss_gap_mean']:+.2f}%",
        per_seed,
        "" if mtp is None else f"{mtp:.4f}",
        f"{row['load_max_over_mean']:.2f}",
        f"{row['tokens_per_s_ratio']:.2f}x",
    ]


if __name__ == "__main__":
    main()
