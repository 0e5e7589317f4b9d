"""How the training benchmarks run a training: the run settings they add to a config (a step
count, a run directory, every step logged, no progress line, no checkpoints, and a given peak
FLOP/s, so that rows of one run share the MFU denominator and none measures it again), and
a training in a fresh process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_train.train import read_metrics


def benchmark_run_overrides(steps: int, run_dir: Path, peak_flops: float) -> tuple[str, ...]:
    """Config overrides (``--section.key=value``) of a benchmark's training run."""
    return (
        f"--train.max_steps={steps}",
        f"--train.run_dir={run_dir}",
        "--train.log_interval=1",
        "--train.progress=false",
        f"--train.peak_flops={peak_flops}",
        "--checkpoint.interval=0",
        "--checkpoint.interval_minutes=0",
    )


def train_in_fresh_process(
    config: Path, steps: int, run_dir: Path, peak_flops: float, extra: Sequence[str] = ()
) -> list[dict]:
    """Train `config` for `steps` steps in `run_dir` (the run settings above, then the `extra`
    overrides) through `moe-train train` in a new process; the run's metrics rows.

    Each run gets a process of its own: in one process a medium-sized run after another one
    ran several times slower than alone (the allocator's state after the first run's
    gigabytes), which would bias whichever variant runs second.
    """
    overrides = [*benchmark_run_overrides(steps, run_dir, peak_flops), *extra]
    command = [sys.executable, "-m", "moe_train.cli", "train", str(config), *overrides]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(run_dir / "metrics.jsonl")
