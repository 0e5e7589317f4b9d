"""The run settings every training benchmark adds to its config: a step count, a run
directory, every step logged, no progress line, no checkpoints, and a given peak FLOP/s (so
that rows of one run share the MFU denominator and none measures it again)."""

from __future__ import annotations

from pathlib import Path


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
