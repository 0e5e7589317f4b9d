"""Training comparisons over several seeds: each variant of a config trained once per seed,
the runs of one seed compared with the baseline's run of the same seed.

Runs of one seed see the same batches and start from the same weights, yet their
trajectories part, so one seed's gap from the baseline says little; a variant is judged on
the mean of its per-seed gaps, shown beside them. Each run trains in a process of its own
(``harness.processes``), ``--jobs`` of them at once with ``--threads`` torch threads each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

RunOne = Callable[[str, int, Path], dict]
"""Train variant ``name`` at ``seed`` under the folder ``root``; its run record: a dict with
at least ``run``, ``seed``, ``final_loss`` and ``wall_s``."""


def add_seed_arguments(
    parser: argparse.ArgumentParser, *, config: Path, steps: int, seeds: Sequence[int] = (0, 1, 2)
) -> None:
    """The options every seeded comparison takes: ``--config``, ``--steps``, ``--seeds``,
    ``--loss-window``, ``--warmup``, ``--jobs`` and ``--threads`` (``--out`` and the variants
    stay the benchmark's)."""
    parser.add_argument("--config", type=Path, default=config)
    parser.add_argument("--steps", type=int, default=steps, help=f"steps per run (default {steps})")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=list(seeds), help="one run per seed and variant"
    )
    parser.add_argument(
        "--loss-window", type=int, default=10, help="final loss: mean of the last this many steps"
    )
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument(
        "--jobs",
        type=_positive,
        default=1,
        help="runs at once, each in its own process (default 1)",
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="torch threads of each run (default: torch's with one job, else cores / jobs)",
    )


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def runs_peak_flops(args: argparse.Namespace) -> float:
    """The CPU's bf16 matmul peak at the runs' thread count (``run_threads``; this process
    keeps that count): the MFU denominator every run of the comparison shares."""
    import torch

    from moe_train.train import measure_matmul_peak

    threads = run_threads(args)
    if threads is not None:
        torch.set_num_threads(threads)
    return measure_matmul_peak(torch.bfloat16, torch.device("cpu"))


def run_threads(args: argparse.Namespace) -> int | None:
    """Torch threads of each run: ``--threads``, else the cores shared among ``--jobs``, else
    (one job) None, torch's default."""
    if args.threads is not None:
        return args.threads
    if args.jobs > 1:
        return max(1, (os.cpu_count() or 1) // args.jobs)
    return None


def train_seeded(
    args: argparse.Namespace, overrides: Sequence[str], seed: int, run_dir: Path, peak: float
) -> tuple[list[dict], float]:
    """Train ``args.config`` in bf16 compute with ``overrides`` for ``args.steps`` steps at
    ``seed`` in ``run_dir`` (``benchmark_run_overrides``) in a fresh process with
    ``run_threads(args)`` threads; its metrics rows (one per step, ``loss`` the LM loss) and
    its wall seconds."""
    from harness.processes import train_in_fresh_process

    start = time.perf_counter()
    records = train_in_fresh_process(
        args.config,
        args.steps,
        run_dir,
        peak,
        ["--precision.compute_dtype=bfloat16", *overrides, f"--train.seed={seed}"],
        threads=run_threads(args),
    )
    return records, time.perf_counter() - start


def run_seeds(
    names: Sequence[str],
    seeds: Sequence[int],
    run_one: RunOne,
    line: Callable[[dict], str],
    jobs: int = 1,
) -> list[dict]:
    """Every variant at every seed, seed by seed, ``jobs`` at a time, in a temporary folder;
    each run's ``line`` printed as it ends, so a cut-short comparison still says what it
    measured. The records come back in seed-by-seed order."""
    order = [(name, seed) for seed in seeds for name in names]
    with tempfile.TemporaryDirectory() as tmp:
        if jobs == 1:  # in this thread: each line right after its run's own output
            runs = []
            for name, seed in order:
                runs.append(run_one(name, seed, Path(tmp)))
                print(line(runs[-1]), flush=True)
            return runs
        # Threads suffice: each run_one waits on a training process of its own.
        done: dict[int, dict] = {}
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {
                pool.submit(run_one, name, seed, Path(tmp)): i
                for i, (name, seed) in enumerate(order)
            }
            for future in as_completed(futures):
                run = done[futures[future]] = future.result()
                print(line(run), flush=True)
        return [done[i] for i in range(len(order))]


def seed_comparison(
    runs: list[dict], name: str, baseline: str
) -> tuple[dict, list[tuple[dict, dict]]]:
    """Variant ``name`` against ``baseline`` over the seeds of ``runs``: the row fields
    ``run``, ``seeds``, ``final_loss_mean``, ``relative_loss_gaps`` (each seed's signed
    relative gap from the baseline's final loss at that seed) and ``relative_loss_gap_mean``;
    and the (variant, baseline) run records seed by seed, for the benchmark's own fields."""
    by_key = {(run["run"], run["seed"]): run for run in runs}
    seeds = sorted({run["seed"] for run in runs})
    pairs = [(by_key[name, seed], by_key[baseline, seed]) for seed in seeds]
    gaps = [(mine["final_loss"] - base["final_loss"]) / base["final_loss"] for mine, base in pairs]
    return {
        "run": name,
        "seeds": seeds,
        "final_loss_mean": statistics.fmean(mine["final_loss"] for mine, _ in pairs),
        "relative_loss_gaps": gaps,
        "relative_loss_gap_mean": statistics.fmean(gaps),
    }, pairs


def median_ratio(pairs: Sequence[tuple[dict, dict]], key: str) -> float:
    """The median over the seeds of the variant's ``key`` over the baseline's."""
    return statistics.median(mine[key] / base[key] for mine, base in pairs)


def gap_cells(row: dict, baseline: str) -> tuple[str, str]:
    """A row's mean gap and its per-seed gaps as table cells, in percent (the baseline's
    per-seed cell is empty: its own gaps are zero)."""
    per_seed = ""
    if row["run"] != baseline:
        per_seed = " ".join(f"{100 * gap:+.2f}%" for gap in row["relative_loss_gaps"])
    return f"{100 * row['relative_loss_gap_mean']:+.2f}%", per_seed
