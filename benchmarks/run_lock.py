"""What one writer per run costs a training step: the launcher check (a parent-pid read per
step) and the run directory's lock with its heartbeat thread, against a tiny training step.

In one run, interleaved (the machines are shared and noisy, so ratios matter): training steps
of a tiny model (the tests' size, the step that makes the added work weigh the most) plain;
followed by the launcher check; and with the run directory's lock held (its heartbeat thread
beating every `run_lock.HEARTBEAT_S` seconds, and, as a stress row, every 10 ms); each row the
median over rounds of `--steps` steps, and its ratio to the plain row. The added work is also
timed alone: one launcher check, and one heartbeat (read the lock, compare, refresh its time)
spread over the steps of HEARTBEAT_S seconds.

    uv run python benchmarks/run_lock.py [--steps 5] [--rounds 31] [--threads 1] [--out bench_results/run_lock.json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from harness.output import print_table, write_json
from harness.timing import interleaved_medians, median_seconds
from moe_plan.config import load_config
from moe_train.signals import StopRequests
from moe_train.train import run_lock
from moe_train.train.runtime import start_runtime
from moe_train.train.step import StepRunner

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
TINY = (
    "--model.d_model=32",
    "--model.n_layers=2",
    "--model.moe.num_experts=4",
    "--model.moe.expert_hidden=32",
    "--data.seq_len=32",
    "--data.global_batch_size=8",
    "--data.micro_batch_size=4",
    "--precision.compute_dtype=float32",
)
"""configs/tiny.yaml shrunk to the tests' model: 2 layers, d_model 32, 4 experts, 8 x 32 tokens."""
STRESS_HEARTBEAT_S = 0.01


def step_measures(
    steps: int, run_dir: Path
) -> tuple[dict[str, Callable[[], float]], Callable[[], None]]:
    """The rows' measures (seconds of `steps` tiny steps each), and the step alone."""
    config = load_config(CONFIG, list(TINY))
    runtime = start_runtime(config, torch.device("cpu"))
    runner = StepRunner(config, runtime)
    batch = torch.randint(0, config.model.vocab_size, (8, config.data.seq_len + 1))
    stops = StopRequests(announce=False)
    stops.watch_launcher()

    def step() -> None:
        runner.train_step(batch, 1e-4)

    def timed(check: bool) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            step()
            if check:
                stops.code  # noqa: B018 (the per-step launcher check)
        return time.perf_counter() - start

    def locked(heartbeat_s: float) -> float:
        saved, run_lock.HEARTBEAT_S = run_lock.HEARTBEAT_S, heartbeat_s
        try:
            run_lock.take_run_lock(run_dir, launch="benchmark")
            return timed(check=True)
        finally:
            run_lock.release_held_locks()
            run_lock.HEARTBEAT_S = saved

    measures = {
        "tiny step": lambda: timed(check=False),
        "+ launcher check": lambda: timed(check=True),
        f"+ check, lock held (beat every {run_lock.HEARTBEAT_S:g} s)": lambda: locked(
            run_lock.HEARTBEAT_S
        ),
        f"+ check, lock held (beat every {STRESS_HEARTBEAT_S * 1e3:g} ms)": lambda: locked(
            STRESS_HEARTBEAT_S
        ),
    }
    return measures, step


def added_work(run_dir: Path) -> dict[str, float]:
    """Seconds of one launcher check and of one heartbeat, each timed alone."""
    stops = StopRequests(announce=False)
    stops.watch_launcher()
    calls = 10_000

    def checks() -> None:
        for _ in range(calls):
            stops.code  # noqa: B018

    lock = run_lock.RunLock.__new__(run_lock.RunLock)  # the beat's work, without its thread
    lock.path = run_dir / "bench.lock"
    lock.content = b"benchmark\n"
    lock.path.write_bytes(lock.content)

    def beats() -> None:
        for _ in range(100):
            if lock.owned():
                lock.path.touch()

    return {
        "check_s": median_seconds(checks, warmup=1, reps=7) / calls,
        "beat_s": median_seconds(beats, warmup=1, reps=7) / 100,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=31, help="timed rounds per row")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("bench_results/run_lock.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        measures, _ = step_measures(args.steps, run_dir)
        medians = interleaved_medians(measures, warmup=2, reps=args.rounds)
        alone = added_work(run_dir)
    step_s = medians["tiny step"] / args.steps
    rows = [
        [name, f"{seconds / args.steps * 1e3:.3f}", f"{seconds / medians['tiny step']:.4f}"]
        for name, seconds in medians.items()
    ]
    beat_per_step_s = alone["beat_s"] * step_s / run_lock.HEARTBEAT_S
    rows += [
        [
            "launcher check alone",
            f"{alone['check_s'] * 1e3:.6f}",
            f"{alone['check_s'] / step_s:.2e}",
        ],
        [
            f"heartbeat alone, per step (1 per {run_lock.HEARTBEAT_S:g} s)",
            f"{beat_per_step_s * 1e3:.6f}",
            f"{beat_per_step_s / step_s:.2e}",
        ],
    ]
    print_table(("per step", "ms", "x tiny step"), rows)
    write_json(
        args.out,
        {
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            "threads": args.threads,
            "step_ms": {name: s / args.steps * 1e3 for name, s in medians.items()},
            "launcher_check_s": alone["check_s"],
            "heartbeat_s": alone["beat_s"],
            "heartbeat_interval_s": run_lock.HEARTBEAT_S,
        },
    )


if __name__ == "__main__":
    main()
