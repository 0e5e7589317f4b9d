"""AdamW against Muon on a config (the tiny one by default): the loss after N steps at each
one's tuned learning rate, over several seeds, and the optimizer step's share of the step time.

Phase 1 (sweep): each optimizer trains at every learning rate of its --lrs list at the first
seed; the lowest final loss (mean of the last --loss-window steps) picks its learning rate.
Phase 2: both train at their picked rate for the other seeds, and the table gives the mean
and spread (sample standard deviation) of the final losses over all seeds. Each run prints
its line as it ends, so a cut-short benchmark still says what it measured. --set adds config
overrides to every run (a larger model: ``--set=--model.n_layers=6 --set=--model.d_model=160``). Muon runs with
optim.adamw_lr_ratio=1 (the Moonlight scale makes its updates the size of AdamW's, so one
rate serves both parts). Phase 3 (step share): one process times --share-steps steps of each
optimizer's StepRunner on random tokens (after two warm steps) and reports the median share
of `optimizer.step` in the step's wall time. Single process, CPU; bf16 compute as the config.

    uv run python benchmarks/optimizers.py [--steps 300] [--seeds 0 1 2]
        [--adamw-lrs 1.5e-3 3e-3 6e-3] [--muon-lrs 3e-3 6e-3 1.2e-2] [--set=--KEY=VALUE ...]
        [--optimizers adamw muon]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.output import print_table, write_json
from harness.processes import benchmark_run_overrides
from moe_plan.config import Config, load_config
from moe_train.train import train

CONFIGS = Path(__file__).parents[1] / "configs"


def run_config(args: argparse.Namespace, name: str, lr: float, seed: int, root: Path) -> Config:
    """The config of one run: optimizer `name` at peak rate `lr`, seed `seed`."""
    return load_config(
        args.config,
        [
            *benchmark_run_overrides(args.steps, root / f"{name}-{lr:g}-{seed}", 1e12),
            f"--optim.name={name}",
            f"--optim.lr={lr}",
            f"--train.seed={seed}",
            *args.set,
        ],
    )


def final_loss(args: argparse.Namespace, name: str, lr: float, seed: int, root: Path) -> float:
    """Train one run; the mean of its last --loss-window losses."""
    start = time.perf_counter()
    losses = train(run_config(args, name, lr, seed, root)).losses
    loss = statistics.fmean(losses[-args.loss_window :])
    print(f"{name:>5} lr {lr:g} seed {seed}: {loss:.4f} ({time.perf_counter() - start:.0f} s)")
    return loss


def optimizer_share(config: Config, steps: int) -> float:
    """Median share of `optimizer.step` in the wall time of a training step."""
    from moe_train.train.runtime import start_runtime
    from moe_train.train.step import StepRunner

    runtime = start_runtime(config, torch.device("cpu"))
    runner = StepRunner(config, runtime)
    optimizer_step = runner.optimizer.step
    spent: list[float] = []

    def timed_step(lr: float | None = None) -> None:
        start = time.perf_counter()
        optimizer_step(lr)
        spent.append(time.perf_counter() - start)

    runner.optimizer.step = timed_step
    shape = (config.data.global_batch_size, config.data.seq_len + 1)
    generator = torch.Generator().manual_seed(0)
    shares = []
    for step in range(steps + 2):
        batch = torch.randint(0, config.model.vocab_size, shape, generator=generator)
        start = time.perf_counter()
        runner.train_step(batch, config.optim.lr)
        if step >= 2:
            shares.append(spent[-1] / (time.perf_counter() - start))
    runtime.close(clean=True)
    return statistics.median(shares)


def compare(args: argparse.Namespace, root: Path) -> list[dict]:
    """Sweep both, pick, run the other seeds, time the step share: one row per optimizer."""
    first, rest = args.seeds[0], args.seeds[1:]
    lrs = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    names = {name: lrs[name] for name in args.optimizers}
    sweeps = {
        name: {lr: final_loss(args, name, lr, first, root) for lr in lrs}
        for name, lrs in names.items()
    }
    best = {name: min(sweep, key=sweep.__getitem__) for name, sweep in sweeps.items()}
    losses = {name: [sweeps[name][best[name]]] for name in names}
    for seed in rest:
        for name in names:
            losses[name].append(final_loss(args, name, best[name], seed, root))
    rows = []
    for name in names:
        share = optimizer_share(run_config(args, name, best[name], first, root), args.share_steps)
        rows.append(
            {
                "optimizer": name,
                "sweep": {f"{lr:g}": loss for lr, loss in sweeps[name].items()},
                "lr": best[name],
                "final_losses": losses[name],
                "mean": statistics.fmean(losses[name]),
                "stdev": statistics.stdev(losses[name]) if len(losses[name]) > 1 else 0.0,
                "optimizer_step_share": share,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIGS / "tiny.yaml")
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[3e-3, 6e-3, 1.2e-2])
    parser.add_argument("--loss-window", type=int, default=20, help="final loss: mean of last N")
    parser.add_argument("--share-steps", type=int, default=10, help="timed steps of the share")
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=("adamw", "muon"),
        default=["adamw", "muon"],
        help="which to run (one each in parallel processes on a machine with spare cores)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="--KEY=VALUE",
        help="a config override for every run (repeat for several)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/optimizers.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(args, Path(tmp))
    print(
        f"\n{args.config.name} {' '.join(args.set)}, {args.steps} steps, seeds {' '.join(map(str, args.seeds))}; "
        f"loss = mean of the last {args.loss_window} steps (mean +- stdev over the seeds)"
    )
    print_table(
        ("optimizer", "lr", "sweep (seed 0)", "final loss", "optimizer step share"),
        [
            [
                row["optimizer"],
                f"{row['lr']:g}",
                " ".join(f"{lr}: {loss:.3f}" for lr, loss in row["sweep"].items()),
                f"{row['mean']:.4f} +- {row['stdev']:.4f}",
                f"{100 * row['optimizer_step_share']:.1f}%",
            ]
            for row in rows
        ],
    )
    write_json(
        args.out,
        {"config": str(args.config), "set": args.set, "steps": args.steps, "rows": rows},
    )


if __name__ == "__main__":
    main()
