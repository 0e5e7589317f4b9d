"""Every feature on every layout: the invariance matrix.

Each cell trains one feature (`harness.invariance_cells.FEATURES`) on one parallel layout
(`LAYOUTS`) with the real trainer, `moe-train train --nproc-per-node N` (gloo on the CPU),
and compares it at every step with the single-process run of the same feature and seed:
loss, grad_norm, lb_loss, z_loss, mtp_loss, eval_loss, the dropped-token fraction and the
tokens counted (`harness.invariance_compare.METRICS`), then the final parameters, read from
each run's last checkpoint (global FP32 tensors). A feature's single-process run is made once
and shared by its layouts. fp32 cells pass within 1e-5 relative; bf16 and FP8 cells within
their feature's tolerance. A cell the trainer refuses at its start check shows as refused,
with the trainer's line; one that crashes fails with its last error line.

Without --features, --layouts or --all it runs the fixed CI subset (`CI_CELLS`), which
touches every feature and every layout. Prints the matrix as a table; exit 1 when a cell
fails. `--card FILE.json` writes docs/verification.md's table from a --json file instead;
`--spread FILE.json ...` prints the spread over seeds (the --json files of runs at other
`--seed`s) and the tolerances of the low-precision features it gives
(`harness.invariance_spread`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.invariance_card import card, commit_of, merged, write_card
from harness.invariance_cells import (
    FEATURES,
    LAYOUTS,
    STEPS,
    Feature,
    base_config,
    select_cells,
    with_keys,
)
from harness.invariance_compare import compare_params, compare_rows, final_params
from harness.invariance_runs import RunEnd, run_env, train_run, write_data
from harness.invariance_spread import spread
from harness.output import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "verification.md"
COLUMNS = {
    "loss": ("loss",),
    "grad_norm": ("grad_norm",),
    "lb_loss": ("lb_loss",),
    "z_loss": ("z_loss",),
    "mtp_loss": ("mtp_loss",),
    "eval_loss": ("eval_loss",),
    "dropped": ("dropped_token_frac",),
    "tokens": ("tokens_seen", "trained_tokens", "tokens_per_source"),
}
"""The table's metric columns: each shows the worst of its metrics."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=_names, help="comma-separated features (default all)")
    parser.add_argument("--layouts", type=_names, help="comma-separated layouts (default all)")
    parser.add_argument("--all", action="store_true", help="every feature on every layout")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps per run ({STEPS})")
    parser.add_argument("--seed", type=int, default=0, help="train.seed of every run (0)")
    parser.add_argument("--list", action="store_true", help="print the features and layouts")
    parser.add_argument("--json", type=Path, help="write the matrix, one object per cell")
    parser.add_argument(
        "--card",
        type=Path,
        nargs="+",
        help="write docs/verification.md's table from --json files of one commit",
    )
    parser.add_argument(
        "--spread",
        type=Path,
        nargs="+",
        help="print each low-precision feature's worst differences per seed and the "
        "tolerances they give, from --json files of one commit at other seeds",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "auto"),
        default="gloo",
        help="gloo: hide the GPUs (CPU ranks over gloo); auto: the trainer's choice, NCCL "
        "and one GPU per rank where CUDA is available",
    )
    parser.add_argument("--work", type=Path, help="keep the runs in this new folder")
    return parser.parse_args(argv)


def _names(text: str) -> list[str]:
    """An argparse type: a comma-separated list of names."""
    return [name for name in text.split(",") if name]


def list_names() -> list[str]:
    """`--list`'s lines: each feature, then each layout, named as such."""
    return [f"feature {name}" for name in FEATURES] + [f"layout {name}" for name in LAYOUTS]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(list_names()))
        return 0
    if args.card:
        try:
            document = merged([json.loads(path.read_text()) for path in args.card])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        write_card(PAGE, card(document, list(FEATURES), list(LAYOUTS)))
        return 0
    if args.spread:
        return print_spread(args.spread, args.json)
    try:
        cells = select_cells(args.features, args.layouts, args.all)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    commit = commit_of(ROOT)  # before the runs: what they ran
    work = args.work or Path(tempfile.mkdtemp(prefix="invariance-"))
    try:
        results = run_matrix(cells, work, args.steps, args.backend, args.seed)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print_matrix(results)
    if args.json:
        document = {**commit, "steps": args.steps, "backend": args.backend, "seed": args.seed}
        write_json(args.json, {**document, "cells": results})
    return 1 if any(cell["status"] == "fail" for cell in results) else 0


