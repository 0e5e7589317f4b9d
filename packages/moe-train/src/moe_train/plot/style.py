"""Matplotlib, imported on first use (the `plot` extra), and the look the figures share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moe_train.errors import MoeTrainError


def matplotlib_module() -> Any:
    """matplotlib set to the Agg backend (files only, no display); a one-line error naming
    the extra when it is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise MoeTrainError(
            "moe-train plot needs matplotlib: pip install 'moestack-train[plot]'"
        ) from e
    matplotlib.use("Agg")
    return matplotlib


def new_figure(rows: int, cols: int, *, width: float, height: float) -> tuple[Any, list[Any]]:
    """A figure (not registered with pyplot) and its axes in reading order."""
    matplotlib_module()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained", dpi=110)
    grid = figure.subplots(rows, cols, squeeze=False)
    for axes in grid.flat:
        axes.grid(True, alpha=0.3)
    return figure, list(grid.flat)


def run_colour(index: int) -> Any:
    """The colour of the index-th run."""
    from matplotlib import colormaps

    return colormaps["tab10"](index % 10)


def tokens_axis(axes: Any, axis: str = "x") -> None:
    """Label large counts with SI prefixes (1.5M rather than 1500000)."""
    from matplotlib.ticker import EngFormatter

    target = axes.xaxis if axis == "x" else axes.yaxis
    target.set_major_formatter(EngFormatter(sep=""))


def step_axis(
    axes: Any, resumes: Sequence[int] = (), colour: Any = "black", name: str = ""
) -> None:
    """Label the x axis "step", tick it at whole steps only, and mark each step in `resumes`
    (where a launch of the run continued from a checkpoint) with a dashed line and a label
    (prefixed by `name` when several runs share the axes)."""
    from matplotlib.ticker import MaxNLocator

    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    for step in resumes:
        mark_resume(axes, step, step, colour, name)


def mark_resume(axes: Any, x: float, step: int, colour: Any = "black", name: str = "") -> None:
    """A dashed vertical line at `x` (the resumed step, or its tokens seen) labelled with the
    step a launch resumed from; the line's gid is "resume"."""
    axes.axvline(x, color=colour, ls="--", lw=1.1, gid="resume")
    axes.text(
        x,
        0.98,
        f" {name + ': ' if name else ''}resumed at step {step}",
        transform=axes.get_xaxis_transform(),
        rotation=90,
        ha="right",
        va="top",
        fontsize="x-small",
        color=colour,
        gid="resume",
    )
