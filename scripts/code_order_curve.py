"""The quickstart's built-in task over runs: a table and a plot.

    uv run python scripts/code_order_curve.py RUN_DIR... [--out docs/code-order-accuracy.png]

Each RUN_DIR is a run of a config whose eval.tasks holds builtin:code_order (the quickstart,
configs/tiny.yaml, one run per seed). The accuracy at the steps that evaluated comes from
RUN_DIR/metrics.jsonl; step 0, the untrained model, which the loop does not score, is scored
here on a model built from RUN_DIR/config.yaml with its seed, as training builds it. Prints
a Markdown table (a row per run) and the scoring seconds per call (eval/tasks_s), and draws
the accuracy over steps, a line per run, into `--out`.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from moe_plan.config import load_config
from moe_train.run_tokenizer import run_tokenizer
from moe_train.train import read_metrics
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner
from moe_train.train.task_scoring import open_task_scorer

TASK = "code_order"
CHANCE = 0.25


def untrained_accuracy(run_dir: Path) -> float:
    """`TASK`'s accuracy of the run's model at step 0 (its config and seed, no training)."""
    config = load_config(run_dir / "config.yaml")
    runtime = start_runtime(config)
    try:
        torch.manual_seed(config.train.seed)
        runner = StepRunner(config, runtime, run_tokenizer(config)[1])
        results = open_task_scorer(config, runner).score()
    finally:
        runtime.close(clean=True)
    return next(result.metrics["acc"] for result in results if result.name == TASK)


def run_curve(run_dir: Path) -> tuple[int, dict[int, float], list[float]]:
    """The run's seed, its accuracy per step (step 0 included) and its scoring seconds."""
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if f"eval/{TASK}/acc" in row]
    if not rows:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has no eval/{TASK}/acc")
    curve = {0: untrained_accuracy(run_dir)}
    curve |= {row["step"]: row[f"eval/{TASK}/acc"] for row in rows}
    seed = load_config(run_dir / "config.yaml").train.seed
    return seed, curve, [row["eval/tasks_s"] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=Path("docs/code-order-accuracy.png"))
    args = parser.parse_args()
    curves = [run_curve(run) for run in args.runs]
    steps = sorted({step for _, curve, _ in curves for step in curve})
    print("| seed | " + " | ".join(f"step {step}" for step in steps) + " |")
    print("| --- |" + " --- |" * len(steps))
    for seed, curve, _ in curves:
        print(
            f"| {seed} | " + " | ".join(f"{curve.get(s, float('nan')):.3f}" for s in steps) + " |"
        )
    means = [statistics.mean(c[s] for _, c, _ in curves if s in c) for s in steps]
    print("| mean | " + " | ".join(f"{mean:.3f}" for mean in means) + " |")
    seconds = [s for _, _, per_call in curves for s in per_call]
    print(
        f"\neval/tasks_s per call ({len(seconds)} calls): mean {statistics.mean(seconds):.2f} s, "
        f"min {min(seconds):.2f}, max {max(seconds):.2f}"
    )

    figure, axes = plt.subplots(figsize=(6, 3.6))
    for seed, curve, _ in curves:
        axes.plot(
            sorted(curve), [curve[s] for s in sorted(curve)], marker="o", label=f"seed {seed}"
        )
    axes.axhline(CHANCE, color="grey", linestyle="--", linewidth=1, label="chance")
    axes.set(xlabel="step", ylabel="acc", ylim=(0, 1), xticks=steps)
    axes.set_title(f"builtin:{TASK} on configs/tiny.yaml")
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
