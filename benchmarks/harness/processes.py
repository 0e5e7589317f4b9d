"""Runs in fresh processes, and the run settings of the training benchmarks.

A measurement that follows another one in the same process inherits its allocator's state
(the heap the first run grew and freed), which can slow it several times over and would bias
whichever variant runs second; so each training run of a benchmark gets a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def benchmark_run_overrides(steps: int, run_dir: Path, peak_flops: float) -> tuple[str, ...]:
    """Config overrides (``--section.key=value``) of a benchmark's training run: ``steps``
    steps in ``run_dir``, every step logged, no progress line, no checkpoints, no evaluation
    (it costs time and leaves the training losses as they are), and the given
    peak FLOP/s, so that the rows of one benchmark share the MFU denominator and none
    measures it again."""
    return (
        f"--train.max_steps={steps}",
        f"--train.run_dir={run_dir}",
        "--train.log_interval=1",
        "--train.progress=false",
        f"--train.peak_flops={peak_flops}",
        "--checkpoint.interval=0",
        "--checkpoint.interval_minutes=0",
        "--eval.interval=0",
        "--eval.tasks=[]",
    )


def run_python(*args: str, threads: int | None = None) -> None:
    """``python ARGS...`` with this interpreter in a new process, its standard output
    discarded; raises ``CalledProcessError`` if it fails. ``threads``: the process's torch
    threads (``OMP_NUM_THREADS``, which torch reads at start-up), else torch's default."""
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL, env=env)


def json_from_fresh_process(script: Path | str, *args: str) -> Any:
    """Run ``python SCRIPT ARGS... --out FILE`` in a new process; the JSON it wrote to FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run_python(str(script), *args, "--out", str(out))
        return json.loads(out.read_text())


def train_in_fresh_process(
    config: Path,
    steps: int,
    run_dir: Path,
    peak_flops: float,
    extra: Sequence[str] = (),
    threads: int | None = None,
) -> list[dict]:
    """Train ``config`` for ``steps`` steps in ``run_dir`` (``benchmark_run_overrides``, then
    the ``extra`` overrides) through ``moe-train train`` in a new process with ``threads``
    torch threads (``run_python``); the run's metrics rows."""
    from moe_train.train import read_metrics

    overrides = [*benchmark_run_overrides(steps, run_dir, peak_flops), *extra]
    run_python("-m", "moe_train.cli", "train", str(config), *overrides, threads=threads)
    return read_metrics(run_dir / "metrics.jsonl")
