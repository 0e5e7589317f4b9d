"""`moe-train plot`: PNG figures of one or more runs (needs the extra moestack-train[plot]).

Written files: `loss.png`, `lr.png`, `throughput.png` (several runs overlaid), `tasks.png` when
a run scored eval.tasks (overlaid likewise), and for each run
with an expert_load.jsonl `expert_load.png`, `rank_load.png` (only with several EP ranks) and
`balance.png` (named `expert_load-RUN.png` and so on when several runs are plotted). Step axes
are ticked at whole steps, and the steps a resumed run continued from are marked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_train.errors import MoeTrainError
from moe_train.plot.routing import balance_figure, expert_load_figure, rank_load_figure
from moe_train.plot.runs import Run, read_run, read_runs
from moe_train.plot.style import matplotlib_module
from moe_train.plot.training import loss_figure, lr_figure, tasks_figure, throughput_figure

__all__ = ["PlotResult", "Run", "plot_runs", "read_run", "read_runs"]


@dataclass
class PlotResult:
    out: Path
    """The directory the files went to."""
    files: list[Path] = field(default_factory=list)
    """The PNG files written."""
    notes: list[str] = field(default_factory=list)
    """Figures left out, and why."""


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> PlotResult:
    """Write the PNG figures of `run_dirs` to `out` (default: RUN_DIR/plots for one run,
    ./plots for several). Every run is read, and matplotlib found, before anything is
    written; a bad run directory stops it with a one-line `MoeTrainError`."""
    runs = read_runs(run_dirs)
    matplotlib_module()
    result = PlotResult(
        out if out is not None else (run_dirs[0] / "plots" if len(runs) == 1 else Path("plots"))
    )
    try:
        result.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MoeTrainError(f"--out {result.out} cannot be created: {e.strerror}") from e
    for name, build in (
        ("loss", loss_figure),
        ("lr", lr_figure),
        ("throughput", throughput_figure),
    ):
        _save(build(runs), result, f"{name}.png")
    tasks = tasks_figure(runs)
    if tasks is not None:
        _save(tasks, result, "tasks.png")
    per_run: list[tuple[str, Callable[[Run], Any]]] = [
        ("expert_load", expert_load_figure),
        ("rank_load", rank_load_figure),
        ("balance", balance_figure),
    ]
    for run in runs:
        if not run.routing:
            result.notes.append(f"{run.name}: no expert_load.jsonl, so no routing figures")
            continue
        suffix = f"-{run.name}" if len(runs) > 1 else ""
        for name, build in per_run:
            figure = build(run)
            if figure is None:
                result.notes.append(
                    f"{run.name}: one EP rank (parallel.ep = 1) holds every expert, so no "
                    f"{name}.png: there are no ranks to compare"
                )
                continue
            _save(figure, result, f"{name}{suffix}.png")
    return result


def _save(figure: Any, result: PlotResult, name: str) -> None:
    path = result.out / name
    try:
        figure.savefig(path)
    except OSError as e:
        raise MoeTrainError(f"{path} cannot be written: {e.strerror}") from e
    result.files.append(path)
