"""Data wait: the share of training step time spent waiting for the step's sequences.

Trains a config (default `configs/medium.yaml`, one process, a fresh one for each run) for
`--steps` steps twice in one run, reading each step's sequences ahead in a background thread
(`data.prefetch=true`, the default) and at the start of the step (`data.prefetch=false`), in
alternating rounds. Each metrics row holds the step time and the seconds that step waited for
its sequences (`data_wait_s`); the first `--skip` steps of each run (start-up) are left out.
"wait share" is the waited seconds over the step seconds; "read ms" is the median wait of the
reading-at-the-start runs, i.e. the cost of reading a step's sequences. Goal: under 2% with
prefetch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from harness.output import print_table, write_json
from harness.processes import train_in_fresh_process

CONFIGS = Path(__file__).parents[1] / "configs"


def run_once(args: argparse.Namespace, prefetch: bool, run_dir: Path) -> dict:
    """Train `args.steps` steps; the step and wait seconds of the steps after `args.skip`."""
    extra = [f"--data.prefetch={str(prefetch).lower()}", *args.override]
    rows = train_in_fresh_process(args.config, args.steps, run_dir, args.peak_flops, extra)
    rows = rows[args.skip :]
    return {
        "step_s": [row["step_time_s"] for row in rows],
        "wait_s": [row["data_wait_s"] for row in rows],
    }


def summarise(runs: list[dict]) -> dict:
    step_s = [s for run in runs for s in run["step_s"]]
    wait_s = [w for run in runs for w in run["wait_s"]]
    return {
        "steps": len(step_s),
        "median_step_s": statistics.median(step_s),
        "median_wait_ms": 1e3 * statistics.median(wait_s),
        "max_wait_ms": 1e3 * max(wait_s),
        "wait_share": sum(wait_s) / sum(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIGS / "medium.yaml")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (start-up)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of both")
    parser.add_argument("--peak-flops", type=float, default=1e12, help="MFU denominator")
    parser.add_argument(
        "--override", action="append", default=[], help="a config override, e.g. --data.paths=..."
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/data_loading.json"))
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error(f"--steps={args.steps} must be more than --skip={args.skip}")

    runs: dict[str, list[dict]] = {"prefetch": [], "read at step start": []}
    with tempfile.TemporaryDirectory() as work:
        for round_index in range(args.rounds):
            for name, prefetch in (("prefetch", True), ("read at step start", False)):
                run_dir = Path(work) / f"{round_index}-{prefetch}"
                runs[name].append(run_once(args, prefetch, run_dir))
    summary = {name: summarise(r) for name, r in runs.items()}

    print(
        f"config {args.config.name}, {args.steps} steps per run ({args.skip} left out), "
        f"{args.rounds} round(s)"
    )
    print_table(
        ("reading", "steps", "step s", "wait ms", "max ms", "wait share"),
        (
            [
                name,
                figures["steps"],
                f"{figures['median_step_s']:.2f}",
                f"{figures['median_wait_ms']:.2f}",
                f"{figures['max_wait_ms']:.2f}",
                f"{100 * figures['wait_share']:.2f}%",
            ]
            for name, figures in summary.items()
        ),
    )
    goal = summary["prefetch"]["wait_share"] < 0.02
    print(f"goal (prefetch wait share < 2%): {'met' if goal else 'NOT met'}")
    result = {
        "config": str(args.config),
        "steps": args.steps,
        "skip": args.skip,
        "rounds": args.rounds,
        "overrides": args.override,
        "summary": summary,
        "runs": runs,
        "goal_met": goal,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
