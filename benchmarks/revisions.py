"""Training-step throughput of several git revisions of this repository, in one run.

Each revision is checked out into a temporary worktree and its packages are put first on
PYTHONPATH; every measurement is a fresh process running this tree's
`benchmarks/train_step.py` for one row (config and dtype) against that revision's code. The
revisions take turns, round after round, so noise on a shared machine falls on all of them;
the table gives each revision's median tokens/s over the rounds and its ratio to the first
revision. A row whose dtype a revision does not know (bf16-params before it existed) is
left out for that revision.

    uv run python benchmarks/revisions.py REV [REV ...] [--configs bench-14m]
        [--dtypes float32 bfloat16 bf16-params] [--rounds 3] [--steps 8] [--compile]
        [--out bench_results/revisions.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.output import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe-kernels", "moe-dispatch", "moe-parallel", "moe-checkpoint", "moe-train")


def worktree(revision: str, root: Path) -> Path:
    """A detached worktree of `revision` under `root`."""
    path = root / revision.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), revision],
        check=True,
        capture_output=True,
    )
    return path


def measure(
    tree: Path, config: str, dtype: str, steps: int, out: Path, compile_: bool = False
) -> float | None:
    """Tokens/s of one train_step.py row with `tree`'s packages; None if the row fails
    (e.g. a dtype that revision does not support)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / "packages" / p / "src") for p in PACKAGES)
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "train_step.py"),
        "--configs",
        config,
        "--dtypes",
        dtype,
        "--steps",
        str(steps),
        "--warmup",
        "2",
        "--out",
        str(out),
        *(["--compile"] if compile_ else []),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"  {tree.name} {config} {dtype}: failed ({result.stderr.strip().splitlines()[-1]})")
        return None
    return json.loads(out.read_text())["runs"][0]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="git revisions; ratios are to the first")
    parser.add_argument("--configs", nargs="+", default=["bench-14m"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "bf16-params"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="rows with train.compile=true")
    parser.add_argument("--out", type=Path, default=Path("bench_results/revisions.json"))
    args = parser.parse_args()

    samples: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: worktree(rev, Path(tmp)) for rev in args.revisions}
        try:
            for round_index in range(args.rounds):
                for config in args.configs:
                    for dtype in args.dtypes:
                        for rev, tree in trees.items():
                            value = measure(
                                tree,
                                config,
                                dtype,
                                args.steps,
                                Path(tmp) / "row.json",
                                args.compile,
                            )
                            if value is not None:
                                samples.setdefault((rev, config, dtype), []).append(value)
                print(f"round {round_index + 1}/{args.rounds} done", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    capture_output=True,
                )
    rows = summarise(samples, args)
    print()
    print_table(("config", "dtype", "revision", "tokens/s", "vs first"), map(_table_row, rows))
    print()
    write_json(args.out, {"rounds": args.rounds, "steps": args.steps, "rows": rows})


def summarise(samples: dict[tuple[str, str, str], list[float]], args) -> list[dict]:
    """One row per (config, dtype, revision): median tokens/s and the ratio to the first."""
    rows = []
    for config in args.configs:
        for dtype in args.dtypes:
            first = samples.get((args.revisions[0], config, dtype))
            for rev in args.revisions:
                values = samples.get((rev, config, dtype))
                if not values:
                    continue
                median = statistics.median(values)
                ratio = median / statistics.median(first) if first else None
                rows.append(
                    {
                        "config": config,
                        "dtype": dtype,
                        "revision": rev,
                        "tokens_per_s": median,
                        "samples": values,
                        "ratio_to_first": ratio,
                    }
                )
    return rows


def _table_row(row: dict) -> list:
    ratio = row["ratio_to_first"]
    return [
        row["config"],
        row["dtype"],
        row["revision"][:12],
        f"{row['tokens_per_s']:,.0f}",
        f"{ratio:.2f}x" if ratio else "",
    ]


if __name__ == "__main__":
    main()
