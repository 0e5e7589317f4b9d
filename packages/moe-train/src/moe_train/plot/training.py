"""Figures of the training curves: loss and eval loss, learning rate, throughput and MFU, and
the downstream tasks' figures (eval.tasks).

Each takes one or more runs and overlays them (one colour per run).
"""

from __future__ import annotations

from typing import Any

from moe_train.plot.runs import Run
from moe_train.plot.style import mark_resume, new_figure, run_colour, step_axis, tokens_axis


def loss_figure(runs: list[Run]) -> Any:
    """Training loss (lines) and eval loss (dashed, dots) against steps and tokens seen."""
    figure, (by_step, by_tokens) = new_figure(1, 2, width=13, height=4.8)
    for index, run in enumerate(runs):
        tokens = {r["step"]: r.get("tokens_seen") for r in run.metrics}
        for key in ("loss", "eval_loss"):
            steps, values = run.series(key)
            style = {"lw": 1.4} if key == "loss" else {"ls": "--", "marker": "o", "ms": 4}
            style["color"] = run_colour(index)
            label = f"{run.name}: {'eval loss' if key == 'eval_loss' else 'loss'}"
            if steps:
                by_step.plot(steps, values, label=label, **style)
            points = [(tokens[s], v) for s, v in zip(steps, values, strict=True) if tokens.get(s)]
            if points:
                by_tokens.plot(*zip(*points, strict=True), label=label, **style)
        _mark_resumes(by_step, runs, index)
        for step in run.resumes:
            if tokens.get(step):
                mark_resume(by_tokens, tokens[step], step, run_colour(index), _name(runs, index))
    by_step.set(title="Loss by step", ylabel="loss (nats per token)")
    by_tokens.set(title="Loss by tokens seen", xlabel="tokens seen", ylabel="loss (nats per token)")
    tokens_axis(by_tokens)
    by_step.legend(fontsize="small")
    return figure


def lr_figure(runs: list[Run]) -> Any:
    """The learning rate of every step logged."""
    figure, (axes,) = new_figure(1, 1, width=8, height=4.2)
    for index, run in enumerate(runs):
        axes.plot(*run.series("lr"), color=run_colour(index), label=run.name)
        _mark_resumes(axes, runs, index)
    axes.set(title="Learning rate", ylabel="learning rate")
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes.legend(fontsize="small")
    return figure


def throughput_figure(runs: list[Run]) -> Any:
    """Tokens per second (all ranks together) and MFU, by step."""
    figure, (speed, mfu) = new_figure(1, 2, width=13, height=4.6)
    for index, run in enumerate(runs):
        colour = run_colour(index)
        speed.plot(*run.series("tokens_per_s"), color=colour, label=run.name)
        steps, values = run.series("mfu")
        mfu.plot(steps, [100 * v for v in values], color=colour, label=run.name)
        for axes in (speed, mfu):
            _mark_resumes(axes, runs, index)
    speed.set(title="Throughput", ylabel="tokens/s (all ranks)")
    tokens_axis(speed, axis="y")
    mfu.set(title="Model FLOPs utilisation", ylabel="MFU (% of peak)")
    speed.set_ylim(bottom=0)
    mfu.set_ylim(bottom=0)
    speed.legend(fontsize="small")
    return figure


TASK_METRICS = {
    "acc": "accuracy",
    "acc_norm": "accuracy, length-normalised",
    "bits_per_byte": "bits per byte",
}
"""The task figures drawn, each in its own panel, with its title."""


def tasks_figure(runs: list[Run]) -> Any | None:
    """Each task's figures by step (eval/<task>/<metric>), one panel per kind of figure and
    one line per run and task; None when no run scored tasks."""
    keys = sorted({key for run in runs for row in run.metrics for key in row})
    panels = {
        metric: [k for k in keys if k.startswith("eval/") and k.endswith(f"/{metric}")]
        for metric in TASK_METRICS
    }
    panels = {metric: found for metric, found in panels.items() if found}
    if not panels:
        return None
    figure, axes_list = new_figure(1, len(panels), width=6.5 * len(panels), height=4.6)
    for axes, (metric, metric_keys) in zip(axes_list, panels.items(), strict=True):
        for index, run in enumerate(runs):
            for style_index, key in enumerate(metric_keys):
                steps, values = run.series(key)
                if steps:
                    label = (
                        f"{run.name}: {key.split('/')[1]}" if len(runs) > 1 else key.split("/")[1]
                    )
                    marker = "os^vD"[style_index % 5]
                    axes.plot(
                        steps, values, marker=marker, ms=4, color=run_colour(index), label=label
                    )
            _mark_resumes(axes, runs, index)
        axes.set(title=f"Tasks: {TASK_METRICS[metric]}", ylabel=metric)
        axes.legend(fontsize="small")
    return figure


def _name(runs: list[Run], index: int) -> str:
    """The run's name on a marker when several runs share the axes."""
    return runs[index].name if len(runs) > 1 else ""


def _mark_resumes(axes: Any, runs: list[Run], index: int) -> None:
    """Whole-step ticks and the index-th run's resume markers, in its colour."""
    step_axis(axes, runs[index].resumes, run_colour(index), _name(runs, index))
