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
        [--steps 200] [--seeds 0 1 2] [--micro-batch-size 2] [--jobs 2] [--threads 1]
"""

import argparse
import statistics
from pathlib import Path

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
BASELINE = "micro_batch"
VARIANTS: dict[str, tuple[str, ...]] = {
    BASELINE: ("--model.moe.lb_scope=micro_batch",),
    "global_batch": ("--model.moe.lb_scope=global_batch",),
    "sequence": ("--model.moe.lb_scope=sequence",),
    "mtp1": ("--model.mtp_depth=1", "--model.mtp_loss_weight=0.3"),
}
"""The baseline and the variants, each one change from it."""


def run_one(name: str, seed: int, args: argparse.Namespace, peak: float, root: Path) -> dict:
    """Train one variant at one seed; its final losses, load and speed."""
    overrides = (f"--data.micro_batch_size={args.micro_batch_size}", *VARIANTS[name])
    records, wall_s = train_seeded(args, overrides, seed, root / f"{name}-{seed}", peak)
    losses = [r["loss"] for r in records]
    window = records[-args.loss_window :]
    return {
        "run": name,
        "seed": seed,
        "steps": len(losses),
        "final_loss": statistics.fmean(losses[-args.loss_window :]),
        "final_mtp_loss": (
            statistics.fmean(r["mtp_loss"] for r in window) if "mtp_loss" in window[0] else None
        ),
        "final_load_max_over_mean": statistics.fmean(
            r["expert_load_max_over_mean"] for r in window
        ),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[args.warmup :]),
        "wall_s": wall_s,
        "losses": losses,
    }


def summarise(runs: list[dict], names: list[str]) -> list[dict]:
    """Per run: means over the seeds, and each seed's loss gap from the baseline of the same
    seed (relative, signed)."""
    rows = []
    for name in names:
        row, pairs = seed_comparison(runs, name, BASELINE)
        mtp = [mine["final_mtp_loss"] for mine, _ in pairs if mine["final_mtp_loss"] is not None]
        row["final_mtp_loss_mean"] = statistics.fmean(mtp) if mtp else None
        row["load_max_over_mean"] = statistics.fmean(
            mine["final_load_max_over_mean"] for mine, _ in pairs
        )
        row["tokens_per_s_ratio"] = median_ratio(pairs, "tokens_per_s")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seed_arguments(parser, config=CONFIGS / "tiny.yaml", steps=200)
    variants = [name for name in VARIANTS if name != BASELINE]
    parser.add_argument("--variants", nargs="+", choices=variants, default=variants)
    parser.add_argument(
        "--micro-batch-size", type=int, default=2, help="data.micro_batch_size of every run"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/recipe_training.json"))
    args = parser.parse_args()

    peak = runs_peak_flops(args)
    names = [BASELINE, *args.variants]
    runs = run_seeds(
        names,
        args.seeds,
        lambda name, seed, root: run_one(name, seed, args, peak, root),
        lambda run: (
            f"{run['run']:>12} seed {run['seed']}: loss {run['final_loss']:.4f}  "
            f"({run['wall_s']:.0f} s)"
        ),
        args.jobs,
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
    mean_gap, per_seed = gap_cells(row, BASELINE)
    mtp = row["final_mtp_loss_mean"]
    return [
        row["run"],
        f"{row['final_loss_mean']:.4f}",
        mean_gap,
        per_seed,
        "" if mtp is None else f"{mtp:.4f}",
        f"{row['load_max_over_mean']:.2f}",
        f"{row['tokens_per_s_ratio']:.2f}x",
    ]


if __name__ == "__main__":
    main()