def run_matrix(
    cells: list[tuple[str, str]], work: Path, steps: int, backend: str, seed: int = 0
) -> list[dict]:
    """Run `cells` in order under `work`, each feature's single process first, every run
    at `seed`; one result per cell (`cell_result`)."""
    base = with_keys(base_config(write_data(work / "data"), steps), {"train.seed": seed})
    env = run_env(backend)
    references: dict[str, tuple[RunEnd, Path]] = {}
    results = []
    for feature_name, layout_name in cells:
        feature, layout = FEATURES[feature_name], LAYOUTS[layout_name]
        config = with_keys(base, feature.keys)
        if feature_name not in references:
            folder = work / feature_name / "single"
            references[feature_name] = (train_run(folder, config, 1, env), folder / "run")
            _say(feature_name, "single process", references[feature_name][0])
        folder = work / feature_name / layout_name
        end = train_run(folder, with_keys(config, layout.keys), layout.ranks, env)
        _say(feature_name, layout_name, end)
        reference_end, reference_dir = references[feature_name]
        result = cell_result(end, folder / "run", reference_end, reference_dir, feature)
        results.append(
            {"feature": feature_name, "layout": layout_name, "ranks": layout.ranks, **result}
        )
    return results


def cell_result(
    end: RunEnd, run_dir: Path, reference_end: RunEnd, reference_dir: Path, feature: Feature
) -> dict[str, Any]:
    """A cell's status (ok, fail, refused), worst difference per metric and of the
    parameters, the reason of a status other than ok, and its seconds."""
    result: dict[str, Any] = {"status": end.status, "metrics": {}, "params": None}
    result |= {"reason": end.reason, "rtol": feature.rtol, "params_rtol": feature.params_rtol}
    result["wall_s"] = round(end.wall_s, 1)
    if end.status == "ok" and reference_end.status != "ok":
        result["status"] = reference_end.status
        result["reason"] = f"the single process: {reference_end.reason}"
    if result["status"] != "ok":
        return result
    from moe_train.train import read_metrics

    comparison = compare_rows(
        read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference_dir / "metrics.jsonl")
    )
    compare_params(final_params(run_dir), final_params(reference_dir), comparison)
    if end.reports != 1:
        comparison.problems.append(f"{end.reports} ranks reported the end of the run (one should)")
    failures = comparison.failures(feature.rtol, feature.params_rtol)
    more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    result |= {"metrics": comparison.metrics, "params": comparison.params}
    if failures:
        result |= {"status": "fail", "reason": failures[0] + more}
    return result


def print_spread(files: list[Path], json_path: Path | None) -> int:
    """`--spread`: the low-precision features' worst differences per seed and the tolerances
    they give, as a table (and a JSON file); exit 2 naming what is wrong with the files."""
    try:
        documents = [json.loads(path.read_text()) for path in files]
        precision = [name for name, feature in FEATURES.items() if feature.precision]
        rows = spread(documents, precision)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: --spread: {e}", file=sys.stderr)
        return 2
    seeds = sorted({seed for row in rows for seed in row["seeds"]})
    header = ["feature", "cells", *(f"seed {s}" for s in seeds), "worst", "tolerance"]
    table = []
    for row in rows:
        for what, key in (("metrics", "metrics"), ("params", "params")):
            figures = [_figure(row["seeds"].get(s, {}).get(key)) for s in seeds]
            cells = max(s["cells"] for s in row["seeds"].values())
            tolerance = row["rtol"] if what == "metrics" else row["params_rtol"]
            worst = row[f"worst_{what}"]
            table.append([f"{row['feature']} {what}", cells, *figures, _figure(worst)])
            table[-1].append(f"{tolerance:.0e}")
    print_table(header, table, left=["feature"])
    if json_path:
        write_json(json_path, {"commit": documents[0]["commit"], "features": rows})
    return 0


def _say(feature: str, layout: str, end: RunEnd) -> None:
    """A progress line on stderr."""
    why = f": {end.reason}" if end.reason else ""
    print(f"{feature} on {layout}: {end.status} ({end.wall_s:.0f} s){why}", file=sys.stderr)


def print_matrix(results: list[dict]) -> None:
    """The cells as a table: status, worst difference per metric and of the parameters."""
    header = ["feature", "layout", "ranks", "status", *COLUMNS, "params", "s", "reason"]
    rows = []
    for cell in results:
        figures = [_worst(cell["metrics"], names) for names in COLUMNS.values()]
        rows.append([cell["feature"], cell["layout"], cell["ranks"], cell["status"], *figures])
        rows[-1] += [_figure(cell["params"]), f"{cell['wall_s']:.0f}", cell["reason"]]
    print_table(header, rows, left=["layout", "status", "reason"])


def _worst(metrics: dict[str, float | None], names: tuple[str, ...]) -> str:
    """The worst of the `names` metrics as the table shows it (`_figure`)."""
    values = [metrics[name] for name in names if metrics.get(name) is not None]
    return _figure(max(values) if values else None)


def _figure(value: float | None) -> str:
    """A difference as the table shows it: two digits, or a dash where there is none."""
    return "-" if value is None else f"{value:.1e}"


if __name__ == "__main__":
    sys.exit(main())
